"""The TGB container: one immutable object holding every slice of a transactional global batch.

Layout (byte-exact description in ``docs/format.md``)::

    [slice 0][slice 1]...[slice n-1][footer JSON][trailer: 32 bytes]

Slices are stored in ``(d, c)`` order (index ``d * cp + c``), each encoded by the object's codec
and optionally zstd-compressed. The footer (a :class:`TgbFooter` as JSON) indexes them; the
fixed-size trailer locates and checksums the footer and ends with a magic number. A reader that
knows nothing fetches the tail with one suffix read; a reader that knows the footer's location
(recorded in the manifest) fetches it with one exact range read; after that every slice costs
exactly one range read.

Every stored byte is covered: each slice by its own checksum (over the stored, possibly
compressed, bytes), the footer and the trailer's fields by the footer checksum, and the magic by
an exact comparison. Corruption therefore surfaces as :class:`batchweave.FormatError` or
:class:`batchweave.ChecksumMismatch`, never as wrong data.
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Any, Final, NamedTuple, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from batchweave._checks import as_count
from batchweave._errors import ChecksumMismatch, FormatError, UnsupportedFormatVersion
from batchweave._format._checksum import (
    DEFAULT_CHECKSUM_ALGO,
    ChecksumAlgo,
    checksum,
    checksum_bits,
)
from batchweave._format._codecs import (
    CODECS,
    COMPRESSIONS,
    Buffer,
    check_compression,
    compress,
    decompress,
    first_overlap,
    get_codec,
)
from batchweave._format._sample_ids import SAMPLE_IDS_KEY, parse_sample_ids
from batchweave._mesh import Mesh
from batchweave._store._base import Bounded, ObjectStore, Suffix
from batchweave._unchecked import unchecked

__all__ = [
    "FOOTER_READ_GUESS",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_FOOTER_LENGTH",
    "TRAILER_SIZE",
    "EncodedTgb",
    "SliceEntry",
    "SliceIndex",
    "SliceSpan",
    "TgbBuilder",
    "SliceLayout",
    "TgbFooter",
    "check_encoded",
    "decode_entry",
    "decode_slice",
    "encode_tgb",
    "parse_footer",
    "parse_footer_exact",
    "payload_list",
    "read_footer",
    "read_slice",
    "slice_range",
]

FORMAT_VERSION: Final = 2
"""The newest TGB format version this library reads.

Each object is written with the oldest version that can express it, so older readers keep
reading what they understand: version 1, or version 2 when its checksum algorithm is ``xxh3``
(which version-1 readers do not know; the version makes them answer "upgrade", not "damaged").
"""

MAGIC: Final = b"BWTGB\x00\x01\n"
"""Last 8 bytes of every TGB object, in every format version."""

TRAILER_SIZE: Final = 32
"""Size of the fixed trailer; its layout is the same in every format version."""

MAX_FOOTER_LENGTH: Final = 256 << 20
"""Footers longer than this are refused before anything is allocated for them."""

FOOTER_READ_GUESS: Final = 64 << 10
"""Suffix length fetched when the footer's location is unknown; holds most footers entirely."""

# footer_length u64, format_version u16, checksum algo id u8, 5 reserved zero bytes,
# footer checksum u64, magic 8 bytes; little-endian.
_TRAILER: Final = struct.Struct("<QHB5sQ8s")
_CHECKED_TRAILER_BYTES: Final = 16  # footer checksum covers footer + trailer[0:16]
_ALGO_IDS: Final[dict[ChecksumAlgo, int]] = {"crc32c": 1, "xxhash64": 2, "xxh3": 3}
_ALGO_BY_ID: Final[dict[int, ChecksumAlgo]] = {v: k for k, v in _ALGO_IDS.items()}
_ALGO_VERSIONS: Final[dict[ChecksumAlgo, int]] = {"crc32c": 1, "xxhash64": 1, "xxh3": 2}
"""The format version that introduced each algorithm: the version an object using it is written
with, and the lowest version a valid object using it can have."""
_RESERVED: Final = bytes(5)
_DAMAGED_ADVICE: Final = (
    "Committed TGBs are immutable (the manifest records their checksums), so do not rewrite "
    "it: read it again (a transfer error may pass), restore the object from a backup or "
    "replica, or skip its step deliberately (Consumer(start_step=...) past it); "
    "`batchweave verify` lists every damaged object"
)
"""What a reader can do about a damaged TGB object: never rewrite it in place."""

assert _TRAILER.size == TRAILER_SIZE

SliceIndex = int | tuple[int, int]
"""A slice's flat index ``d * cp + c`` or its ``(dp_rank, cp_rank)`` coordinates."""


class SliceEntry(BaseModel):
    """Where one slice lives in its TGB object and how to verify it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    offset: int = Field(ge=0)
    """Byte offset of the stored slice from the start of the object."""
    length: int = Field(ge=0)
    """Stored (possibly compressed) length in bytes: the size of its range read."""
    uncompressed_length: int = Field(ge=0)
    """Length after decompression; equals ``length`` when the object is uncompressed."""
    checksum: int = Field(ge=0, lt=1 << 64)
    """Checksum of the stored bytes under the footer's ``checksum_algo``."""
    sample_count: int = Field(ge=0)
    """Number of samples in the slice (codec default or the producer's value)."""


class SliceSpan(NamedTuple):
    """The fields of a :class:`SliceEntry` a reader needs to fetch and verify one slice.

    A consumer looks one up per slice per step from the manifest's slice table; a tuple costs a
    fraction of constructing a pydantic model there.
    """

    offset: int
    length: int
    uncompressed_length: int
    checksum: int


class TgbFooter(BaseModel):
    """The index at the end of a TGB object: everything needed to find and decode any slice."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int = Field(ge=1)
    mesh: Mesh
    codec: str
    """Name of the codec every slice is encoded with: ``raw``, ``arrow`` or ``tensors``."""
    compression: str | None = None
    """``"zstd"`` if each slice's codec bytes are zstd-compressed, else ``None``."""
    checksum_algo: ChecksumAlgo
    payload_length: int = Field(ge=0)
    """Bytes before the footer; every slice lies within ``[0, payload_length)``."""
    slices: tuple[SliceEntry, ...]
    """One entry per slice in ``(d, c)`` order: index ``d * mesh.cp + c``."""
    metadata: dict[str, str] = Field(default_factory=dict)
    """Producer-supplied metadata; BatchWeave interprets only ``batchweave.sample_ids``
    (:mod:`batchweave._format._sample_ids`), which the builder checks against the slice count."""

    def index(self, index: SliceIndex) -> int:
        """Return the flat index of ``index``, checking it against the mesh."""
        if isinstance(index, tuple):
            return self.mesh.slice_index(*index)
        if not 0 <= index < self.mesh.slices:
            raise IndexError(f"slice index {index} is outside 0..{self.mesh.slices - 1}")
        return index

    def coords(self, index: int) -> tuple[int, int]:
        """Return ``(dp_rank, cp_rank)`` of flat slice ``index``."""
        return divmod(index, self.mesh.cp)

    def entry(self, index: SliceIndex) -> SliceEntry:
        """Return the entry of slice ``index`` (flat or ``(d, c)``)."""
        return self.slices[self.index(index)]


@dataclass(frozen=True)
class EncodedTgb:
    """A complete TGB object ready to upload, plus what the manifest records about it.

    The object is held as ``parts``: the stored slices in ``(d, c)`` order, then the footer
    JSON, then the trailer. :meth:`ObjectStore.put_parts` writes them without joining them first
    (on ``file://``, joining a 10 MB TGB into a fresh buffer cost more CPU than writing it);
    :attr:`data` is the joined object, built on first use. Parts are immutable: slices given
    as mutable buffers were copied when the TGB was built.

    ``footer_offset`` and ``footer_length`` locate the footer JSON; :func:`read_footer` given both
    fetches footer and trailer (``footer_length + TRAILER_SIZE`` bytes) in one exact range read.
    """

    parts: tuple[bytes | memoryview, ...]
    footer: TgbFooter
    footer_offset: int
    footer_length: int

    def __post_init__(self) -> None:
        # One built by hand is published as it is: parts that disagree with the footer would
        # commit a step no consumer can read.
        expected = self.footer.payload_length + self.footer_length + TRAILER_SIZE
        if self.footer_offset != self.footer.payload_length or self.size != expected:
            raise ValueError(
                f"inconsistent EncodedTgb: its parts hold {self.size} bytes and footer_offset is "
                f"{self.footer_offset}, but its footer describes {self.footer.payload_length} "
                f"payload bytes, then a {self.footer_length}-byte footer and the "
                f"{TRAILER_SIZE}-byte trailer ({expected} bytes); build TGBs with encode_tgb or "
                "TgbBuilder and pass them on unchanged"
            )

    def __reduce__(self) -> tuple[Any, ...]:
        # Parts may be views of the caller's ``bytes``, which cannot be pickled: a TGB built in
        # a worker process must still reach the producer's process.
        parts = tuple(bytes(p) if isinstance(p, memoryview) else p for p in self.parts)
        return (EncodedTgb, (parts, self.footer, self.footer_offset, self.footer_length))

    @functools.cached_property
    def data(self) -> bytes:
        """The whole object as one ``bytes`` (joined on first use, then kept)."""
        return b"".join(self.parts)

    @property
    def footer_bytes(self) -> bytes | memoryview:
        """The footer JSON (``data[footer_offset : footer_offset + footer_length]``)."""
        # Only when the last part is exactly the trailer: a TGB reassembled as (payload,
        # footer + trailer) may have a payload part as long as the footer.
        parts = self.parts
        if _is_footer_then_trailer(parts, self.footer_length):
            return parts[-2]  # laid out as built: ..., footer, trailer
        return self.data[self.footer_offset : self.footer_offset + self.footer_length]

    @functools.cached_property
    def size(self) -> int:
        """Total object size in bytes."""
        return sum(memoryview(part).nbytes for part in self.parts)


def _is_footer_then_trailer(parts: Sequence[bytes | memoryview], footer_length: int) -> bool:
    """Whether ``parts`` end with the footer and the trailer as two separate byte parts."""
    if len(parts) < 2:
        return False
    footer, trailer = memoryview(parts[-2]), memoryview(parts[-1])
    return (
        trailer.nbytes == TRAILER_SIZE
        and trailer.itemsize == 1
        and footer.nbytes == footer_length
        and footer.itemsize == 1
    )


# --------------------------------------------------------------------------------------------
# writing


class _StoredSlice(NamedTuple):
    data: bytes | memoryview
    """Immutable: copied when the slice was set if the caller could still change it."""
    length: int
    """Stored bytes: ``len(data)`` in bytes, whatever the buffer's item size."""
    uncompressed_length: int
    checksum: int
    sample_count: int


class TgbBuilder:
    """Assembles a TGB slice by slice, in any order; :meth:`build` needs every slice set.

    Each slice is encoded, compressed and checksummed as soon as it is set, so an unsuitable
    payload fails at the call that supplied it.
    """

    def __init__(
        self,
        mesh: Mesh,
        *,
        codec: str = "raw",
        compression: str | None = None,
        checksum_algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        self._codec = get_codec(codec)
        check_compression(compression)
        checksum_bits(checksum_algo)  # validates the name
        meta = dict(metadata or {})
        for k, v in meta.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise TypeError(f"TGB metadata must map str to str, got {k!r}: {v!r}")
            try:
                k.encode()
                v.encode()
            except UnicodeEncodeError as exc:
                raise ValueError(
                    f"TGB metadata {k!r}: {v!r:.100} is not valid Unicode ({exc}); the footer is "
                    "UTF-8 JSON, so remove lone surrogates (e.g. decode bytes with errors="
                    "'replace')"
                ) from None
        _check_sample_ids(meta, mesh)
        # What build() re-checks only if it changed (the metadata attribute is mutable).
        self._checked_ids = meta.get(SAMPLE_IDS_KEY)
        self.mesh = mesh
        self.codec = codec
        self.compression = compression
        self.checksum_algo: ChecksumAlgo = checksum_algo
        self.metadata = meta
        self._slices: list[_StoredSlice | None] = [None] * mesh.slices

    def set_slice(
        self, dp_rank: int, cp_rank: int, payload: Any, sample_count: int | None = None
    ) -> None:
        """Encode ``payload`` as slice ``(dp_rank, cp_rank)``; each slice may be set once."""
        self._set(self.mesh.slice_index(dp_rank, cp_rank), payload, sample_count)

    def _set(self, index: int, payload: Any, sample_count: int | None) -> None:
        if self._slices[index] is not None:
            d, c = divmod(index, self.mesh.cp)
            raise ValueError(f"slice ({d}, {c}) was already set")
        try:
            # Encoded first: the codec's type check must run before sample_count looks inside.
            encoded = self._codec.encode(payload)
        except TypeError as exc:
            d, c = divmod(index, self.mesh.cp)
            raise TypeError(f"slice ({d}, {c}): {exc}") from exc
        if sample_count is None:
            sample_count = self._codec.sample_count(payload)
        else:
            # Checked here: the footer's model would take "3" or 3.0 as 3.
            try:
                sample_count = as_count("sample_count", sample_count, 0)
            except (TypeError, ValueError) as exc:
                d, c = divmod(index, self.mesh.cp)
                raise type(exc)(f"slice ({d}, {c}): {exc}") from None
        raw_length = memoryview(encoded).nbytes
        stored: bytes | memoryview
        if self.compression is None:
            # Copied now, not at build(): the checksum must cover exactly the bytes laid out,
            # and a caller filling a builder may reuse its buffer for the next slice.
            stored, length = _immutable(encoded), raw_length
        else:
            stored = compress(encoded, self.compression)
            length = len(stored)
        self._slices[index] = _StoredSlice(
            data=stored,
            length=length,
            uncompressed_length=raw_length,
            checksum=checksum(stored, self.checksum_algo),
            sample_count=sample_count,
        )

    def build(self) -> EncodedTgb:
        """Lay out the payloads, footer and trailer; raise ``ValueError`` if slices are missing."""
        missing = [divmod(i, self.mesh.cp) for i, s in enumerate(self._slices) if s is None]
        if missing:
            shown = ", ".join(f"({d}, {c})" for d, c in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(
                f"cannot build a TGB for mesh {self.mesh}: slices {shown}{more} were never set"
            )
        if self.metadata.get(SAMPLE_IDS_KEY) is not self._checked_ids:
            _check_sample_ids(self.metadata, self.mesh)
        stored = [s for s in self._slices if s is not None]
        entries: list[SliceEntry] = []
        offset = 0
        for s in stored:
            entries.append(_built_entry(offset, s))
            offset += s.length
        version = _ALGO_VERSIONS[self.checksum_algo]
        footer = TgbFooter(
            format_version=version,
            mesh=self.mesh,
            codec=self.codec,
            compression=self.compression,
            checksum_algo=self.checksum_algo,
            payload_length=offset,
            slices=tuple(entries),
            metadata=self.metadata,
        )
        footer_bytes = footer.model_dump_json().encode()
        if len(footer_bytes) > MAX_FOOTER_LENGTH:
            raise ValueError(
                f"the footer for mesh {self.mesh} would be {len(footer_bytes)} bytes, over the "
                f"{MAX_FOOTER_LENGTH}-byte limit; use a smaller mesh or less metadata"
            )
        trailer = _pack_trailer(footer_bytes, version, self.checksum_algo)
        parts = (*(s.data for s in stored), footer_bytes, trailer)
        return EncodedTgb(
            parts=parts, footer=footer, footer_offset=offset, footer_length=len(footer_bytes)
        )


def _check_sample_ids(metadata: Mapping[str, str], mesh: Mesh) -> None:
    """Raise ``ValueError`` unless ``metadata``'s sample ids (if any) fit ``mesh``: refused
    before the object exists, as a malformed value would make its step unexportable forever."""
    raw = metadata.get(SAMPLE_IDS_KEY)
    if raw is None:
        return
    try:
        parse_sample_ids(raw, mesh.slices)
    except ValueError as exc:
        raise ValueError(
            f"TGB for mesh {mesh}: {exc}; build the value with sample_ids_metadata(ids), one "
            "list of ids per slice in (d, c) order"
        ) from None


def _built_entry(offset: int, stored: _StoredSlice) -> SliceEntry:
    """The footer entry of ``stored``, a slice this builder laid out at ``offset``.

    Offset, lengths and checksum were computed here, so they are valid non-negative ints (the
    checksum fits 64 bits); only the sample count can come from the caller. A plain
    non-negative ``int`` skips validation (footers hold one entry per slice); anything else is
    validated, which converts it or raises exactly as before.
    """
    fields = {
        "offset": offset,
        "length": stored.length,
        "uncompressed_length": stored.uncompressed_length,
        "checksum": stored.checksum,
        "sample_count": stored.sample_count,
    }
    if type(stored.sample_count) is int and stored.sample_count >= 0:
        return _entry(fields)
    return SliceEntry(**fields)


def _immutable(data: Buffer) -> bytes | memoryview:
    """``data`` itself if nobody can change it any more, else a copy.

    A TGB's parts are uploaded later, on another thread: a caller reusing a ``bytearray`` or a
    NumPy array for its next batch must not change what was appended. ``bytes`` (and
    read-only views of ``bytes``) cannot change, so they are kept without a copy.
    """
    if isinstance(data, bytes):
        return data
    if isinstance(data, memoryview) and data.readonly and isinstance(data.obj, bytes):
        return data.cast("B")
    return bytes(memoryview(data).cast("B"))


def payload_list(slices: Iterable[Any], mesh: Mesh) -> Sequence[Any]:
    """``slices`` as a sequence in ``(d, c)`` order: lists and tuples as they are, iterators
    (a generator) read into a list; ``TypeError`` for one payload or an unordered collection.
    """
    return _ordered(
        slices, "slices", f"dp*cp = {mesh.slices} payloads in (d, c) order for mesh ({mesh})"
    )


def _ordered(values: Iterable[Any], name: str, what: str) -> Sequence[Any]:
    if isinstance(values, str | bytes | bytearray | memoryview | Mapping):
        raise TypeError(
            f"{name} must be a list of {what}, got one {type(values).__name__}; wrap a single "
            "payload in a list"
        )
    if isinstance(values, Sequence):
        return values
    if isinstance(values, Set):
        raise TypeError(
            f"{name} must be a list of {what}, got a {type(values).__name__}, which has no "
            "order; pass a list"
        )
    try:
        return list(values)
    except TypeError:
        raise TypeError(
            f"{name} must be a list of {what}, got the {type(values).__name__} {values!r:.100}"
        ) from None


def encode_tgb(
    slices: Iterable[Any],
    mesh: Mesh,
    *,
    codec: str = "raw",
    compression: str | None = None,
    checksum_algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO,
    sample_counts: Iterable[int | None] | None = None,
    metadata: Mapping[str, str] | None = None,
) -> EncodedTgb:
    """Encode ``mesh.slices`` payloads, given in ``(d, c)`` order, into one TGB object.

    ``sample_counts`` overrides the codec's per-slice default (raw: 1, arrow: ``num_rows``,
    tensors: length of the first array's first axis). ``checksum_algo`` checksums every slice and
    the footer; ``"xxh3"`` objects are written as format 2, which needs a reader of BatchWeave
    with xxh3 support (``docs/format.md``).
    """
    slices = payload_list(slices, mesh)
    if sample_counts is not None:
        sample_counts = _ordered(sample_counts, "sample_counts", "one count (or None) per slice")
    if len(slices) != mesh.slices:
        raise ValueError(
            f"a TGB for mesh {mesh} needs {mesh.slices} slices in (d, c) order, got {len(slices)}"
        )
    if sample_counts is not None and len(sample_counts) != len(slices):
        raise ValueError(
            f"got {len(sample_counts)} sample counts for {len(slices)} slices; give one per slice"
        )
    builder = TgbBuilder(
        mesh, codec=codec, compression=compression, checksum_algo=checksum_algo, metadata=metadata
    )
    for i, payload in enumerate(slices):
        builder._set(i, payload, None if sample_counts is None else sample_counts[i])
    return builder.build()


def _pack_trailer(
    footer_bytes: bytes, version: int, algo: ChecksumAlgo, *, reserved: bytes = _RESERVED
) -> bytes:
    head = _TRAILER.pack(len(footer_bytes), version, _ALGO_IDS[algo], reserved, 0, MAGIC)
    checked = head[:_CHECKED_TRAILER_BYTES]
    digest = checksum(footer_bytes + checked, algo)
    return _TRAILER.pack(len(footer_bytes), version, _ALGO_IDS[algo], reserved, digest, MAGIC)


# --------------------------------------------------------------------------------------------
# reading the footer


@dataclass(frozen=True)
class _Trailer:
    footer_length: int
    version: int
    algo_id: int
    reserved: bytes
    footer_checksum: int
    raw: bytes


def _unpack_trailer(buf: bytes | memoryview, key: str) -> _Trailer:
    """Check size and magic of the trailer at the end of ``buf`` and unpack it."""
    if len(buf) < TRAILER_SIZE:
        what = "is empty" if len(buf) == 0 else f"is only {len(buf)} bytes"
        raise FormatError(
            f"object {key!r} is not a BatchWeave TGB: it {what}, shorter than the "
            f"{TRAILER_SIZE}-byte trailer (truncated or foreign object)"
        )
    raw = bytes(buf[len(buf) - TRAILER_SIZE :])
    footer_length, version, algo_id, reserved, footer_checksum, magic = _TRAILER.unpack(raw)
    if magic != MAGIC:
        raise FormatError(
            f"object {key!r} is not a BatchWeave TGB (bad magic {magic!r} at its end, expected "
            f"{MAGIC!r}): a foreign, truncated or damaged object"
        )
    if footer_length > MAX_FOOTER_LENGTH:
        raise FormatError(
            f"object {key!r}: trailer claims a {footer_length}-byte footer, over the "
            f"{MAX_FOOTER_LENGTH}-byte limit; the object is damaged"
        )
    if algo_id not in _ALGO_BY_ID:
        _check_version(version, key)
        known = ", ".join(f"{i} ({name})" for i, name in _ALGO_BY_ID.items())
        raise FormatError(
            f"object {key!r}: trailer names unknown checksum algorithm id {algo_id} (this "
            f"BatchWeave knows {known}): the object was written by a newer BatchWeave (upgrade "
            "batchweave to read it) or is damaged"
        )
    return _Trailer(footer_length, version, algo_id, reserved, footer_checksum, raw)


def _check_version(version: int, key: str) -> None:
    if version > FORMAT_VERSION:
        raise UnsupportedFormatVersion(
            f"object {key!r} was written by a newer BatchWeave (format {version}, this library "
            f"reads up to {FORMAT_VERSION}): upgrade batchweave"
        )
    if version < 1:
        raise FormatError(f"object {key!r} has invalid format version {version}")


def parse_footer(buf: bytes | memoryview, *, key: str) -> TgbFooter:
    """Parse the footer from a buffer that ends with a TGB's footer and trailer.

    ``buf`` may hold more of the object before the footer (for example a suffix read). ``key``
    names the object in errors. Raises ``FormatError`` (foreign, truncated or damaged objects),
    ``ChecksumMismatch`` or ``UnsupportedFormatVersion``.
    """
    trailer = _unpack_trailer(buf, key)
    return _parse_with_trailer(buf, trailer, key)


def _parse_with_trailer(buf: bytes | memoryview, trailer: _Trailer, key: str) -> TgbFooter:
    end = len(buf) - TRAILER_SIZE
    if trailer.footer_length > end:
        raise FormatError(
            f"object {key!r} is truncated: its trailer claims a {trailer.footer_length}-byte "
            f"footer but only {end} bytes precede the trailer"
        )
    footer_bytes = bytes(buf[end - trailer.footer_length : end])
    algo = _ALGO_BY_ID[trailer.algo_id]
    computed = checksum(footer_bytes + trailer.raw[:_CHECKED_TRAILER_BYTES], algo)
    if computed != trailer.footer_checksum:
        raise ChecksumMismatch(
            f"footer of object {key!r} is corrupt: stored {algo} checksum "
            f"{trailer.footer_checksum:#x}, computed {computed:#x}; the object was damaged in "
            f"storage or transit, or replaced. {_DAMAGED_ADVICE}"
        )
    _check_version(trailer.version, key)
    if trailer.reserved != _RESERVED:
        raise FormatError(f"object {key!r}: reserved trailer bytes are not zero")
    footer = _footer_from_json(footer_bytes, key)  # also checks version against algorithm
    if footer.format_version != trailer.version or footer.checksum_algo != algo:
        raise FormatError(
            f"object {key!r}: footer (format {footer.format_version}, {footer.checksum_algo}) "
            f"disagrees with its trailer (format {trailer.version}, {algo})"
        )
    return footer


def parse_footer_exact(buf: bytes | memoryview, *, key: str) -> TgbFooter:
    """Parse exactly the footer JSON bytes (no trailer), e.g. a range the manifest recorded.

    Without the trailer the footer checksum cannot be verified, only the footer's structure;
    prefer :func:`read_footer`, which fetches the trailer in the same request.
    """
    if len(buf) > MAX_FOOTER_LENGTH:
        raise FormatError(
            f"object {key!r}: a {len(buf)}-byte footer is over the {MAX_FOOTER_LENGTH}-byte limit"
        )
    return _footer_from_json(bytes(buf), key)


def _footer_from_json(footer_bytes: bytes, key: str) -> TgbFooter:
    try:
        doc = json.loads(footer_bytes)
    except (ValueError, RecursionError) as exc:
        raise FormatError(f"object {key!r}: footer is not valid JSON ({exc})") from exc
    if isinstance(doc, dict) and "format_version" in doc:
        version = doc["format_version"]
        if type(version) is not int:
            # Not coerced: "3" or 3.0 is no version, and must not read as a supported one.
            raise FormatError(
                f"object {key!r}: invalid TGB footer: format_version must be a JSON integer, "
                f"got {version!r:.50}"
            )
        _check_version(version, key)
    footer = _fast_footer(doc)
    if footer is None:
        try:
            # Strict: "2", 2.0 or true is no integer in a footer ("Integers are JSON
            # integers", docs/format.md). Strict mode takes no list for a tuple.
            if isinstance(doc, dict) and type(doc.get("slices")) is list:
                doc = {**doc, "slices": tuple(doc["slices"])}
            footer = TgbFooter.model_validate(doc, strict=True)
        except ValidationError as exc:
            raise FormatError(f"object {key!r}: invalid TGB footer: {exc}") from exc
        _check_footer(footer, key)
    needed = _ALGO_VERSIONS[footer.checksum_algo]
    if footer.format_version < needed:
        raise FormatError(
            f"object {key!r}: format {footer.format_version} footer names checksum algorithm "
            f"{footer.checksum_algo!r}, which needs format {needed} or newer; the object is "
            "damaged"
        )
    return footer


_ENTRY_FIELDS: Final = frozenset(SliceEntry.model_fields)
_ALL_ENTRY_FIELDS_SET: Final = set(_ENTRY_FIELDS)
_U64_LIMIT: Final = 1 << 64


def _entry(fields: dict[str, Any]) -> SliceEntry:
    """Wrap already-validated ``fields`` (exactly SliceEntry's, all ints) without revalidating.

    Sets exactly what ``SliceEntry.model_construct`` sets, minus its per-call field bookkeeping:
    footers hold one entry per slice and are parsed once per step on every rank. All entries
    share one fields-set (every field is always set, and frozen models never add to it), which
    halves the objects the garbage collector tracks per parsed footer.
    """
    return unchecked(SliceEntry, fields, _ALL_ENTRY_FIELDS_SET)


def _fast_footer(doc: Any) -> TgbFooter | None:
    """Validate a footer as this library writes it, with plain integer checks per slice.

    Returns ``None`` (the caller then runs full pydantic validation and :func:`_check_footer`,
    which raise the precise error or accept a lax-but-valid footer) on anything unusual: an
    invalid or non-canonical value, slices out of offset order, any failed check. Everything it
    accepts satisfies every rule :func:`_check_footer` and :class:`SliceEntry` enforce.
    """
    if not isinstance(doc, dict):
        return None
    raw_slices = doc.get("slices")
    if type(raw_slices) is not list:
        return None
    algo = doc.get("checksum_algo")
    payload_length = doc.get("payload_length")
    if type(algo) is not str or algo not in _ALGO_IDS or type(payload_length) is not int:
        return None
    limit = min(1 << checksum_bits(algo), _U64_LIMIT)
    same_lengths = doc.get("compression") is None
    prev_end = 0
    entries: list[SliceEntry] = []
    for raw in raw_slices:
        if type(raw) is not dict or raw.keys() != _ENTRY_FIELDS:
            return None
        offset = raw["offset"]
        length = raw["length"]
        uncompressed = raw["uncompressed_length"]
        digest = raw["checksum"]
        samples = raw["sample_count"]
        if not (
            type(offset) is int
            and type(length) is int
            and type(uncompressed) is int
            and type(digest) is int
            and type(samples) is int
            and length >= 0
            and uncompressed >= 0
            and samples >= 0
            and 0 <= digest < limit
            and (not same_lengths or uncompressed == length)
        ):
            return None
        if length:
            # Non-empty slices in ascending, non-overlapping offset order (the writer's
            # layout); anything else takes the general path.
            if offset < prev_end:
                return None
            prev_end = offset + length
            if prev_end > payload_length:
                return None
        elif not 0 <= offset <= payload_length:
            return None
        entries.append(_entry(raw))
    try:
        footer = TgbFooter.model_validate({**doc, "slices": tuple(entries)}, strict=True)
    except ValidationError:
        return None
    if (
        footer.codec not in CODECS
        or (footer.compression is not None and footer.compression not in COMPRESSIONS)
        or len(entries) != footer.mesh.slices
    ):
        return None
    return footer


def _check_footer(footer: TgbFooter, key: str) -> None:
    """Reject footers whose values are individually valid but inconsistent or unknown."""

    def bad(msg: str) -> FormatError:
        return FormatError(f"object {key!r}: invalid TGB footer: {msg}")

    if footer.codec not in CODECS:
        raise FormatError(
            f"object {key!r} uses codec {footer.codec!r}, which this library does not know "
            f"(known: {', '.join(CODECS)}): upgrade batchweave"
        )
    if footer.compression is not None and footer.compression not in COMPRESSIONS:
        raise FormatError(
            f"object {key!r} uses compression {footer.compression!r}, which this library does "
            f"not know (known: {', '.join(COMPRESSIONS)}): upgrade batchweave"
        )
    if len(footer.slices) != footer.mesh.slices:
        raise bad(f"{len(footer.slices)} slices for mesh {footer.mesh} ({footer.mesh.slices})")
    limit = 1 << checksum_bits(footer.checksum_algo)
    spans: list[tuple[int, int, int]] = []
    for i, entry in enumerate(footer.slices):
        end = entry.offset + entry.length
        if end > footer.payload_length:
            raise bad(
                f"slice {footer.coords(i)} spans [{entry.offset}, {end}), past the "
                f"{footer.payload_length}-byte payload region"
            )
        if footer.compression is None and entry.uncompressed_length != entry.length:
            raise bad(f"slice {footer.coords(i)} is uncompressed but lengths differ")
        if entry.checksum >= limit:
            raise bad(f"slice {footer.coords(i)} checksum does not fit {footer.checksum_algo}")
        if entry.length:
            spans.append((entry.offset, end, i))
    overlap = first_overlap(spans)
    if overlap is not None:
        a, b = overlap
        raise bad(f"slices {footer.coords(a)} and {footer.coords(b)} overlap")


def read_footer(
    store: ObjectStore,
    key: str,
    *,
    footer_offset: int | None = None,
    footer_length: int | None = None,
) -> TgbFooter:
    """Fetch and verify the footer of TGB object ``key``.

    With ``footer_offset`` and ``footer_length`` (from :class:`EncodedTgb`, as recorded in the
    manifest): exactly one bounded range read of footer plus trailer. Without: one suffix read of
    :data:`FOOTER_READ_GUESS` bytes, and a second suffix read only if the footer is larger.
    """
    if (footer_offset is None) != (footer_length is None):
        raise ValueError("give both footer_offset and footer_length, or neither")
    if footer_offset is not None and footer_length is not None:
        want = footer_length + TRAILER_SIZE
        buf = store.get_range(key, Bounded(footer_offset, footer_offset + want))
        if len(buf) < want:
            raise FormatError(
                f"object {key!r} is truncated: expected footer and trailer at bytes "
                f"[{footer_offset}, {footer_offset + want}) but the object ends at "
                f"{footer_offset + len(buf)}"
            )
        trailer = _unpack_trailer(buf, key)
        if trailer.footer_length != footer_length:
            raise FormatError(
                f"object {key!r}: the manifest records a {footer_length}-byte footer but the "
                f"object's trailer says {trailer.footer_length}; manifest and object disagree"
            )
        footer = _parse_with_trailer(buf, trailer, key)
        if footer.payload_length != footer_offset:
            raise FormatError(
                f"object {key!r}: the manifest records the footer at offset {footer_offset} but "
                f"the footer says it follows {footer.payload_length} payload bytes"
            )
        return footer

    buf = store.get_range(key, Suffix(FOOTER_READ_GUESS))
    whole_object = len(buf) < FOOTER_READ_GUESS
    trailer = _unpack_trailer(buf, key)
    want = trailer.footer_length + TRAILER_SIZE
    if want > len(buf) and not whole_object:
        buf = store.get_range(key, Suffix(want))
        whole_object = len(buf) < want
    footer = _parse_with_trailer(buf, trailer, key)
    if whole_object and footer.payload_length + want != len(buf):
        raise FormatError(
            f"object {key!r} is {len(buf)} bytes but its footer describes "
            f"{footer.payload_length + want}: truncated or damaged"
        )
    return footer


def check_encoded(tgb: EncodedTgb, *, what: str) -> None:
    """Raise ``FormatError`` unless ``tgb.footer`` is exactly the footer its bytes hold.

    For a TGB built elsewhere and passed on (possibly reassembled by hand): the manifest
    records the ``footer`` object (slice table, checksums), readers verify the bytes, and a
    disagreement would commit a step no consumer can read. ``what`` names the TGB in errors.
    Also raises ``ValueError`` if its sample ids do not fit its mesh (a hand-assembled TGB).
    """
    parts = tgb.parts
    if _is_footer_then_trailer(parts, tgb.footer_length):
        tail: bytes | memoryview = bytes(parts[-2]) + bytes(parts[-1])
    else:
        tail = memoryview(tgb.data)[tgb.footer_offset :]
    parsed = parse_footer(tail, key=what)
    if parsed != tgb.footer:
        raise FormatError(
            f"{what}: its footer is not the one stored in its bytes (a footer of another TGB, "
            "or one changed after encoding); pass the EncodedTgb that encode_tgb / "
            "TgbBuilder.build returned, unchanged"
        )
    _check_sample_ids(parsed.metadata, parsed.mesh)


# --------------------------------------------------------------------------------------------
# reading slices


def slice_range(footer: TgbFooter, index: SliceIndex) -> Bounded:
    """The byte range of slice ``index`` in its object: the one read a rank issues."""
    entry = footer.entry(index)
    return Bounded(entry.offset, entry.offset + entry.length)


class SliceLayout(Protocol):
    """How every slice of one object is stored: a :class:`TgbFooter`, or a copy of its fields."""

    @property
    def codec(self) -> str: ...
    @property
    def compression(self) -> str | None: ...
    @property
    def checksum_algo(self) -> ChecksumAlgo: ...


def decode_slice(raw: bytes | memoryview, footer: TgbFooter, index: SliceIndex, *, key: str) -> Any:
    """Verify, decompress and decode the stored bytes of slice ``index``.

    Returns what the codec produces: ``bytes`` (raw), ``pyarrow.Table`` (arrow) or
    ``dict[str, numpy.ndarray]`` (tensors, read-only views of ``raw`` or of the decompressed
    bytes). Raises ``ChecksumMismatch`` naming the object, the slice and both checksums.
    """
    i = footer.index(index)
    d, c = footer.coords(i)
    return decode_entry(raw, footer.slices[i], footer, where=f"slice ({d}, {c}) of object {key!r}")


def decode_entry(
    raw: bytes | memoryview, entry: SliceEntry | SliceSpan, layout: SliceLayout, *, where: str
) -> Any:
    """Verify ``raw`` against ``entry`` and decode it with ``layout``'s codec; see decode_slice.

    ``where`` names the slice and object in error messages.
    """
    if len(raw) != entry.length:
        raise FormatError(
            f"{where}: got {len(raw)} bytes, the slice index (footer or manifest slice table) "
            f"records {entry.length} (truncated object, or an index from another object)"
        )
    computed = checksum(raw, layout.checksum_algo)
    if computed != entry.checksum:
        raise ChecksumMismatch(
            f"{where} is corrupt: stored {layout.checksum_algo} checksum {entry.checksum:#x}, "
            f"computed {computed:#x}; the object was damaged in storage or transit, or replaced. "
            f"{_DAMAGED_ADVICE}"
        )
    try:
        body: bytes | memoryview = raw
        if layout.compression is not None:
            body = decompress(raw, layout.compression, entry.uncompressed_length)
        return CODECS[layout.codec].decode(body)
    except FormatError as exc:
        raise type(exc)(f"{where}: {exc}") from exc


def read_slice(store: ObjectStore, key: str, footer: TgbFooter, index: SliceIndex) -> Any:
    """Fetch slice ``index`` of object ``key`` with exactly one range read and decode it.

    An empty stored slice (possible only for an uncompressed empty raw payload) needs no read.
    """
    rng = slice_range(footer, index)
    raw = store.get_range(key, rng) if rng.end > rng.start else b""
    return decode_slice(raw, footer, index, key=key)

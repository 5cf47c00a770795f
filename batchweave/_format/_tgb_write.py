"""Writing TGB objects: encoding, compressing and checksumming slices, then laying them out.

:class:`TgbBuilder` takes slices one at a time, :func:`encode_tgb` a whole batch; both check the
producer's metadata (sample ids must fit the mesh) before the object exists. :func:`check_encoded`
refuses a TGB built elsewhere whose bytes disagree with its footer. The writer depends on the
reader (:mod:`batchweave._format._tgb_read`) only for that check; readers never need the writer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Set
from typing import Any, NamedTuple

import pyarrow as pa

from batchweave._checks import as_count, check_int64
from batchweave._errors import FormatError
from batchweave._format._checksum import (
    DEFAULT_CHECKSUM_ALGO,
    ChecksumAlgo,
    checksum,
    checksum_bits,
)
from batchweave._format._codecs import Buffer, check_compression, compress, get_codec
from batchweave._format._sample_ids import SAMPLE_IDS_KEY, parse_sample_ids
from batchweave._format._tgb import (
    ALGO_IDS,
    ALGO_VERSIONS,
    CHECKED_TRAILER_BYTES,
    MAGIC,
    MAX_FOOTER_LENGTH,
    TRAILER_RESERVED,
    TRAILER_STRUCT,
    EncodedTgb,
    SliceEntry,
    TgbFooter,
    is_footer_then_trailer,
    trusted_entry,
)
from batchweave._format._tgb_read import parse_footer
from batchweave._mesh import Mesh

__all__ = ["TgbBuilder", "check_encoded", "encode_tgb", "payload_list"]


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
        if not isinstance(metadata, Mapping | None):
            _check_metadata(metadata)  # dict() would take pairs, or fail not naming metadata
        meta = dict(metadata or {})
        _check_metadata(meta)
        _check_sample_ids(meta, mesh)
        # What build() re-checks only if it changed (the metadata attribute is mutable).
        self._checked_ids = meta.get(SAMPLE_IDS_KEY)
        self._mesh = mesh
        self._codec_name = codec
        self._compression = compression
        self._checksum_algo: ChecksumAlgo = checksum_algo
        self.metadata = meta
        """The footer's metadata (str -> str): may still change until :meth:`build`, which
        checks it again."""
        self._slices: list[_StoredSlice | None] = [None] * mesh.slices

    # Read-only: slices set so far were encoded, compressed and checksummed with these, so a
    # change would lay them out under a footer that names other settings (a committed step no
    # consumer can read). Build another TgbBuilder for other settings.

    @property
    def mesh(self) -> Mesh:
        """The mesh this TGB is built for: ``mesh.slices`` slices (read-only)."""
        return self._mesh

    @property
    def codec(self) -> str:
        """The codec every slice is encoded with (read-only)."""
        return self._codec_name

    @property
    def compression(self) -> str | None:
        """The compression of every slice, ``None`` for none (read-only)."""
        return self._compression

    @property
    def checksum_algo(self) -> ChecksumAlgo:
        """The checksum algorithm of every slice and the footer (read-only)."""
        return self._checksum_algo

    def set_slice(
        self, dp_rank: int, cp_rank: int, payload: Any, sample_count: int | None = None
    ) -> None:
        """Encode ``payload`` as slice ``(dp_rank, cp_rank)``; each slice may be set once."""
        self._set(self._mesh.slice_index(dp_rank, cp_rank), payload, sample_count)

    def _set(self, index: int, payload: Any, sample_count: int | None) -> None:
        if self._slices[index] is not None:
            d, c = divmod(index, self._mesh.cp)
            raise ValueError(f"slice ({d}, {c}) was already set")
        try:
            # Encoded first: the codec's type check must run before sample_count looks inside.
            encoded = self._codec.encode(payload)
        except (TypeError, ValueError, pa.ArrowException) as exc:
            d, c = divmod(index, self._mesh.cp)
            raise _slice_error(exc, f"slice ({d}, {c}): {exc}") from exc
        if sample_count is None:
            sample_count = self._codec.sample_count(payload)
        else:
            # Checked here: the footer's model would take "3" or 3.0 as 3.
            try:
                sample_count = check_int64(
                    "sample_count", as_count("sample_count", sample_count, 0)
                )
            except (TypeError, ValueError) as exc:
                d, c = divmod(index, self._mesh.cp)
                raise type(exc)(f"slice ({d}, {c}): {exc}") from None
        raw_length = memoryview(encoded).nbytes
        stored: bytes | memoryview
        if self._compression is None:
            # Copied now, not at build(): the checksum must cover exactly the bytes laid out,
            # and a caller filling a builder may reuse its buffer for the next slice.
            stored, length = _immutable(encoded), raw_length
        else:
            stored = compress(encoded, self._compression)
            length = len(stored)
        self._slices[index] = _StoredSlice(
            data=stored,
            length=length,
            uncompressed_length=raw_length,
            checksum=checksum(stored, self._checksum_algo),
            sample_count=sample_count,
        )

    def build(self) -> EncodedTgb:
        """Lay out the payloads, footer and trailer; raise ``ValueError`` if slices are missing."""
        missing = [divmod(i, self._mesh.cp) for i, s in enumerate(self._slices) if s is None]
        if missing:
            shown = ", ".join(f"({d}, {c})" for d, c in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            raise ValueError(
                f"cannot build a TGB for mesh {self._mesh}: slices {shown}{more} were never set"
            )
        _check_metadata(self.metadata)
        if self.metadata.get(SAMPLE_IDS_KEY) is not self._checked_ids:
            _check_sample_ids(self.metadata, self._mesh)
        stored = [s for s in self._slices if s is not None]
        entries: list[SliceEntry] = []
        offset = 0
        for s in stored:
            entries.append(_built_entry(offset, s))
            offset += s.length
        version = ALGO_VERSIONS[self._checksum_algo]
        footer = TgbFooter(
            format_version=version,
            mesh=self._mesh,
            codec=self._codec_name,
            compression=self._compression,
            checksum_algo=self._checksum_algo,
            payload_length=offset,
            slices=tuple(entries),
            metadata=self.metadata,
        )
        footer_bytes = footer.model_dump_json().encode()
        if len(footer_bytes) > MAX_FOOTER_LENGTH:
            raise ValueError(
                f"the footer for mesh {self._mesh} would be {len(footer_bytes)} bytes, over the "
                f"{MAX_FOOTER_LENGTH}-byte limit; use a smaller mesh or less metadata"
            )
        trailer = _pack_trailer(footer_bytes, version, self._checksum_algo)
        parts = (*(s.data for s in stored), footer_bytes, trailer)
        return EncodedTgb(
            parts=parts, footer=footer, footer_offset=offset, footer_length=len(footer_bytes)
        )


def _slice_error(exc: Exception, message: str) -> Exception:
    """An error of ``exc``'s family (``TypeError``, ``ValueError``, or else its own pyarrow
    type) carrying ``message``, which names the slice."""
    if isinstance(exc, TypeError):
        return TypeError(message)
    if isinstance(exc, ValueError):
        return ValueError(message)
    try:
        return type(exc)(message)
    except Exception:  # an exception type that takes other arguments: keep the original
        return exc


def _check_metadata(metadata: object) -> None:
    """Raise ``TypeError`` unless ``metadata`` maps str to str, ``ValueError`` unless each is
    valid Unicode (the footer is UTF-8 JSON)."""
    if not isinstance(metadata, Mapping):
        raise TypeError(f"TGB metadata must be a mapping of str to str, got {metadata!r:.100}")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"TGB metadata must map str to str, got {k!r:.100}: {v!r:.100}")
        try:
            k.encode()
            v.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"TGB metadata {k!r:.100}: {v!r:.100} is not valid Unicode ({exc}); the footer "
                "is UTF-8 JSON, so remove lone surrogates (e.g. decode bytes with errors="
                "'replace')"
            ) from None


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
        return trusted_entry(fields)
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
    footer_bytes: bytes, version: int, algo: ChecksumAlgo, *, reserved: bytes = TRAILER_RESERVED
) -> bytes:
    head = TRAILER_STRUCT.pack(len(footer_bytes), version, ALGO_IDS[algo], reserved, 0, MAGIC)
    checked = head[:CHECKED_TRAILER_BYTES]
    digest = checksum(footer_bytes + checked, algo)
    return TRAILER_STRUCT.pack(len(footer_bytes), version, ALGO_IDS[algo], reserved, digest, MAGIC)


def check_encoded(tgb: EncodedTgb, *, what: str) -> None:
    """Raise ``FormatError`` unless ``tgb.footer`` is exactly the footer its bytes hold.

    For a TGB built elsewhere and passed on (possibly reassembled by hand): the manifest
    records the ``footer`` object (slice table, checksums), readers verify the bytes, and a
    disagreement would commit a step no consumer can read. ``what`` names the TGB in errors.
    Also raises ``ValueError`` if its sample ids do not fit its mesh (a hand-assembled TGB).
    """
    parts = tgb.parts
    if is_footer_then_trailer(parts, tgb.footer_length):
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

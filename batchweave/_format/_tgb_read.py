"""Reading TGB objects: the trailer, the footer (one or two reads) and slices (one read each).

Everything here verifies before it trusts: the trailer's magic, sizes and algorithm id, the
footer's checksum, version and consistency, each slice's checksum. A footer as this library
writes it takes a fast path of plain integer checks (:func:`_fast_footer`); anything else gets
full validation and the precise error. Consumers, ``batchweave verify`` and the history export
only read, so this side does not depend on the writer (:mod:`batchweave._format._tgb_write`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Final, Protocol

from pydantic import ValidationError

from batchweave._errors import ChecksumMismatch, FormatError, UnsupportedFormatVersion
from batchweave._format._checksum import ChecksumAlgo, checksum, checksum_bits
from batchweave._format._codecs import CODECS, COMPRESSIONS, decompress, first_overlap
from batchweave._format._tgb import (
    ALGO_IDS,
    ALGO_VERSIONS,
    CHECKED_TRAILER_BYTES,
    ENTRY_FIELDS,
    MAGIC,
    MAX_FOOTER_LENGTH,
    TRAILER_RESERVED,
    TRAILER_SIZE,
    TRAILER_STRUCT,
    SliceEntry,
    SliceIndex,
    SliceSpan,
    TgbFooter,
    trusted_entry,
)
from batchweave._store._base import Bounded, ObjectStore, Suffix, check_store

__all__ = [
    "FOOTER_READ_GUESS",
    "FORMAT_VERSION",
    "SliceLayout",
    "decode_entry",
    "decode_slice",
    "parse_footer",
    "parse_footer_exact",
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

FOOTER_READ_GUESS: Final = 64 << 10
"""Suffix length fetched when the footer's location is unknown; holds most footers entirely."""

_ALGO_BY_ID: Final[dict[int, ChecksumAlgo]] = {v: k for k, v in ALGO_IDS.items()}
_DAMAGED_ADVICE: Final = (
    "Committed TGBs are immutable (the manifest records their checksums), so do not rewrite "
    "it: read it again (a transfer error may pass), restore the object from a backup or "
    "replica, or skip its step deliberately (Consumer(start_step=...) past it); "
    "`batchweave verify` lists every damaged object"
)
"""What a reader can do about a damaged TGB object: never rewrite it in place."""


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
    footer_length, version, algo_id, reserved, footer_checksum, magic = TRAILER_STRUCT.unpack(raw)
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
    computed = checksum(footer_bytes + trailer.raw[:CHECKED_TRAILER_BYTES], algo)
    if computed != trailer.footer_checksum:
        raise ChecksumMismatch(
            f"footer of object {key!r} is corrupt: stored {algo} checksum "
            f"{trailer.footer_checksum:#x}, computed {computed:#x}; the object was damaged in "
            f"storage or transit, or replaced. {_DAMAGED_ADVICE}"
        )
    _check_version(trailer.version, key)
    if trailer.reserved != TRAILER_RESERVED:
        raise FormatError(f"object {key!r}: reserved trailer bytes are not zero")
    # Checks the footer's version against the trailer's before the supported range, so a
    # disagreement reads as damage, not as a newer format.
    footer = _footer_from_json(footer_bytes, key, trailer_version=trailer.version)
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


def _footer_from_json(
    footer_bytes: bytes, key: str, *, trailer_version: int | None = None
) -> TgbFooter:
    """Parse and validate footer JSON; ``trailer_version`` is the trailer's, if read with it."""
    try:
        # Strictly UTF-8 (docs/format.md): json.loads(bytes) would also take UTF-16 and
        # UTF-32, and json.loads(str) refuses a byte-order mark.
        doc = json.loads(footer_bytes.decode())
    except UnicodeDecodeError as exc:
        raise FormatError(
            f"object {key!r}: footer is not UTF-8 JSON ({exc}); the object is damaged or was "
            "written by a non-conforming writer"
        ) from exc
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
        if trailer_version is not None and version != trailer_version:
            raise FormatError(
                f"object {key!r}: footer format_version {version} disagrees with its "
                f"trailer's ({trailer_version}); the object is damaged. {_DAMAGED_ADVICE}"
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
    needed = ALGO_VERSIONS[footer.checksum_algo]
    if footer.format_version < needed:
        raise FormatError(
            f"object {key!r}: format {footer.format_version} footer names checksum algorithm "
            f"{footer.checksum_algo!r}, which needs format {needed} or newer; the object is "
            "damaged"
        )
    return footer


_U64_LIMIT: Final = 1 << 64


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
    if type(algo) is not str or algo not in ALGO_IDS or type(payload_length) is not int:
        return None
    limit = min(1 << checksum_bits(algo), _U64_LIMIT)
    same_lengths = doc.get("compression") is None
    prev_end = 0
    entries: list[SliceEntry] = []
    for raw in raw_slices:
        if type(raw) is not dict or raw.keys() != ENTRY_FIELDS:
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
        entries.append(trusted_entry(raw))
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
    check_store(store)
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
    check_store(store)
    rng = slice_range(footer, index)
    raw = store.get_range(key, rng) if rng.end > rng.start else b""
    return decode_slice(raw, footer, index, key=key)

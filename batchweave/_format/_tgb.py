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

This module holds what both sides share: the footer models, :class:`EncodedTgb` and the
byte layout (trailer structure, magic, algorithm ids). Writing lives in
:mod:`batchweave._format._tgb_write`, reading in :mod:`batchweave._format._tgb_read`.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

from pydantic import BaseModel, ConfigDict, Field

from batchweave._format._checksum import ChecksumAlgo
from batchweave._mesh import Mesh
from batchweave._unchecked import unchecked

__all__ = [
    "ALGO_IDS",
    "ALGO_VERSIONS",
    "CHECKED_TRAILER_BYTES",
    "ENTRY_FIELDS",
    "MAGIC",
    "MAX_FOOTER_LENGTH",
    "TRAILER_RESERVED",
    "TRAILER_SIZE",
    "TRAILER_STRUCT",
    "EncodedTgb",
    "SliceEntry",
    "SliceIndex",
    "SliceSpan",
    "TgbFooter",
    "is_footer_then_trailer",
    "trusted_entry",
]

MAGIC: Final = b"BWTGB\x00\x01\n"
"""Last 8 bytes of every TGB object, in every format version."""

TRAILER_SIZE: Final = 32
"""Size of the fixed trailer; its layout is the same in every format version."""

MAX_FOOTER_LENGTH: Final = 256 << 20
"""Footers longer than this are refused before anything is allocated for them."""

# footer_length u64, format_version u16, checksum algo id u8, 5 reserved zero bytes,
# footer checksum u64, magic 8 bytes; little-endian.
TRAILER_STRUCT: Final = struct.Struct("<QHB5sQ8s")
CHECKED_TRAILER_BYTES: Final = 16  # footer checksum covers footer + trailer[0:16]
ALGO_IDS: Final[dict[ChecksumAlgo, int]] = {"crc32c": 1, "xxhash64": 2, "xxh3": 3}
ALGO_VERSIONS: Final[dict[ChecksumAlgo, int]] = {"crc32c": 1, "xxhash64": 1, "xxh3": 2}
"""The format version that introduced each algorithm: the version an object using it is written
with, and the lowest version a valid object using it can have."""
TRAILER_RESERVED: Final = bytes(5)

assert TRAILER_STRUCT.size == TRAILER_SIZE

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
        if is_footer_then_trailer(parts, self.footer_length):
            return parts[-2]  # laid out as built: ..., footer, trailer
        return self.data[self.footer_offset : self.footer_offset + self.footer_length]

    @functools.cached_property
    def size(self) -> int:
        """Total object size in bytes."""
        return sum(memoryview(part).nbytes for part in self.parts)


def is_footer_then_trailer(parts: Sequence[bytes | memoryview], footer_length: int) -> bool:
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


ENTRY_FIELDS: Final = frozenset(SliceEntry.model_fields)
_ALL_ENTRY_FIELDS_SET: Final = set(ENTRY_FIELDS)


def trusted_entry(fields: dict[str, Any]) -> SliceEntry:
    """Wrap already-validated ``fields`` (exactly SliceEntry's, all ints) without revalidating.

    Sets exactly what ``SliceEntry.model_construct`` sets, minus its per-call field bookkeeping:
    footers hold one entry per slice and are parsed once per step on every rank. All entries
    share one fields-set (every field is always set, and frozen models never add to it), which
    halves the objects the garbage collector tracks per parsed footer.
    """
    return unchecked(SliceEntry, fields, _ALL_ENTRY_FIELDS_SET)

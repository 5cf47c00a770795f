"""What a manifest version persists: pydantic models, JSON encoded, with an explicit format.

A manifest version is the complete state of a namespace: its identity (mesh, namespace id), the
ordered TGB list (``base_step``, immutable segment references, an inline tail), every producer's
committed state, and whether the stream is sealed. Step ``s`` is the ``s``-th TGB descriptor of
that list; steps are assigned at commit and never change.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import struct
from functools import cached_property
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    model_serializer,
    model_validator,
)

from batchweave._errors import InvalidKey
from batchweave._format import (
    CHECKSUM_ALGOS,
    CODECS,
    COMPRESSIONS,
    ChecksumAlgo,
    SliceSpan,
    TgbFooter,
    checksum_bits,
)
from batchweave._mesh import Mesh
from batchweave._store._base import validate_key
from batchweave._unchecked import unchecked

__all__ = [
    "FORMAT_WITH_SOURCES",
    "MANIFEST_FORMAT",
    "MAX_SOURCE_LENGTH",
    "SEGMENT_FORMAT",
    "Manifest",
    "ProducerState",
    "Segment",
    "SegmentRef",
    "TAIL_REUSED",
    "SliceTable",
    "TgbDescriptor",
    "TgbObjectRef",
    "check_source",
]

MANIFEST_FORMAT = 4
"""The newest manifest format this library reads.

Format 2 added the optional :class:`SliceTable` of an object reference, format 3 its compact
columns (a repeated value written once, checksums packed in base64), format 4 a producer
state's ``source``; formats 1 to 3 are still read. Each version is written in the oldest format
that can express it: 4 only when some producer state has a ``source``, else 3, so a namespace
that does not use source identities stays readable by releases that read format 3 (which
answer "upgrade batchweave" for format 4, not "corrupt").
"""

_FORMAT_WITHOUT_SOURCES = 3
"""The format of a manifest in which no producer state has a ``source``."""
FORMAT_WITH_SOURCES = 4
"""The first format with a producer state's ``source``."""

MAX_SOURCE_LENGTH = 1024
"""Longest ``source`` identity of a producer state, in characters."""

SEGMENT_FORMAT = 3
"""Segment format this library writes and the newest it reads (descriptors as in the manifest)."""

_STRICT = ConfigDict(frozen=True, extra="forbid")
"""Config of every persisted model. Persisted JSON is also validated in pydantic's strict mode
(``decode_manifest``, ``decode_segment``): ``"3"``, ``true`` or ``3.0`` are no integer there."""

_Count = Annotated[int, Field(ge=0)]


def _back_to_back(lengths: tuple[int, ...]) -> tuple[int, ...]:
    """The offsets of slices of ``lengths`` stored back to back from byte 0."""
    return (0, *itertools.accumulate(lengths))[:-1]


_INT_COLUMNS = ("lengths", "uncompressed_lengths", "sample_counts")
_TUPLE_COLUMNS = (*_INT_COLUMNS, "checksums")
_PACKED = {4: "I", 8: "Q"}
"""struct format of a packed checksum, by width in bytes."""


class SliceTable(BaseModel):
    """The slice entries of one object's footer, copied into the manifest in compact columns.

    With it a consumer reads its slice with one request and never fetches the footer: a step
    costs one dependent request instead of two. Slices are stored back to back from byte 0, so
    offsets are the running sums of ``lengths``. The manifest's own checksum covers the table, and
    each slice is still verified against its checksum here, so nothing goes unchecked.

    In memory every column is a tuple with one value per slice. On disk (format 3) the table
    names its slice ``count``, an integer column whose values are all equal is written as that
    one value, and ``checksums`` is the base64 of the values packed big-endian at the
    algorithm's width: about 6 bytes a slice for equal-sized slices, so a 128-slice table costs
    under 1 KB. The per-slice lists of format 2 are still read.
    """

    model_config = _STRICT

    codec: str
    compression: str | None = None
    checksum_algo: ChecksumAlgo
    lengths: tuple[_Count, ...] = Field(min_length=1)
    """Stored (possibly compressed) length of each slice, in slice order."""
    checksums: tuple[_Count, ...]
    uncompressed_lengths: tuple[_Count, ...] | None = None
    """Only when ``compression`` is set: each slice's length after decompression."""
    sample_counts: tuple[_Count, ...]

    @model_validator(mode="before")
    @classmethod
    def _expand_compact_columns(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # a model instance
        # What this hook returns is validated as Python input, where strict mode (persisted
        # JSON is decoded strictly) takes no list for a tuple: JSON arrays become tuples here.
        data = dict(data)
        for name in _TUPLE_COLUMNS:
            value = data.get(name)
            if isinstance(value, list):
                data[name] = tuple(value)
        if "count" not in data:
            return data  # format 2: one list per column
        count = data.pop("count")
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ValueError(f"count must be a positive integer, got {count!r}")
        for name in _INT_COLUMNS:
            value = data.get(name)
            if isinstance(value, list | tuple) and len(value) != count:
                raise ValueError(f"{name} has {len(value)} entries, count is {count}")
        # The checksum column holds one explicit value per slice, so it bounds ``count`` by the
        # object's size: check it before expanding a repeated value ``count`` times.
        packed = data.get("checksums")
        if isinstance(packed, str):
            data["checksums"] = _unpack_checksums(packed, count, data.get("checksum_algo"))
        elif not isinstance(packed, list | tuple) or len(packed) != count:
            raise ValueError(f"checksums must be packed base64 or a list of {count} values")
        for name in _INT_COLUMNS:
            value = data.get(name)
            if isinstance(value, int) and not isinstance(value, bool):
                data[name] = (value,) * count
        return data

    @model_serializer(mode="wrap")
    def _compact_columns(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = {"count": len(self.lengths), **handler(self)}
        for name in _INT_COLUMNS:
            column = getattr(self, name)
            if column is not None and column.count(column[0]) == len(column):
                out[name] = column[0]
        if self.compression is None:
            del out["compression"], out["uncompressed_lengths"]
        width = checksum_bits(self.checksum_algo) // 8
        packed = struct.pack(f">{len(self.checksums)}{_PACKED[width]}", *self.checksums)
        out["checksums"] = base64.b64encode(packed).decode("ascii")
        return out

    @model_validator(mode="after")
    def _check_columns(self) -> SliceTable:
        if self.codec not in CODECS:
            raise ValueError(f"unknown codec {self.codec!r}; expected one of {sorted(CODECS)}")
        if self.compression is not None and self.compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {self.compression!r}")
        if (self.compression is None) != (self.uncompressed_lengths is None):
            raise ValueError("uncompressed_lengths must be given exactly when compression is set")
        columns = [self.lengths, self.checksums, self.sample_counts]
        if self.uncompressed_lengths is not None:
            columns.append(self.uncompressed_lengths)
        if any(len(column) != len(self.lengths) for column in columns):
            raise ValueError(f"each slice table column must have {len(self.lengths)} entries")
        if max(self.checksums) >> checksum_bits(self.checksum_algo):
            raise ValueError(f"a checksum does not fit {self.checksum_algo}")
        return self

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each slice in the object."""
        return _back_to_back(self.lengths)

    @property
    def payload_length(self) -> int:
        """Bytes before the footer: where the object's footer starts."""
        return sum(self.lengths)

    def span(self, index: int) -> SliceSpan:
        """Slice ``index``'s location and checksum, without building a :class:`SliceEntry`."""
        return SliceSpan(
            self.offsets[index],
            self.lengths[index],
            (self.uncompressed_lengths or self.lengths)[index],
            self.checksums[index],
        )

    @classmethod
    def from_footer(cls, footer: TgbFooter, *, validate: bool = True) -> SliceTable | None:
        """The table of ``footer``, or None if its slices are not stored back to back from 0.

        ``validate=False`` skips validation, for a footer this library has just built from
        settings it checked (a producer's own encoding): every value is then valid by
        construction, and the table equals the validated one.
        """
        entries = footer.slices
        lengths = tuple([e.length for e in entries])
        if not entries or tuple([e.offset for e in entries]) != _back_to_back(lengths):
            return None
        fields: dict[str, Any] = {
            "codec": footer.codec,
            "compression": footer.compression,
            "checksum_algo": footer.checksum_algo,
            "lengths": lengths,
            "checksums": tuple([e.checksum for e in entries]),
            "uncompressed_lengths": (
                tuple([e.uncompressed_length for e in entries]) if footer.compression else None
            ),
            "sample_counts": tuple([e.sample_count for e in entries]),
        }
        return cls(**fields) if validate else unchecked(cls, fields)


def _unpack_checksums(packed: str, count: int, algo: object) -> tuple[int, ...]:
    """The checksum column of a compact table: ``count`` big-endian values in base64."""
    if isinstance(algo, str) and algo not in CHECKSUM_ALGOS:
        raise ValueError(
            f"checksums use algorithm {algo!r}, which this BatchWeave does not know (it knows "
            f"{', '.join(CHECKSUM_ALGOS)}): written by a newer BatchWeave, upgrade batchweave"
        )
    if not isinstance(algo, str):
        raise ValueError(f"checksum_algo must be a string, got {algo!r}")
    try:
        width = checksum_bits(algo) // 8  # type: ignore[arg-type]  # validated as a field later
        raw = base64.b64decode(packed, validate=True)
    except (ValueError, binascii.Error) as exc:
        raise ValueError(f"checksums: {exc}") from None
    if len(raw) != count * width:
        raise ValueError(
            f"checksums: {len(raw)} packed bytes, expected {count} slices x {width} bytes"
        )
    return struct.unpack(f">{count}{_PACKED[width]}", raw)


def _relative_key(key: str) -> str:
    try:
        validate_key(key)
    except InvalidKey as exc:
        raise ValueError(str(exc)) from None
    return key


RelativeKey = Annotated[str, AfterValidator(_relative_key)]
"""A key relative to the namespace that the store layer accepts: a manifest naming
``../other-namespace/...`` or ``/abs`` is refused when decoded, naming the manifest."""


class TgbObjectRef(BaseModel):
    """One immutable object holding a contiguous run of a TGB's slices."""

    model_config = _STRICT

    key: RelativeKey
    """Object key relative to the namespace root, e.g.
    ``data/prep-0/3/00000000000000000017-<uuid>.tgb`` (producer, epoch, 20-digit offset)."""
    size: int = Field(ge=0)
    first_slice: int = Field(default=0, ge=0)
    """Index (``d * cp + c``) of the first slice this object holds."""
    slice_count: int = Field(ge=1)
    footer_offset: int = Field(ge=0)
    footer_length: int = Field(ge=1)
    footer_checksum: int = Field(ge=0)
    """Checksum of the footer bytes, checked when the footer is fetched by exact range."""
    slices: SliceTable | None = None
    """The footer's slice entries, when the producer copied them here (small meshes)."""

    @model_validator(mode="after")
    def _check_table(self) -> TgbObjectRef:
        if self.slices is not None:
            if len(self.slices.lengths) != self.slice_count:
                raise ValueError(
                    f"object {self.key!r}: slice table has {len(self.slices.lengths)} entries, "
                    f"slice_count is {self.slice_count}"
                )
            if self.slices.payload_length != self.footer_offset:
                raise ValueError(
                    f"object {self.key!r}: slice table ends at byte {self.slices.payload_length}, "
                    f"the footer starts at {self.footer_offset}"
                )
        return self


class TgbDescriptor(BaseModel):
    """Everything a consumer needs to read one TGB, and who produced it."""

    model_config = _STRICT

    producer_id: str
    epoch: int = Field(ge=0)
    offset: int = Field(ge=0)
    """The producer's source offset for this TGB; strictly increasing per producer."""
    objects: tuple[TgbObjectRef, ...] = Field(min_length=1)
    bytes: int = Field(ge=0)
    """Total stored bytes over all objects."""
    samples: int | None = Field(default=None, ge=0)
    """Total sample count over all slices, when the producer knows it."""

    def tiling_problem(self, slices: int) -> str | None:
        """What is wrong with how the objects hold a TGB of ``slices`` slices, or ``None``.

        The objects must hold slices ``0 .. slices - 1`` in order, each once. The schema cannot
        check it (a descriptor does not know the mesh); a reader must, or a rank would read
        another rank's slice from an object that says it starts later than it does.
        """
        expected = 0
        for ref in self.objects:
            if ref.first_slice != expected:
                return f"objects do not cover slices contiguously at slice {expected}"
            expected += ref.slice_count
        if expected != slices:
            return f"objects hold {expected} slices, the mesh has {slices}"
        return None


class SegmentRef(BaseModel):
    """A manifest's pointer to an immutable segment object holding a run of descriptors."""

    model_config = _STRICT

    key: RelativeKey
    """Object key relative to the namespace, ``_segments/{first_step:020d}-{uuid}.seg``."""
    first_step: int = Field(ge=0)
    count: int = Field(ge=1)
    bytes: int = Field(ge=0)
    """Size of the whole segment object; a reader refuses an object of another size."""
    checksum: int = Field(ge=0)
    """CRC-32C of the segment's JSON body (as in its header line); guards against replacement."""

    @property
    def end_step(self) -> int:
        """One past the last step in the segment."""
        return self.first_step + self.count


class Segment(BaseModel):
    """The body of a segment object: ``count`` descriptors starting at ``first_step``."""

    model_config = _STRICT

    format: int = SEGMENT_FORMAT
    namespace_id: str
    first_step: int = Field(ge=0)
    tgbs: tuple[TgbDescriptor, ...] = Field(min_length=1)


def check_source(source: str) -> str:
    """``source`` if it is a valid source identity (1 to 1024 printable characters)."""
    if not source or len(source) > MAX_SOURCE_LENGTH or not source.isprintable():
        shown = repr(source[:60]) + ("..." if len(source) > 60 else "")
        raise ValueError(
            f"a source identity must be 1 to {MAX_SOURCE_LENGTH} printable characters, got "
            f"{len(source)} characters: {shown}"
        )
    return source


class ProducerState(BaseModel):
    """A producer's committed state: the basis of fencing and exactly-once resume."""

    model_config = _STRICT

    epoch: int = Field(ge=0)
    """Bumped by a commit each time the producer starts; a lower epoch is fenced."""
    offset: int | None = Field(default=None, ge=0)
    """Highest source offset committed by this producer (``None``: nothing yet)."""
    last_version: int = Field(ge=0)
    """Manifest version of this producer's last successful commit."""
    last_commit_at: float = Field(default=0.0, allow_inf_nan=False)
    """Wall-clock time (seconds since the epoch, finite) of that commit; counts active producers."""
    source: Annotated[str, AfterValidator(check_source)] | None = None
    """What the offsets mean (``Producer(source=...)``), opaque; only in manifest format 4,
    and written only when set (see :meth:`_drop_unset_source`)."""

    @model_serializer(mode="wrap")
    def _drop_unset_source(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """This state's fields, without ``source`` when it is unset.

        So a format-3 manifest (no state has a source) is byte for byte what releases without
        source identities wrote and read, and a format-4 one writes the key only where it is set.
        Decided per state, not with an ``exclude`` keyed by producer id, which pydantic reads
        specially for some keys (``"__all__"`` means every entry).
        """
        out: dict[str, Any] = handler(self)
        if self.source is None:
            out.pop("source", None)
        return out


TAIL_REUSED = "batchweave.tail_reused"
"""Validation context key: how many leading tail descriptors the JSON being validated lacks.

``decode_manifest`` leaves out of the JSON it validates the leading tail descriptors that are
byte for byte those of a manifest it decoded before, and passes their count here so that the
step layout is checked with them; it then puts the decoded objects back in front of the tail."""


class Manifest(BaseModel):
    """One immutable manifest version: the complete state of a namespace."""

    model_config = _STRICT

    format: int = MANIFEST_FORMAT
    """Schema version; when not given, the oldest that expresses the manifest (3 or 4)."""
    namespace_id: str
    mesh: Mesh
    version: int = Field(ge=0)
    parent: int | None = Field(default=None, ge=0)
    commit_id: str
    """Random id of the attempt that wrote this version; resolves ambiguous writes."""
    created_at: float = Field(default=0.0, allow_inf_nan=False)
    """Writer's wall clock (seconds since the epoch). Finite: pydantic writes inf and NaN as
    ``null``, which no reader accepts."""
    base_step: int = Field(default=0, ge=0)
    """Steps below this were reclaimed and can no longer be read."""
    segments: tuple[SegmentRef, ...] = ()
    """Immutable runs of descriptors, contiguous and in step order, ending where the tail starts."""
    tail: tuple[TgbDescriptor, ...] = ()
    """Descriptors not yet moved into a segment, for steps ``tail_start .. next_step - 1``."""
    tail_start: int = Field(default=0, ge=0)
    producers: dict[str, ProducerState] = Field(default_factory=dict)
    sealed: bool = False
    """Set by a final commit: consumers stop cleanly after ``next_step``."""

    @property
    def next_step(self) -> int:
        """The step the next committed TGB will get (= number of steps ever committed)."""
        return self.tail_start + len(self.tail)

    @model_validator(mode="after")
    def _check_format(self) -> Manifest:
        with_sources = any(state.source is not None for state in self.producers.values())
        if "format" not in self.model_fields_set:
            # Built by this library: the oldest format that can express it (see MANIFEST_FORMAT).
            fmt = FORMAT_WITH_SOURCES if with_sources else _FORMAT_WITHOUT_SOURCES
            object.__setattr__(self, "format", fmt)
        elif with_sources and self.format < FORMAT_WITH_SOURCES:
            raise ValueError(f"a producer state has a source, which format {self.format} lacks")
        return self

    @model_validator(mode="after")
    def _check_step_layout(self, info: ValidationInfo) -> Manifest:
        context = info.context
        reused = context.get(TAIL_REUSED, 0) if isinstance(context, dict) else 0
        next_step = self.next_step + reused
        expected = self.segments[0].first_step if self.segments else self.tail_start
        for ref in self.segments:
            if ref.first_step != expected:
                raise ValueError(
                    f"segment {ref.key!r} starts at step {ref.first_step}, expected {expected}"
                )
            expected = ref.end_step
        if self.tail_start != expected:
            raise ValueError(f"tail starts at step {self.tail_start}, expected {expected}")
        first_listed = self.segments[0].first_step if self.segments else self.tail_start
        if self.base_step > next_step or (self.base_step < first_listed):
            raise ValueError(
                f"base_step {self.base_step} outside the listed steps [{first_listed}, {next_step}]"
            )
        return self

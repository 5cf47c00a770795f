"""Slice codecs: how one slice's Python value becomes bytes and back.

Three codecs, chosen by name and recorded in the TGB footer:

- ``"raw"``: ``bytes``-like in, ``bytes`` out, unchanged.
- ``"arrow"``: a ``pyarrow.RecordBatch`` or ``pyarrow.Table`` as an Arrow IPC stream; decodes to a
  ``pyarrow.Table`` whose buffers point into the slice bytes (zero-copy).
- ``"tensors"``: a ``dict[str, numpy.ndarray]`` in a small self-describing layout (see
  ``docs/format.md``); decodes with ``np.frombuffer`` on the slice bytes, so no array data is
  copied (unless the slice sits at an address that would misalign an array: slices written
  by this library are padded so that it does not). Arrays decoded from an immutable ``bytes``
  buffer are read-only; copy one (``arr.copy()``) to modify it.

Compression (``"zstd"``) is applied by the container on top of a codec's bytes; codecs never see
it. Decoders distrust their input: every length and offset is checked against the buffer before
anything is allocated or viewed, and errors are :class:`batchweave.FormatError`.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import numpy as np
import pyarrow as pa
import zstandard

from batchweave._errors import FormatError

__all__ = [
    "CODECS",
    "COMPRESSIONS",
    "TENSOR_ALIGNMENT",
    "TENSOR_DTYPES",
    "Buffer",
    "Codec",
    "compress",
    "decompress",
    "first_overlap",
    "get_codec",
]

_T = TypeVar("_T")

Buffer = bytes | bytearray | memoryview
"""Any contiguous byte buffer a codec accepts or produces."""


@dataclass(frozen=True)
class Codec:
    """A named pair of encode/decode functions plus the slice's default sample count."""

    name: str
    encode: Callable[[Any], Buffer]
    """Value -> bytes. Raises ``TypeError``/``ValueError`` for values the codec cannot store."""
    decode: Callable[[bytes | memoryview], Any]
    """Bytes -> value, without copying where the codec allows. Raises ``FormatError``."""
    sample_count: Callable[[Any], int]
    """Number of samples in a value, used when the caller does not give one."""


# --------------------------------------------------------------------------------------------
# raw


def _raw_encode(value: Any) -> Buffer:
    if isinstance(value, bytes | bytearray):
        return value
    if isinstance(value, memoryview):
        # A strided or Fortran-ordered view is no single run of bytes: store what
        # ``bytes(view)`` gives (its elements in C order), which is what a reader gets back.
        return value if value.c_contiguous else value.tobytes()
    raise TypeError(
        f"codec 'raw' stores bytes, bytearray or memoryview, got {type(value).__name__}; "
        "use codec 'arrow' or 'tensors' for structured data"
    )


def _raw_decode(buf: bytes | memoryview) -> bytes:
    return buf if isinstance(buf, bytes) else bytes(buf)


# --------------------------------------------------------------------------------------------
# arrow


def _arrow_encode(value: Any) -> Buffer:
    if isinstance(value, pa.RecordBatch):
        write = "write_batch"
    elif isinstance(value, pa.Table):
        write = "write_table"
    else:
        raise TypeError(
            f"codec 'arrow' stores a pyarrow.RecordBatch or pyarrow.Table, got "
            f"{type(value).__name__}"
        )
    try:
        # The reader's check (_arrow_decode): a table it refuses must never be committed, as
        # every consumer of its step would fail forever. Costs what it costs the reader.
        value.validate(full=True)
    except pa.ArrowInvalid as exc:
        raise ValueError(
            f"codec 'arrow': invalid {type(value).__name__} ({exc}), which every reader would "
            "refuse; build it with pyarrow's checked constructors (pa.array(..., pa.string()) "
            "checks UTF-8, Array.view and Array.from_buffers do not) or call "
            ".validate(full=True) to find the column"
        ) from None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, value.schema) as writer:
        getattr(writer, write)(value)
    return memoryview(sink.getvalue())


_IPC_CONTINUATION: Final = -1
_FB_DICTIONARY_BATCH: Final = 2
_FB_RECORD_BATCH: Final = 3
_FB_METADATA_V4: Final = 3
_COMPRESSED: Final = "IPC body compression"
_EXPERIMENTAL_COMPRESSION: Final = b"ARROW:experimental_compression"
"""Message metadata key through which Arrow 0.17 streams announced compressed bodies."""
_I32: Final = struct.Struct("<i")
_U32: Final = struct.Struct("<I")
_I64: Final = struct.Struct("<q")
_U16: Final = struct.Struct("<H")
_NO_FIELDS: Final = (0, 0, 0, 0, 0)


def _fb_fields(meta: memoryview, table: int) -> tuple[int, ...]:
    """Field offsets (0: unset) of the flatbuffer table at ``table``, padded to five fields."""
    vtable = table - _I32.unpack_from(meta, table)[0]
    count = max(_U16.unpack_from(meta, vtable)[0] - 4, 0) // 2
    return struct.unpack_from(f"<{count}H", meta, vtable + 4) + _NO_FIELDS


def _fb_ref(meta: memoryview, table: int, offset: int) -> int:
    """Position of the table that the reference field at ``table + offset`` points to."""
    return table + offset + int(_U32.unpack_from(meta, table + offset)[0])


def _read_message(meta: memoryview) -> tuple[int, str | None]:
    """The body length an IPC message's flatbuffer metadata records, and what in it codec
    ``arrow`` refuses (``None``: nothing).

    Fields per Arrow's ``Message.fbs``: Message (0 metadata version, 1 header type, 2 header,
    3 body length, 4 custom metadata), DictionaryBatch (1 data, 2 is delta), RecordBatch (3
    compression). Refused: body compression (also announced, up to metadata V4, by the custom
    metadata key Arrow 0.17 used), and dictionary deltas, each of which a reader appends to
    every earlier one (a small slice of them decodes quadratically). Only metadata Arrow
    accepts matters (it verifies metadata before reading it), and that this reads as Arrow does.
    """
    message = _U32.unpack_from(meta, 0)[0]
    fields = _fb_fields(meta, message)
    body = _I64.unpack_from(meta, message + fields[3])[0] if fields[3] else 0
    kind = meta[message + fields[1]] if fields[1] else 0
    if kind not in (_FB_RECORD_BATCH, _FB_DICTIONARY_BATCH) or not fields[2]:
        return body, None
    version = _U16.unpack_from(meta, message + fields[0])[0] if fields[0] else 0
    if version <= _FB_METADATA_V4 and fields[4] and _EXPERIMENTAL_COMPRESSION in meta.tobytes():
        return body, _COMPRESSED
    batch = _fb_ref(meta, message, fields[2])
    if kind == _FB_DICTIONARY_BATCH:
        dictionary = _fb_fields(meta, batch)
        if dictionary[2] and meta[batch + dictionary[2]]:
            return body, "a dictionary delta (a reader appends each to every earlier one)"
        if not dictionary[1]:
            return body, None
        batch = _fb_ref(meta, batch, dictionary[1])
    return body, _COMPRESSED if _fb_fields(meta, batch)[3] != 0 else None


def _check_uncompressed(buf: bytes | memoryview) -> None:
    """Refuse IPC body compression and dictionary deltas, with which a small slice could decode
    to any size.

    Without them, every decoded buffer is a view of the slice, so decoding allocates no more
    than about the slice's size. Walks the stream's message framing as Arrow reads it (continuation
    token, metadata length, flatbuffer metadata, body), reading metadata only: about 2 us per
    message, against ~1 us for Arrow's own decoding of it.
    """
    view = memoryview(buf).cast("B")
    pos, size = 0, len(view)
    try:
        while pos < size:
            length = _I32.unpack_from(view, pos)[0]
            if length == _IPC_CONTINUATION:
                pos += 4
                length = _I32.unpack_from(view, pos)[0]
            if length == 0:  # end of stream
                return
            body, refused = _read_message(view[pos + 4 : pos + 4 + max(length, 0)])
            if length < 0 or body < 0:
                raise struct.error(f"negative length {min(length, body)}")
            if refused is not None:
                fix = (
                    "write the table without IpcWriteOptions(compression=...) and compress the "
                    "TGB instead (compression='zstd')"
                    if refused == _COMPRESSED
                    else "write the table without IpcWriteOptions(emit_dictionary_deltas=True), "
                    "as Producer.append does"
                )
                raise FormatError(
                    f"Arrow IPC stream uses {refused}, which codec 'arrow' does not allow (a "
                    f"small slice could decode to any size; docs/format.md): {fix}"
                )
            pos += 4 + length + body
    except (struct.error, IndexError) as exc:
        # Fails closed: a stream this walk cannot follow is no stream Arrow reads either.
        raise FormatError(
            f"invalid Arrow IPC stream: unreadable message at byte {pos} ({exc})"
        ) from None


def _arrow_decode(buf: bytes | memoryview) -> Any:
    _check_uncompressed(buf)
    try:
        table = pa.ipc.open_stream(pa.py_buffer(buf)).read_all()
        # Full validation: the shallow one misses non-monotonic offsets, which make a zero-copy
        # table read outside its buffer. Costs ~50 us per MB of strings (UTF-8), ~0 for numbers.
        table.validate(full=True)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise FormatError(f"invalid Arrow IPC stream: {exc}") from exc
    return table


def _arrow_sample_count(value: Any) -> int:
    return int(value.num_rows)


# --------------------------------------------------------------------------------------------
# tensors

TENSOR_ALIGNMENT: Final = 64
"""Every tensor's data starts at a multiple of this many bytes from the slice start."""

TENSOR_DTYPES: Final[dict[str, np.dtype[Any]]] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
}
"""Stored dtype name -> the little-endian numpy dtype it denotes."""

_DTYPE_NAMES: Final[dict[tuple[str, int], str]] = {
    (dt.kind, dt.itemsize): name for name, dt in TENSOR_DTYPES.items()
}

_TENSOR_PREFIX: Final = 8  # u64 little-endian header length
_MAX_TENSOR_HEADER: Final = 1 << 28
"""Longest header a reader accepts (and so the writer writes): 256 MiB."""


def _align(n: int) -> int:
    return -(-n // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT


def _dtype_name(name: str, arr: np.ndarray[Any, Any]) -> str:
    dt = arr.dtype
    stored = _DTYPE_NAMES.get((dt.kind, dt.itemsize))
    if stored is None or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(
            f"codec 'tensors' cannot store tensor {name!r} of dtype {dt}: only fixed-size "
            f"numeric and bool dtypes are supported ({', '.join(TENSOR_DTYPES)}); encode "
            "strings or objects with codec 'arrow'"
        )
    return stored


def _tensors_encode(value: Any) -> Buffer:
    if not isinstance(value, Mapping):
        raise TypeError(
            f"codec 'tensors' stores a dict of str -> numpy.ndarray, got {type(value).__name__}"
        )
    entries: list[dict[str, Any]] = []
    arrays: list[np.ndarray[Any, Any]] = []
    for name, raw in value.items():
        if not isinstance(name, str):
            raise TypeError(f"codec 'tensors' needs str tensor names, got {name!r}")
        if not isinstance(raw, np.ndarray):
            raise TypeError(
                f"codec 'tensors': tensor {name!r} is a {type(raw).__name__}, not a "
                "numpy.ndarray; convert it first (np.asarray(x), or tensor.numpy() for torch)"
            )
        if isinstance(raw, np.ma.MaskedArray):
            # np.asarray would keep the values under the mask and silently drop the mask.
            raise TypeError(
                f"codec 'tensors': tensor {name!r} is a masked array, whose mask would be lost; "
                f"store the mask as its own tensor ({{{name!r}: arr.data, "
                f"{name + '_mask'!r}: np.ma.getmaskarray(arr)}}) or fill it (arr.filled(...))"
            )
        dtype_name = _dtype_name(name, raw)
        if dtype_name == "bool":
            # Stored as 0/1: a bool array viewed from other bytes (uint8 2 or 255) holds
            # them, and numpy copies them as they are.
            arr = np.asarray(raw, order="C").view(np.uint8) != 0
        else:
            arr = np.asarray(raw, dtype=TENSOR_DTYPES[dtype_name], order="C")
        entries.append({"name": name, "dtype": dtype_name, "shape": list(arr.shape)})
        arrays.append(arr)

    # Offsets depend on the header length, which depends on the offsets' digits: iterate to the
    # fixed point (two rounds at most in practice, since offsets only grow).
    header_len = 0
    while True:
        pos = _align(_TENSOR_PREFIX + header_len)
        for entry, arr in zip(entries, arrays, strict=True):
            entry["offset"] = pos
            pos = _align(pos + arr.nbytes)
        header = json.dumps({"tensors": entries}, separators=(",", ":")).encode()
        if len(header) <= header_len:
            break
        header_len = len(header)
    if header_len > _MAX_TENSOR_HEADER:
        raise ValueError(
            f"codec 'tensors': the header would be {header_len} bytes, over the "
            f"{_MAX_TENSOR_HEADER}-byte limit readers accept; use fewer tensors or shorter names"
        )
    header = header.ljust(header_len, b" ")

    last = entries[-1]["offset"] + arrays[-1].nbytes if arrays else _TENSOR_PREFIX + header_len
    # Zero-padded to a multiple of the alignment: slices are stored back to back, so in an
    # uncompressed TGB every slice, and with it every tensor, starts at a multiple of 64 bytes
    # from the object's start (a mapped object or a range read of several slices keeps arrays
    # aligned).
    out = np.zeros(_align(last), dtype=np.uint8)
    prefix = header_len.to_bytes(_TENSOR_PREFIX, "little") + header
    out[: len(prefix)] = np.frombuffer(prefix, dtype=np.uint8)
    for entry, arr in zip(entries, arrays, strict=True):
        start = entry["offset"]
        out[start : start + arr.nbytes] = arr.reshape(-1).view(np.uint8)
    return out.data


def _bad_tensors(msg: str) -> FormatError:
    return FormatError(f"invalid tensor slice: {msg}")


def _tensors_decode(buf: bytes | memoryview) -> dict[str, np.ndarray[Any, Any]]:
    size = len(buf)
    if size < _TENSOR_PREFIX:
        raise _bad_tensors(f"{size} bytes is shorter than the {_TENSOR_PREFIX}-byte prefix")
    header_len = int.from_bytes(buf[:_TENSOR_PREFIX], "little")
    if header_len > size - _TENSOR_PREFIX:
        raise _bad_tensors(f"header length {header_len} exceeds the {size}-byte slice")
    if header_len > _MAX_TENSOR_HEADER:
        raise _bad_tensors(
            f"header length {header_len} exceeds the {_MAX_TENSOR_HEADER}-byte limit on headers"
        )
    try:
        # Strictly UTF-8 (docs/format.md): json.loads(bytes) would also take UTF-16/32.
        header = json.loads(bytes(buf[_TENSOR_PREFIX : _TENSOR_PREFIX + header_len]).decode())
        specs = header["tensors"]
        if not isinstance(specs, list):
            raise TypeError("'tensors' is not a list")
    except (ValueError, TypeError, KeyError, RecursionError) as exc:
        raise _bad_tensors(f"unreadable header: {exc}") from exc

    data_start = _TENSOR_PREFIX + header_len
    out: dict[str, np.ndarray[Any, Any]] = {}
    spans: list[tuple[int, int, str]] = []
    for spec in specs:
        name, dtype, shape, offset = _tensor_spec(spec)
        if name in out:
            raise _bad_tensors(f"tensor {name!r} appears twice")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset < data_start or offset + nbytes > size:
            raise _bad_tensors(
                f"tensor {name!r} spans bytes [{offset}, {offset + nbytes}) outside the data "
                f"region [{data_start}, {size})"
            )
        if nbytes:
            spans.append((offset, offset + nbytes, name))
        count = nbytes // dtype.itemsize
        try:
            arr = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).reshape(shape)
        except ValueError as exc:  # a shape numpy cannot hold: over 64 axes, an axis over 2^63
            raise _bad_tensors(f"tensor {name!r} has a shape numpy cannot hold: {exc}") from exc
        if not arr.flags.aligned:
            # A slice stored at an offset that is no multiple of 64 (written before slices
            # were padded, or by another writer): copied, so no array is misaligned.
            arr = _aligned_copy(arr)
        out[name] = arr
    overlap = first_overlap(spans)
    if overlap is not None:
        raise _bad_tensors(f"tensors {overlap[0]!r} and {overlap[1]!r} overlap")
    return out


def _aligned_copy(arr: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """An aligned copy of ``arr``, read-only if ``arr`` is."""
    copy: np.ndarray[Any, Any] = arr.copy()
    copy.flags.writeable = arr.flags.writeable
    return copy


def first_overlap(spans: list[tuple[int, int, _T]]) -> tuple[_T, _T] | None:
    """Return the labels of two overlapping non-empty ``(start, end, label)`` spans, if any."""
    ordered = sorted(spans, key=lambda span: (span[0], span[1]))
    for (_, end, first), (start, _, second) in itertools.pairwise(ordered):
        if start < end:
            return first, second
    return None


def _tensor_spec(spec: Any) -> tuple[str, np.dtype[Any], tuple[int, ...], int]:
    if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape", "offset"}:
        raise _bad_tensors(f"malformed tensor entry {spec!r:.200}")
    name, dtype_name, shape, offset = spec["name"], spec["dtype"], spec["shape"], spec["offset"]
    if not isinstance(name, str):
        raise _bad_tensors(f"tensor name {name!r:.100} is not a string")
    dtype = TENSOR_DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise _bad_tensors(f"tensor {name!r} has unknown dtype {dtype_name!r:.100}")
    if not (
        isinstance(shape, list)
        and all(type(d) is int and d >= 0 for d in shape)
        and type(offset) is int
    ):
        raise _bad_tensors(f"tensor {name!r} has a malformed shape or offset")
    return name, dtype, tuple(shape), offset


def _tensors_sample_count(value: Any) -> int:
    for arr in value.values():
        return int(arr.shape[0]) if arr.ndim else 1
    return 0


# --------------------------------------------------------------------------------------------
# registry and compression


def _one(_value: Any) -> int:
    return 1


CODECS: Final[dict[str, Codec]] = {
    c.name: c
    for c in (
        Codec("raw", _raw_encode, _raw_decode, _one),
        Codec("arrow", _arrow_encode, _arrow_decode, _arrow_sample_count),
        Codec("tensors", _tensors_encode, _tensors_decode, _tensors_sample_count),
    )
}
"""Every codec this library reads and writes, by the name stored in footers."""

COMPRESSIONS: Final = ("zstd",)
"""Compression names a footer may record (``None`` means uncompressed)."""

_ZSTD_LEVEL: Final = 3


def get_codec(name: str) -> Codec:
    """Return the codec called ``name``; ``ValueError`` naming the known codecs otherwise."""
    try:
        return CODECS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown codec {name!r}; this library knows {', '.join(map(repr, CODECS))}"
        ) from None


def check_compression(compression: str | None) -> None:
    """``ValueError`` naming the known compressions unless ``compression`` is None or one."""
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(
            f"unknown compression {compression!r}; expected None or "
            f"{', '.join(map(repr, COMPRESSIONS))}"
        )


def compress(data: Buffer, compression: str) -> bytes:
    """Compress an encoded slice; the frame records its content size."""
    if compression != "zstd":
        raise ValueError(f"unknown compression {compression!r}; expected None or 'zstd'")
    return zstandard.ZstdCompressor(level=_ZSTD_LEVEL, write_content_size=True).compress(data)


_ONE_SHOT_LIMIT: Final = 64 << 20
"""Largest claimed size decompressed into one buffer of that size. Above it, output grows only as
real data comes out: a frame and a footer that both lie about a huge size allocate nothing."""
_STREAM_CHUNK: Final = 4 << 20


def _decompress_streaming(data: bytes | memoryview, uncompressed_length: int) -> bytearray:
    """Decompress at most ``uncompressed_length + 1`` bytes, chunk by chunk (see above)."""
    out = bytearray()
    with zstandard.ZstdDecompressor().stream_reader(data) as reader:
        while len(out) <= uncompressed_length:
            chunk = reader.read(min(_STREAM_CHUNK, uncompressed_length + 1 - len(out)))
            if not chunk:
                break
            out += chunk
    return out


def decompress(data: bytes | memoryview, compression: str, uncompressed_length: int) -> bytes:
    """Decompress one slice, never producing (or allocating) more than ``uncompressed_length``.

    The frame's own content size is checked against the footer-recorded length before
    decompressing, so a lying frame header cannot trigger a huge allocation.
    """
    if compression != "zstd":
        raise FormatError(f"unknown compression {compression!r}")
    try:
        frame_size = zstandard.frame_content_size(data)
        if frame_size not in (-1, uncompressed_length):
            raise FormatError(
                f"zstd frame claims {frame_size} bytes but the slice index records "
                f"{uncompressed_length}"
            )
        if uncompressed_length <= _ONE_SHOT_LIMIT:
            # Every writer sets the content size; 0 needs special care because python-zstandard
            # treats max_output_size=0 as "unlimited".
            out: bytes | bytearray = zstandard.ZstdDecompressor().decompress(
                data, max_output_size=max(uncompressed_length, 1)
            )
        else:
            out = _decompress_streaming(data, uncompressed_length)
    except zstandard.ZstdError as exc:
        raise FormatError(f"corrupt zstd data: {exc}") from exc
    if len(out) != uncompressed_length:
        raise FormatError(
            f"zstd data decompressed to {len(out)} bytes, the slice index records "
            f"{uncompressed_length}"
        )
    return bytes(out)

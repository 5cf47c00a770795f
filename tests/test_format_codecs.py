"""Slice codecs on their own: round trips, zero-copy decoding, and distrust of lying input.

Lying input includes an Arrow slice whose offsets are not monotonic: its checksum was computed
by the (buggy or hostile) writer, so only full validation catches it.
"""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import batchweave as bw
from batchweave import FormatError
from batchweave._format import get_codec
from batchweave._format._codecs import CODECS, TENSOR_ALIGNMENT, TENSOR_DTYPES, compress, decompress

TENSORS = get_codec("tensors")
ARROW = get_codec("arrow")
RAW = get_codec("raw")

_dtypes = st.sampled_from(list(TENSOR_DTYPES.values())).flatmap(
    lambda dt: st.sampled_from([dt, dt.newbyteorder(">")])
)
tensor_dicts = st.dictionaries(
    st.text(max_size=6),
    _dtypes.flatmap(
        lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
    ),
    max_size=4,
)


def assert_same_tensors(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Bit-exact equality (NaN payloads included), same order, little-endian dtypes."""
    assert list(got) == list(want)
    for name, arr in want.items():
        out = got[name]
        assert out.dtype == arr.dtype.newbyteorder("<")
        assert out.dtype.byteorder in ("<", "=", "|")
        assert out.shape == arr.shape
        assert out.tobytes() == arr.astype(out.dtype).tobytes()


def encode_bytes(codec_value: Any) -> bytes:
    return bytes(memoryview(codec_value).cast("B"))


@settings(max_examples=150, deadline=None)
@given(tensor_dicts)
def test_tensors_round_trip_bit_exact(tensors: dict[str, np.ndarray]) -> None:
    buf = encode_bytes(TENSORS.encode(tensors))
    assert_same_tensors(TENSORS.decode(buf), tensors)
    header_len = int.from_bytes(buf[:8], "little")
    for spec in json.loads(buf[8 : 8 + header_len])["tensors"]:
        assert spec["offset"] % TENSOR_ALIGNMENT == 0
    # padded, so the next slice stored after this one starts aligned too
    assert len(buf) % TENSOR_ALIGNMENT == 0
    assert not any(buf[_data_end(buf) :])


def _data_end(buf: bytes) -> int:
    header_len = int.from_bytes(buf[:8], "little")
    specs = json.loads(buf[8 : 8 + header_len])["tensors"]
    ends = [8 + header_len]
    for spec in specs:
        itemsize = TENSOR_DTYPES[spec["dtype"]].itemsize
        ends.append(spec["offset"] + itemsize * int(np.prod(spec["shape"], dtype=np.int64)))
    return max(ends)


@settings(max_examples=100, deadline=None)
@given(
    hnp.arrays(np.uint8, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)),
    st.booleans(),
)
def test_tensors_store_bool_as_0_or_1(raw: np.ndarray, transpose: bool) -> None:
    # Before: a bool array viewing other bytes (uint8 2 or 255 viewed as bool) was stored as
    # those bytes; docs/format.md says a bool element is 0 or 1.
    mask = raw.view(np.bool_)
    if transpose:
        mask = mask.T  # not C-contiguous: copied in C order
    buf = encode_bytes(TENSORS.encode({"m": mask}))
    out = TENSORS.decode(buf)["m"]
    assert out.shape == mask.shape
    assert out.view(np.uint8).tolist() == (mask.view(np.uint8) != 0).astype(np.uint8).tolist()


@pytest.mark.parametrize("shift", [1, 3, 12])
def test_tensors_at_a_misaligned_address_are_copied_aligned(shift: int) -> None:
    # A slice at an offset that is no multiple of 64 in its object (written before slices were
    # padded, or by another writer) would give misaligned arrays: they are copied instead.
    src = {"x": np.arange(5, dtype=np.float64), "c": np.arange(3, dtype=np.complex128)}
    buf = encode_bytes(TENSORS.encode(src))
    padded = bytes(shift) + buf
    for view, writeable in (
        (memoryview(padded)[shift:], False),
        (memoryview(bytearray(padded))[shift:], True),
    ):
        out = TENSORS.decode(view)
        assert_same_tensors(out, src)
        for arr in out.values():
            assert arr.flags.aligned
            assert arr.flags.writeable == writeable


def test_tensors_decode_is_zero_copy_and_read_only() -> None:
    src = {
        "x": np.arange(24, dtype=np.float32).reshape(4, 6),
        "y": np.arange(5, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float16),
    }
    buf = encode_bytes(TENSORS.encode(src))
    whole = np.frombuffer(buf, dtype=np.uint8)
    out = TENSORS.decode(buf)
    for name in ("x", "y"):
        assert np.shares_memory(out[name], whole), name
        assert not out[name].flags.owndata
        assert not out[name].flags.writeable, "views of immutable bytes are read-only"
    # a writable buffer gives writable views, still without copying
    writable = bytearray(buf)
    out_w = TENSORS.decode(memoryview(writable))
    out_w["y"][0] = 99
    assert np.frombuffer(writable, dtype=np.int64, count=1, offset=_offset_of(buf, "y"))[0] == 99


def _offset_of(buf: bytes, name: str) -> int:
    header_len = int.from_bytes(buf[:8], "little")
    specs = json.loads(buf[8 : 8 + header_len])["tensors"]
    return next(s["offset"] for s in specs if s["name"] == name)


@pytest.mark.parametrize(
    "bad",
    [
        np.array(["a", "b"]),
        np.array([b"a"]),
        np.array([1, "x"], dtype=object),
        np.array(["2020-01-01"], dtype="datetime64[D]"),
        np.zeros(2, dtype=[("a", "<i4")]),
        np.zeros(2, dtype=np.longdouble) if np.dtype(np.longdouble).itemsize > 8 else None,
    ],
)
def test_tensors_refuse_non_numeric_dtypes(bad: np.ndarray | None) -> None:
    if bad is None:
        bad = np.zeros(1, dtype="V3")
    with pytest.raises(TypeError, match=r"cannot store tensor 'bad' of dtype .*codec 'arrow'"):
        TENSORS.encode({"bad": bad})


def test_tensors_refuse_non_dicts_and_non_arrays() -> None:
    with pytest.raises(TypeError, match="dict of str"):
        TENSORS.encode([np.zeros(2)])
    with pytest.raises(TypeError, match=r"not a numpy\.ndarray"):
        TENSORS.encode({"a": [1, 2]})
    with pytest.raises(TypeError, match="str tensor names"):
        TENSORS.encode({1: np.zeros(2)})


def _tensor_blob(header: Any, data_len: int = 64, header_len: int | None = None) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(raw) if header_len is None else header_len
    return n.to_bytes(8, "little") + raw + bytes(data_len)


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        (b"", "shorter than the 8-byte prefix"),
        ((1 << 62).to_bytes(8, "little") + b"{}", "header length .* exceeds"),
        (_tensor_blob(b"{not json"), "unreadable header"),
        (_tensor_blob({"tensors": 3}), "unreadable header"),
        (_tensor_blob({}), "unreadable header"),
        (
            _tensor_blob(
                {"tensors": [{"name": "a", "dtype": "float32", "shape": [1 << 40], "offset": 64}]}
            ),
            "outside the data region",
        ),
        (
            _tensor_blob(
                {"tensors": [{"name": "a", "dtype": "float32", "shape": [2], "offset": 0}]}
            ),
            "outside the data region",
        ),
        (
            _tensor_blob({"tensors": [{"name": "a", "dtype": "object", "shape": [], "offset": 0}]}),
            "unknown dtype",
        ),
        (
            _tensor_blob({"tensors": [{"name": "a", "dtype": "int8", "shape": [-1], "offset": 0}]}),
            "malformed shape",
        ),
        (_tensor_blob({"tensors": [{"name": "a"}]}), "malformed tensor entry"),
        (
            _tensor_blob(
                {
                    "tensors": [
                        {"name": "a", "dtype": "int64", "shape": [2], "offset": 256},
                        {"name": "b", "dtype": "int64", "shape": [2], "offset": 264},
                    ]
                },
                data_len=300,
            ),
            "overlap",
        ),
        (
            _tensor_blob(
                {
                    "tensors": [
                        {"name": "a", "dtype": "int8", "shape": [1], "offset": 256},
                        {"name": "a", "dtype": "int8", "shape": [1], "offset": 257},
                    ]
                },
                data_len=300,
            ),
            "appears twice",
        ),
    ],
    ids=lambda v: v if isinstance(v, str) else "blob",
)
def test_tensors_decode_distrusts_lying_headers(blob: bytes, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        TENSORS.decode(blob)


arrow_tables = (
    st.integers(min_value=0, max_value=12)
    .flatmap(
        lambda n: st.fixed_dictionaries(
            {
                "i": st.lists(st.none() | st.integers(-(2**63), 2**63 - 1), min_size=n, max_size=n),
                "f": st.lists(st.floats(allow_nan=False), min_size=n, max_size=n),
                "s": st.lists(st.none() | st.text(max_size=5), min_size=n, max_size=n),
                "b": st.lists(st.booleans(), min_size=n, max_size=n),
                "l": st.lists(st.lists(st.integers(-5, 5), max_size=3), min_size=n, max_size=n),
            }
        )
    )
    .map(
        lambda cols: pa.table(
            {
                "i": pa.array(cols["i"], pa.int64()),
                "f": pa.array(cols["f"], pa.float64()),
                "s": pa.array(cols["s"], pa.string()),
                "b": pa.array(cols["b"], pa.bool_()),
                "l": pa.array(cols["l"], pa.list_(pa.int32())),
            }
        )
    )
)


@settings(max_examples=60, deadline=None)
@given(arrow_tables, st.booleans())
def test_arrow_round_trip(table: pa.Table, as_batch: bool) -> None:
    value = table.combine_chunks().to_batches()[0] if as_batch and table.num_rows else table
    out = ARROW.decode(encode_bytes(ARROW.encode(value)))
    assert isinstance(out, pa.Table)
    assert out.equals(table)
    assert ARROW.sample_count(value) == table.num_rows


def test_arrow_decode_is_zero_copy() -> None:
    table = pa.table({"x": pa.array(np.arange(1000, dtype=np.int64))})
    buf = encode_bytes(ARROW.encode(table))
    base = pa.py_buffer(buf).address
    out = ARROW.decode(buf)
    data_buf = out.column("x").chunks[0].buffers()[1]
    assert base <= data_buf.address < base + len(buf)


def test_arrow_rejects_garbage_and_wrong_types() -> None:
    with pytest.raises(FormatError, match="invalid Arrow IPC stream"):
        ARROW.decode(b"\x00" * 7 + b"garbage")
    with pytest.raises(TypeError, match=r"RecordBatch or pyarrow\.Table"):
        ARROW.encode({"x": [1]})


def test_raw_round_trip_and_type_check() -> None:
    assert RAW.decode(encode_bytes(RAW.encode(bytearray(b"abc")))) == b"abc"
    assert RAW.decode(memoryview(b"xy")) == b"xy"
    with pytest.raises(TypeError, match="codec 'raw' stores bytes"):
        RAW.encode("text")


def test_sample_count_defaults() -> None:
    assert RAW.sample_count(b"abc") == 1
    assert TENSORS.sample_count({"a": np.zeros((7, 2)), "b": np.zeros(3)}) == 7
    assert TENSORS.sample_count({"a": np.array(1.0)}) == 1
    assert TENSORS.sample_count({}) == 0


def test_unknown_codec_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"unknown codec 'pickle'.*'raw', 'arrow', 'tensors'"):
        get_codec("pickle")


@given(st.binary(max_size=5000))
def test_zstd_round_trip(data: bytes) -> None:
    assert decompress(compress(data, "zstd"), "zstd", len(data)) == data


def test_zstd_output_is_capped_by_the_recorded_length() -> None:
    data = bytes(1 << 20)
    framed = compress(data, "zstd")
    with pytest.raises(
        FormatError, match="frame claims 1048576 bytes but the slice index records 10"
    ):
        decompress(framed, "zstd", 10)
    unframed = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    with pytest.raises(FormatError, match="corrupt zstd data"):
        decompress(unframed, "zstd", 10)
    assert decompress(unframed, "zstd", len(data)) == data
    with pytest.raises(FormatError, match="decompressed to"):
        decompress(unframed, "zstd", len(data) + 5)
    with pytest.raises(FormatError, match="corrupt zstd data"):
        decompress(b"not zstd at all", "zstd", 10)


# -- hostile Arrow slices ----------------------------------------------------------------------


def test_an_arrow_slice_with_non_monotonic_offsets_is_a_format_error() -> None:
    # Before: decoded "successfully" (only shallow validation), giving a zero-copy table whose
    # string offsets point before its buffer: reading it raised SystemError or read out of
    # bounds. The checksum cannot help: it was computed by the (buggy or hostile) writer.
    table = pa.table({"s": pa.array(["ab", "cd", "ef"])})
    raw = bytearray(bytes(CODECS["arrow"].encode(table)))
    offsets = raw.find(struct.pack("<4i", 0, 2, 4, 6))
    assert offsets > 0
    raw[offsets : offsets + 16] = struct.pack("<4i", 0, 2, -100, 6)
    with pytest.raises(bw.FormatError, match="non-monotonic offset"):
        CODECS["arrow"].decode(bytes(raw))


def _ipc_stream(batches: list[pa.RecordBatch], **options: Any) -> bytes:
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(**options)
    with pa.ipc.new_stream(sink, batches[0].schema, options=opts) as writer:
        for batch in batches:
            writer.write_batch(batch)
    return bytes(sink.getvalue().to_pybytes())


@settings(max_examples=40, deadline=None)
@given(
    arrow_tables.filter(lambda t: t.num_rows > 0),
    st.sampled_from(["zstd", "lz4"]),
    st.sampled_from([pa.ipc.MetadataVersion.V4, pa.ipc.MetadataVersion.V5]),
    st.booleans(),
    st.booleans(),
)
def test_arrow_refuses_ipc_body_compression(
    table: pa.Table, compression: str, version: Any, legacy: bool, dictionary: bool
) -> None:
    # Before: accepted, so a 17 KB slice could decode to a 512 MB table (a decompression bomb
    # past every length the footer records). docs/format.md: "without IPC-level body
    # compression".
    if dictionary:
        table = table.set_column(2, "s", table.column("s").dictionary_encode())
    batches = table.to_batches()
    plain = _ipc_stream(batches, metadata_version=version, use_legacy_format=legacy)
    assert ARROW.decode(plain).equals(table)
    packed = _ipc_stream(
        batches, metadata_version=version, use_legacy_format=legacy, compression=compression
    )
    with pytest.raises(FormatError, match=r"uses IPC body compression.*compression='zstd'"):
        ARROW.decode(packed)


def test_arrow_refuses_compressed_dictionary_batches_and_the_0_17_compression_key() -> None:
    # A compressed dictionary message is caught on its own (the record batch after it is
    # replaced by an uncompressed one); Arrow 0.17 announced compression in message metadata.
    dict_batch = pa.record_batch({"d": pa.array(["p", "q"] * 8).dictionary_encode()})
    plain = _ipc_stream([dict_batch])
    packed = _ipc_stream([dict_batch], compression="zstd")
    plain_msgs = list(pa.ipc.MessageReader.open_stream(pa.py_buffer(plain)))
    packed_msgs = list(pa.ipc.MessageReader.open_stream(pa.py_buffer(packed)))
    assert [m.type for m in packed_msgs] == ["schema", "dictionary", "record batch"]
    sink = pa.BufferOutputStream()
    for message in (packed_msgs[0], packed_msgs[1], plain_msgs[2]):
        message.serialize_to(sink)
    sink.write(b"\xff\xff\xff\xff\x00\x00\x00\x00")
    with pytest.raises(FormatError, match="uses IPC body compression"):
        ARROW.decode(sink.getvalue().to_pybytes())

    batch = pa.record_batch({"x": np.arange(10)})
    sink = pa.BufferOutputStream()
    v4 = pa.ipc.IpcWriteOptions(metadata_version=pa.ipc.MetadataVersion.V4)
    with pa.ipc.new_stream(sink, batch.schema, options=v4) as writer:
        writer.write_batch(batch, custom_metadata={"ARROW:experimental_compression": "zstd"})
    with pytest.raises(FormatError, match="uses IPC body compression"):
        ARROW.decode(sink.getvalue().to_pybytes())


def test_arrow_refuses_dictionary_deltas_and_ignores_the_0_17_key_from_metadata_v5() -> None:
    """Before: dictionary deltas passed (a reader appends each to every earlier one: a 1.2 MB
    slice decoded to 520 MB), and a V5 batch whose custom metadata merely named the 0.17
    compression key, which Arrow ignores from V5 on, was refused."""
    schema = pa.schema([("d", pa.dictionary(pa.int32(), pa.string()))])
    deltas = pa.ipc.IpcWriteOptions(emit_dictionary_deltas=True)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, schema, options=deltas) as writer:
        for k in range(1, 4):
            words = pa.array([str(i) for i in range(k)]).dictionary_encode()
            writer.write_batch(pa.record_batch([words], schema=schema))
    with pytest.raises(FormatError, match="uses a dictionary delta"):
        ARROW.decode(sink.getvalue().to_pybytes())

    batch = pa.record_batch({"x": np.arange(10)})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:  # metadata V5, the default
        writer.write_batch(batch, custom_metadata={"ARROW:experimental_compression": "zstd"})
    assert ARROW.decode(sink.getvalue().to_pybytes()).num_rows == 10

    # What Producer.append writes for chunks with different dictionaries is no delta.
    chunks = [pa.table({"d": pa.array(w).dictionary_encode()}) for w in (["a"], ["a", "b"])]
    table = pa.concat_tables(chunks)
    assert ARROW.decode(bytes(ARROW.encode(table))).to_pylist() == table.to_pylist()


def test_arrow_bomb_slice_is_refused_before_allocating() -> None:
    # 8 MiB of zeros in a ~1 KB slice: refused by reading message metadata only.
    zeros = pa.table({"x": np.zeros(1 << 20, dtype=np.int64)})
    packed = _ipc_stream(zeros.to_batches(), compression="zstd")
    assert len(packed) < 4096
    pool = pa.default_memory_pool()
    before = pool.bytes_allocated()
    with pytest.raises(FormatError, match="uses IPC body compression"):
        ARROW.decode(packed)
    assert pool.bytes_allocated() == before


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_arrow_decode_of_mutated_streams_is_a_table_or_format_error(data: st.DataObject) -> None:
    table = pa.table({"x": [1, 2, 3], "s": pa.array(["a", "b", "a"]).dictionary_encode()})
    raw = bytearray(_ipc_stream(table.to_batches()))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    try:
        out = ARROW.decode(bytes(raw[:cut]))
    except FormatError:
        return
    assert isinstance(out, pa.Table)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32", "utf-8-sig"])
def test_tensors_header_must_be_utf8_without_a_byte_order_mark(encoding: str) -> None:
    # Before: json.loads(bytes) guessed UTF-16/32 (and skipped a UTF-8 BOM), so such a header
    # decoded; docs/format.md says the header is UTF-8 JSON.
    spec = {"tensors": [{"name": "a", "dtype": "uint8", "shape": [1], "offset": 1024}]}
    header = json.dumps(spec).encode(encoding)
    blob = bytearray(_tensor_blob(header, data_len=2048))
    blob[1024] = 7
    assert TENSORS.decode(_tensor_blob(json.dumps(spec).encode(), data_len=2048))["a"] == [0]
    with pytest.raises(FormatError, match="invalid tensor slice: unreadable header"):
        TENSORS.decode(bytes(blob))


def _invalid_arrow_columns() -> dict[str, pa.Array]:
    """String columns the reader's full validation refuses, made with unchecked constructors."""
    bad_utf8 = pa.array([b"ok", b"\xff\xfe"], pa.binary()).view(pa.string())
    good = pa.array(["ab", "cd", "ef"])
    _, _, data = good.buffers()
    backwards = pa.Array.from_buffers(
        pa.string(), 3, [None, pa.py_buffer(struct.pack("<4i", 0, 4, 2, 6)), data]
    )
    return {"invalid UTF-8": bad_utf8, "non-monotonic offsets": backwards}


@pytest.mark.parametrize("column", list(_invalid_arrow_columns()))
@pytest.mark.parametrize("as_batch", [False, True])
def test_arrow_encode_refuses_what_the_reader_would_refuse(column: str, as_batch: bool) -> None:
    # Before: encoded (and so committed); every consumer of the step then failed on it forever.
    table = pa.table({"s": _invalid_arrow_columns()[column]})
    value = table.to_batches()[0] if as_batch else table
    with pytest.raises(ValueError, match=r"codec 'arrow': invalid (Table|RecordBatch) \(.*"):
        CODECS["arrow"].encode(value)


def test_tensors_header_over_the_readers_cap_is_refused_at_encode(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The real cap is 2**28 bytes; lowered here so that no test allocates gigabytes.
    import batchweave._format._codecs as codecs

    value = {"n" * 300: np.zeros(1, np.uint8)}
    blob = bytes(TENSORS.encode(value))
    header_len = int.from_bytes(blob[:8], "little")
    assert 256 < header_len < len(blob) - 8
    monkeypatch.setattr(codecs, "_MAX_TENSOR_HEADER", 256)
    # Before: encoded, and the reader refused it saying the header exceeded the (longer) slice.
    with pytest.raises(ValueError, match=f"header would be {header_len} bytes, over the 256-byte"):
        TENSORS.encode(value)
    with pytest.raises(FormatError, match=f"header length {header_len} exceeds the 256-byte limit"):
        TENSORS.decode(blob)

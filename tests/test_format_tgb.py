"""The TGB container: round trips, request counts, footer validation and corruption safety.

A checksum mismatch in a slice or the footer gives advice a reader can follow (a committed TGB is
immutable: do not rewrite it, restore a backup or start past it, run ``batchweave verify``), and
tensor shapes numpy cannot hold are ``FormatError``s naming the slice.
"""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_format_codecs import arrow_tables, assert_same_tensors, tensor_dicts

import batchweave as bw
from batchweave import (
    Bounded,
    ChecksumMismatch,
    EncodedTgb,
    FormatError,
    MemoryStore,
    Mesh,
    Suffix,
    TgbBuilder,
    UnsupportedFormatVersion,
    decode_slice,
    encode_tgb,
    parse_footer,
    parse_footer_exact,
    read_footer,
    read_slice,
    slice_range,
)
from batchweave._format import (
    CHECKSUM_ALGOS,
    FOOTER_READ_GUESS,
    FORMAT_VERSION,
    MAGIC,
    MAX_FOOTER_LENGTH,
    TRAILER_SIZE,
    ChecksumAlgo,
    _tgb_read,
    checksum,
)
from batchweave._format._codecs import TENSOR_ALIGNMENT
from batchweave._format._tgb_read import decode_entry
from batchweave._format._tgb_write import _pack_trailer, check_encoded
from batchweave._store._base import ByteRange

KEY = "data/p0/1/7-abc.tgb"


class RangeRecordingStore(bw.CountingStore):
    """The library's request counter over a MemoryStore that also records each range asked for."""

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.ranges: list[ByteRange] = []

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        self.ranges.append(rng)
        return super().get_range(key, rng)

    def reset(self) -> None:
        super().reset()
        self.ranges.clear()


# --------------------------------------------------------------------------------------------
# strategies and comparison


meshes = st.builds(Mesh, dp=st.integers(1, 3), cp=st.integers(1, 3))
PAYLOADS: dict[str, st.SearchStrategy[Any]] = {
    "raw": st.binary(max_size=300),
    "arrow": arrow_tables,
    "tensors": tensor_dicts,
}


def expected_samples(codec: str, payload: Any) -> int:
    if codec == "raw":
        return 1
    if codec == "arrow":
        return int(payload.num_rows)
    first = next(iter(payload.values()), None)
    return 0 if first is None else (first.shape[0] if first.ndim else 1)


def assert_same(codec: str, got: Any, want: Any) -> None:
    if codec == "raw":
        assert got == bytes(want)
    elif codec == "arrow":
        assert got.equals(want if isinstance(want, pa.Table) else pa.Table.from_batches([want]))
    else:
        assert_same_tensors(got, want)


@st.composite
def tgb_cases(draw: st.DrawFn, codec: str | None = None) -> dict[str, Any]:
    mesh = draw(meshes)
    codec = codec or draw(st.sampled_from(sorted(PAYLOADS)))
    return {
        "mesh": mesh,
        "codec": codec,
        "slices": draw(st.lists(PAYLOADS[codec], min_size=mesh.slices, max_size=mesh.slices)),
        "compression": draw(st.sampled_from([None, "zstd"])),
        "checksum_algo": draw(st.sampled_from(CHECKSUM_ALGOS)),
        "metadata": draw(st.dictionaries(st.text(max_size=5), st.text(max_size=10), max_size=3)),
    }


def encode_case(case: dict[str, Any]) -> EncodedTgb:
    return encode_tgb(
        case["slices"],
        case["mesh"],
        codec=case["codec"],
        compression=case["compression"],
        checksum_algo=case["checksum_algo"],
        metadata=case["metadata"],
    )


# --------------------------------------------------------------------------------------------
# round trips


@pytest.mark.parametrize("codec", sorted(PAYLOADS))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip_every_codec(codec: str, data: st.DataObject) -> None:
    case = data.draw(tgb_cases(codec))
    enc = encode_case(case)
    mesh: Mesh = case["mesh"]
    assert enc.size == len(enc.data) == enc.footer_offset + enc.footer_length + TRAILER_SIZE
    assert enc.data.endswith(MAGIC)
    store = MemoryStore()
    store.put(KEY, enc.data)

    blind = read_footer(store, KEY)
    located = read_footer(
        store, KEY, footer_offset=enc.footer_offset, footer_length=enc.footer_length
    )
    exact = parse_footer_exact(
        enc.data[enc.footer_offset : enc.footer_offset + enc.footer_length], key=KEY
    )
    assert blind == located == exact == enc.footer
    footer = blind
    assert footer.mesh == mesh
    assert footer.codec == codec
    assert footer.compression == case["compression"]
    assert footer.checksum_algo == case["checksum_algo"]
    assert footer.metadata == case["metadata"]
    assert footer.payload_length == enc.footer_offset
    for d in range(mesh.dp):
        for c in range(mesh.cp):
            i = mesh.slice_index(d, c)
            want = case["slices"][i]
            assert_same(codec, read_slice(store, KEY, footer, (d, c)), want)
            assert_same(codec, read_slice(store, KEY, footer, i), want)
            rng = slice_range(footer, i)
            assert_same(
                codec, decode_slice(enc.data[rng.start : rng.end], footer, i, key=KEY), want
            )
            assert footer.slices[i].sample_count == expected_samples(codec, want)
            if codec == "tensors" and footer.compression is None:
                # each slice (so each tensor) starts at a multiple of 64 in the object
                assert footer.slices[i].offset % TENSOR_ALIGNMENT == 0


def test_builder_matches_encode_tgb_and_checks_completeness() -> None:
    mesh = Mesh(dp=2, cp=3)
    payloads = [f"slice-{i}".encode() * (i + 1) for i in range(mesh.slices)]
    builder = TgbBuilder(mesh, codec="raw", compression="zstd")
    for i in reversed(range(mesh.slices)):  # any order
        d, c = divmod(i, mesh.cp)
        if (d, c) != (1, 2):
            builder.set_slice(d, c, payloads[i], sample_count=10 + i)
    with pytest.raises(ValueError, match=r"slices \(1, 2\) were never set"):
        builder.build()
    builder.set_slice(1, 2, payloads[5], sample_count=15)
    with pytest.raises(ValueError, match=r"slice \(1, 2\) was already set"):
        builder.set_slice(1, 2, b"again")
    with pytest.raises(ValueError, match=r"outside mesh"):
        builder.set_slice(2, 0, b"x")
    built = builder.build()
    direct = encode_tgb(
        payloads, mesh, compression="zstd", sample_counts=[10 + i for i in range(6)]
    )
    assert built == direct
    assert [s.sample_count for s in built.footer.slices] == list(range(10, 16))


def test_parts_keep_immutable_payloads_and_copy_mutable_ones() -> None:
    immutable = b"kept as is" * 100
    view = memoryview(b"0123456789" * 50)[5:405]
    mutable = bytearray(b"m" * 300)
    mutable_view = memoryview(bytearray(b"v" * 200))
    enc = encode_tgb([immutable, view, mutable, mutable_view], Mesh(dp=4))
    assert enc.parts[0] is immutable  # uploaded without a copy
    assert enc.parts[1].obj is view.obj
    assert enc.parts[2] is not mutable
    assert enc.parts[3] is not mutable_view
    before = enc.data
    mutable[:] = b"x" * 300  # a caller reusing its buffers for the next batch
    mutable_view[:] = b"y" * 200
    assert b"".join(enc.parts) == before == enc.data
    assert enc.size == len(before)
    start = enc.footer_offset
    assert enc.footer_bytes == before[start : start + enc.footer_length]
    store = MemoryStore()
    store.put_parts(KEY, enc.parts)
    footer = read_footer(store, KEY)
    assert read_slice(store, KEY, footer, 2) == b"m" * 300
    assert read_slice(store, KEY, footer, 3) == b"v" * 200


def test_an_encoded_tgb_of_one_part_reads_the_same() -> None:
    enc = encode_tgb([b"abc" * 50, b"de" * 9], Mesh(dp=2))
    whole = EncodedTgb(
        parts=(enc.data,),
        footer=enc.footer,
        footer_offset=enc.footer_offset,
        footer_length=enc.footer_length,
    )
    assert whole.size == enc.size == len(enc.data)
    assert whole.footer_bytes == enc.footer_bytes
    assert whole.data == enc.data


def test_a_tgb_split_after_its_payload_keeps_its_footer_bytes() -> None:
    # Before: footer_bytes returned parts[-2] whenever it was footer_length bytes long, without
    # checking that parts[-1] is the trailer. Split as (payload, footer + trailer), which
    # check_encoded accepts, a payload exactly as long as the footer was taken for the footer:
    # the manifest recorded its checksum as the footer's and every read of the step failed.
    mesh = Mesh(dp=1)
    n = encode_tgb([b"x"], mesh).footer_length
    for _ in range(5):  # the footer grows with the payload's length digits: find a fixed point
        enc = encode_tgb([b"x" * n], mesh)
        if enc.footer_length == n:
            break
        n = enc.footer_length
    assert enc.footer_offset == enc.footer_length
    data = enc.data
    split = EncodedTgb(
        parts=(data[: enc.footer_offset], data[enc.footer_offset :]),
        footer=enc.footer,
        footer_offset=enc.footer_offset,
        footer_length=enc.footer_length,
    )
    check_encoded(split, what="split TGB")
    assert bytes(split.footer_bytes) == bytes(enc.footer_bytes) == data[n : 2 * n]
    store = MemoryStore()
    with bw.Producer(
        store, "ns", producer_id="p", mesh=mesh, policy="naive", slice_table_limit=0
    ) as producer:
        producer.append(split, offset=0)
        producer.seal()
    with bw.Consumer(store, "ns", mesh=mesh, dp_rank=0) as consumer:
        assert [data for _, data in consumer] == [b"x" * n]


def test_encode_validates_its_arguments() -> None:
    mesh = Mesh(dp=2, cp=2)
    with pytest.raises(
        ValueError, match=r"mesh dp=2, cp=2 needs 4 slices in \(d, c\) order, got 3"
    ):
        encode_tgb([b"a"] * 3, mesh)
    with pytest.raises(ValueError, match="2 sample counts for 4 slices"):
        encode_tgb([b"a"] * 4, mesh, sample_counts=[1, 2])
    with pytest.raises(ValueError, match="unknown codec 'json'"):
        encode_tgb([b"a"] * 4, mesh, codec="json")
    with pytest.raises(ValueError, match="unknown compression 'lz4'"):
        encode_tgb([b"a"] * 4, mesh, compression="lz4")
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        encode_tgb([b"a"] * 4, mesh, checksum_algo="md5")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="metadata must map str to str"):
        encode_tgb([b"a"] * 4, mesh, metadata={"n": 1})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="codec 'raw' stores bytes"):
        encode_tgb(["a"] * 4, mesh)
    with pytest.raises(ValueError, match="sample_count must be >= 0"):
        encode_tgb([b"a"] * 4, mesh, sample_counts=[1, 1, 1, -1])


def test_footer_index_helpers() -> None:
    enc = encode_tgb([b"a", b"bb", b"ccc", b"dddd", b"e", b"f"], Mesh(dp=3, cp=2))
    f = enc.footer
    assert f.coords(3) == (1, 1)
    assert f.entry((1, 1)) == f.slices[3]
    assert slice_range(f, (1, 1)) == Bounded(6, 10)
    with pytest.raises(IndexError, match=r"slice index 6 is outside 0\.\.5"):
        f.entry(6)
    with pytest.raises(ValueError, match=r"slice \(0, 2\) is outside mesh"):
        f.entry((0, 2))


# --------------------------------------------------------------------------------------------
# request counts


def test_read_costs_one_request_per_slice_and_per_located_footer() -> None:
    mesh = Mesh(dp=4, cp=2)
    payloads = [bytes([i]) * (1000 + i) for i in range(mesh.slices)]
    enc = encode_tgb(payloads, mesh, codec="raw")
    store = RangeRecordingStore()
    store.put(KEY, enc.data)

    footer = read_footer(
        store, KEY, footer_offset=enc.footer_offset, footer_length=enc.footer_length
    )
    assert store.ranges == [
        Bounded(enc.footer_offset, enc.footer_offset + enc.footer_length + TRAILER_SIZE)
    ]
    assert store.snapshot().gets == 0
    store.reset()

    assert read_slice(store, KEY, footer, (2, 1)) == payloads[5]
    assert store.ranges == [slice_range(footer, 5)]
    assert store.snapshot().bytes_read == len(payloads[5]), "read amplification is exactly 1"
    assert store.snapshot().gets == 0
    store.reset()

    assert read_footer(store, KEY) == footer
    assert store.ranges == [Suffix(FOOTER_READ_GUESS)], "a small footer costs one suffix read"


def test_large_footer_costs_exactly_two_blind_reads() -> None:
    mesh = Mesh(dp=2)
    big = {"notes": "x" * (FOOTER_READ_GUESS * 2)}
    enc = encode_tgb([b"a", b"b"], mesh, metadata=big)
    store = RangeRecordingStore()
    store.put(KEY, enc.data)
    footer = read_footer(store, KEY)
    assert footer.metadata == big
    assert store.ranges == [
        Suffix(FOOTER_READ_GUESS),
        Suffix(enc.footer_length + TRAILER_SIZE),
    ]


def test_empty_slice_needs_no_request() -> None:
    enc = encode_tgb([b"", b"x"], Mesh(dp=2))
    store = RangeRecordingStore()
    store.put(KEY, enc.data)
    assert read_slice(store, KEY, enc.footer, 0) == b""
    assert store.ranges == []


# --------------------------------------------------------------------------------------------
# corruption: every single-byte flip is either harmless or a clear error


def _small_objects() -> list[tuple[str, dict[str, Any]]]:
    mesh = Mesh(dp=2, cp=2)
    return [
        (
            "raw-crc32c",
            {
                "mesh": mesh,
                "codec": "raw",
                "slices": [b"alpha", b"", b"gamma-gamma", b"d"],
                "compression": None,
                "checksum_algo": "crc32c",
                "metadata": {"k": "v"},
            },
        ),
        (
            "tensors-zstd-xxhash",
            {
                "mesh": Mesh(dp=1, cp=2),
                "codec": "tensors",
                "slices": [
                    {"x": np.arange(6, dtype=np.int16).reshape(2, 3)},
                    {"y": np.array([1.5, -2.0], dtype=np.float32), "z": np.zeros(0, np.uint8)},
                ],
                "compression": "zstd",
                "checksum_algo": "xxhash64",
                "metadata": {},
            },
        ),
        (
            "raw-xxh3",
            {
                "mesh": Mesh(dp=1, cp=2),
                "codec": "raw",
                "slices": [b"xxh3", b"format-2"],
                "compression": None,
                "checksum_algo": "xxh3",
                "metadata": {},
            },
        ),
    ]


def _attempt(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, FormatError | None]:
    try:
        return fn(*args, **kwargs), None
    except FormatError as exc:
        return None, exc


def check_flipped(
    flipped: bytes, original: EncodedTgb, case: dict[str, Any], *, located: bool = False
) -> str:
    """Read every slice of ``flipped`` through its own footer; return what happened.

    Any outcome other than the exact original data or a FormatError naming the object (and, for
    slice reads, the slice) fails the test.
    """
    store = MemoryStore()
    store.put(KEY, flipped)
    location = (
        {"footer_offset": original.footer_offset, "footer_length": original.footer_length}
        if located
        else {}
    )
    footer, error = _attempt(read_footer, store, KEY, **location)
    if error is not None:
        assert repr(KEY) in str(error), str(error)
        return "footer-error"
    assert footer == original.footer, "a corrupt footer must never parse"
    outcome = "harmless"
    for i, want in enumerate(case["slices"]):
        d, c = footer.coords(i)
        got, error = _attempt(read_slice, store, KEY, footer, i)
        if error is None:
            assert_same(case["codec"], got, want)
        else:
            assert repr(KEY) in str(error), str(error)
            assert f"slice ({d}, {c})" in str(error), str(error)
            outcome = "slice-error"
    return outcome


@pytest.mark.parametrize(
    ("name", "case"), _small_objects(), ids=lambda v: v if isinstance(v, str) else ""
)
def test_every_single_byte_flip_is_detected_or_harmless(name: str, case: dict[str, Any]) -> None:
    enc = encode_case(case)
    outcomes: dict[str, int] = {}
    for pos in range(enc.size):
        for xor in (*(1 << bit for bit in range(8)), 0xFF):
            flipped = bytearray(enc.data)
            flipped[pos] ^= xor
            for located in (False, True):
                result = check_flipped(bytes(flipped), enc, case, located=located)
                outcomes[result] = outcomes.get(result, 0) + 1
    # every byte is covered by a checksum or the magic, so no flip can be harmless
    assert outcomes.get("harmless", 0) == 0, outcomes
    assert outcomes["footer-error"] > 0
    assert outcomes["slice-error"] > 0


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=tgb_cases(), pos=st.integers(min_value=0), xor=st.integers(1, 255))
def test_random_flips_in_arbitrary_objects(case: dict[str, Any], pos: int, xor: int) -> None:
    enc = encode_case(case)
    flipped = bytearray(enc.data)
    flipped[pos % enc.size] ^= xor
    assert check_flipped(bytes(flipped), enc, case) != "harmless"


def test_flipping_the_version_field_is_an_error_not_acceptance() -> None:
    enc = encode_tgb([b"a"], Mesh(dp=1))
    version_at = enc.size - TRAILER_SIZE + 8
    for new_version in (0, 2, 7, 0xFFFF):
        data = bytearray(enc.data)
        data[version_at : version_at + 2] = new_version.to_bytes(2, "little")
        with pytest.raises(ChecksumMismatch, match=rf"footer of object {KEY!r} is corrupt"):
            parse_footer(bytes(data), key=KEY)


def test_slice_checksum_mismatch_names_object_slice_and_both_checksums() -> None:
    enc = encode_tgb([b"aaaa", b"bbbb", b"cccc", b"dddd"], Mesh(dp=2, cp=2))
    data = bytearray(enc.data)
    data[9] ^= 0x20  # inside slice 2 = (1, 0)
    stored = enc.footer.slices[2].checksum
    with pytest.raises(ChecksumMismatch) as info:
        decode_slice(bytes(data[8:12]), enc.footer, 2, key=KEY)
    msg = str(info.value)
    assert f"slice (1, 0) of object {KEY!r}" in msg
    assert f"{stored:#x}" in msg
    assert f"{bw._format.checksum(bytes(data[8:12])):#x}" in msg


def test_short_slice_read_is_a_clear_error() -> None:
    enc = encode_tgb([b"aaaa", b"bbbb"], Mesh(dp=2))
    with pytest.raises(FormatError, match=r"slice \(1, 0\) of object .*got 3 bytes.*records 4"):
        decode_slice(b"bbb", enc.footer, 1, key=KEY)


# --------------------------------------------------------------------------------------------
# truncated and foreign objects


def test_every_truncation_is_rejected() -> None:
    enc = encode_case(_small_objects()[0][1])
    for n in range(enc.size):
        store = MemoryStore()
        store.put(KEY, enc.data[:n])
        with pytest.raises(FormatError, match=repr(KEY)):
            read_footer(store, KEY)
        with pytest.raises(FormatError, match=repr(KEY)):
            read_footer(
                store, KEY, footer_offset=enc.footer_offset, footer_length=enc.footer_length
            )
        with pytest.raises(FormatError, match=repr(KEY)):
            parse_footer(enc.data[:n], key=KEY)


def test_truncated_object_message_says_so() -> None:
    enc = encode_tgb([b"x" * 100], Mesh(dp=1))
    store = MemoryStore()
    store.put(KEY, enc.data[:-1])
    with pytest.raises(FormatError, match=r"not a BatchWeave TGB \(bad magic"):
        read_footer(store, KEY)
    with pytest.raises(FormatError, match="is truncated"):
        read_footer(store, KEY, footer_offset=enc.footer_offset, footer_length=enc.footer_length)


def _parquet_bytes() -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.table({"a": [1, 2, 3]}), sink)
    return sink.getvalue()


@pytest.mark.parametrize(
    ("blob", "match"),
    [
        (b"", "is empty"),
        (b"PAR1", "is only 4 bytes"),
        (_parquet_bytes(), r"not a BatchWeave TGB \(bad magic b'.*PAR1'"),
        (b"{}" * 100, "bad magic"),
        (bytes(100) + MAGIC, "invalid format version 0"),
    ],
    ids=["empty", "tiny", "parquet", "json", "zeros-with-magic"],
)
def test_foreign_objects_are_rejected(blob: bytes, match: str) -> None:
    store = MemoryStore()
    store.put(KEY, blob)
    with pytest.raises(FormatError, match=match) as info:
        read_footer(store, KEY)
    assert repr(KEY) in str(info.value)


@given(st.binary(max_size=400))
def test_random_bytes_are_rejected(blob: bytes) -> None:
    with pytest.raises(FormatError, match=repr(KEY)):
        parse_footer(blob, key=KEY)


# --------------------------------------------------------------------------------------------
# versions and footer validation (crafted objects with valid checksums)


def craft(
    footer: dict[str, Any] | bytes,
    *,
    payload: bytes = b"",
    version: int = 1,
    algo: ChecksumAlgo = "crc32c",
) -> bytes:
    """An object with an arbitrary footer and a correctly checksummed trailer."""
    raw = footer if isinstance(footer, bytes) else json.dumps(footer).encode()
    return payload + raw + _pack_trailer(raw, version, algo)


def _footer_doc(enc: EncodedTgb) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(enc.footer.model_dump_json())
    return doc


def test_future_format_version_is_unsupported() -> None:
    enc = encode_tgb([b"abc"], Mesh(dp=1))
    doc = _footer_doc(enc) | {"format_version": 7, "new_field": [1, 2]}
    blob = craft(doc, payload=enc.data[: enc.footer_offset], version=7)
    store = MemoryStore()
    store.put(KEY, blob)
    expected = (
        rf"object {KEY!r} was written by a newer BatchWeave \(format 7, this library reads up to "
        rf"{FORMAT_VERSION}\): upgrade batchweave"
    )
    with pytest.raises(UnsupportedFormatVersion, match=expected):
        read_footer(store, KEY)
    with pytest.raises(UnsupportedFormatVersion, match=expected):
        parse_footer_exact(json.dumps(doc).encode(), key=KEY)


def test_future_version_with_new_checksum_algorithm_is_unsupported() -> None:
    raw = b'{"format_version": 9}'
    trailer = bytearray(_pack_trailer(raw, 9, "crc32c"))
    trailer[10] = 42  # an algorithm id this library does not know
    with pytest.raises(UnsupportedFormatVersion, match="format 9"):
        parse_footer(raw + bytes(trailer), key=KEY)


def _trailer_fields(enc: EncodedTgb) -> tuple[int, int]:
    """The (format version, checksum algorithm id) an object's trailer records."""
    trailer = enc.data[-TRAILER_SIZE:]
    return int.from_bytes(trailer[8:10], "little"), trailer[10]


def test_each_algorithm_has_its_trailer_id_and_oldest_possible_version() -> None:
    written = {
        algo: _trailer_fields(encode_tgb([b"a"], Mesh(dp=1), checksum_algo=algo))
        for algo in CHECKSUM_ALGOS
    }
    # ids are frozen (docs/format.md); only xxh3, unknown to format-1 readers, needs format 2
    assert written == {"crc32c": (1, 1), "xxhash64": (1, 2), "xxh3": (2, 3)}
    enc = encode_tgb([b"a", b"bc"], Mesh(dp=2), checksum_algo="xxh3")
    assert enc.footer.format_version == 2
    assert parse_footer(enc.data, key=KEY) == enc.footer
    assert [s.checksum for s in enc.footer.slices] == [
        bw._format.checksum(b"a", "xxh3"),
        bw._format.checksum(b"bc", "xxh3"),
    ]


@pytest.mark.parametrize("version", [1, 2])
def test_unknown_checksum_algorithm_id_tells_to_upgrade(version: int) -> None:
    raw = b'{"format_version": 1}'
    trailer = bytearray(_pack_trailer(raw, version, "crc32c"))
    trailer[10] = 4  # the next id a future BatchWeave might assign
    with pytest.raises(FormatError, match="unknown checksum algorithm id 4") as info:
        parse_footer(raw + bytes(trailer), key=KEY)
    assert not isinstance(info.value, UnsupportedFormatVersion)
    msg = str(info.value)
    assert repr(KEY) in msg
    assert "upgrade batchweave" in msg
    assert "1 (crc32c), 2 (xxhash64), 3 (xxh3)" in msg


def test_a_format_1_reader_asks_for_an_upgrade_on_xxh3_objects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A reader from before xxh3 knows format 1 and algorithm ids 1-2 only; the version the
    # writer chose makes it refuse with "upgrade" (trailer rule 4), not call the object damaged.
    enc = encode_tgb([b"abc"], Mesh(dp=1), checksum_algo="xxh3")
    monkeypatch.setattr(_tgb_read, "FORMAT_VERSION", 1)
    monkeypatch.delitem(_tgb_read._ALGO_BY_ID, 3)
    with pytest.raises(UnsupportedFormatVersion, match=r"\(format 2, .*up to 1\): upgrade"):
        parse_footer(enc.data, key=KEY)


def test_xxh3_in_a_format_1_object_is_rejected() -> None:
    enc = encode_tgb([b"abc"], Mesh(dp=1), checksum_algo="xxh3")
    doc = _footer_doc(enc) | {"format_version": 1}
    blob = craft(doc, payload=enc.data[: enc.footer_offset], version=1, algo="xxh3")
    with pytest.raises(FormatError, match="'xxh3', which needs format 2 or newer"):
        parse_footer(blob, key=KEY)
    with pytest.raises(FormatError, match="'xxh3', which needs format 2 or newer"):
        parse_footer_exact(json.dumps(doc).encode(), key=KEY)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (
            lambda d: d.update(codec="pickle"),
            "uses codec 'pickle', which this library does not know",
        ),
        (lambda d: d.update(compression="lz4"), "uses compression 'lz4'"),
        (lambda d: d["slices"].pop(), r"1 slices for mesh dp=2, cp=1 \(2\)"),
        (lambda d: d["slices"][1].update(offset=0), r"slices \(0, 0\) and \(1, 0\) overlap"),
        (lambda d: d["slices"][1].update(length=99), r"slice \(1, 0\) spans .* past the"),
        (lambda d: d["slices"][0].update(uncompressed_length=1), "uncompressed but lengths differ"),
        (lambda d: d["slices"][0].update(checksum=1 << 40), "does not fit crc32c"),
        (lambda d: d["slices"][0].update(checksum=-1), "invalid TGB footer"),
        (lambda d: d.update(checksum_algo="xxhash64"), "disagrees with its trailer"),
        (lambda d: d.update(format_version=0), r"format_version 0 disagrees with its trailer"),
        (lambda d: d.update(extra=1), "invalid TGB footer"),
        (lambda d: d.update(mesh={"dp": 0}), "invalid TGB footer"),
        (lambda d: d.update(metadata={"a": 1}), "invalid TGB footer"),
    ],
)
def test_inconsistent_footers_are_rejected(mutate: Any, match: str) -> None:
    enc = encode_tgb([b"abc", b"defg"], Mesh(dp=2))
    doc = _footer_doc(enc)
    mutate(doc)
    with pytest.raises(FormatError, match=match) as info:
        parse_footer(craft(doc, payload=enc.data[: enc.footer_offset]), key=KEY)
    assert repr(KEY) in str(info.value)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.update(format_version="1"), "format_version must be a JSON integer"),
        (lambda d: d.update(format_version=1.0), "format_version must be a JSON integer"),
        (lambda d: d.update(format_version=True), "format_version must be a JSON integer"),
        (lambda d: d.update(format_version="3"), "format_version must be a JSON integer"),
        (lambda d: d.update(format_version=3.0), "format_version must be a JSON integer"),
        (lambda d: d.update(mesh={"dp": "2", "cp": 1}), r"mesh\.dp"),
        (lambda d: d.update(mesh={"dp": 2, "cp": 1.0}), r"mesh\.cp"),
        (lambda d: d.update(payload_length=7.0), "payload_length"),
        (lambda d: d["slices"][0].update(checksum=str(d["slices"][0]["checksum"])), "checksum"),
        (lambda d: d["slices"][1].update(sample_count=True), "sample_count"),
        (lambda d: d["slices"][1].update(offset=3.0), "offset"),
    ],
)
def test_footer_values_of_the_wrong_json_type_are_refused_not_coerced(
    mutate: Any, match: str
) -> None:
    # Before: "3" or 3.0 became format 3 (a footer instead of an error from
    # parse_footer_exact), mesh dp "2", checksum "123" and sample_count true were accepted:
    # docs/format.md says integers are JSON integers.
    enc = encode_tgb([b"abc", b"defg"], Mesh(dp=2))
    doc = _footer_doc(enc)
    mutate(doc)
    with pytest.raises(FormatError, match=match) as info:
        parse_footer(craft(doc, payload=enc.data[: enc.footer_offset]), key=KEY)
    assert not isinstance(info.value, UnsupportedFormatVersion)
    assert repr(KEY) in str(info.value)
    with pytest.raises(FormatError, match=match):
        parse_footer_exact(json.dumps(doc).encode(), key=KEY)


@pytest.mark.parametrize(
    ("raw", "match"),
    [(b"{nope", "footer is not valid JSON"), (b"[1, 2]", "invalid TGB footer"), (b"\xff", "JSON")],
)
def test_unparsable_footers_are_rejected(raw: bytes, match: str) -> None:
    with pytest.raises(FormatError, match=match):
        parse_footer(craft(raw), key=KEY)


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16", "utf-32", "utf-32-be", "utf-8-sig"])
def test_footers_must_be_utf8_without_a_byte_order_mark(encoding: str) -> None:
    # Before: json.loads(bytes) guessed the encoding, so UTF-16/32 footers (with or without a
    # BOM) and a UTF-8 BOM were accepted; docs/format.md: "UTF-8 JSON object, no byte-order
    # mark", which a conforming reader in another language enforces.
    enc = encode_tgb([b"hello"], Mesh(dp=1))
    raw = bytes(enc.footer_bytes).decode().encode(encoding)
    blob = craft(raw, payload=enc.data[: enc.footer_offset])
    with pytest.raises(FormatError, match=r"footer is not (UTF-8|valid) JSON") as info:
        parse_footer(blob, key=KEY)
    assert repr(KEY) in str(info.value)
    with pytest.raises(FormatError, match=r"footer is not (UTF-8|valid) JSON"):
        parse_footer_exact(raw, key=KEY)


def test_a_non_ascii_utf8_footer_still_reads() -> None:
    enc = encode_tgb([b"hello"], Mesh(dp=1), metadata={"note": "caf\u00e9 \u2603"})
    assert parse_footer(enc.data, key=KEY) == enc.footer


@settings(max_examples=40, deadline=None)
@given(
    st.integers(0, FORMAT_VERSION + 3),
    st.integers(1, FORMAT_VERSION + 3),
)
def test_footer_and_trailer_versions_that_disagree_mean_damage(
    footer_version: int, trailer_version: int
) -> None:
    # Before: a footer saying 3 behind a trailer saying 2 raised UnsupportedFormatVersion
    # ("upgrade batchweave"), which cannot help: the object is damaged (docs/format.md step 9).
    # A trailer newer than this library still means "upgrade": its footer may differ.
    if footer_version == trailer_version:
        return
    enc = encode_tgb([b"x"], Mesh(dp=1))
    doc = _footer_doc(enc) | {"format_version": footer_version}
    blob = craft(doc, payload=enc.data[: enc.footer_offset], version=trailer_version)
    if trailer_version > FORMAT_VERSION:
        with pytest.raises(UnsupportedFormatVersion, match="upgrade batchweave"):
            parse_footer(blob, key=KEY)
        return
    expected = (
        rf"object {KEY!r}: footer format_version {footer_version} disagrees with its trailer's "
        rf"\({trailer_version}\); the object is damaged.*do not rewrite"
    )
    with pytest.raises(FormatError, match=expected) as info:
        parse_footer(blob, key=KEY)
    assert not isinstance(info.value, UnsupportedFormatVersion)


def test_invalid_version_without_a_trailer_is_still_named() -> None:
    doc = _footer_doc(encode_tgb([b"x"], Mesh(dp=1))) | {"format_version": 0}
    with pytest.raises(FormatError, match="invalid format version 0"):
        parse_footer_exact(json.dumps(doc).encode(), key=KEY)


def test_absurd_footer_length_is_rejected_before_reading_it() -> None:
    trailer = bytearray(_pack_trailer(b"{}", 1, "crc32c"))
    trailer[0:8] = (1 << 62).to_bytes(8, "little")
    store = RangeRecordingStore()
    store.put(KEY, b"{}" + bytes(trailer))
    with pytest.raises(FormatError, match=f"over the {MAX_FOOTER_LENGTH}-byte limit"):
        read_footer(store, KEY)
    assert store.ranges == [Suffix(FOOTER_READ_GUESS)]
    with pytest.raises(FormatError, match="over the"):
        parse_footer_exact(memoryview(bytes(MAX_FOOTER_LENGTH + 1)), key=KEY)


def test_nonzero_reserved_bytes_are_rejected() -> None:
    raw = encode_tgb([b"a"], Mesh(dp=1)).footer.model_dump_json().encode()
    blob = b"a" + raw + _pack_trailer(raw, 1, "crc32c", reserved=b"\x00\x00\x01\x00\x00")
    with pytest.raises(FormatError, match="reserved trailer bytes are not zero"):
        parse_footer(blob, key=KEY)


def test_manifest_location_must_agree_with_the_object() -> None:
    enc = encode_tgb([b"abc", b"de"], Mesh(dp=2))
    store = MemoryStore()
    store.put(KEY, enc.data)
    with pytest.raises(FormatError, match=r"manifest records a .*-byte footer but the object"):
        read_footer(
            store, KEY, footer_offset=enc.footer_offset - 1, footer_length=enc.footer_length + 1
        )
    with pytest.raises(ValueError, match="give both footer_offset and footer_length"):
        read_footer(store, KEY, footer_offset=enc.footer_offset)
    # a footer copied onto other payload bytes: the recorded offset disagrees with the footer
    moved = b"xx" + enc.data
    store.put(KEY, moved)
    with pytest.raises(FormatError, match="footer says it follows 5 payload bytes"):
        read_footer(
            store, KEY, footer_offset=enc.footer_offset + 2, footer_length=enc.footer_length
        )
    with pytest.raises(FormatError, match=r"is \d+ bytes but its footer describes"):
        read_footer(store, KEY)


def test_lying_uncompressed_length_is_capped() -> None:
    enc = encode_tgb([b"z" * 10_000], Mesh(dp=1), compression="zstd")
    doc = _footer_doc(enc)
    doc["slices"][0]["uncompressed_length"] = 100
    blob = craft(doc, payload=enc.data[: enc.footer_offset])
    store = MemoryStore()
    store.put(KEY, blob)
    footer = read_footer(store, KEY)
    with pytest.raises(FormatError, match=r"slice \(0, 0\) of object .*frame claims 10000 bytes"):
        read_slice(store, KEY, footer, 0)


def test_missing_object_is_object_not_found() -> None:
    with pytest.raises(bw.ObjectNotFound):
        read_footer(MemoryStore(), KEY)


def test_container_decodes_tensors_without_copying() -> None:
    tensors = [{"x": np.arange(100, dtype=np.float64).reshape(10, 10)} for _ in range(2)]
    enc = encode_tgb(tensors, Mesh(dp=2), codec="tensors")
    rng = slice_range(enc.footer, 1)
    raw = enc.data[rng.start : rng.end]
    out = decode_slice(raw, enc.footer, 1, key=KEY)
    assert np.shares_memory(out["x"], np.frombuffer(raw, dtype=np.uint8))
    assert not out["x"].flags.writeable
    assert out["x"].ctypes.data % out["x"].dtype.itemsize == 0
    assert enc.footer.slices[1].sample_count == 10


@settings(max_examples=150, deadline=None)
@given(
    dp=st.integers(1, 4),
    cp=st.integers(1, 3),
    data=st.data(),
    compression=st.sampled_from([None, "zstd"]),
    algo=st.sampled_from(CHECKSUM_ALGOS),
    metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3),
)
def test_built_footer_equals_the_fully_validated_footer(
    dp: int,
    cp: int,
    data: st.DataObject,
    compression: str | None,
    algo: ChecksumAlgo,
    metadata: dict[str, str],
) -> None:
    # The builder wraps the entries of slices it stored without validating them again; the
    # footer must be the one full validation builds, down to its JSON bytes.
    mesh = Mesh(dp=dp, cp=cp)
    payloads = [data.draw(st.binary(max_size=64)) for _ in range(mesh.slices)]
    counts = data.draw(
        st.none()
        | st.lists(st.none() | st.integers(0, 1 << 40), min_size=mesh.slices, max_size=mesh.slices)
    )
    enc = encode_tgb(
        payloads,
        mesh,
        compression=compression,
        checksum_algo=algo,
        sample_counts=counts,
        metadata=metadata,
    )
    # The validated path, computed independently from the stored parts.
    entries, offset = [], 0
    for i, part in enumerate(enc.parts[: mesh.slices]):
        entries.append(
            bw.SliceEntry(
                offset=offset,
                length=len(part),
                uncompressed_length=len(payloads[i]),
                checksum=checksum(part, algo),
                sample_count=1 if counts is None or counts[i] is None else counts[i],
            )
        )
        offset += len(part)
    validated = bw.TgbFooter(
        format_version=2 if algo == "xxh3" else 1,
        mesh=mesh,
        codec="raw",
        compression=compression,
        checksum_algo=algo,
        payload_length=offset,
        slices=tuple(entries),
        metadata=metadata,
    )
    assert enc.footer == validated
    assert enc.footer.slices == validated.slices
    assert bytes(enc.footer_bytes) == validated.model_dump_json().encode()
    for built, checked in zip(enc.footer.slices, validated.slices, strict=True):
        assert type(built) is bw.SliceEntry
        assert built.model_fields_set == checked.model_fields_set
        assert built.model_dump_json() == checked.model_dump_json()
        assert repr(built) == repr(checked)
    assert parse_footer(enc.data, key=KEY) == enc.footer


@pytest.mark.parametrize(("given_count", "stored"), [(np.int64(3), 3), (7, 7)])
def test_sample_counts_that_are_integers_are_stored_as_plain_ints(
    given_count: object, stored: int
) -> None:
    enc = encode_tgb([b"a", b"b"], Mesh(dp=2), sample_counts=[given_count, 1])  # type: ignore[list-item]
    assert enc.footer.slices[0].sample_count == stored
    assert type(enc.footer.slices[0].sample_count) is int


@pytest.mark.parametrize("given_count", [2.5, 2.0, True, "2"])
def test_a_sample_count_that_is_no_integer_is_refused(given_count: object) -> None:
    # 2.0, True and "2" used to be stored as 2, 1 and 2 (the footer's model converted them).
    with pytest.raises(TypeError, match=r"slice \(0, 0\): sample_count must be an integer"):
        encode_tgb([b"a", b"b"], Mesh(dp=2), sample_counts=[given_count, 1])  # type: ignore[list-item]


# -- a damaged TGB: advice a reader can follow; hostile tensor headers -------------------------


def _damaged(store: bw.ObjectStore, flip: int) -> None:
    tgb = bw.encode_tgb([b"hello", b"world!"], bw.Mesh(dp=2, cp=1))
    data = bytearray(tgb.data)
    data[flip] ^= 0x01
    store.put(KEY, bytes(data))


def test_slice_checksum_mismatch_gives_advice_a_reader_can_follow() -> None:
    # Before: "... the object was damaged in storage or transit, rewrite it": a committed TGB is
    # immutable, and a reader cannot rewrite it (the manifest records its checksums).
    store = bw.MemoryStore()
    _damaged(store, flip=6)  # inside slice (1, 0)
    footer = bw.read_footer(store, KEY)
    with pytest.raises(bw.ChecksumMismatch) as info:
        bw.read_slice(store, KEY, footer, (1, 0))
    text = str(info.value)
    assert f"slice (1, 0) of object {KEY!r} is corrupt" in text
    assert "transit, rewrite it" not in text
    for advice in ("do not rewrite", "backup", "start_step", "batchweave verify"):
        assert advice in text, advice


def test_footer_checksum_mismatch_gives_the_same_advice() -> None:
    store = bw.MemoryStore()
    _damaged(store, flip=15)  # inside the footer JSON
    with pytest.raises(bw.ChecksumMismatch, match=rf"footer of object {KEY!r} is corrupt") as info:
        bw.read_footer(store, KEY)
    assert "transit, rewrite it" not in str(info.value)
    assert "backup" in str(info.value)


def _tensor_slice(shape: list[int]) -> bytes:
    header = json.dumps(
        {"tensors": [{"name": "a", "dtype": "int8", "shape": shape, "offset": 1024}]}
    ).encode()
    prefix = len(header).to_bytes(8, "little") + header
    return prefix + bytes(2048 - len(prefix))


@pytest.mark.parametrize(
    "shape",
    [[1] * 65, [0] * 100, [2**70, 0], [2**63, 0]],
    ids=["65-axes", "100-empty-axes", "2^70", "2^63"],
)
def test_tensor_shapes_numpy_cannot_hold_are_format_errors_naming_the_slice(
    shape: list[int],
) -> None:
    # Before: a plain ValueError from numpy ("maximum supported dimension for an ndarray is
    # currently 64", "Maximum allowed dimension exceeded") without the object or slice: every
    # other damaged tensor header is a FormatError naming both.
    raw = _tensor_slice(shape)
    footer = bw.encode_tgb([raw], bw.Mesh(dp=1, cp=1)).footer
    layout = SimpleNamespace(codec="tensors", compression=None, checksum_algo="crc32c")
    where = f"slice (0, 0) of object {KEY!r}"
    with pytest.raises(bw.FormatError, match=re.escape(where)) as info:
        decode_entry(raw, footer.slices[0], layout, where=where)
    assert "numpy cannot hold" in str(info.value)


@pytest.mark.parametrize("metadata", ["source=shard-17", 5, b"xy", [("a", "b")], ""])
def test_metadata_that_is_no_mapping_is_refused_clearly(metadata: object) -> None:
    # Before: dict() ran first ("dictionary update sequence element #0 has length 1", "'int'
    # object is not iterable") or accepted a list of pairs and "".
    for build in (
        lambda: encode_tgb([b"a"], Mesh(dp=1, cp=1), metadata=metadata),  # type: ignore[arg-type]
        lambda: TgbBuilder(Mesh(dp=1, cp=1), metadata=metadata),  # type: ignore[arg-type]
    ):
        with pytest.raises(TypeError, match="metadata must be a mapping of str to str, got"):
            build()


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_released_memoryview_is_an_error_naming_its_slice(compression: str | None) -> None:
    # Before: only TypeErrors of the codec named the slice.
    mesh = Mesh(dp=4, cp=2)
    payloads = [memoryview(bytearray(b"x" * 10)) for _ in range(mesh.slices)]
    payloads[5].release()
    with pytest.raises(ValueError, match=r"^slice \(2, 1\): .*released memoryview"):
        encode_tgb(payloads, mesh, compression=compression)


def test_arrow_errors_at_encode_name_the_slice() -> None:
    mesh = Mesh(dp=1, cp=2)
    deep = pa.array([1, 2])
    for _ in range(70):  # deeper than pyarrow writes: ArrowInvalid "Max recursion depth"
        deep = pa.StructArray.from_arrays([deep], names=["f"])
    bad_utf8 = pa.array([b"\xff"], pa.binary()).view(pa.string())
    ok = pa.table({"s": ["a"]})
    with pytest.raises(ValueError, match=r"^slice \(0, 1\): .*[Rr]ecursion depth"):
        encode_tgb([ok, pa.table({"s": deep})], mesh, codec="arrow")
    with pytest.raises(ValueError, match=r"^slice \(0, 1\): codec 'arrow': invalid Table"):
        encode_tgb([ok, pa.table({"s": bad_utf8})], mesh, codec="arrow")

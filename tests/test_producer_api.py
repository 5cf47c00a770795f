"""The producer-side public API as a preprocessing worker uses it: every valid input round-trips
exactly through a Consumer, and every mistake is refused, clearly, before anything is written.

Covers ``TgbBuilder`` (a buffer reused between ``set_slice()`` and ``build()``), slices from
memoryviews, generators and masked arrays, ``EncodedTgb`` built in worker processes, producer
arguments and custom commit policies, codec round trips, and ``LanceSource`` feeding a producer.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import pickle
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from fake_time import FakeTime
from prometheus_client import CollectorRegistry

import batchweave as bw
from batchweave import (
    AttemptOutcome,
    CommitPolicy,
    EncodedTgb,
    MemoryStore,
    Mesh,
    Producer,
    TgbBuilder,
    encode_tgb,
)
from batchweave.lance import LanceSource

MESH = Mesh(dp=2, cp=2)
NS = "api"


def make(store: bw.ObjectStore, **kw: Any) -> Producer:
    opts: dict[str, Any] = {"policy": "naive", **FakeTime(1000.0).producer_options(), **kw}
    mesh = opts.pop("mesh", MESH)
    return Producer(store, NS, producer_id="p0", mesh=mesh, **opts)


def read_back(store: bw.ObjectStore, mesh: Mesh = MESH) -> dict[tuple[int, int], list[Any]]:
    """Every rank's decoded slices of the sealed namespace, in step order."""
    out: dict[tuple[int, int], list[Any]] = {}
    for d in range(mesh.dp):
        for c in range(mesh.cp):
            consumer = Consumer(store, mesh, d, c)
            out[(d, c)] = [data for _, data in consumer]
            consumer.close()
    return out


def Consumer(store: bw.ObjectStore, mesh: Mesh, d: int, c: int) -> bw.Consumer:  # noqa: N802
    return bw.Consumer(store, NS, mesh=mesh, dp_rank=d, cp_rank=c, timeout=0, prefetch=0)


def publish(store: bw.ObjectStore, batches: list[Any], **kw: Any) -> None:
    with make(store, **kw) as p:
        for offset, batch in enumerate(batches):
            p.append(batch, offset=offset)
        p.seal()


def data_objects(store: MemoryStore) -> list[str]:
    return [m.key for m in store.list("") if "/data/" in m.key]


# ---------------------------------------------------------------------------------------------
# TgbBuilder: a buffer reused between set_slice() and build() must not corrupt the TGB


def test_a_builder_keeps_what_each_slice_held_when_it_was_set() -> None:
    # A worker filling a builder slice by slice from one reused buffer: the builder used to
    # copy the buffer only at build(), after checksumming it at set_slice(), so the published
    # TGB held the last contents under the first checksum and every read failed.
    store = MemoryStore()
    buf = bytearray(8)
    builder = TgbBuilder(MESH)
    for i in range(MESH.slices):
        buf[:] = bytes([i]) * 8
        builder.set_slice(*divmod(i, MESH.cp), buf)
    buf[:] = b"reused!!"
    publish(store, [builder])
    got = read_back(store)
    assert [got[divmod(i, MESH.cp)] for i in range(MESH.slices)] == [
        [bytes([i]) * 8] for i in range(MESH.slices)
    ]


def test_a_builder_slice_set_from_a_numpy_view_is_copied_at_once() -> None:
    arr = np.arange(4, dtype=np.int32)
    builder = TgbBuilder(Mesh(dp=1))
    builder.set_slice(0, 0, arr.data)
    arr[:] = -1
    tgb = builder.build()
    store = MemoryStore()
    store.put_parts("x.tgb", tgb.parts)
    footer = bw.read_footer(store, "x.tgb")
    assert bw.read_slice(store, "x.tgb", footer, 0) == np.arange(4, dtype=np.int32).tobytes()


# ---------------------------------------------------------------------------------------------
# payload shapes: memoryviews, generators, sets


def test_non_contiguous_memoryviews_round_trip_as_their_bytes() -> None:
    # Used to fail with "memoryview: casts are restricted to C-contiguous views", naming no slice.
    grid = np.arange(24, dtype=np.int16).reshape(4, 6)
    views = [
        memoryview(b"abcdefgh")[::2],
        np.asfortranarray(grid).data,
        grid[:, ::3].data,
        memoryview(bytearray(b"plain")),
    ]
    for compression in (None, "zstd"):
        store = MemoryStore()
        publish(store, [views], compression=compression)
        got = read_back(store)
        assert [got[divmod(i, MESH.cp)] for i in range(4)] == [[bytes(v)] for v in views]


def test_slices_may_come_from_a_generator() -> None:
    # Used to raise "object of type 'generator' has no len()".
    store = MemoryStore()
    with make(store) as p:
        p.append((bytes([i]) for i in range(MESH.slices)), offset=0)
        p.append([b"a", b"b", b"c", b"d"], offset=1, sample_counts=(n for n in (1, 2, 3, 4)))
        p.seal()
    got = read_back(store)
    assert got[(1, 1)] == [b"\x03", b"d"]
    tgb = encode_tgb(iter([b"x", b"y"]), Mesh(dp=2), sample_counts=np.array([5, 6]))
    assert [s.sample_count for s in tgb.footer.slices] == [5, 6]


def test_a_set_of_slices_is_refused_because_it_has_no_order() -> None:
    # A set used to be accepted, in hash order: payloads silently went to the wrong ranks.
    store = MemoryStore()
    p = make(store)
    with pytest.raises(TypeError, match="set, which has no order"):
        p.append({b"a", b"b", b"c", b"d"}, offset=0)
    with pytest.raises(TypeError, match=r"sample_counts .*no order"):
        p.append([b"a", b"b", b"c", b"d"], offset=0, sample_counts={1, 2, 3, 4})
    with pytest.raises(TypeError, match="slices must be a list"):
        p.append(5, offset=0)  # type: ignore[arg-type]
    p.abort()
    assert data_objects(store) == []


def test_a_non_numeric_sample_count_gets_a_type_error_not_a_comparison_crash() -> None:
    # Used to raise "'<' not supported between instances of 'str' and 'int'".
    with pytest.raises(TypeError, match="sample_count must be an integer"):
        encode_tgb([b"a", b"b"], Mesh(dp=2), sample_counts=["many", 1])  # type: ignore[list-item]


def test_metadata_that_is_not_valid_unicode_is_refused_naming_the_key() -> None:
    # Used to surface as a PydanticSerializationError from deep inside build().
    with pytest.raises(ValueError, match=r"metadata 'source'.*surrogates"):
        encode_tgb([b"a", b"b"], Mesh(dp=2), metadata={"source": "bad\ud800"})


def test_a_masked_array_is_refused_rather_than_stored_without_its_mask() -> None:
    # np.asarray used to drop the mask silently: consumers got the values under it.
    masked = np.ma.masked_array([1, 2, 3], mask=[False, True, False])
    with pytest.raises(TypeError, match=r"slice \(0, 0\).*'x' is a masked array"):
        encode_tgb([{"x": masked}], Mesh(dp=1), codec="tensors")


# ---------------------------------------------------------------------------------------------
# EncodedTgb built elsewhere


def _encode_in_worker(payloads: list[bytes]) -> EncodedTgb:
    # Views of bytes stay views in the parts (no copy); they must still cross processes.
    return encode_tgb([memoryview(p)[1:] for p in payloads], MESH, checksum_algo="xxh3")


def test_an_encoded_tgb_with_views_of_bytes_pickles() -> None:
    tgb = encode_tgb([memoryview(b"xabc")[1:], b"d", b"e", b"f"], MESH)
    assert any(isinstance(part, memoryview) for part in tgb.parts)
    copy = pickle.loads(pickle.dumps(tgb))
    assert copy.data == tgb.data
    assert copy.footer == tgb.footer


def test_tgbs_encoded_in_worker_processes_are_published_as_built() -> None:
    store = MemoryStore()
    batches = [[bytes([o, i]) * 3 for i in range(MESH.slices)] for o in range(3)]
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        tgbs = list(pool.map(_encode_in_worker, batches))
    publish(store, tgbs)
    got = read_back(store)
    assert got[(1, 0)] == [b[2][1:] for b in batches]


def test_an_encoded_tgb_whose_parts_disagree_with_its_footer_is_refused() -> None:
    a = encode_tgb([b"a", b"b", b"c", b"d"], MESH)
    b = encode_tgb([b"long " * 10] * 4, MESH)
    with pytest.raises(ValueError, match="inconsistent EncodedTgb"):
        EncodedTgb(
            parts=a.parts,
            footer=b.footer,
            footer_offset=b.footer_offset,
            footer_length=b.footer_length,
        )


def test_an_encoded_tgb_whose_footer_is_not_its_own_is_refused_before_upload() -> None:
    # A footer swapped in from a TGB of the same sizes used to be committed: the manifest's
    # slice table carried its checksums, and every consumer read failed with ChecksumMismatch.
    enc = encode_tgb([b"a", b"b", b"c", b"d"], MESH)
    other = encode_tgb([b"w", b"x", b"y", b"z"], MESH)
    bogus_codec = enc.footer.model_copy(update={"codec": "bogus"})
    store = MemoryStore()
    p = make(store)
    for footer in (other.footer, bogus_codec):
        with pytest.raises(bw.FormatError, match="its footer is not the one stored in its bytes"):
            p.append(dataclasses.replace(enc, footer=footer), offset=0)
    joined = EncodedTgb(
        parts=(enc.data,),
        footer=enc.footer,
        footer_offset=enc.footer_offset,
        footer_length=enc.footer_length,
    )
    p.append(joined, offset=0)
    p.seal()
    p.close()
    assert len(data_objects(store)) == 1
    assert read_back(store)[(1, 0)] == [b"c"]


# ---------------------------------------------------------------------------------------------
# constructor arguments: refused before the namespace is created or the epoch committed


class _NotAPolicy:
    pass


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"policy": None}, TypeError, "commit policy name .* or a CommitPolicy instance"),
        ({"policy": bw.DacPolicy}, TypeError, r"got the class DacPolicy; instantiate it"),
        ({"policy": _NotAPolicy()}, TypeError, "CommitPolicy instance, got the _NotAPolicy"),
        ({"mesh": {"dp": 2, "cp": 2}}, TypeError, "mesh must be a batchweave.Mesh"),
        ({"mesh": (2, 2)}, TypeError, "mesh must be a batchweave.Mesh"),
        ({"producer_id": 3}, TypeError, "producer_id must be a str"),
        ({"namespace": 3}, TypeError, "namespace must be a str"),
        ({"max_retries": -1}, ValueError, "max_retries must be >= 0"),
        ({"slice_table_limit": -1}, ValueError, "slice_table_limit must be >= 0"),
        ({"refresh_age": -1.0}, ValueError, "refresh_age must be >= 0"),
        ({"active_horizon": float("nan")}, ValueError, "active_horizon must be >= 0"),
    ],
)
def test_bad_producer_arguments_are_refused_before_anything_is_written(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    # policy=None or a policy class used to commit the epoch, upload the first TGB and then
    # fail in the commit thread ("'NoneType' object has no attribute 'observe_put'"); a dict
    # mesh created the namespace and then reported a NamespaceMismatch with itself.
    store = MemoryStore()
    opts: dict[str, Any] = {"producer_id": "p0", "mesh": MESH, "namespace": NS, **kwargs}
    with pytest.raises(error, match=match):
        Producer(store, opts.pop("namespace"), **opts)
    assert list(store.list("")) == []


def test_make_policy_and_instrument_policy_refuse_what_they_cannot_build() -> None:
    with pytest.raises(ValueError, match="unknown commit policy 'DAC'; choose one of aimd, dac"):
        bw.make_policy("DAC")
    with pytest.raises(ValueError, match=r"bad options \['bogus'\] for commit policy 'dac'"):
        bw.make_policy("dac", bogus=1)
    with pytest.raises(TypeError, match="CommitPolicy instance"):
        bw.instrument_policy(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already built"):
        # Options given with an instance used to be silently ignored.
        bw.instrument_policy(bw.DacPolicy(), conflict_budget=0.05)


def test_a_custom_commit_policy_paces_the_producer() -> None:
    class EveryTwo(CommitPolicy):
        name = "every-two"

        def __init__(self) -> None:
            self.outcomes: list[AttemptOutcome] = []

        def ready(self, pending: int, since_last_attempt: float) -> bool:
            return pending >= 2

        def record(self, outcome: AttemptOutcome) -> None:
            self.outcomes.append(outcome)

    policy = EveryTwo()
    store = MemoryStore()
    publish(store, [[bytes([o])] * 4 for o in range(4)], policy=policy)
    committed = [o for o in policy.outcomes if o.committed and o.tgbs]
    assert sum(o.tgbs for o in committed) == 4
    assert all(o.tgbs >= 2 for o in committed if not o.forced)
    assert read_back(store)[(0, 0)] == [bytes([o]) for o in range(4)]


def test_a_custom_policy_without_a_name_can_be_instrumented() -> None:
    # instrument_policy labels metrics with policy.name, which a subclass had to know to set:
    # without it, AttributeError: 'Quiet' object has no attribute 'name'.
    class Quiet(CommitPolicy):
        def ready(self, pending: int, since_last_attempt: float) -> bool:
            return True

        def record(self, outcome: AttemptOutcome) -> None:
            pass

    assert Quiet.name == "Quiet"
    assert bw.instrument_policy(Quiet(), registry=CollectorRegistry()).inner.name == "Quiet"
    assert bw.make_policy("dac").name == "dac"


def test_builder_coordinates_must_be_integers() -> None:
    builder = TgbBuilder(MESH)
    with pytest.raises(TypeError, match="dp_rank must be an integer, got the float"):
        builder.set_slice(1.0, 0, b"x")  # type: ignore[arg-type]
    builder.set_slice(np.int64(1), np.int64(1), b"x")
    with pytest.raises(ValueError, match=r"slice \(1, 1\) was already set"):
        builder.set_slice(1, 1, b"y")


# ---------------------------------------------------------------------------------------------
# round trips: every codec, compression and checksum algorithm


TABLE = pa.table({"a": [1, 2, 3], "s": ["x", None, "zz"], "l": [[1], [], None]})
GRID = np.arange(24, dtype=np.float32).reshape(4, 6)
TENSORS = [
    {"t": GRID.T, "strided": GRID[:, ::2], "big": GRID.astype(">i8"), "mask": GRID > 3},
    {},
    {"scalar": np.array(7, dtype=np.uint64), "half": GRID.astype(np.float16)},
    {"empty": np.zeros((0, 5), np.int16), "c": (GRID + 1j).astype(np.complex64)},
]


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("algo", ["crc32c", "xxhash64", "xxh3"])
def test_tensors_round_trip(compression: str | None, algo: bw._format.ChecksumAlgo) -> None:
    store = MemoryStore()
    publish(store, [TENSORS], codec="tensors", compression=compression, checksum_algo=algo)
    got = read_back(store)
    for i, want in enumerate(TENSORS):
        (data,) = got[divmod(i, MESH.cp)]
        assert list(data) == list(want)
        for name, arr in want.items():
            assert data[name].shape == arr.shape
            assert data[name].dtype == arr.dtype.newbyteorder("<")
            assert np.array_equal(data[name], arr)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_arrow_round_trip(compression: str | None) -> None:
    payloads = [
        TABLE,
        pa.concat_tables([TABLE, TABLE]),
        pa.record_batch({"a": [1]}),
        TABLE.slice(1, 1),
    ]
    store = MemoryStore()
    with make(store, codec="arrow", compression=compression) as p:
        p.append(payloads, offset=0, metadata={"k": "v"})
        p.seal()
    got = read_back(store)
    for i, want in enumerate(payloads):
        (data,) = got[divmod(i, MESH.cp)]
        assert data.to_pylist() == want.to_pylist()


def test_ready_built_tgbs_keep_their_own_settings_on_a_file_store(tmp_path: Path) -> None:
    store = bw.open_store(f"file://{tmp_path}")
    zstd = encode_tgb([b"a", b"", b"c", b"d"], MESH, compression="zstd", checksum_algo="xxh3")
    builder = TgbBuilder(MESH, codec="tensors", checksum_algo="xxhash64", metadata={"m": "1"})
    for i in range(MESH.slices):
        builder.set_slice(*divmod(i, MESH.cp), {"x": np.full(i, i)})
    publish(store, [zstd, builder, [b"", b"", b"", b""]])
    got = read_back(store)
    assert got[(0, 0)][0] == b"a"
    assert got[(0, 1)][0] == b""
    assert np.array_equal(got[(1, 1)][1]["x"], np.full(3, 3))
    assert got[(1, 0)][2] == b""


# ---------------------------------------------------------------------------------------------
# LanceSource


@pytest.fixture
def five_rows(tmp_path: Path) -> str:
    uri = str(tmp_path / "five.lance")
    lance.write_dataset(pa.table({"id": pa.array(range(5), pa.int64())}), uri)
    return uri


def ids(batches: Iterator[tuple[int, pa.Table]]) -> list[list[int]]:
    return [t["id"].to_pylist() for _, t in batches]


def test_lance_source_refuses_unknown_columns_up_front(five_rows: str) -> None:
    # An unknown column used to make the first take() panic in Rust (a BaseException that
    # `except Exception` does not catch), after the producer had started.
    with pytest.raises(ValueError, match=r"columns \['nope'\].*has columns \['id'\]"):
        LanceSource(five_rows, rows_per_batch=2, columns=["nope"])
    with pytest.raises(ValueError, match="non-empty list of column names"):
        LanceSource(five_rows, rows_per_batch=2, columns=[])
    assert ids(LanceSource(five_rows, rows_per_batch=5, columns=["id"], epochs=1).iter_from(0))


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"rows_per_batch": 2.5}, TypeError, "rows_per_batch must be an integer"),
        ({"epochs": 1.5}, TypeError, "epochs must be an integer"),
        ({"seed": None}, TypeError, "seed must be an integer"),
        ({"seed": -1}, ValueError, "seed must be >= 0"),
        ({"shard": 6, "num_shards": 8}, ValueError, "holds no rows"),
    ],
)
def test_lance_source_refuses_bad_arguments_up_front(
    five_rows: str, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    # rows_per_batch=2.5 or seed=None used to be accepted and fail at the first take().
    opts: dict[str, Any] = {"rows_per_batch": 2, **kwargs}
    with pytest.raises(error, match=match):
        LanceSource(five_rows, **opts)


def test_lance_source_refuses_an_open_dataset_at_another_version(five_rows: str) -> None:
    # version= used to be ignored for an open dataset: the run read whatever it was open at.
    lance.write_dataset(pa.table({"id": pa.array([9], pa.int64())}), five_rows, mode="append")
    latest = lance.dataset(five_rows)
    assert latest.version == 2
    with pytest.raises(ValueError, match="open at version 2, not the version=1"):
        LanceSource(latest, rows_per_batch=2, version=1)
    pinned = LanceSource(five_rows, rows_per_batch=2, version=1)
    assert pinned.rows_per_epoch == 5
    assert LanceSource(latest, rows_per_batch=2, version=2).rows_per_epoch == 6


def test_lance_source_edges(five_rows: str) -> None:
    whole = LanceSource(five_rows, rows_per_batch=100, epochs=1, seed=1)
    assert whole.num_batches == 1
    assert sorted(ids(whole.iter_from(0))[0]) == [0, 1, 2, 3, 4]
    assert list(whole.iter_from(1)) == []  # resumed at the end: nothing left
    two = LanceSource(five_rows, rows_per_batch=2, epochs=2, seed=3)
    batches = ids(two.iter_from(0))
    assert [len(b) for b in batches] == [2, 2, 2, 2, 2]
    flat = [i for b in batches for i in b]
    assert sorted(flat[:5]) == sorted(flat[5:]) == [0, 1, 2, 3, 4]
    assert ids(two.iter_from(np.int64(3))) == batches[3:]
    with pytest.raises(TypeError, match="offset must be an integer"):
        two.take(1.0)  # type: ignore[arg-type]
    endless = LanceSource(five_rows, rows_per_batch=12, seed=1)
    first = endless.take(0)["id"].to_pylist()
    assert sorted(first[:5]) == sorted(first[5:10]) == [0, 1, 2, 3, 4]


def test_lance_source_feeds_a_resumed_producer_exactly_once(five_rows: str) -> None:
    store = MemoryStore()
    source = LanceSource(five_rows, rows_per_batch=2, epochs=1, seed=4)
    mesh = Mesh(dp=1)

    def pack(table: pa.Table) -> list[dict[str, np.ndarray]]:
        return [{"id": table["id"].to_numpy()}]

    with make(store, mesh=mesh, codec="tensors") as p:
        for offset, table in source.iter_from(p.resume_offset, stop=2):
            p.append(pack(table), offset=offset)
    with make(store, mesh=mesh, codec="tensors") as p:
        assert p.resume_offset == 2
        for offset, table in source.iter_from(p.resume_offset):
            p.append(pack(table), offset=offset)
    with make(store, mesh=mesh, codec="tensors") as p:
        assert p.resume_offset == source.num_batches == 3
        assert list(source.iter_from(p.resume_offset)) == []  # resumed at the end
        p.seal()
    consumer = Consumer(store, mesh, 0, 0)
    got = [int(x) for _, data in consumer for x in data["id"]]
    consumer.close()
    assert sorted(got) == [0, 1, 2, 3, 4]
    assert got == [i for b in ids(source.iter_from(0)) for i in b]

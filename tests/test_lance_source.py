"""``batchweave.lance.LanceSource``: a stable order, pinned versions, and arguments checked early.

The order uses only numpy primitives that stay stable across releases, keeps tied keys in index
order and is the same in another process with another hash seed; the dataset version is recorded
so a pinned restart reads the same rows, and writes through the dataset object a caller passed
do not reach or move the source. Shapes and arguments: an empty dataset, too many shards,
batches larger than an epoch, the last partial batch, blob columns and huge offsets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import partial
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest

from batchweave._dac_sim import simulate
from batchweave.lance import LanceSource
from batchweave.testing import S3Endpoint

ROWS = 103


def _write(path: Path, start: int, count: int, mode: str = "create") -> lance.LanceDataset:
    table = pa.table(
        {
            "id": pa.array(np.arange(start, start + count, dtype=np.int64)),
            "text": pa.array([f"row {i}" for i in range(start, start + count)]),
        }
    )
    # Small files, so that takes cross fragments.
    return lance.write_dataset(table, str(path), mode=mode, max_rows_per_file=17)


@pytest.fixture
def dataset(tmp_path: Path) -> str:
    path = tmp_path / "rows.lance"
    _write(path, 0, ROWS)
    return str(path)


def _ids(table: pa.Table) -> list[int]:
    return [int(x) for x in table.column("id").to_pylist()]


# -- LanceSource: the order --------------------------------------------------------------------


def _reference_order(seed: int, shard: int, num_shards: int, epoch: int, n: int) -> list[int]:
    keys = np.random.PCG64(np.random.SeedSequence([seed, shard, epoch])).random_raw(n)
    return [shard + int(i) * num_shards for i in np.argsort(keys, kind="stable")]


def test_the_order_uses_only_numpy_primitives_that_stay_stable_across_releases(
    dataset: str,
) -> None:
    # Before: Generator.permutation, whose stream NumPy's compatibility policy lets change
    # between releases: a producer restarted after a NumPy upgrade would map its resumed offsets
    # to other rows. SeedSequence and the raw PCG64 stream are the stable parts.
    source = LanceSource(dataset, rows_per_batch=10, seed=7, shard=1, num_shards=2)
    n = source.rows_per_epoch
    assert n == 51
    seen = np.concatenate([source.indices(o) for o in range(11)]).tolist()
    expected = [_reference_order(7, 1, 2, epoch, n) for epoch in range(3)]
    assert seen == (expected[0] + expected[1] + expected[2])[:110]
    # Golden values: these change only if the algorithm (or NumPy's stable streams) change.
    assert seen[:8] == GOLDEN_SEED7_SHARD1_OF2


GOLDEN_SEED7_SHARD1_OF2 = [51, 23, 59, 73, 45, 91, 55, 65]


def test_tied_keys_keep_their_index_order(dataset: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # The order sorts with the faster unstable sort, which may put equal keys either way; a tie
    # (about n^2 / 2^65 likely) must still give the one stable order every release agrees on.
    source = LanceSource(dataset, rows_per_batch=ROWS, seed=7)
    n = source.rows_per_epoch
    keys = np.tile(np.array([5, 3, 5, 3, 1], dtype=np.uint64), -(-n // 5))[:n]

    class TiedKeys:
        def __init__(self, entropy: object) -> None:
            pass

        def random_raw(self, size: int) -> np.ndarray:
            return keys[:size].copy()

    monkeypatch.setattr(np.random, "PCG64", TiedKeys)
    assert source.indices(0).tolist() == np.argsort(keys, kind="stable").tolist()


def test_order_is_the_same_in_another_process_with_another_hash_seed(dataset: str) -> None:
    code = (
        "import json, sys; from batchweave.lance import LanceSource; "
        "from batchweave._dac_sim import simulate; "
        "s = LanceSource(sys.argv[1], rows_per_batch=10, seed=3, epochs=3); "
        "r = simulate('dac', 4, 0.05, 30.0, seed=9); "
        "print(json.dumps([[s.indices(o).tolist() for o in range(31)], r.as_dict()]))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", code, dataset], env=env, capture_output=True, text=True, check=True
    )
    batches, sim = json.loads(out.stdout)
    source = LanceSource(dataset, rows_per_batch=10, seed=3, epochs=3)
    assert batches == [source.indices(o).tolist() for o in range(31)]
    assert sim == simulate("dac", 4, 0.05, 30.0, seed=9).as_dict()


# -- LanceSource: versions ---------------------------------------------------------------------


def test_version_is_recorded_and_a_pinned_restart_reads_the_same_rows(
    dataset: str, tmp_path: Path
) -> None:
    # Before: no way to learn which version a source read, so a restart after the dataset grew
    # silently re-permuted every epoch (count_rows changed) and resumed offsets read other rows.
    first = LanceSource(dataset, rows_per_batch=10, seed=4)
    before = [_ids(first.take(o)) for o in range(12)]
    _write(Path(dataset), ROWS, 50, mode="append")
    assert lance.dataset(dataset).version == first.version + 1
    unpinned = LanceSource(dataset, rows_per_batch=10, seed=4)
    assert [_ids(unpinned.take(o)) for o in range(12)] != before  # the hazard the pin avoids
    resumed = LanceSource(dataset, rows_per_batch=10, seed=4, version=first.version)
    assert resumed.version == first.version
    assert [_ids(resumed.take(o)) for o in range(5, 12)] == before[5:]
    assert f"version={first.version}" in repr(resumed)


def test_source_id_changes_with_the_version_and_whatever_maps_offsets_to_rows(
    dataset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # It is what Producer(source=...) commits: equal exactly when the offsets read the same rows.
    args: dict[str, Any] = {"rows_per_batch": 10, "seed": 4, "shard": 1, "num_shards": 2}
    first = LanceSource(dataset, **args)
    same = first.source_id
    assert same.isprintable()
    assert f"version={first.version}" in same
    assert LanceSource(dataset, **args).source_id == same
    # The same dataset named another way, or passed open, is the same source.
    monkeypatch.chdir(Path(dataset).parent)
    assert LanceSource(f"./{Path(dataset).name}", **args).source_id == same
    assert LanceSource(lance.dataset(dataset), **args).source_id == same
    _write(Path(dataset), ROWS, 50, mode="append")
    newest = LanceSource(dataset, **args)
    assert newest.source_id != same
    assert f"version={first.version + 1}" in newest.source_id
    assert LanceSource(dataset, **args, version=first.version).source_id == same
    others: list[dict[str, Any]] = [
        {"rows_per_batch": 11},
        {"seed": 5},
        {"shard": 0},
        {"num_shards": 3},
        {"shuffle": False},
        {"epochs": 2},
        {"columns": ["id"]},
    ]
    ids = [
        LanceSource(dataset, **{**args, **other}, version=first.version).source_id
        for other in others
    ]
    assert same not in ids
    assert len(set(ids)) == len(others)


def test_source_id_holds_no_credentials_and_fits_a_producer(tmp_path: Path) -> None:
    from batchweave.lance import _uri_identity

    assert _uri_identity("s3://key:secret@bucket/c.lance?sig=abc") == "s3://bucket/c.lance"
    long_name = "c" * 1100
    path = tmp_path / "long.lance"
    lance.write_dataset(pa.table({long_name: [1, 2, 3]}), str(path))
    source = LanceSource(path, rows_per_batch=2, columns=[long_name])
    assert len(source.source_id) == 1024
    assert source.source_id.isprintable()
    assert source.source_id.startswith("lance:")
    other = LanceSource(path, rows_per_batch=3, columns=[long_name])
    assert other.source_id != source.source_id  # the digest covers what was cut


def test_a_delete_through_the_passed_dataset_object_does_not_reach_the_source(
    dataset: str,
) -> None:
    # Before: LanceSource kept the caller's object, which delete() moves to a new version in
    # place: positions then named other rows and take() silently returned them.
    ds = lance.dataset(dataset)
    source = LanceSource(ds, rows_per_batch=10, seed=2)
    expected = _ids(source.take(3))
    ds.delete("id < 40")
    assert _ids(source.take(3)) == expected
    assert ds.version == source.version + 1
    # The source's own handle moved: refused, not read.
    source.dataset.checkout_latest()
    with pytest.raises(RuntimeError, match=f"version {source.version} to") as info:
        source.take(3)
    assert dataset in str(info.value)
    assert "batch 3" in str(info.value)
    assert f"version={source.version}" in str(info.value)


def test_an_insert_through_the_passed_dataset_object_does_not_move_the_source(
    dataset: str,
) -> None:
    ds = lance.dataset(dataset)
    source = LanceSource(ds, rows_per_batch=10, seed=2)
    expected = [_ids(source.take(o)) for o in range(11)]
    # Before: the source read the caller's object, now a new version of other rows.
    ds.insert(pa.table({"id": pa.array(range(1000, 1200), pa.int64())}), mode="overwrite")
    assert [_ids(source.take(o)) for o in range(11)] == expected
    assert ds.version == lance.dataset(dataset).version == 2
    assert source.version == 1


def test_a_version_that_does_not_exist_names_the_dataset_and_the_newest(dataset: str) -> None:
    with pytest.raises(ValueError, match=r"has no version 99 \(the newest is 1") as info:
        LanceSource(dataset, rows_per_batch=4, version=99)
    assert dataset in str(info.value)


@pytest.mark.moto_server
# The fixture's server is a child process (fork + exec), started after lance is imported.
@pytest.mark.filterwarnings("ignore:lance is not fork-safe:UserWarning")
def test_credentials_in_the_uri_appear_in_no_repr_or_message(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str, aws_env: pytest.MonkeyPatch
) -> None:
    """Before: ``source_id`` dropped the URI's user info and query, but the repr and every
    message (unknown columns, too many shards, a missing version, a batch past the end, a moved
    version) printed the URI as given, secret included."""
    aws_env.setenv("AWS_ACCESS_KEY_ID", moto_endpoint.access_key_id)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", moto_endpoint.secret_access_key)
    aws_env.setenv("AWS_DEFAULT_REGION", moto_endpoint.region)
    options = {
        "aws_endpoint": moto_endpoint.endpoint_url,
        "aws_allow_http": "true",
        "aws_access_key_id": moto_endpoint.access_key_id,
        "aws_secret_access_key": moto_endpoint.secret_access_key,
        "aws_region": moto_endpoint.region,
    }
    remote: dict[str, Any] = {"storage_options": options}
    plain = f"s3://{s3_bucket}/{s3_prefix}/c.lance"
    lance.write_dataset(pa.table({"id": list(range(10))}), plain, storage_options=options)
    for uri in (
        f"s3://AKIAKEYID:SECRETKEY@{s3_bucket}/{s3_prefix}/c.lance",
        f"{plain}?x-amz-security-token=SECRETTOKEN",
    ):
        source = LanceSource(uri, rows_per_batch=3, epochs=1, storage_options=options)
        shown: list[str] = [repr(source), source.source_id]
        for call in (
            partial(source.take, 100),
            partial(LanceSource, uri, rows_per_batch=3, columns=["nope"], **remote),
            partial(LanceSource, uri, rows_per_batch=3, shard=20, num_shards=30, **remote),
            partial(LanceSource, uri, rows_per_batch=3, version=7, **remote),
            partial(LanceSource, source.dataset, rows_per_batch=3, version=7),
        ):
            with pytest.raises((ValueError, IndexError)) as info:
                call()
            shown.append(str(info.value))
        source.dataset.insert(pa.table({"id": [10]}))  # the source's own handle moves
        with pytest.raises(RuntimeError, match=r"moved from version \d+ to") as moved:
            source.take(0)
        shown.append(str(moved.value))
        for text in shown:
            assert plain in text, text
            assert "SECRET" not in text, text


# -- LanceSource: shapes and arguments ---------------------------------------------------------


def test_an_empty_dataset_and_too_many_shards_say_what_to_do(tmp_path: Path) -> None:
    empty = tmp_path / "empty.lance"
    lance.write_dataset(pa.table({"id": pa.array([], pa.int64())}), str(empty))
    with pytest.raises(ValueError, match="has no rows"):
        LanceSource(str(empty), rows_per_batch=4)
    small = tmp_path / "small.lance"
    lance.write_dataset(pa.table({"id": pa.array([0, 1, 2], pa.int64())}), str(small))
    with pytest.raises(ValueError, match="use at most 3 shards"):
        LanceSource(str(small), rows_per_batch=4, shard=3, num_shards=4)


def test_iter_from_checks_its_arguments_when_called_and_yields_plain_ints(dataset: str) -> None:
    source = LanceSource(dataset, rows_per_batch=10, epochs=1)
    # Before: a generator, so a bad offset raised only at the first next(), inside the producer
    # loop, and NumPy offsets came back as NumPy integers.
    with pytest.raises(IndexError, match="offset must be >= 0"):
        source.iter_from(-1)
    with pytest.raises(TypeError, match="stop must be an integer"):
        source.iter_from(0, stop=2.5)  # type: ignore[arg-type]
    offsets = [o for o, _ in source.iter_from(np.int64(9))]
    assert offsets == [9, 10]
    assert all(type(o) is int for o in offsets)
    assert list(source.iter_from(11)) == []  # a producer that had finished resumes to nothing
    assert [o for o, _ in source.iter_from(3, stop=5)] == [3, 4]


def test_batches_larger_than_an_epoch_and_the_last_partial_batch(dataset: str) -> None:
    # A shard of 3 rows read 8 at a time: every batch repeats rows, across three epochs.
    source = LanceSource(dataset, rows_per_batch=8, seed=1, shard=0, num_shards=40, epochs=5)
    assert source.rows_per_epoch == 3
    assert source.num_batches == 2  # ceil(15 / 8)
    first, last = source.take(0), source.take(1)
    assert _ids(first) == source.indices(0).tolist()
    assert len(first) == 8
    assert len(last) == 7
    seen = _ids(first) + _ids(last)
    for epoch in range(5):
        assert sorted(seen[3 * epoch : 3 * epoch + 3]) == [0, 40, 80]


def test_blob_columns_come_back_as_bytes_not_descriptors(tmp_path: Path) -> None:
    # Before: take() returned Lance's blob descriptors (kind, position, size, ...) in place of
    # the bytes, and the producer packed those.
    uri = str(tmp_path / "blobs.lance")
    payloads = [bytes([i]) * (i + 1) for i in range(12)]
    field = pa.field("blob", pa.large_binary(), metadata={"lance-encoding:blob": "true"})
    table = pa.table(
        {"id": pa.array(range(12), pa.int64()), "blob": pa.array(payloads, pa.large_binary())},
        schema=pa.schema([pa.field("id", pa.int64()), field]),
    )
    lance.write_dataset(table, uri, max_rows_per_file=5)
    source = LanceSource(uri, rows_per_batch=16, seed=3)  # 16 > 12: repeats rows
    batch = source.take(0)
    assert batch.schema.field("blob").type == pa.large_binary()
    assert batch.column("blob").to_pylist() == [payloads[i] for i in _ids(batch)]
    only = LanceSource(uri, rows_per_batch=4, columns=["blob"], shuffle=False).take(1)
    assert only.column_names == ["blob"]
    assert only.column("blob").to_pylist() == payloads[4:8]
    assert LanceSource(uri, rows_per_batch=4, columns=["id"]).take(0).column_names == ["id"]


def test_nested_columns_are_read_and_nested_blobs_come_back_as_bytes(tmp_path: Path) -> None:
    # Before: columns=["st.x"] passed the column check (Lance resolves nested paths) and then
    # raised a raw KeyError from schema.field("st.x") while looking for blob columns.
    uri = str(tmp_path / "nested.lance")
    payloads = [bytes([i]) * (i + 1) for i in range(6)]
    blob = pa.field("b", pa.large_binary(), metadata={"lance-encoding:blob": "true"})
    struct = pa.struct([pa.field("x", pa.int64()), blob])
    rows = [{"x": 10 * i, "b": payloads[i]} for i in range(6)]
    table = pa.table({"id": pa.array(range(6), pa.int64()), "st": pa.array(rows, struct)})
    lance.write_dataset(table, uri)
    assert lance.dataset(uri).take([0], columns=["st.x"]).num_rows == 1  # Lance accepts it

    x_only = LanceSource(uri, rows_per_batch=4, columns=["st.x"], shuffle=False).take(0)
    assert x_only.to_pylist() == [{"st": {"x": 10 * i}} for i in range(4)]
    # a blob nested in a struct, selected by its path, by its struct or with every column
    for columns in (["id", "st.b"], ["id", "st"], None):
        got = LanceSource(uri, rows_per_batch=3, columns=columns, shuffle=False).take(1)
        assert got.column("id").to_pylist() == [3, 4, 5]
        assert [row["b"] for row in got.column("st").to_pylist()] == payloads[3:6]
    with pytest.raises(ValueError, match="columns"):
        LanceSource(uri, rows_per_batch=4, columns=["st.nope"])


def test_huge_offsets_stay_exact(dataset: str) -> None:
    source = LanceSource(dataset, rows_per_batch=7, seed=5)
    offset = 10**15 + 3
    epoch, within = divmod(offset * 7, ROWS)
    rows = source.indices(offset)
    assert (
        rows.tolist()[: min(7, ROWS - within)]
        == (_reference_order(5, 0, 1, epoch, ROWS)[within : within + 7])
    )
    assert _ids(source.take(offset)) == rows.tolist()

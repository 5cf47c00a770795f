"""``batchweave.lance``: a deterministic, resumable Lance source, and the history export."""

from __future__ import annotations

from pathlib import Path

import lance
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import batchweave as bw
from batchweave._history import SAMPLE_IDS_KEY, sample_ids_metadata
from batchweave.lance import LanceSource, export_history

ROWS = 103


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("lance") / "rows.lance"
    table = pa.table(
        {
            "id": pa.array(np.arange(ROWS, dtype=np.int64)),
            "text": pa.array([f"row {i}" * (i % 7 + 1) for i in range(ROWS)]),
        }
    )
    lance.write_dataset(table, str(path))
    return str(path)


def test_take_returns_exactly_the_indexed_rows(dataset: str) -> None:
    source = LanceSource(dataset, rows_per_batch=10, seed=3)
    table = source.take(4)
    assert table.column("id").to_pylist() == source.indices(4).tolist()
    assert table.column("text").to_pylist()[0] == f"row {table['id'][0]}" * (
        table["id"][0].as_py() % 7 + 1
    )


def test_every_row_once_per_epoch_and_batches_straddle_epochs(dataset: str) -> None:
    source = LanceSource(dataset, rows_per_batch=10, seed=1, epochs=2)
    assert source.num_batches == 21  # ceil(206 / 10)
    seen = np.concatenate([source.indices(o) for o in range(21)])
    assert len(seen) == 2 * ROWS
    assert sorted(seen[:ROWS].tolist()) == list(range(ROWS))
    assert sorted(seen[ROWS:].tolist()) == list(range(ROWS))
    assert seen[:ROWS].tolist() != seen[ROWS:].tolist()  # each epoch has its own order
    assert len(source.indices(20)) == 6
    with pytest.raises(IndexError):
        source.indices(21)


@settings(max_examples=25, deadline=None)
@given(start=st.integers(0, 30), seed=st.integers(0, 2**32 - 1))
def test_resuming_at_an_offset_yields_the_same_batches(dataset: str, start: int, seed: int) -> None:
    full = LanceSource(dataset, rows_per_batch=7, seed=seed)
    resumed = LanceSource(dataset, rows_per_batch=7, seed=seed)  # a new process, same config
    for offset, table in resumed.iter_from(start, stop=start + 3):
        assert table.column("id").to_pylist() == full.indices(offset).tolist()


def test_shards_partition_the_rows(dataset: str) -> None:
    rows: list[int] = []
    for shard in range(3):
        source = LanceSource(dataset, rows_per_batch=5, seed=9, shard=shard, num_shards=3, epochs=1)
        for _, table in source.iter_from(0):
            rows.extend(table.column("id").to_pylist())
    assert sorted(rows) == list(range(ROWS))


def test_unshuffled_order_and_column_selection(dataset: str) -> None:
    source = LanceSource(dataset, rows_per_batch=4, shuffle=False, columns=["id"])
    batch = source.take(1)
    assert batch.column_names == ["id"]
    assert batch.column("id").to_pylist() == [4, 5, 6, 7]


def test_bad_arguments_are_refused(dataset: str) -> None:
    with pytest.raises(ValueError, match="rows_per_batch"):
        LanceSource(dataset, rows_per_batch=0)
    with pytest.raises(ValueError, match="shard"):
        LanceSource(dataset, rows_per_batch=1, shard=3, num_shards=3)
    with pytest.raises(ValueError, match="version must be >= 0, got -1"):  # was OverflowError
        LanceSource(dataset, rows_per_batch=1, version=-1)


def test_a_producer_fed_by_the_source_exports_its_history(dataset: str, tmp_path: Path) -> None:
    store = bw.open_store((tmp_path / "store").as_uri())
    mesh = bw.Mesh(dp=2, cp=1)
    source = LanceSource(dataset, rows_per_batch=8, seed=5)
    with bw.Producer(store, "ns", producer_id="lance-0", mesh=mesh, codec="arrow") as producer:
        for offset, table in source.iter_from(producer.resume_offset, stop=5):
            halves = [table.slice(0, 4), table.slice(4, 4)]
            ids = [h.column("id").to_pylist() for h in halves]
            producer.append(
                halves, offset=offset, metadata={SAMPLE_IDS_KEY: sample_ids_metadata(ids)}
            )
    rows = export_history(store, "ns", tmp_path / "history.lance")
    assert rows == 10
    history = lance.dataset(str(tmp_path / "history.lance")).to_table().to_pylist()
    for row in history:
        expected = source.indices(row["offset"])[row["dp"] * 4 : row["dp"] * 4 + 4]
        assert row["sample_ids"] == [str(i) for i in expected]
        assert row["producer_id"] == "lance-0"
        assert row["samples"] == 4
    assert [r["step"] for r in history] == [0, 0, 1, 1, 2, 2, 3, 3, 4, 4]


def test_an_export_that_fails_reading_raises_the_original_error(tmp_path: Path) -> None:
    store = bw.open_store(f"file://{tmp_path / 'store'}")
    with bw.Producer(store, "ns", producer_id="p", mesh=bw.Mesh(dp=2), policy="naive") as p:
        for offset in range(3):
            p.append([b"a" * 10, b"b" * 10], offset=offset)
    gone = sorted(m.key for m in store.list("ns/data/"))[1]
    store.delete_many([gone])
    # Before: LanceError(Arrow) with the Python traceback flattened into its message.
    with pytest.raises(bw.ObjectNotFound, match="no object") as info:
        export_history(store, "ns", tmp_path / "history.lance")
    assert gone in str(info.value)
    assert "Traceback" not in str(info.value)

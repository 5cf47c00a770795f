"""Operator audit: lifecycle, inspect/verify/export and reclaim as an SRE runs them.

Each test reproduces a problem found by operating BatchWeave (several readers' watermarks, a
damaged manifest or segment under ``verify``, a failed export, a namespace with hundreds of
producers) and checks the fix.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path

import pytest
from _reclaimer_worker import FakeClock
from click.testing import CliRunner, Result
from prometheus_client import CollectorRegistry

import batchweave as bw
from batchweave._history import write_parquet
from batchweave._manifest import ManifestLog
from batchweave.cli._app import cli
from batchweave.cli._inspect import MAX_TABLE_ROWS

NS = "runs/ops"
MESH = bw.Mesh(dp=2, cp=1)


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def publish(store: bw.ObjectStore, steps: int, *, producer_id: str = "p0") -> None:
    """``steps`` TGBs, one per commit, with a small tail so older steps go to segments."""
    with bw.Producer(
        store, NS, producer_id=producer_id, mesh=MESH, policy="naive", tail_limit=4
    ) as producer:
        for offset in range(steps):
            producer.append([f"{offset}:{s}".encode() * 4 for s in range(2)], offset=offset)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.fixture
def store(root: Path) -> bw.ObjectStore:
    return bw.open_store(root.as_uri())


# -- watermarks of several readers -------------------------------------------------------------


def test_keep_last_of_one_reader_never_releases_another_readers_watermarks() -> None:
    store = bw.MemoryStore("readers")
    train = bw.Watermarks(store, NS, keep_last=2, scope="train-")
    evaluation = bw.Watermarks(store, NS, scope="eval-")
    evaluation.record("eval-start", 0, version=0)
    evaluation.record("eval-50", 50, version=3)
    for step in (100, 110, 120, 130):
        train.record(f"train-{step}", step, version=5)
    live = [(m.checkpoint_id, m.step) for m in bw.Watermarks(store, NS).live()]
    # The training job's keep_last kept its own two newest and never touched the evaluator's.
    assert live == [("eval-start", 0), ("eval-50", 50), ("train-120", 120), ("train-130", 130)]
    assert train.boundary() == 0


def test_a_scoped_reader_refuses_checkpoint_ids_outside_its_scope() -> None:
    store = bw.MemoryStore("scope")
    train = bw.Watermarks(store, NS, keep_last=1, scope="train-")
    with pytest.raises(ValueError, match="outside this reader's scope 'train-'"):
        train.record("eval-10", 10, version=0)
    assert list(store.list(f"{NS}/")) == []
    with pytest.raises(ValueError, match="safe key segment"):
        bw.Watermarks(store, NS, scope="a/b")
    assert "scope='train-'" in repr(train)


# -- verify: damage is a failed check (exit 1) naming the object, not "could not run" ----------


def _manifest_path(root: Path, version: int) -> Path:
    return root / NS / "_manifests" / f"{version:020d}.manifest"


def test_verify_fails_with_exit_1_on_a_truncated_newest_manifest(
    root: Path, store: bw.ObjectStore
) -> None:
    publish(store, 6)
    latest = ManifestLog(store, NS).latest().version
    os.truncate(_manifest_path(root, latest), 60)
    result = run("verify", str(root), NS)
    assert result.exit_code == 1, result.output
    assert f"{latest:020d}.manifest" in result.output
    assert "truncated" in result.output
    assert "Restore the object" in result.output
    data = json.loads(run("verify", str(root), NS, "--json").output)
    assert data["ok"] is False
    assert data["latest_version"] == latest


@pytest.mark.parametrize("damage", ["truncate", "delete"])
def test_verify_fails_with_exit_1_on_a_damaged_segment(
    root: Path, store: bw.ObjectStore, damage: str
) -> None:
    publish(store, 12)
    latest = ManifestLog(store, NS).latest()
    assert latest.segments, "the test needs a manifest with segments"
    segment = root / NS / latest.segments[0].key
    if damage == "truncate":
        os.truncate(segment, 20)
    else:
        segment.unlink()
    result = run("verify", str(root), NS)
    assert result.exit_code == 1, result.output
    assert segment.name in result.output
    assert "restore the segment" in result.output


def test_verify_says_what_to_do_about_a_missing_object(root: Path, store: bw.ObjectStore) -> None:
    publish(store, 4)
    victim = sorted((root / NS / "data" / "p0").glob("*/*.tgb"))[2]
    victim.unlink()
    result = run("verify", str(root), NS, "--footers-only")
    assert result.exit_code == 1
    assert victim.name in result.output
    assert "resume from a checkpoint past this step" in " ".join(result.output.split())


def test_a_truncated_object_message_says_what_was_read(root: Path, store: bw.ObjectStore) -> None:
    publish(store, 4)
    victim = sorted((root / NS / "data" / "p0").glob("*/*.tgb"))[1]
    size = victim.stat().st_size
    os.truncate(victim, 10)
    result = run("verify", str(root), NS, "--footers-only")
    assert result.exit_code == 1
    text = " ".join(result.output.split())
    assert f"the manifest records {size} bytes" in text
    assert "returned 0" in text
    assert "damaged or replaced" in text


# -- export --------------------------------------------------------------------------------------


def test_a_failed_parquet_export_leaves_no_partial_file(
    root: Path, store: bw.ObjectStore, tmp_path: Path
) -> None:
    publish(store, 6)
    victim = sorted((root / NS / "data" / "p0").glob("*/*.tgb"))[4]
    os.truncate(victim, 10)
    dest = tmp_path / "history.parquet"
    with pytest.raises(bw.FormatError, match="truncated"):
        write_parquet(store, NS, str(dest))
    assert list(tmp_path.glob("history.parquet*")) == []
    result = run("export", str(root), NS, str(dest))
    assert result.exit_code == 2
    assert list(tmp_path.glob("history.parquet*")) == []
    # The operator restores the object and simply runs the export again (no --overwrite).
    victim.unlink()
    assert write_parquet(store, NS, str(dest), start=0, stop=4) == 8
    assert list(tmp_path.glob("history.parquet*")) == [dest]


# -- inspect ---------------------------------------------------------------------------------


def test_inspect_shows_how_old_each_watermark_is(root: Path, store: bw.ObjectStore) -> None:
    publish(store, 4)
    bw.Watermarks(store, NS, clock=lambda: 1_000.0).record("stale-reader", 1)
    data = json.loads(run("inspect", str(root), NS, "--json").output)
    (mark,) = data["watermarks"]
    assert mark["age_seconds"] > 1e9  # recorded in 1970: that reader stopped long ago
    table = run("inspect", str(root), NS).output
    assert "age" in table
    assert " d " in table  # shown in days


def test_inspect_of_hundreds_of_producers_stays_readable(root: Path, store: bw.ObjectStore) -> None:
    count = 3 * MAX_TABLE_ROWS
    for i in range(count):
        with bw.Producer(store, NS, producer_id=f"w{i:03d}", mesh=MESH, policy="naive") as p:
            p.append([b"a", b"b"], offset=0)
    result = run("inspect", str(root), NS)
    assert result.exit_code == 0, result.output
    assert len(result.output.splitlines()) < 3 * MAX_TABLE_ROWS
    data = json.loads(run("inspect", str(root), NS, "--json").output)
    assert len(data["producers"]) == count
    assert sum(row["prefix"].startswith("data/w") for row in data["storage"]) == count
    assert f"... {count - MAX_TABLE_ROWS + 1} more" in result.output
    assert f"... {len(data['storage']) - MAX_TABLE_ROWS + 1} more prefixes" in result.output
    assert "--json lists every row" in result.output
    checked = run("verify", str(root), NS, "--footers-only")
    assert checked.exit_code == 0, checked.output
    assert len(checked.output.splitlines()) < 2 * MAX_TABLE_ROWS
    assert f"... {count - MAX_TABLE_ROWS + 1} more producers" in checked.output


# -- reclaimer -------------------------------------------------------------------------------


def test_a_pass_on_a_missing_namespace_still_sets_last_report() -> None:
    clock = FakeClock()
    store = bw.MemoryStore("empty", clock=clock)
    reclaimer = bw.Reclaimer(store, NS, grace=600.0, clock=clock)
    report = reclaimer.run_once()
    assert report.latest_version == -1
    assert reclaimer.last_report is report


# -- reclaimer metrics -------------------------------------------------------------------------


def test_reclaimer_metrics_count_each_pass_once_and_expose_failures_and_the_boundary() -> None:
    clock = FakeClock()
    store = bw.MemoryStore("metrics", clock=clock)
    publish(store, 6)
    registry = CollectorRegistry()
    reclaimer = bw.Reclaimer(store, NS, grace=600.0, clock=clock)
    bw.track_metrics(reclaimer, registry=registry)
    bw.track_metrics(reclaimer, registry=registry)  # e.g. by a library and by the application
    labels = {"namespace": NS}
    assert registry.get_sample_value("batchweave_reclaim_errors_total", labels) == 0.0

    marks = bw.Watermarks(store, NS)
    marks.record("ckpt-4", 4)
    reclaimer.run_once()
    assert registry.get_sample_value("batchweave_reclaim_passes_total", labels) == 1.0
    assert registry.get_sample_value("batchweave_reclaim_boundary", labels) == 4.0
    assert registry.get_sample_value("batchweave_reclaim_base_step", labels) == 4.0
    success = registry.get_sample_value("batchweave_reclaim_last_success_timestamp_seconds", labels)
    assert success is not None
    assert success > 0

    store.put(marks.key("broken"), b"not a watermark")  # every pass now fails, by design
    with pytest.raises(bw.FormatError, match="broken"):
        reclaimer.run_once()
    assert registry.get_sample_value("batchweave_reclaim_errors_total", labels) == 1.0
    assert registry.get_sample_value("batchweave_reclaim_passes_total", labels) == 1.0


class _LockedPrefixStore(bw.StoreWrapper):
    """Refuses to delete anything under ``locked`` (a permission or object-lock rule)."""

    def __init__(self, inner: bw.ObjectStore, locked: str) -> None:
        super().__init__(inner)
        self.locked = locked

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            if key.startswith(self.locked):
                raise bw.AccessDenied(f"permission denied to delete {key!r}")
            self.inner.delete_many([key])


def test_one_undeletable_prefix_does_not_stop_the_rest_of_the_pass() -> None:
    clock = FakeClock()
    inner = bw.MemoryStore("locked", clock=clock)
    publish(inner, 4, producer_id="p0")
    publish(inner, 4, producer_id="p1")  # steps 4..7
    bw.Watermarks(inner, NS).record("ckpt-6", 6)
    store = _LockedPrefixStore(inner, f"{NS}/data/p0/")
    reclaimer = bw.Reclaimer(store, NS, grace=600.0, clock=clock)
    with pytest.raises(bw.AccessDenied, match=r"refused to delete 4 objects .*data/p0/") as info:
        reclaimer.run_once()
    assert "the next pass retries them" in str(info.value)
    report = reclaimer.last_report
    assert report is not None
    assert report.base_step_after == 6
    assert report.tgbs_deleted == 2  # p1's steps 4 and 5 went despite p0's refusals
    assert len(list(inner.list(f"{NS}/data/p1/"))) == 2
    # Once the permission is fixed, the next pass deletes what was refused.
    fixed = bw.Reclaimer(inner, NS, grace=600.0, clock=clock)
    clock.advance(601.0)
    fixed.run_once()
    assert list(inner.list(f"{NS}/data/p0/")) == []


def test_inspect_flags_timestamps_from_a_clock_that_runs_ahead(
    root: Path, store: bw.ObjectStore
) -> None:
    ahead = time.time() + 7200.0
    with bw.Producer(
        store, NS, producer_id="fast-clock", mesh=MESH, wall_clock=lambda: ahead
    ) as producer:
        producer.append([b"a", b"b"], offset=0)
    bw.Watermarks(store, NS, clock=lambda: ahead).record("ahead", 0)
    data = json.loads(run("inspect", str(root), NS, "--json").output)
    assert data["producers"][0]["idle_seconds"] < -7000
    assert data["watermarks"][0]["age_seconds"] < -7000
    assert run("inspect", str(root), NS).output.count("clock skew?") == 2


def test_inspect_still_shows_the_namespace_when_a_watermark_is_unreadable(
    root: Path, store: bw.ObjectStore
) -> None:
    publish(store, 4)
    marks = bw.Watermarks(store, NS)
    marks.record("good", 2)
    store.put(marks.key("broken"), b"garbage")
    data = json.loads(run("inspect", str(root), NS, "--json").output)
    assert data["next_step"] == 4
    assert data["boundary"] is None
    assert "broken.json" in data["watermark_error"]
    result = run("inspect", str(root), NS)
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert "reclamation is blocked" in text
    assert "delete 'runs/ops/_watermarks/broken.json' by hand" in text

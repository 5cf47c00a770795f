"""What an operator meets running ``verify``, ``export``, ``inspect`` and reclaim passes.

``verify`` treats a damaged (truncated or corrupt) manifest or segment as a failed check, exit
status 1 naming the object and what to do, not as "could not run"; a failed Parquet export
leaves no partial file; ``inspect`` shows how old each watermark is, stays readable with
hundreds of producers, flags timestamps from a clock that runs ahead and still shows the
namespace when a watermark is unreadable. A reclaim pass counts in the metrics once per pass
(exposing failures and the boundary) and one undeletable prefix does not stop the rest of it.
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
            producer.flush()  # one per commit however the uploads overlap (a loaded machine)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    path = tmp_path / "store"
    path.mkdir()
    return path


@pytest.fixture
def store(root: Path) -> bw.ObjectStore:
    return bw.open_store(root.as_uri())


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


def test_verify_says_what_to_do_about_a_damaged_old_manifest_version(
    root: Path, store: bw.ObjectStore
) -> None:
    # It said only "not a BatchWeave manifest ...; the prefix may hold other data".
    publish(store, 6)
    _manifest_path(root, 2).write_bytes(b"garbage")
    result = run("verify", str(root), NS)
    assert result.exit_code == 1, result.output
    assert f"{2:020d}.manifest" in result.output
    assert "an old version" in result.output
    assert "restore it from a backup" in result.output


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


# -- export ------------------------------------------------------------------------------------


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


# -- inspect -----------------------------------------------------------------------------------


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


# -- reclaimer ---------------------------------------------------------------------------------


# -- reclaim passes: metrics and partial permissions -------------------------------------------


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

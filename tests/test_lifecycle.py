"""The checkpoint hook and the reclaimer: what is deleted, when, and what never is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from _reclaimer_worker import FakeClock, Writer, expected_slice

import batchweave as bw
from batchweave._manifest import Committed, Conflict, ManifestLog, manifest_key
from batchweave._store._base import PutMode

NS = "runs/life"
GRACE = 100.0
MESH = bw.Mesh(dp=2, cp=1)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> bw.MemoryStore:
    return bw.MemoryStore("lifecycle", clock=clock)


def keys(store: bw.ObjectStore, under: str) -> set[str]:
    return {m.key for m in store.list(f"{NS}/{under}/")}


def reclaimer(store: bw.ObjectStore, clock: FakeClock) -> bw.Reclaimer:
    return bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)


def read_step(store: bw.ObjectStore, step: int, dp_rank: int = 0) -> bytes:
    with bw.Consumer(
        store, NS, mesh=MESH, dp_rank=dp_rank, start_step=step, prefetch=1, timeout=0
    ) as consumer:
        got, data = next(consumer)
    assert got == step
    assert isinstance(data, bytes)
    return data


# -- checkpoint hook -------------------------------------------------------------------------


def test_hook_records_the_step_the_saved_state_resumes_at(store: bw.MemoryStore) -> None:
    Writer(store, NS, MESH).publish(6)
    marks = bw.Watermarks(store, NS)
    consumer = bw.Consumer(store, NS, mesh=MESH, dp_rank=0, timeout=0)
    for _ in range(3):
        next(consumer)
    mark = bw.checkpoint_hook(consumer, marks, "ckpt-3", rank=0)
    assert mark is not None
    assert (mark.step, mark.version) == (3, 1)
    assert marks.boundary() == 3

    saved = consumer.state_dict()
    next(consumer)  # the loop moved on while an asynchronous checkpoint was being written
    mark = bw.checkpoint_hook(consumer, marks, "ckpt-async", state=saved, rank=0)
    assert mark is not None
    assert mark.step == 3
    consumer.close()


def test_hook_translates_logical_steps_of_a_resharded_consumer(store: bw.MemoryStore) -> None:
    Writer(store, NS, MESH).publish(8)  # stored dp=2
    consumer = bw.Consumer(store, NS, mesh=bw.Mesh(dp=4, cp=1), dp_rank=0, timeout=0)
    next(consumer)
    next(consumer)  # logical steps 0, 1 of dp=4 read TGB steps 0..3
    assert consumer.resume_tgb_step() == 4
    consumer.close()


def test_only_rank_zero_writes(store: bw.MemoryStore) -> None:
    Writer(store, NS, MESH).publish(1)
    marks = bw.Watermarks(store, NS)
    consumer = bw.Consumer(store, NS, mesh=MESH, dp_rank=1, timeout=0)
    assert bw.checkpoint_hook(consumer, marks, "c", environ={"RANK": "3"}) is None
    assert bw.checkpoint_hook(consumer, marks, "c", rank=1) is None
    assert marks.live() == []
    assert bw.checkpoint_hook(consumer, marks, "c", environ={"RANK": "0"}) is not None
    with pytest.raises(ValueError, match="RANK"):
        bw.checkpoint_hook(consumer, marks, "c", environ={"RANK": "zero"})
    consumer.close()


# -- reclaiming ------------------------------------------------------------------------------


def test_without_watermarks_nothing_committed_is_reclaimed(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    Writer(store, NS, MESH).publish(5)
    before = {m.key for m in store.list(f"{NS}/")}
    clock.advance(10 * GRACE)
    report = reclaimer(store, clock).run_once()
    assert report.boundary == 0
    assert report.objects_deleted == 0
    assert {m.key for m in store.list(f"{NS}/")} == before


def test_reclaims_below_the_boundary_and_keeps_the_rest(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    writer = Writer(store, NS, MESH)
    for _ in range(10):
        writer.publish(2)
        clock.advance(1)
    marks = bw.Watermarks(store, NS)
    marks.record("ckpt-a", 8, version=4)
    marks.record("ckpt-b", 14, version=8)
    report = reclaimer(store, clock).run_once()
    assert (report.boundary, report.base_step_before, report.base_step_after) == (8, 0, 8)
    assert report.tgbs_deleted == 8
    assert report.tgb_bytes_deleted > 0
    assert report.manifests_deleted == 0  # nothing was superseded more than `grace` ago
    assert len(keys(store, "data")) == 12
    latest = ManifestLog(store, NS).latest()
    assert latest.base_step == 8
    for step in (8, 19):
        assert read_step(store, step, 1) == expected_slice("w0", step, 1)
    with pytest.raises(bw.StepReclaimed):
        read_step(store, 7)

    clock.advance(GRACE + 1)
    report = reclaimer(store, clock).run_once()
    assert report.tgbs_deleted == 0
    # Versions 0..3 lie below the oldest watermark's version (4) and were superseded long ago.
    assert report.manifests_deleted == 4
    assert min(ManifestLog(store, NS).versions()) == 4

    marks.release("ckpt-a")
    clock.advance(GRACE + 1)
    report = reclaimer(store, clock).run_once()
    assert report.base_step_after == 14
    assert report.tgbs_deleted == 6
    assert min(ManifestLog(store, NS).versions()) == 8
    again = reclaimer(store, clock).run_once()
    assert again.objects_deleted == 0


def test_latest_manifest_is_never_deleted(store: bw.MemoryStore, clock: FakeClock) -> None:
    Writer(store, NS, MESH).publish(3)
    bw.Watermarks(store, NS).record("c", 3, version=10**6)
    for _ in range(3):
        clock.advance(10 * GRACE)
        reclaimer(store, clock).run_once()
    latest = ManifestLog(store, NS).latest()
    assert list(ManifestLog(store, NS).versions()) == [latest.version]
    assert latest.base_step == 3
    assert keys(store, "data") == set()


def test_unreferenced_segments_go_after_twice_the_grace(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    writer = Writer(store, NS, MESH)
    writer.log = ManifestLog(store, NS, tail_limit=4)
    for _ in range(12):
        writer.publish(2)
        clock.advance(1)
    assert len(keys(store, "_segments")) >= 3
    bw.Watermarks(store, NS).record("c", 20)
    latest = ManifestLog(store, NS).latest()
    clock.advance(GRACE + 1)
    first = reclaimer(store, clock).run_once()
    assert first.segments_deleted == 0  # not older than 2 * grace yet
    clock.advance(GRACE)
    second = reclaimer(store, clock).run_once()
    assert second.segments_deleted > 0
    now_latest = ManifestLog(store, NS).latest()
    assert {ref.key for ref in now_latest.segments} <= {
        k.removeprefix(f"{NS}/") for k in keys(store, "_segments")
    }
    for step in range(20, latest.next_step):
        assert read_step(store, step) == expected_slice("w0", step, 0)


def test_a_lost_race_is_retried_on_the_winner(store: bw.MemoryStore, clock: FakeClock) -> None:
    writer = Writer(store, NS, MESH)
    writer.publish(6)
    bw.Watermarks(store, NS).record("c", 4)

    class Racing(bw.MemoryStore):
        raced = False

        def put(
            self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE
        ) -> None:
            if mode is PutMode.CREATE and key.endswith(".manifest") and not self.raced:
                self.raced = True
                writer.publish(1)  # another producer wins this version first
            store.put(key, data, mode=mode)

    racing = Racing()
    for name in ("get", "get_range", "head", "list", "delete_many"):
        setattr(racing, name, getattr(store, name))
    report = bw.Reclaimer(racing, NS, grace=GRACE, clock=clock, sleep=lambda _: None).run_once()
    assert report.commit_conflicts == 1
    latest = ManifestLog(store, NS).latest()
    assert (latest.base_step, latest.next_step) == (4, 7)
    assert read_step(store, 6) == expected_slice("w0", 6, 0)


def test_background_thread_runs_passes_until_stopped(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    Writer(store, NS, MESH).publish(4)
    bw.Watermarks(store, NS).record("c", 2)
    rec = reclaimer(store, clock)
    rec.start(0.01)
    deadline = time.monotonic() + 10
    while rec.last_report is None and time.monotonic() < deadline:
        time.sleep(0.01)
    rec.stop()
    assert rec.last_report is not None
    assert ManifestLog(store, NS).latest().base_step == 2
    with pytest.raises(ValueError, match="interval"):
        rec.start(0)


# -- stale writers ---------------------------------------------------------------------------


def test_a_stale_writer_paused_across_a_reclaim_cannot_fork_history(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    writer = Writer(store, NS, MESH)
    writer.publish(2)
    stale_log = ManifestLog(store, NS)
    stale_base = stale_log.latest()  # read, then the process is paused (GC, preemption, ...)
    stale_desc = Writer(store, NS, MESH, producer_id="stale").upload(0)
    for _ in range(6):
        writer.publish(1)
        clock.advance(GRACE)
    bw.Watermarks(store, NS).record("c", 8)
    report = reclaimer(store, clock).run_once()
    assert report.manifests_deleted > 0
    assert stale_base.version not in set(ManifestLog(store, NS).versions())
    history = {m.key: store.get(m.key) for m in store.list(f"{NS}/_manifests/")}

    result = stale_log.commit(stale_base, append=[stale_desc])
    assert isinstance(result, Conflict)
    # No deleted version name was re-created: history is unchanged.
    assert {m.key: store.get(m.key) for m in store.list(f"{NS}/_manifests/")} == history
    # Refreshing from the stale base finds the true newest version, not the stale one (a probe
    # of stale_base.version + 1 would miss: that version was reclaimed too).
    fresh = stale_log.latest(result.winner or stale_base)
    assert fresh.version == ManifestLog(store, NS).latest().version
    retry = stale_log.commit(fresh, append=[stale_desc])
    assert isinstance(retry, Committed)
    assert retry.manifest.version == fresh.version + 1
    assert retry.manifest.next_step == 9


def test_a_stale_producer_paused_across_a_reclaim_rebases(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    sleeps: list[float] = []
    producer = bw.Producer(
        store,
        NS,
        producer_id="stale",
        mesh=MESH,
        policy="naive",
        clock=clock,
        wall_clock=clock,
        sleep=sleeps.append,
    )
    try:
        producer.append([b"a", b"b"], offset=0)
        producer.flush()
        writer = Writer(store, NS, MESH)
        for _ in range(6):  # the stale producer is idle while history moves on
            writer.publish(1)
            clock.advance(GRACE)
        bw.Watermarks(store, NS).record("c", 7)
        assert reclaimer(store, clock).run_once().manifests_deleted > 0
        before = set(ManifestLog(store, NS).versions())
        producer.append([b"c", b"d"], offset=1)
        producer.flush()
    finally:
        producer.close()
    after = set(ManifestLog(store, NS).versions())
    assert min(after) == min(before)  # nothing below the survivors was re-created
    latest = ManifestLog(store, NS).latest()
    assert latest.next_step == 8
    assert latest.producers["stale"].offset == 1
    assert read_step(store, 7) == b"c"


def test_a_consumer_holding_a_reclaimed_manifest_still_finds_new_steps(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    writer = Writer(store, NS, MESH)
    writer.log = ManifestLog(store, NS, clock=clock)  # versions stamped with the fake clock
    writer.publish(4)
    with bw.Consumer(store, NS, mesh=MESH, dp_rank=0, prefetch=1, timeout=5) as consumer:
        assert [next(consumer)[0] for _ in range(2)] == [0, 1]
        held = consumer.manifest_version
        for _ in range(6):  # a long evaluation: the consumer does not refresh meanwhile
            writer.publish(1)
            clock.advance(GRACE)
        bw.Watermarks(store, NS).record("c", 2)
        reclaimer(store, clock).run_once()
        assert held is not None
        assert {held, held + 1}.isdisjoint(ManifestLog(store, NS).versions())
        steps = [next(consumer) for _ in range(6)]
    assert [s for s, _ in steps] == list(range(2, 8))
    assert [d for _, d in steps] == [expected_slice("w0", s, 0) for s in range(2, 8)]


# -- orphans of crashed producers ----------------------------------------------------------

_CRASHING_PRODUCER = textwrap.dedent(
    """
    import os, signal, sys, time
    import batchweave as bw
    store = bw.FileStore(sys.argv[1])
    p = bw.Producer(store, sys.argv[2], producer_id="doomed", mesh=bw.Mesh(dp=2, cp=1),
                    policy="fixed100")
    for offset in range(5):
        p.append([b"x" * 100, b"y" * 100], offset=offset)
    deadline = time.monotonic() + 30
    while p.stats().inflight_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)
    """
)


def test_orphans_of_a_killed_producer_go_after_the_grace_period_and_never_before(
    tmp_path: Path,
) -> None:
    store = bw.FileStore(str(tmp_path))
    Writer(store, NS, MESH).publish(3)
    proc = subprocess.run(
        [sys.executable, "-c", _CRASHING_PRODUCER, str(tmp_path), NS],
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    orphans = {k for k in keys(store, "data") if "/doomed/" in k}
    assert len(orphans) == 5
    committed = keys(store, "data") - orphans
    newest = max(store.head(k).last_modified for k in orphans)

    for now in (newest, newest + GRACE - 1):
        report = bw.Reclaimer(store, NS, grace=GRACE, clock=lambda now=now: now).run_once()
        assert report.orphans_deleted == 0
        assert keys(store, "data") == committed | orphans

    report = bw.Reclaimer(store, NS, grace=GRACE, clock=lambda: newest + GRACE + 1).run_once()
    assert report.orphans_deleted == 5
    assert report.orphan_bytes_deleted > 0
    assert report.tgbs_deleted == 0
    assert keys(store, "data") == committed
    for step in range(3):
        assert read_step(store, step) == expected_slice("w0", step, 0)


# -- max_lag uses the real boundary ----------------------------------------------------------


def test_max_lag_blocks_until_a_checkpoint_advances_the_watermarks(
    store: bw.MemoryStore,
) -> None:
    producer = bw.Producer(store, NS, producer_id="p", mesh=MESH, policy="naive", max_lag=3)
    marks = bw.Watermarks(store, NS)
    try:
        for offset in range(3):
            producer.append([b"a", b"b"], offset=offset)
        producer.flush()
        done = threading.Event()

        def blocked_appends() -> None:
            producer.append([b"c", b"d"], offset=3)  # visible 3: still within max_lag
            producer.flush()
            producer.append([b"e", b"f"], offset=4)  # visible 4 > 0 + 3: blocks
            done.set()

        thread = threading.Thread(target=blocked_appends)
        thread.start()
        deadline = time.monotonic() + 20
        while not producer.stats().lag_blocked and time.monotonic() < deadline:
            time.sleep(0.005)
        assert producer.stats().lag_blocked
        assert not done.is_set()
        marks.record("ckpt-2", 2)
        thread.join(20)
        assert done.is_set()
        producer.flush()
    finally:
        producer.close()
    assert ManifestLog(store, NS).latest().next_step == 5


def test_manifest_key_layout_matches_the_reclaimer() -> None:
    # The reclaimer parses version numbers from keys; keep it in step with the log's layout.
    assert manifest_key(42) == "_manifests/00000000000000000042.manifest"
    assert os.path.basename(manifest_key(7)).startswith("0" * 19 + "7")

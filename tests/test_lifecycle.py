"""The checkpoint hook and the reclaimer: what is deleted, when, and what never is.

A watermark released while the reclaimer lists the watermarks never lets the boundary jump
over the checkpoint recorded just before that release. The background thread refuses intervals
it cannot wait, survives failing passes, and a restart after a timed-out ``stop()`` runs one
loop; the hook refuses watermarks of another namespace.

Also how a pass reports itself: a pass is mostly LISTs and 1,000-key batch deletes and can run
for minutes, so ``Reclaimer(progress=...)`` gets a :class:`batchweave.ReclaimProgress` at each
phase and after every delete batch, a pass ends with one summary log line (INFO, or DEBUG when
it had nothing to do), and ``batchweave reclaim`` prints progress lines when asked or a live line
on a terminal, keeping ``--json`` output clean.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from _reclaimer_worker import (
    ONE_SLICE,
    FakeClock,
    RefuseOne,
    Writer,
    expected_slice,
    publish_one_slice,
)
from cli_helpers import run_on_terminal
from click.testing import CliRunner
from fake_time import FakeTime
from manifest_helpers import descriptor
from prometheus_client import CollectorRegistry

import batchweave as bw
from batchweave import (
    MemoryStore,
    Mesh,
    ObjectStore,
    Reclaimer,
    StoreWrapper,
    Watermarks,
)
from batchweave._lifecycle import METADATA_MIN_GRACE
from batchweave._manifest import Committed, Conflict, ManifestLog, manifest_key
from batchweave._store._base import ObjectMeta, PutMode
from batchweave.cli._app import cli
from batchweave.cli._reclaim import ProgressLines, describe_progress

NS = "runs/life"
GRACE = 150.0
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


@pytest.mark.parametrize("rank", ["0", "1", 0.0, True, None])
def test_a_rank_that_is_no_integer_is_refused_not_taken_for_another_rank(
    store: bw.MemoryStore, rank: object
) -> None:
    # rank=os.environ["RANK"] on rank 0 is "0", which is not 0: the hook returned None and
    # recorded nothing, and the reclaimer never saw the checkpoint.
    Writer(store, NS, MESH).publish(1)
    marks = bw.Watermarks(store, NS)
    consumer = bw.Consumer(store, NS, mesh=MESH, dp_rank=0, timeout=0)
    if rank is None:  # unset: RANK from the environment, parsed
        assert bw.checkpoint_hook(consumer, marks, "c", environ={"RANK": "0"}) is not None
    else:
        with pytest.raises(TypeError, match="rank must be an integer"):
            bw.checkpoint_hook(consumer, marks, "c", rank=rank)  # type: ignore[arg-type]
        assert marks.live() == []
    assert bw.checkpoint_hook(consumer, marks, "c", rank=np.int64(0)) is not None
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
    marks = bw.Watermarks(store, NS)
    for _ in range(3):
        # At the latest version (the cut's, once committed): the highest a watermark can name
        # (one above it comes from a lost history and stops the pass).
        marks.record("c", 3)
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


def test_a_deleted_segment_stops_the_pass_naming_it(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    """Before: a bare ``ObjectNotFound`` with no word of what the object is or what to do."""
    with bw.Producer(store, NS, producer_id="p0", mesh=MESH, policy="naive", tail_limit=2) as p:
        for offset in range(8):
            p.append([b"a", b"b"], offset=offset)
    log = ManifestLog(store, NS)
    ref = log.latest().segments[0]
    store.delete_many([log.key(ref.key)])
    before = {m.key for m in store.list(f"{NS}/")}
    clock.advance(10 * GRACE)
    with pytest.raises(bw.ObjectNotFound) as info:
        reclaimer(store, clock).run_once()
    message = str(info.value)
    assert repr(log.key(ref.key)) in message
    assert f"TGB steps {ref.first_step}..{ref.end_step - 1}" in message
    assert "batchweave verify" in message
    assert {m.key for m in store.list(f"{NS}/")} == before  # nothing deleted blindly


# -- stale writers ---------------------------------------------------------------------------


def test_a_stale_writer_paused_across_a_reclaim_cannot_fork_history(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    writer = Writer(store, NS, MESH)
    writer.publish(2)
    # The paused process's clock moves on with everyone else's.
    stale_log = ManifestLog(store, NS, clock=clock, monotonic=clock)
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


def test_a_short_grace_reclaims_data_on_time_and_keeps_metadata_for_the_minimum(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    # A reader holding a young version trusts a missing successor (PROBE_TRUST_SECONDS). Before,
    # a 5 s grace deleted that version and its successor 5 s after they were superseded, and the
    # reader saw no new version until its own was a minute old.
    writer = Writer(store, NS, MESH)
    writer.log = ManifestLog(store, NS, clock=clock, tail_limit=4)  # segments roll early
    writer.publish(4)
    reader = ManifestLog(store, NS, clock=clock)
    held = reader.latest()
    for _ in range(12):
        writer.publish(1)
        clock.advance(2)
    newest = ManifestLog(store, NS).latest()
    bw.Watermarks(store, NS).record("c", 10, version=newest.version)
    short = bw.Reclaimer(store, NS, grace=5.0, clock=clock, sleep=lambda _: None)
    assert short.metadata_grace == METADATA_MIN_GRACE

    report = short.run_once()
    assert report.tgbs_deleted == 10  # data follows the short grace
    assert (report.manifests_deleted, report.segments_deleted) == (0, 0)
    cut = reader.latest(held)
    assert cut.version == newest.version + 1  # committed by the pass
    unreferenced = keys(store, "_segments") - {f"{NS}/{ref.key}" for ref in cut.segments}
    assert unreferenced  # segments of the steps below the cut, kept for now

    clock.advance(2 * METADATA_MIN_GRACE + 1)
    report = short.run_once()
    assert report.manifests_deleted > 0
    assert report.segments_deleted == len(unreferenced)
    assert read_step(store, 10) == expected_slice("w0", 10, 0)


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


# -- reclaim progress and the pass summary -----------------------------------------------------


def reclaimable(store: bw.ObjectStore, clock: FakeClock, steps: int, boundary: int) -> Writer:
    """``steps`` committed TGBs, a watermark at ``boundary``, two orphans past the grace."""
    writer = Writer(store, NS, MESH)
    writer.publish(steps)
    writer.orphan()
    writer.orphan()
    bw.Watermarks(store, NS).record("ckpt", step=boundary)
    clock.advance(2 * GRACE + 1)
    return writer


def test_a_pass_reports_each_phase_and_every_delete_batch(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    reclaimable(store, clock, steps=10, boundary=9)
    seen: list[bw.ReclaimProgress] = []
    reclaimer = bw.Reclaimer(
        store,
        NS,
        grace=GRACE,
        clock=clock,
        sleep=lambda _: None,
        delete_batch=4,
        progress=seen.append,
    )
    report = reclaimer.run_once()
    assert report.tgbs_deleted == 9
    assert report.orphans_deleted == 2

    phases = list(dict.fromkeys(p.phase for p in seen))
    for earlier, later in [
        ("reading watermarks", "committing base_step"),
        ("committing base_step", "listing _manifests/"),
        ("listing _manifests/", "listing data/"),
        ("listing data/", "deleting TGBs"),
        ("deleting TGBs", "deleting orphans"),
        ("deleting orphans", "listing _segments/"),
    ]:
        assert phases.index(earlier) < phases.index(later), phases
    assert phases[-1] == "done"
    # one report as the phase begins, then one per delete request of at most 4 keys
    tgbs = [(p.phase_done, p.phase_total) for p in seen if p.phase == "deleting TGBs"]
    assert tgbs == [(0, 9), (4, 9), (8, 9), (9, 9)]
    assert all(p.phase_total is None for p in seen if p.phase.startswith("listing"))
    # running totals only grow, and the last report is the report's totals
    for before, after in itertools.pairwise(seen):
        assert after.keys_listed >= before.keys_listed
        assert after.objects_deleted >= before.objects_deleted
        assert after.bytes_deleted >= before.bytes_deleted
    last = seen[-1]
    assert last.objects_deleted == report.objects_deleted
    assert last.bytes_deleted == report.bytes_deleted > 0
    assert last.keys_listed == report.keys_listed
    # data/ held 10 TGBs and 2 orphans; _manifests/ at least the versions written
    assert report.keys_listed >= 12 + report.latest_version + 1


def test_a_long_listing_reports_every_thousand_keys(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    Writer(store, NS, MESH).publish(1)
    for i in range(2500):  # not BatchWeave's names: listed, never deleted
        store.put(f"{NS}/data/other-tool/{i:05d}.bin", b"x")
    listed: list[int] = []

    def progress(p: bw.ReclaimProgress) -> None:
        if p.phase == "listing data/":
            listed.append(p.keys_listed)

    bw.Reclaimer(
        store, NS, grace=GRACE, clock=clock, sleep=lambda _: None, progress=progress
    ).run_once()
    before = listed[0]  # keys of _manifests/ listed earlier in the pass
    assert [n for n in listed[1:] if n % 1000 == 0] == [
        n for n in range(1000, before + 2501, 1000) if n > before
    ]
    assert listed[-1] == before + 2501
    assert len(list(store.list(f"{NS}/data/other-tool/"))) == 2500


def test_a_progress_callback_that_raises_stops_the_pass_and_the_next_finishes(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    reclaimable(store, clock, steps=6, boundary=6)

    def interrupt(p: bw.ReclaimProgress) -> None:
        if p.phase == "deleting TGBs" and p.phase_done >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bw.Reclaimer(
            store,
            NS,
            grace=GRACE,
            clock=clock,
            sleep=lambda _: None,
            delete_batch=2,
            progress=interrupt,
        ).run_once()
    assert len(list(store.list(f"{NS}/data/"))) == 6 + 2 - 2
    report = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None).run_once()
    assert list(store.list(f"{NS}/data/")) == []
    assert report.base_step_after == 6


def reclaimer_refusing_one_tgb(
    store: bw.MemoryStore, clock: FakeClock, progress: Callable[[bw.ReclaimProgress], None]
) -> bw.Reclaimer:
    """Five reclaimable steps, in a store that refuses to delete the first TGB object."""
    reclaimable(store, clock, steps=5, boundary=5)
    locked = sorted(m.key for m in store.list(f"{NS}/data/w0/"))[0]
    return bw.Reclaimer(
        RefuseOne(store, locked),
        NS,
        grace=GRACE,
        clock=clock,
        sleep=lambda _: None,
        progress=progress,
    )


def test_a_refused_key_counts_as_handled_but_not_deleted(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    seen: list[bw.ReclaimProgress] = []
    reclaimer = reclaimer_refusing_one_tgb(store, clock, seen.append)
    with pytest.raises(bw.AccessDenied, match="refused to delete 1 objects"):
        reclaimer.run_once()
    tgbs = [p for p in seen if p.phase == "deleting TGBs"]
    assert (tgbs[-1].phase_done, tgbs[-1].phase_total) == (5, 5)
    assert seen[-1].phase == "done"  # reported before the pass raises
    assert reclaimer.last_report is not None
    assert reclaimer.last_report.tgbs_deleted == 4
    assert seen[-1].objects_deleted == reclaimer.last_report.objects_deleted


def test_a_callback_failing_at_the_end_does_not_hide_the_refused_keys(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    def display(progress: bw.ReclaimProgress) -> None:
        if progress.phase == "done":
            raise RuntimeError("the terminal went away")

    reclaimer = reclaimer_refusing_one_tgb(store, clock, display)
    with pytest.raises(bw.AccessDenied, match="refused to delete 1 objects"):
        reclaimer.run_once()


def test_a_pass_ends_with_an_info_summary_and_a_no_op_pass_only_at_debug(
    store: bw.MemoryStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    reclaimable(store, clock, steps=4, boundary=3)
    caplog.set_level(logging.DEBUG, logger="batchweave.lifecycle")
    reclaimer = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)
    report = reclaimer.run_once()
    done = [r for r in caplog.records if "reclaim pass done" in r.getMessage()]
    assert [r.levelno for r in done] == [logging.INFO]
    message = done[0].getMessage()
    assert f"{store.url}/{NS}" in message
    assert "base_step 0 -> 3" in message
    assert f"listed {report.keys_listed} keys" in message
    assert f"{report.bytes_deleted} bytes" in message

    caplog.clear()
    reclaimer.run_once()  # nothing left to do: routine for a background thread
    done = [r for r in caplog.records if "reclaim pass done" in r.getMessage()]
    assert [r.levelno for r in done] == [logging.DEBUG]


# -- the reclaim command's progress ------------------------------------------------------------


def file_store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    store = bw.open_store(root.as_uri())
    writer = Writer(store, NS, MESH)
    writer.publish(6)
    bw.Watermarks(store, NS).record("ckpt", step=4)
    return root


def test_the_command_prints_progress_lines_when_asked_and_keeps_json_clean(
    tmp_path: Path,
) -> None:
    root = file_store(tmp_path)
    result = CliRunner().invoke(
        cli, ["reclaim", str(root), NS, "--grace", "0", "--json", "--progress"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tgbs_deleted"] == 4
    lines = result.stderr.splitlines()
    assert any(line.startswith("reclaiming: listing data/:") for line in lines), lines
    assert any(line.startswith("reclaiming: deleting TGBs:") for line in lines), lines
    assert lines[-1].startswith("reclaiming: done: ")
    assert f"{report['objects_deleted']} objects deleted" in lines[-1]
    assert f"{report['keys_listed']} keys listed" in lines[-1]


def test_the_command_is_silent_off_a_terminal_by_default_and_says_how_long_it_took(
    tmp_path: Path,
) -> None:
    root = file_store(tmp_path)
    quiet = CliRunner().invoke(cli, ["reclaim", str(root), NS, "--grace", "0"])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == ""
    assert "took" in quiet.stdout


def test_the_command_shows_a_live_line_on_a_terminal(tmp_path: Path) -> None:
    root = file_store(tmp_path)
    status, stdout, terminal = run_on_terminal("reclaim", str(root), NS, "--grace", "0")
    assert status == 0, (stdout, terminal)
    assert "reclaiming" in terminal
    assert "reclaiming" not in stdout
    assert "TGB objects" in stdout


def test_progress_lines_come_at_each_phase_and_at_most_every_interval() -> None:
    fake = FakeTime()
    printed: list[str] = []
    lines = ProgressLines(printed.append, clock=fake.clock, interval=10.0)

    def at(phase: str, deleted: int) -> None:
        lines(bw.ReclaimProgress(phase, keys_listed=5, objects_deleted=deleted, bytes_deleted=0))

    at("listing data/", 0)
    fake.advance(3)
    at("listing data/", 0)  # same phase, 3 s later: dropped
    at("deleting TGBs", 0)  # a new phase: printed
    fake.advance(9.9)
    at("deleting TGBs", 1000)
    fake.advance(0.1)
    at("deleting TGBs", 2000)  # 10 s since the last line
    at("done", 2000)
    assert [line.split(":")[1].strip() for line in printed] == [
        "listing data/",
        "deleting TGBs",
        "deleting TGBs",
        "done",
    ]
    assert "2,000 objects deleted" in printed[2]


def test_describe_progress_names_the_share_of_a_deleting_phase() -> None:
    text = describe_progress(
        bw.ReclaimProgress(
            "deleting TGBs",
            keys_listed=12_345,
            objects_deleted=3000,
            bytes_deleted=3 << 30,
            phase_done=2000,
            phase_total=9000,
        )
    )
    assert text == (
        "deleting TGBs: 12,345 keys listed, 3,000 objects deleted (3.0 GiB), "
        "2,000 of 9,000 in this phase"
    )


# -- watermarks released while the reclaimer lists them ----------------------------------------


class _CheckpointDuringList(StoreWrapper):
    """Runs ``between`` once, right before the first GET of ``key`` (after the LIST saw it)."""

    def __init__(self, inner: ObjectStore, key: str, between: Callable[[], None]) -> None:
        super().__init__(inner)
        self._key = key
        self._between: Callable[[], None] | None = between

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        # One page, fetched whole, as S3 answers a LIST (the memory store's is a live view).
        return iter(list(super().list(prefix, start_after=start_after)))

    def get(self, key: str) -> bytes:
        if key == self._key and self._between is not None:
            between, self._between = self._between, None
            between()
        return super().get(key)


def test_a_watermark_released_during_the_listing_never_lets_the_boundary_jump() -> None:
    # Two readers share a namespace (training scope "train-", evaluation scope "eval-"). The
    # reclaimer LISTs the watermarks; before it GETs train-100, training records train-200
    # (keep_last=1 releases train-100 right after). Skipping the vanished train-100 made the
    # boundary eval-500's step: the reclaimer then cut steps 200..499, which train-200 needs.
    wall = FakeClock(1.7e9)
    inner = MemoryStore(clock=wall)
    log = ManifestLog(inner, NS, clock=wall)
    head = log.create_or_open(Mesh(dp=8, cp=1))
    result = log.commit(head, append=[descriptor("p", i) for i in range(600)])
    assert isinstance(result, Committed)
    train = Watermarks(inner, NS, keep_last=1, scope="train-", clock=wall)
    train.record("train-100", 100)
    Watermarks(inner, NS, scope="eval-", clock=wall).record("eval-500", 500)

    store = _CheckpointDuringList(
        inner, train.key("train-100"), lambda: train.record("train-200", 200)
    )
    report = Reclaimer(store, NS, grace=600.0, clock=wall).run_once()
    assert report.boundary == 200
    assert report.base_step_after == 200
    assert [m.checkpoint_id for m in Watermarks(inner, NS).live()] == ["train-200", "eval-500"]


class _ListDuring(StoreWrapper):
    """The first LIST of the watermarks runs ``during`` and answers as ``FileStore.list`` does:
    the keys there when it began, less those gone when it came to them. It skips the key
    deleted while it ran and misses the one created while it ran."""

    def __init__(self, inner: ObjectStore, during: Callable[[], None]) -> None:
        super().__init__(inner)
        self._during: Callable[[], None] | None = during

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        began = [m.key for m in super().list(prefix, start_after=start_after)]
        if self._during is not None and "/_watermarks/" in prefix:
            during, self._during = self._during, None
            during()
        now = {m.key: m for m in super().list(prefix, start_after=start_after)}
        return iter([now[key] for key in began if key in now])


def test_a_listing_lacking_a_successor_and_its_released_predecessor_cuts_nothing_needed() -> None:
    # Reader train- always holds a checkpoint of step 100: while the reclaimer LISTs, it records
    # train-b (step 100) and then releases train-a. A listing lacking both (file:// did, under
    # load) made the boundary eval-500's step, and the pass cut steps 100..499.
    wall = FakeClock(1.7e9)
    inner = MemoryStore(clock=wall)
    log = ManifestLog(inner, NS, clock=wall)
    head = log.create_or_open(Mesh(dp=8, cp=1))
    assert isinstance(log.commit(head, append=[descriptor("p", i) for i in range(600)]), Committed)
    train = Watermarks(inner, NS, scope="train-", clock=wall)
    train.record("train-a", 100)
    Watermarks(inner, NS, scope="eval-", clock=wall).record("eval-500", 500)

    def checkpoint() -> None:
        train.record("train-b", 100)
        train.release("train-a")

    report = Reclaimer(_ListDuring(inner, checkpoint), NS, grace=600.0, clock=wall).run_once()
    assert (report.boundary, report.base_step_after) == (100, 100)


def test_a_cut_the_store_failed_is_no_lost_race(store: bw.MemoryStore, clock: FakeClock) -> None:
    # The reclaimer counted a 503 on its commit as a lost race in commit_conflicts (and, once
    # its attempts ran out, said "after N lost races" though no other writer existed).
    Writer(store, NS, MESH).publish(6)
    bw.Watermarks(store, NS).record("c", 4)
    faulty = bw.FaultInjectingStore(store)
    key_prefix = f"{NS}/_manifests/"
    injected = bw.TransientStoreError("injected 503")
    faulty.fail_next("put", lambda *_: injected, times=2, key_prefix=key_prefix)
    report = reclaimer(faulty, clock).run_once()
    assert (report.base_step_after, report.commit_conflicts) == (4, 0)

    faulty.fail_next("put", lambda *_: injected, times=100, key_prefix=key_prefix)
    bw.Watermarks(store, NS).record("c", 5)
    cutter = bw.Reclaimer(
        faulty, NS, grace=GRACE, clock=clock, sleep=lambda _: None, max_commit_attempts=3
    )
    with pytest.raises(bw.TransientStoreError) as info:
        cutter.run_once()
    message = str(info.value)
    assert "could not commit base_step 5 in 3 attempts: the store failed 3 of them" in message
    assert "injected 503" in message
    assert "lost race" not in message
    assert info.value.__cause__ is injected


# -- the background thread; the hook's namespace -----------------------------------------------


def test_restart_after_a_timed_out_stop_runs_one_loop() -> None:
    store = bw.MemoryStore()
    publish_one_slice(store, 2)
    reclaimer = bw.Reclaimer(store, "ns", grace=3600)
    entered = threading.Event()
    release = threading.Event()
    passes: list[str] = []
    original = reclaimer.run_once

    def slow_pass() -> bw.ReclaimReport:
        passes.append(threading.current_thread().name)
        entered.set()
        release.wait(10)
        return original()

    reclaimer.run_once = slow_pass  # type: ignore[method-assign]
    reclaimer.start(interval=0.01)
    assert entered.wait(10)
    reclaimer.stop(timeout=0.01)  # the pass is still running: stop() gives up waiting
    first = [t for t in threading.enumerate() if t.name == "batchweave-reclaimer"]
    assert len(first) == 1
    reclaimer.start(interval=3600)  # one pass now, the next in an hour
    release.set()
    first[0].join(10)
    try:
        # the stopped loop must end after its pass instead of running on beside the new one
        assert not first[0].is_alive()
    finally:
        reclaimer.stop(timeout=10)
        first[0].join(10)
    assert not any(t.name == "batchweave-reclaimer" for t in threading.enumerate())


def test_checkpoint_hook_refuses_watermarks_of_another_namespace() -> None:
    store = bw.MemoryStore()
    publish_one_slice(store, 2, namespace="a")
    consumer = bw.Consumer(store, "a", mesh=ONE_SLICE, dp_rank=0, timeout=1)
    with consumer:
        next(consumer)
        with pytest.raises(ValueError, match=r"'a'.*'b'"):
            bw.checkpoint_hook(consumer, bw.Watermarks(store, "b"), "ck", rank=0)
    assert bw.Watermarks(store, "b").live() == []
    # a closed consumer still has the state of its checkpoint: the hook works
    mark = bw.checkpoint_hook(consumer, bw.Watermarks(store, "a"), "ck", rank=0)
    assert mark is not None
    assert mark.step == 1


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan"), float("inf")])
def test_start_refuses_intervals_the_loop_cannot_wait(interval: float) -> None:
    # NaN made every wait return at once (passes back to back, hammering the store); inf made
    # the first wait raise OverflowError and kill the thread after one pass
    reclaimer = bw.Reclaimer(bw.MemoryStore(), "ns", grace=3600)
    with pytest.raises(ValueError, match="interval"):
        reclaimer.start(interval)
    assert not any(t.name == "batchweave-reclaimer" for t in threading.enumerate())


def test_the_thread_survives_failing_passes_and_counts_them(
    registry: CollectorRegistry, caplog: pytest.LogCaptureFixture
) -> None:
    failures = threading.Semaphore(0)
    healthy = threading.Event()

    class Flaky(bw.StoreWrapper):
        def list(self, prefix: str = "", *, start_after: str | None = None):  # type: ignore[no-untyped-def]
            if not healthy.is_set():
                failures.release()
                raise bw.StoreUnavailable("store down (test)")
            return super().list(prefix, start_after=start_after)

    inner = bw.MemoryStore()
    publish_one_slice(inner, 3)
    bw.Watermarks(inner, "ns").record("c", step=2)
    reclaimer = bw.track_metrics(bw.Reclaimer(Flaky(inner), "ns", grace=3600), registry=registry)
    done = threading.Event()
    tracked = reclaimer.run_once

    def run_once() -> bw.ReclaimReport:
        report = tracked()
        done.set()
        return report

    reclaimer.run_once = run_once  # type: ignore[method-assign]
    reclaimer.start(interval=0.001)
    try:
        assert failures.acquire(timeout=10)
        assert failures.acquire(timeout=10)  # a second pass: the thread outlived the first
        assert isinstance(reclaimer.last_error, bw.StoreUnavailable)
        healthy.set()
        assert done.wait(10)
    finally:
        reclaimer.stop(timeout=10)
    report = reclaimer.last_report
    assert report is not None
    assert report.base_step_after == 2
    assert report.tgbs_deleted == 2
    assert reclaimer.last_error is None
    errors = registry.get_sample_value("batchweave_reclaim_errors_total", {"namespace": "ns"})
    assert errors is not None
    assert errors >= 2
    assert registry.get_sample_value("batchweave_reclaim_passes_total", {"namespace": "ns"}) >= 1
    assert any("pass failed" in r.getMessage() for r in caplog.records)


# -- a pass on a missing namespace -------------------------------------------------------------


def test_a_pass_on_a_missing_namespace_still_sets_last_report() -> None:
    clock = FakeClock()
    store = bw.MemoryStore("empty", clock=clock)
    reclaimer = bw.Reclaimer(store, NS, grace=600.0, clock=clock)
    report = reclaimer.run_once()
    assert report.latest_version == -1
    assert reclaimer.last_report is report

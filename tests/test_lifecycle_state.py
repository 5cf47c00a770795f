"""Rollback safety as a hypothesis state machine.

Commits, consumption, checkpoints, rollbacks, releases, orphaned uploads, clock jumps and reclaim
passes interleave freely on a memory store. After every step, every live checkpoint's next step
(and the consumer's own position) stays readable by every rank, with verified checksums, and holds
exactly the bytes that were committed for it.
"""

from __future__ import annotations

import logging

import pytest
from _reclaimer_worker import FakeClock, Writer, expected_slice
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import batchweave as bw
from batchweave._manifest import ManifestLog

NS = "runs/state"
GRACE = 50.0
MESH = bw.Mesh(dp=2, cp=1)


class Lifecycle(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.store = bw.MemoryStore("state", clock=self.clock)
        self.writer = Writer(self.store, NS, MESH, clock=self.clock)
        self.writer.log = ManifestLog(
            self.store, NS, tail_limit=3, clock=self.clock, monotonic=self.clock
        )
        self.marks = bw.Watermarks(self.store, NS, clock=self.clock)
        self.reclaimer = bw.Reclaimer(
            self.store, NS, grace=GRACE, clock=self.clock, sleep=lambda _: None
        )
        self.position = 0
        """The training loop's consumer position (next step it reads)."""
        self.checkpoints: dict[str, int] = {}
        self.committed = 0
        self.serial = 0

    @initialize(steps=st.integers(1, 8))
    def warm_up(self, steps: int) -> None:
        """Start from a trained-and-checkpointed run whose old history is past the grace."""
        self.train_and_checkpoint(steps)
        self.wait(3 * GRACE)
        self.train_and_checkpoint(steps)

    @rule(count=st.integers(1, 4))
    def commit(self, count: int) -> None:
        self.committed = self.writer.publish(count).next_step

    @rule(steps=st.integers(1, 6))
    def consume(self, steps: int) -> None:
        self.position = min(self.committed, self.position + steps)

    @rule(steps=st.integers(1, 6))
    def train_and_checkpoint(self, steps: int) -> None:
        self.commit(steps)
        self.consume(steps)
        self.checkpoint()

    @rule()
    def checkpoint(self) -> None:
        self.serial += 1
        name = f"ckpt-{self.serial}"
        version = ManifestLog(self.store, NS).latest().version
        self.marks.record(name, self.position, version=version)
        self.checkpoints[name] = self.position

    @precondition(lambda self: self.checkpoints)
    @rule(data=st.data())
    def rollback(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.checkpoints)))
        self.position = self.checkpoints[name]

    @precondition(lambda self: self.checkpoints)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.checkpoints)))
        self.marks.release(name)
        del self.checkpoints[name]
        # The framework only deletes checkpoints it will not resume from: training carries on
        # from a live checkpoint or its current position.
        live = list(self.checkpoints.values())
        if live and self.position < min(live):
            self.position = min(live)

    @rule()
    def orphan(self) -> None:
        self.writer.orphan()

    @rule(seconds=st.sampled_from([1.0, GRACE / 2, GRACE, 3 * GRACE]))
    def wait(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @rule()
    def reclaim(self) -> None:
        report = self.reclaimer.run_once()
        assert report.seconds >= 0
        if self.checkpoints:
            assert report.base_step_after == min(self.checkpoints.values())
        else:
            assert report.base_step_after == report.base_step_before
        event(f"reclaimed TGBs: {min(report.tgbs_deleted, 1)}")
        event(f"deleted manifests: {min(report.manifests_deleted, 1)}")
        event(
            f"deleted segments/orphans: {min(report.segments_deleted + report.orphans_deleted, 1)}"
        )

    @invariant()
    def needed_steps_stay_readable(self) -> None:
        needed = set(self.checkpoints.values()) | {self.position}
        latest = ManifestLog(self.store, NS).latest()
        if self.checkpoints:
            assert latest.base_step <= min(self.checkpoints.values())
        for step in sorted(needed):
            if step >= self.committed:
                continue
            for rank in {step % MESH.dp, self.serial % MESH.dp}:
                with bw.Consumer(
                    self.store, NS, mesh=MESH, dp_rank=rank, start_step=step, prefetch=1
                ) as consumer:
                    assert next(consumer) == (step, expected_slice("w0", step, rank))


TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_a_wall_clock_stepped_back_mid_pass_gives_no_negative_duration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: the pass was timed with the reclaimer's wall clock: "reclaim pass done in -100.0 s"
    # and negative ReclaimReport.seconds / ReclaimProgress.seconds after an NTP step back.
    clock = FakeClock()
    store = bw.MemoryStore("stepped", clock=clock)
    writer = Writer(store, NS, MESH, clock=clock)
    writer.publish(2)
    bw.Watermarks(store, NS, clock=clock).record("ckpt-1", 1)
    clock.advance(3 * GRACE)
    readings = 0

    def stepped() -> float:  # the reclaimer's wall clock: 100 s back after its first reading
        nonlocal readings
        readings += 1
        return clock() - (100.0 if readings > 1 else 0.0)

    progress: list[bw.ReclaimProgress] = []
    reclaimer = bw.Reclaimer(
        store, NS, grace=GRACE, clock=stepped, sleep=lambda _: None, progress=progress.append
    )
    with caplog.at_level(logging.DEBUG, logger="batchweave.lifecycle"):
        report = reclaimer.run_once()
    assert report.base_step_after == 1
    assert report.seconds >= 0
    assert progress
    assert all(p.seconds >= 0 for p in progress)
    assert [p.seconds for p in progress] == sorted(p.seconds for p in progress)
    done = [r.getMessage() for r in caplog.records if "reclaim pass done in" in r.getMessage()]
    assert done
    assert "in -" not in done[-1]

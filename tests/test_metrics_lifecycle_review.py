"""Review regressions: metrics of restarted or failing objects, the reclaimer thread, the hook."""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Iterable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

import batchweave as bw
from batchweave._outage import OutageLog

MESH = bw.Mesh(dp=1, cp=1)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


def samples(registry: CollectorRegistry, name: str) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def publish(store: bw.ObjectStore, count: int, namespace: str = "ns") -> None:
    with bw.Producer(store, namespace, producer_id="p0", mesh=MESH) as producer:
        for offset in range(producer.resume_offset, count):
            producer.append([b"x" * 10], offset=offset)


def test_a_producer_restarted_in_process_is_exported_once(registry: CollectorRegistry) -> None:
    store = bw.MemoryStore()
    old = bw.track_metrics(bw.Producer(store, "ns", producer_id="p0", mesh=MESH), registry=registry)
    old.append([b"x"], offset=0)
    old.close()  # still referenced (a traceback, a list of workers): not garbage-collected yet
    new = bw.track_metrics(bw.Producer(store, "ns", producer_id="p0", mesh=MESH), registry=registry)
    try:
        new.append([b"x"], offset=1)
        new.append([b"x"], offset=2)
        new.flush()
        lines = samples(registry, "batchweave_tgbs_published_total")
        # one series per label set: the live producer's (a duplicate series breaks scrapes)
        assert lines == ['batchweave_tgbs_published_total{namespace="ns",producer_id="p0"} 2.0']
    finally:
        new.close()
    assert old.stats().tgbs_published == 1


def test_a_consumer_replaced_in_process_is_exported_once(registry: CollectorRegistry) -> None:
    store = bw.MemoryStore()
    publish(store, 3)
    old = bw.Consumer(store, "ns", mesh=MESH, dp_rank=0, timeout=1)
    bw.track_metrics(old, registry=registry)
    next(old)
    next(old)
    state = old.state_dict()
    old.close()
    new = bw.track_metrics(
        bw.Consumer(store, "ns", mesh=MESH, dp_rank=0, timeout=1), registry=registry
    )
    with new:
        new.load_state_dict(state)
        next(new)
        lines = samples(registry, "batchweave_consumer_steps_total")
        assert lines == [
            'batchweave_consumer_steps_total{cp_rank="0",dp_rank="0",namespace="ns"} 1.0'
        ]
    assert old.stats.steps == 2


class RefuseOne(bw.StoreWrapper):
    """Refuses to delete one key (an object lock), like a store with a partial permission."""

    def __init__(self, inner: bw.ObjectStore, refused: str) -> None:
        super().__init__(inner)
        self.refused = refused

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        if self.refused in keys:
            raise bw.AccessDenied(f"{self.refused}: access denied")
        super().delete_many(keys)


def test_a_failed_pass_still_counts_what_it_deleted(registry: CollectorRegistry) -> None:
    inner = bw.MemoryStore()
    publish(inner, 4)
    locked = next(m.key for m in inner.list("ns/data/"))
    bw.Watermarks(inner, "ns").record("c", step=4)
    reclaimer = bw.Reclaimer(RefuseOne(inner, locked), "ns", grace=0)
    bw.track_metrics(reclaimer, registry=registry)
    with pytest.raises(bw.AccessDenied, match="refused to delete 1 objects"):
        reclaimer.run_once()
    report = reclaimer.last_report
    assert report is not None
    assert report.tgbs_deleted == 3
    labels = {"namespace": "ns", "kind": "tgb"}
    get = registry.get_sample_value
    assert get("batchweave_reclaim_errors_total", {"namespace": "ns"}) == 1
    # the deletions happened: the counters and gauges must say so
    assert get("batchweave_reclaimed_objects_total", labels) == 3
    assert get("batchweave_reclaimed_bytes_total", labels) == report.tgb_bytes_deleted
    assert get("batchweave_reclaim_base_step", {"namespace": "ns"}) == 4
    assert get("batchweave_reclaim_boundary", {"namespace": "ns"}) == 4
    # a failed pass is no success
    assert get("batchweave_reclaim_last_success_timestamp_seconds", {"namespace": "ns"}) in (
        None,
        0,
    )


def test_a_namespace_that_does_not_exist_fails_before_counting(
    registry: CollectorRegistry,
) -> None:
    class Down(bw.StoreWrapper):
        def list(self, prefix: str = "", start_after: str | None = None):  # type: ignore[no-untyped-def]
            raise bw.StoreUnavailable("down")

    reclaimer = bw.track_metrics(bw.Reclaimer(Down(bw.MemoryStore()), "ns"), registry=registry)
    reclaimer.last_report = None
    with pytest.raises(bw.StoreUnavailable):
        reclaimer.run_once()
    get = registry.get_sample_value
    assert get("batchweave_reclaim_errors_total", {"namespace": "ns"}) == 1
    assert get("batchweave_reclaimed_objects_total", {"namespace": "ns", "kind": "tgb"}) is None


def test_restart_after_a_timed_out_stop_runs_one_loop() -> None:
    store = bw.MemoryStore()
    publish(store, 2)
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
    publish(store, 2, namespace="a")
    consumer = bw.Consumer(store, "a", mesh=MESH, dp_rank=0, timeout=1)
    with consumer:
        next(consumer)
        with pytest.raises(ValueError, match=r"'a'.*'b'"):
            bw.checkpoint_hook(consumer, bw.Watermarks(store, "b"), "ck", rank=0)
    assert bw.Watermarks(store, "b").live() == []
    # a closed consumer still has the state of its checkpoint: the hook works
    mark = bw.checkpoint_hook(consumer, bw.Watermarks(store, "a"), "ck", rank=0)
    assert mark is not None
    assert mark.step == 1


def test_metrics_port_in_use_names_the_address(registry: CollectorRegistry) -> None:
    with bw.start_metrics_server(0, registry=registry) as first:
        with pytest.raises(OSError, match=f"127.0.0.1:{first.port}") as info:
            bw.start_metrics_server(first.port, registry=registry)
        assert info.value.errno == errno.EADDRINUSE
    first.close()  # closing twice is harmless, and the port is free again
    with bw.start_metrics_server(first.port, registry=registry) as again:
        assert again.port == first.port


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
    publish(inner, 3)
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


def test_outage_log_rate_limits_reminders_and_reports_recovery_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    log = OutageLog(logging.getLogger("batchweave.test"), "producer 'p0'", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="batchweave.test")
    for _ in range(20):  # 100 s of failures, one every 5 s
        log.failed("committing", bw.StoreUnavailable("down"))
        now[0] += 5.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4  # at 0, 30, 60 and 90 s
    assert "unreachable while committing" in warnings[0]
    assert "still unreachable after 30 s (7 failed requests)" in warnings[1]
    assert log.down
    log.recovered()
    log.recovered()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [
        "producer 'p0': the object store is reachable again after 100.0 s (20 failed requests); "
        "resuming"
    ]
    assert not log.down
    log.failed("uploading", bw.StoreUnavailable("down again"))  # a new outage: a new first line
    assert "unreachable while uploading" in caplog.records[-1].getMessage()

"""Prometheus metrics: tracked producers, consumers and reclaimers, and the HTTP endpoint.

The collector uses public state only: producers and consumers say whether they are ``closed``,
and of two tracked producers with one id the open one is exported. A producer restarted or a
consumer replaced in the same process is exported once (a duplicate series breaks scrapes); a
reclaim pass that fails still counts what it deleted, one that fails before starting counts
nothing; a metrics port in use is an error naming the address.
"""

from __future__ import annotations

import errno
import gc
import inspect
import os
import select
import signal
import socket
import urllib.request
from collections.abc import Iterable

import pytest
from _reclaimer_worker import ONE_SLICE, RefuseOne, publish_one_slice
from fake_time import FakeTime
from prometheus_client import CollectorRegistry, generate_latest

import batchweave as bw
import batchweave._metrics
from batchweave._metrics import InstrumentedPolicy, metrics
from batchweave._policy import AttemptOutcome, CommitPolicy, DacPolicy

MESH = bw.Mesh(dp=2, cp=1)


def value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    found = registry.get_sample_value(name, labels)
    assert found is not None, f"no sample {name}{labels}"
    return found


def publish(store: bw.ObjectStore, registry: CollectorRegistry, count: int) -> bw.Producer:
    policy = bw.instrument_policy("naive", registry=registry)
    producer = bw.Producer(store, "ns", producer_id="p0", mesh=MESH, policy=policy)
    bw.track_metrics(producer, registry=registry)
    for offset in range(count):
        producer.append([b"a" * 100, b"b" * 100], offset=offset)
        producer.flush()
    return producer


def test_producer_counters_follow_stats(registry: CollectorRegistry) -> None:
    store = bw.MemoryStore()
    producer = publish(store, registry, 3)
    try:
        stats = producer.stats()
        labels = {"namespace": "ns", "producer_id": "p0"}
        assert value(registry, "batchweave_commits_total", **labels) == stats.commits
        assert value(registry, "batchweave_commit_attempts_total", **labels) == stats.attempts
        assert value(registry, "batchweave_tgbs_published_total", **labels) == 3
        assert value(registry, "batchweave_bytes_published_total", **labels) == (
            stats.bytes_published
        )
        assert value(registry, "batchweave_commit_conflicts_total", **labels) == 0
        assert value(registry, "batchweave_producer_pending_tgbs", **labels) == 0
        # the instrumented policy saw every attempt
        hist = value(registry, "batchweave_fragile_window_seconds_hist_count", policy="naive")
        assert hist == stats.attempts >= 3
        assert (
            value(registry, "batchweave_policy_attempts_total", policy="naive", outcome="committed")
            == stats.commits
        )
    finally:
        producer.close()


def test_consumer_counters_and_read_amplification(registry: CollectorRegistry) -> None:
    store = bw.MemoryStore()
    publish(store, registry, 4).seal()
    consumer = bw.track_metrics(
        bw.Consumer(store, "ns", mesh=MESH, dp_rank=1, cp_rank=0), registry=registry
    )
    steps = [step for step, _ in consumer]
    assert steps == [0, 1, 2, 3]
    stats = consumer.stats
    labels = {"namespace": "ns", "dp_rank": "1", "cp_rank": "0"}
    assert value(registry, "batchweave_consumer_steps_total", **labels) == 4
    assert value(registry, "batchweave_consumer_bytes_delivered_total", **labels) == 400
    assert value(registry, "batchweave_consumer_bytes_read_total", **labels) == stats.bytes_read
    amp = value(registry, "batchweave_consumer_read_amplification", **labels)
    assert amp == pytest.approx(stats.read_amplification)
    assert amp == 1.0  # the manifest carries the slice table: nothing but slices is range-read
    assert value(registry, "batchweave_consumer_stall_seconds_total", **labels) >= 0.0
    latency = value(registry, "batchweave_consumer_read_latency_seconds", **labels)
    assert latency == stats.read_latency
    assert latency > 0.0
    consumer.close()


def test_tracked_reclaimer_counts_deletions(registry: CollectorRegistry) -> None:
    store = bw.MemoryStore()
    publish(store, registry, 4).close()
    bw.Watermarks(store, "ns").record("c", step=3)
    reclaimer = bw.track_metrics(bw.Reclaimer(store, "ns", grace=0), registry=registry)
    report = reclaimer.run_once()
    assert report.tgbs_deleted == 3
    labels = {"namespace": "ns", "kind": "tgb"}
    assert value(registry, "batchweave_reclaimed_objects_total", **labels) == 3
    assert value(registry, "batchweave_reclaimed_bytes_total", **labels) == report.tgb_bytes_deleted
    assert value(registry, "batchweave_reclaim_passes_total", namespace="ns") == 1


def test_untrackable_objects_are_refused(registry: CollectorRegistry) -> None:
    with pytest.raises(TypeError, match="cannot track"):
        bw.track_metrics(object(), registry=registry)  # type: ignore[type-var]


def test_instrumented_policy_delegates(registry: CollectorRegistry) -> None:
    policy = bw.instrument_policy("fixed10", registry=registry)
    assert isinstance(policy, InstrumentedPolicy)
    assert not policy.ready(3, float("inf"))
    assert policy.ready(10, float("inf"))
    assert policy.gap == 0.0


def test_http_endpoint_serves_the_metrics(registry: CollectorRegistry) -> None:
    store = bw.MemoryStore()
    producer = publish(store, registry, 1)
    with bw.start_metrics_server(0, registry=registry) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        body = urllib.request.urlopen(url, timeout=10).read().decode()
    producer.close()
    assert 'batchweave_tgbs_published_total{namespace="ns",producer_id="p0"} 1.0' in body
    assert "batchweave_reclaimed_bytes_total" in body or "batchweave_reclaimed_bytes" in body
    assert metrics(registry).registry is registry


def test_an_instrumented_policy_paces_exactly_like_the_policy_it_wraps(
    registry: CollectorRegistry,
) -> None:
    plain = DacPolicy(seed=7)
    wrapped = bw.instrument_policy(DacPolicy(seed=7), registry=registry)
    for policy in (plain, wrapped):
        policy.start(0.02, 4, rank=1, loaded_window=0.03)
        policy.observe_put(0.004, 100_000)
        policy.record(AttemptOutcome(True, 0.015, 4, 3, bytes_written=20_000))
        policy.record(AttemptOutcome(False, 0.05, 4, 1, forced=True))

    def answers(policy: CommitPolicy) -> tuple[object, ...]:
        return (
            policy.gap,
            policy.forced_gap,
            policy.ready(3, 0.5),
            policy.forced_wait(0.01, 1_700_000_000.3, 1),
            policy.regular_wait(0.2, 1_700_000_000.3, 1),
        )

    assert answers(wrapped) == answers(plain)
    assert answers(plain)[3] > 0  # a lost close slot: the wait is real, not a default 0


# -- open and closed clients -------------------------------------------------------------------


def test_producers_and_consumers_say_whether_they_are_closed() -> None:
    store = bw.MemoryStore()
    producer = bw.Producer(store, "ns", producer_id="p0", mesh=bw.Mesh(dp=1))
    assert producer.closed is False
    producer.append([b"x"], offset=0)
    producer.close()
    assert producer.closed is True
    consumer = bw.Consumer(store, "ns", mesh=bw.Mesh(dp=1), dp_rank=0, timeout=0)
    assert consumer.closed is False
    consumer.close()
    assert consumer.closed is True


def test_the_collector_prefers_the_open_producer_without_private_attributes() -> None:
    assert "_closed" not in inspect.getsource(batchweave._metrics)
    registry = CollectorRegistry()
    store = bw.MemoryStore()
    closed = bw.Producer(store, "ns", producer_id="p0", mesh=bw.Mesh(dp=1))
    closed.close()
    live = bw.Producer(store, "ns", producer_id="p0", mesh=bw.Mesh(dp=1))
    try:
        bw.track_metrics(live, registry=registry)
        bw.track_metrics(closed, registry=registry)  # tracked last, but closed: not exported
        live.append([b"x"], offset=0)
        live.flush()
        labels = {"namespace": "ns", "producer_id": "p0"}
        assert registry.get_sample_value("batchweave_tgbs_published_total", labels) == 1.0
    finally:
        live.close()


# -- objects replaced in process, failed passes, the server's port -----------------------------


def samples(registry: CollectorRegistry, name: str) -> list[str]:
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if line.startswith(name + "{")]


def test_a_producer_restarted_in_process_is_exported_once(registry: CollectorRegistry) -> None:
    store = bw.MemoryStore()
    old = bw.track_metrics(
        bw.Producer(store, "ns", producer_id="p0", mesh=ONE_SLICE), registry=registry
    )
    old.append([b"x"], offset=0)
    old.close()  # still referenced (a traceback, a list of workers): not garbage-collected yet
    new = bw.track_metrics(
        bw.Producer(store, "ns", producer_id="p0", mesh=ONE_SLICE), registry=registry
    )
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


def test_a_producer_failed_and_never_closed_is_not_summed_into_its_restart(
    registry: CollectorRegistry,
) -> None:
    # Open together under one label set meant "summed": a producer stopped by a failure and
    # never closed (kept alive by its traceback) added its stale pending TGBs to the restarted
    # producer's series, a false "pending TGBs not draining" alert.
    store = bw.FaultInjectingStore(bw.MemoryStore())
    old = bw.track_metrics(
        bw.Producer(store, "ns", producer_id="p0", mesh=ONE_SLICE, max_retries=0),
        registry=registry,
    )
    store.fail_next("put", error=bw.AccessDenied("no writes for data"), key_prefix="ns/data/")
    old.append([b"x"], offset=0)
    with pytest.raises(bw.ProducerError):
        old.flush(timeout=30)
    assert old.failed
    assert not old.closed
    assert old.stats().pending == 1
    new = bw.track_metrics(
        bw.Producer(store, "ns", producer_id="p0", mesh=ONE_SLICE), registry=registry
    )
    try:
        new.append([b"y"], offset=new.resume_offset)
        new.flush()
        labels = {"namespace": "ns", "producer_id": "p0"}
        assert registry.get_sample_value("batchweave_producer_pending_tgbs", labels) == 0.0
        assert registry.get_sample_value("batchweave_tgbs_published_total", labels) == 1.0
    finally:
        new.close()


def test_a_consumer_replaced_in_process_is_exported_once(registry: CollectorRegistry) -> None:
    store = bw.MemoryStore()
    publish_one_slice(store, 3)
    old = bw.Consumer(store, "ns", mesh=ONE_SLICE, dp_rank=0, timeout=1)
    bw.track_metrics(old, registry=registry)
    next(old)
    next(old)
    state = old.state_dict()
    old.close()
    new = bw.track_metrics(
        bw.Consumer(store, "ns", mesh=ONE_SLICE, dp_rank=0, timeout=1), registry=registry
    )
    with new:
        new.load_state_dict(state)
        next(new)
        lines = samples(registry, "batchweave_consumer_steps_total")
        assert lines == [
            'batchweave_consumer_steps_total{cp_rank="0",dp_rank="0",namespace="ns"} 1.0'
        ]
    assert old.stats.steps == 2


CONSUMER_LABELS = {"namespace": "ns", "dp_rank": "0", "cp_rank": "0"}


def test_stride_readers_of_one_rank_add_up_and_never_drop(registry: CollectorRegistry) -> None:
    # Before: one object per label set, so two open stride=2 readers of one rank that delivered
    # 8 steps were exported as 4, and a closed one vanished from the series.
    store = bw.MemoryStore()
    with bw.Producer(store, "ns", producer_id="p0", mesh=ONE_SLICE) as producer:
        for offset in range(8):
            producer.append([b"x" * 10], offset=offset)
        producer.seal()
    readers = [
        bw.track_metrics(
            bw.Consumer(store, "ns", mesh=ONE_SLICE, dp_rank=0, start_step=w, stride=2),
            registry=registry,
        )
        for w in range(2)
    ]
    for _ in range(2):
        next(readers[0])
    next(readers[1])
    steps = "batchweave_consumer_steps_total"
    assert value(registry, steps, **CONSUMER_LABELS) == 3
    assert value(registry, "batchweave_consumer_in_flight_steps", **CONSUMER_LABELS) == sum(
        r.stats.in_flight for r in readers
    )
    assert sum(1 for _ in readers[0]) == 2
    readers[0].close()  # done, while the other goes on: its 4 steps still count
    assert value(registry, steps, **CONSUMER_LABELS) == 5
    del readers[0]
    gc.collect()  # and still once it is gone
    assert value(registry, steps, **CONSUMER_LABELS) == 5
    assert sum(1 for _ in readers[0]) == 3
    assert value(registry, steps, **CONSUMER_LABELS) == 8
    assert value(registry, "batchweave_consumer_bytes_delivered_total", **CONSUMER_LABELS) == 80
    assert value(registry, "batchweave_consumer_read_amplification", **CONSUMER_LABELS) == 1.0
    readers[0].close()
    # every reader closed: a new one tracked is a restart, the series starts afresh
    with bw.track_metrics(
        bw.Consumer(store, "ns", mesh=ONE_SLICE, dp_rank=0, start_step=6), registry=registry
    ) as again:
        next(again)
        assert samples(registry, steps) == [
            'batchweave_consumer_steps_total{cp_rank="0",dp_rank="0",namespace="ns"} 1.0'
        ]
    del readers
    gc.collect()
    assert value(registry, steps, **CONSUMER_LABELS) == 1


def test_producers_open_together_under_one_id_add_up(registry: CollectorRegistry) -> None:
    store = bw.MemoryStore()
    labels = {"namespace": "ns", "producer_id": "p0"}
    old = bw.Producer(store, "ns", producer_id="p0", mesh=ONE_SLICE)
    bw.track_metrics(old, registry=registry)
    old.append([b"x"], offset=0)
    old.flush()
    # a new incarnation while the old one is still open (it is fenced, not closed)
    new = bw.track_metrics(
        bw.Producer(store, "ns", producer_id="p0", mesh=ONE_SLICE), registry=registry
    )
    try:
        assert value(registry, "batchweave_tgbs_published_total", **labels) == 1  # before: 0
        old.close()
        new.append([b"x"], offset=1)
        new.flush()
        assert value(registry, "batchweave_tgbs_published_total", **labels) == 2
        del old
        gc.collect()
        assert value(registry, "batchweave_tgbs_published_total", **labels) == 2
    finally:
        new.close()


def test_stall_grows_while_next_is_blocked_and_is_counted_once(
    registry: CollectorRegistry,
) -> None:
    # Before: stall was added only when next() returned, so a consumer blocked for good behind
    # lag-blocked producers (the deadlock the alert is for) showed a flat stall.
    store = bw.MemoryStore()
    producer = bw.Producer(store, "ns", producer_id="p0", mesh=ONE_SLICE)
    producer.append([b"x"], offset=0)
    producer.flush()
    seen: list[tuple[float, float, float]] = []
    consumer: bw.Consumer | None = None

    def while_blocked() -> None:  # runs in the consumer's next(), in each poll sleep
        assert consumer is not None
        metric = value(registry, "batchweave_consumer_stall_seconds_total", **CONSUMER_LABELS)
        seen.append((fake.now, consumer.stats.stall_seconds, metric))
        if len(seen) == 5:
            producer.append([b"y"], offset=1)
            producer.flush()

    fake = FakeTime(on_sleep=while_blocked)
    consumer = bw.Consumer(
        store,
        "ns",
        mesh=ONE_SLICE,
        dp_rank=0,
        clock=fake.clock,
        sleep=fake.sleep,
        poll_interval=1.0,
        max_poll_interval=1.0,
    )
    bw.track_metrics(consumer, registry=registry)
    try:
        assert next(consumer)[0] == 0
        before = consumer.stats.stall_seconds
        began = fake.now
        assert next(consumer)[0] == 1
        assert len(seen) >= 5
        for now, stats, metric in seen:  # the wait so far, while still blocked
            assert stats == pytest.approx(before + now - began)
            assert metric == pytest.approx(stats)
        assert seen[-1][1] >= before + 5.0
        # delivered: the whole wait, counted once
        assert consumer.stats.stall_seconds == pytest.approx(before + fake.now - began)
        assert value(
            registry, "batchweave_consumer_stall_seconds_total", **CONSUMER_LABELS
        ) == pytest.approx(before + fake.now - began)
    finally:
        consumer.close()
        producer.close()


def test_a_failed_pass_still_counts_what_it_deleted(registry: CollectorRegistry) -> None:
    inner = bw.MemoryStore()
    publish_one_slice(inner, 4)
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


class FailAfter(bw.StoreWrapper):
    """Deletes ``budget`` objects, one request each, then fails once with a transient error."""

    def __init__(self, inner: bw.ObjectStore, budget: int) -> None:
        super().__init__(inner)
        self.budget: int | None = budget

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            if self.budget == 0:
                self.budget = None
                raise bw.TransientStoreError("injected: store hiccup")
            if self.budget is not None:
                self.budget -= 1
            super().delete_many([key])


def test_a_pass_failing_part_way_counts_what_it_deleted_once(registry: CollectorRegistry) -> None:
    # Before the fix a pass stopped by a store error set no last_report, so the tracker counted
    # none of the objects it had deleted, and the next pass counted only those left: 6 of 10.
    inner = bw.MemoryStore()
    publish_one_slice(inner, 10)
    bw.Watermarks(inner, "ns").record("c", step=10)
    stored = sum(m.size for m in inner.list("ns/data/"))
    reclaimer = bw.Reclaimer(FailAfter(inner, 4), "ns", grace=0, delete_batch=1)
    bw.track_metrics(reclaimer, registry=registry)
    with pytest.raises(bw.TransientStoreError, match="hiccup"):
        reclaimer.run_once()
    assert reclaimer.last_report is not None
    assert reclaimer.last_report.tgbs_deleted == 4
    labels = {"namespace": "ns", "kind": "tgb"}
    assert value(registry, "batchweave_reclaimed_objects_total", **labels) == 4
    assert value(registry, "batchweave_reclaim_errors_total", namespace="ns") == 1
    report = reclaimer.run_once()
    assert report.tgbs_deleted == 6
    assert not list(inner.list("ns/data/"))
    assert value(registry, "batchweave_reclaimed_objects_total", **labels) == 10
    assert value(registry, "batchweave_reclaimed_bytes_total", **labels) == stored
    assert value(registry, "batchweave_reclaim_passes_total", namespace="ns") == 1


def test_an_interrupted_pass_counts_what_it_deleted(registry: CollectorRegistry) -> None:
    # Ctrl-C (here from the progress callback) after some deletions: they are gone all the same.
    inner = bw.MemoryStore()
    publish_one_slice(inner, 6)
    bw.Watermarks(inner, "ns").record("c", step=6)

    def interrupt(progress: bw.ReclaimProgress) -> None:
        if progress.objects_deleted == 3:
            raise KeyboardInterrupt

    reclaimer = bw.Reclaimer(inner, "ns", grace=0, delete_batch=1, progress=interrupt)
    bw.track_metrics(reclaimer, registry=registry)
    with pytest.raises(KeyboardInterrupt):
        reclaimer.run_once()
    labels = {"namespace": "ns", "kind": "tgb"}
    assert value(registry, "batchweave_reclaimed_objects_total", **labels) == 3
    reclaimer.progress = None
    reclaimer.run_once()
    assert value(registry, "batchweave_reclaimed_objects_total", **labels) == 6


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


def test_metrics_port_in_use_names_the_address(registry: CollectorRegistry) -> None:
    with bw.start_metrics_server(0, registry=registry) as first:
        with pytest.raises(OSError, match=f"127.0.0.1:{first.port}") as info:
            bw.start_metrics_server(first.port, registry=registry)
        assert info.value.errno == errno.EADDRINUSE
    first.close()  # closing twice is harmless, and the port is free again
    with bw.start_metrics_server(first.port, registry=registry) as again:
        assert again.port == first.port


def test_metrics_server_close_releases_the_port_while_a_forked_child_lives(
    registry: CollectorRegistry,
) -> None:
    # Before: a child forked while serving (a DataLoader fork worker) kept the listening socket:
    # close() in the parent left the port bound (rebinding failed with EADDRINUSE) and
    # connections were accepted into a socket nobody served.
    server = bw.start_metrics_server(0, registry=registry)
    port = server.port
    to_parent, from_child = os.pipe()
    to_child, from_parent = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child lives until told to go, then closes its copy
        code = 1
        try:
            os.write(from_child, b"r")
            os.read(to_child, 1)
            signal.alarm(20)  # a close() that waited for the parent's thread: killed
            server.close()  # harmless in the child
            code = 0
        finally:
            os._exit(code)
    try:
        ready, _, _ = select.select([to_parent], [], [], 30)
        assert ready, "the child did not start"
        assert os.read(to_parent, 1) == b"r"
        server.close()
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.connect(("127.0.0.1", port))
        with bw.start_metrics_server(port, registry=registry) as again:
            assert again.port == port
    finally:
        os.write(from_parent, b"x")
        _, status = os.waitpid(pid, 0)
        for fd in (to_parent, from_child, to_child, from_parent):
            os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0  # not killed by the alarm


@pytest.mark.parametrize(
    ("port", "addr", "error", "match"),
    [
        (70000, "127.0.0.1", ValueError, r"port must be a TCP port in 0\.\.65535 .*got 70000"),
        (-1, "127.0.0.1", ValueError, r"port must be a TCP port in 0\.\.65535 .*got -1"),
        ("9100", "127.0.0.1", TypeError, r"port must be an integer, got the str '9100'"),
        (9100.0, "127.0.0.1", TypeError, r"port must be an integer, got the float"),
        (True, "127.0.0.1", TypeError, r"port must be an integer, got the bool"),
        (0, None, TypeError, r"addr must be a str.*got the NoneType None"),
    ],
)
def test_metrics_server_refuses_a_bad_port_or_addr_naming_it(
    registry: CollectorRegistry, port: object, addr: object, error: type[Exception], match: str
) -> None:
    # Before: OverflowError for 70000, "Servname not supported" for -1.
    with pytest.raises(error, match=match):
        bw.start_metrics_server(port, addr, registry=registry)  # type: ignore[arg-type]


def test_metrics_server_on_an_address_it_cannot_bind_says_what_addr_must_be(
    registry: CollectorRegistry,
) -> None:
    # Before: "Cannot assign requested address" alone. A numeric address of TEST-NET-1 (RFC
    # 5737): no name lookup, and binding sends nothing.
    with pytest.raises(OSError, match=r"192\.0\.2\.1:0.*no interface of this machine") as info:
        bw.start_metrics_server(0, "192.0.2.1", registry=registry)
    assert "addr must be an IP address or host name of this machine" in str(info.value)

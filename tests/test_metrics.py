"""Prometheus metrics: tracked producers, consumers and reclaimers, and the HTTP endpoint."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client import CollectorRegistry

import batchweave as bw
from batchweave._metrics import InstrumentedPolicy, metrics
from batchweave._policy import AttemptOutcome, CommitPolicy, DacPolicy

MESH = bw.Mesh(dp=2, cp=1)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


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

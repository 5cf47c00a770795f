"""Prometheus metrics for producers, consumers and the reclaimer (``docs/operations.md``).

Nothing is exported unless asked: call :func:`track_metrics` on the objects to watch and
:func:`start_metrics_server` (or scrape the registry your application already serves).

- Producers and consumers already keep counters (``Producer.stats()``, ``Consumer.stats``); a
  collector reads them at scrape time, so tracking costs nothing on the hot path.
- Distributions need every observation: :func:`instrument_policy` wraps a commit policy so each
  attempt's fragile window and the gap that follows land in histograms.
- A tracked :class:`~batchweave.Reclaimer` adds every pass's deletions to counters.

Metric names (all prefixed ``batchweave_``): ``commit_attempts_total``, ``commits_total``,
``commit_conflicts_total``, ``commit_ambiguous_total``, ``transient_errors_total``,
``tgbs_published_total``, ``bytes_published_total``, ``producer_pending_tgbs``,
``producer_lag_blocked_seconds_total``, ``fragile_window_seconds`` (gauge: last) and
``fragile_window_seconds_hist``, ``commit_gap_seconds`` (gauge) and ``commit_gap_seconds_hist``;
``producer_inflight_bytes``, ``policy_attempts_total{outcome}`` (instrumented policies);
``consumer_steps_total``, ``consumer_stall_seconds_total``, ``consumer_bytes_read_total``,
``consumer_bytes_delivered_total``, ``consumer_requests_total``, ``consumer_retries_total``,
``consumer_read_amplification``,
``consumer_prefetch_depth``, ``consumer_in_flight_steps``, ``consumer_read_latency_seconds``,
``consumer_read_cpu_share``;
``reclaim_passes_total``, ``reclaim_errors_total`` (failed passes),
``reclaim_last_success_timestamp_seconds``, ``reclaim_boundary``, ``reclaim_base_step``,
``reclaimed_objects_total{kind}``, ``reclaimed_bytes_total{kind}``.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import os
import socket
import threading
import weakref
from collections.abc import Iterator
from typing import Any, Final, TypeVar

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchweave._checks import as_int
from batchweave._consumer import Consumer
from batchweave._fork import current_pid
from batchweave._lifecycle import Reclaimer, ReclaimReport
from batchweave._policy import AttemptOutcome, CommitPolicy, PolicyWrapper, resolve_policy
from batchweave._producer import Producer

__all__ = [
    "BatchWeaveCollector",
    "InstrumentedPolicy",
    "MetricsServer",
    "instrument_policy",
    "metrics",
    "start_metrics_server",
    "track_metrics",
]

_T = TypeVar("_T", Producer, Consumer, Reclaimer)

_WINDOW_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_GAP_BUCKETS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


_PRODUCER_COUNTERS = {
    "attempts": ("commit_attempts", "Manifest commit attempts that reached the store."),
    "commits": ("commits", "Commit attempts that created a manifest version."),
    "conflicts": ("commit_conflicts", "Commit attempts lost to another writer."),
    "ambiguous": ("commit_ambiguous", "Commit attempts with an unknown outcome."),
    "transient_errors": ("transient_errors", "Retried transient store failures."),
    "tgbs_published": ("tgbs_published", "TGBs made visible by committed manifests."),
    "bytes_published": ("bytes_published", "Bytes of published TGB objects."),
    "lag_blocked_seconds": (
        "producer_lag_blocked_seconds",
        "Seconds append() was blocked by max_lag.",
    ),
}
_PRODUCER_GAUGES = {  # attr: (name, doc, summed over open producers, else their mean)
    "last_fragile_window": (
        "fragile_window_seconds",
        "Last fragile window: base read to end of the conditional PUT.",
        False,
    ),
    "gap": ("commit_gap_seconds", "The commit policy's current post-attempt gap.", False),
    "pending": ("producer_pending_tgbs", "TGBs appended but not yet committed.", True),
    "inflight_bytes": ("producer_inflight_bytes", "Encoded bytes waiting for upload.", True),
}
_CONSUMER_COUNTERS = {
    "steps": ("consumer_steps", "Steps delivered to the training loop."),
    "stall_seconds": (
        "consumer_stall_seconds",
        "Seconds next() blocked the caller, a call still blocked included.",
    ),
    "bytes_read": ("consumer_bytes_read", "Bytes returned by range reads."),
    "bytes_delivered": ("consumer_bytes_delivered", "Stored bytes of delivered slices."),
    "requests": ("consumer_requests", "Range reads issued."),
    "retries": ("consumer_retries", "Transient read failures retried."),
}
_CONSUMER_GAUGES = {  # attr: (name, doc, summed over open consumers, else their mean)
    "prefetch_depth": ("consumer_prefetch_depth", "Steps allowed in flight.", True),
    "in_flight": ("consumer_in_flight_steps", "Steps being read ahead now.", True),
    "read_latency": (
        "consumer_read_latency_seconds",
        "Moving average of one step's reads (below prefetch_min_latency: no prefetching).",
        False,
    ),
    "read_cpu_share": (
        "consumer_read_cpu_share",
        "Moving average of the share of a step's reads spent on CPU by the reading thread "
        "(above prefetch_max_cpu_share: no prefetching).",
        False,
    ),
}


def _stopped(obj: Producer | Consumer) -> bool:
    """Whether ``obj`` publishes or reads no more: closed, or a producer stopped by a failure
    (never closed, it may live on in a traceback while a restarted one takes its labels)."""
    return obj.closed or (isinstance(obj, Producer) and obj.failed)


class _Member:
    """One tracked object of a :class:`_Series`, with the last ``stats`` snapshot taken of it."""

    __slots__ = ("closed", "last", "order", "ref", "taken")

    def __init__(self, obj: Producer | Consumer, order: int) -> None:
        self.ref: weakref.ref[Producer | Consumer] = weakref.ref(obj)
        self.order = order
        self.last: Any = None
        """The newest snapshot (``ProducerStats`` or ``ConsumerStats``); final once ``closed``."""
        self.taken = -1
        """The scrape that took ``last`` (a slower concurrent scrape must not replace it)."""
        self.closed = False


class _Series:
    """The objects exported under one label set, and what those collected since counted."""

    __slots__ = ("gone", "members", "pid")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.members: list[_Member] = []
        self.gone: dict[str, float] = {}
        """Counter totals of members garbage-collected meanwhile (from their last snapshot)."""

    def has_open(self) -> bool:
        for member in self.members:
            obj = member.ref()
            if obj is not None and not member.closed and not _stopped(obj):
                return True
        return False


class BatchWeaveCollector(Collector):
    """Reads the counters of tracked producers and consumers at scrape time.

    Objects are held weakly. Objects inherited from the parent of a ``fork()`` are skipped
    (their threads stay in the parent; a child serves its own). Each label set is exported once
    (two samples of one series break a scrape), as the sum of the objects open together under
    it (e.g. two ``stride`` readers of one rank): their counters add up, and one that closes or
    is garbage-collected while another goes on still counts with its last figures, so the
    counters never drop. Gauges are those of the open objects (summed for amounts, averaged for
    latencies and windows). An object tracked while none of its label set is open (a producer
    or consumer replaced in the same process, after an error) starts the series afresh, a
    counter reset; one tracked already closed while another is open is not exported. A series
    disappears when all its objects are garbage-collected.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._order = itertools.count()
        self._scrapes = itertools.count()
        self._series: dict[tuple[str, tuple[Any, ...]], _Series] = {}

    def add_producer(self, producer: Producer) -> None:
        """Expose ``producer``'s :meth:`~batchweave.Producer.stats`."""
        self._add("producer", producer, (producer.namespace, producer.producer_id))

    def add_consumer(self, consumer: Consumer) -> None:
        """Expose ``consumer``'s :attr:`~batchweave.Consumer.stats`."""
        self._add("consumer", consumer, (consumer.namespace, consumer.dp_rank, consumer.cp_rank))

    def _add(self, kind: str, obj: Producer | Consumer, labels: tuple[Any, ...]) -> None:
        if not _ours(obj):
            return  # inherited from the parent of a fork(): counted there
        pid = current_pid()
        with self._lock:
            key = (kind, labels)
            series = self._series.get(key)
            if series is not None and series.pid == pid:
                if any(member.ref() is obj for member in series.members):
                    return  # tracked twice
                if series.has_open():
                    if not _stopped(obj):  # open together: both count
                        series.members.append(_Member(obj, next(self._order)))
                    return  # already closed: the open ones are the series
            # nothing open under these labels: this object starts the series afresh
            series = self._series[key] = _Series(pid)
            series.members.append(_Member(obj, next(self._order)))

    def describe(self) -> list[Metric]:
        """No fixed description: the series depend on what is tracked."""
        return []

    def collect(self) -> Iterator[Metric]:
        """Build every family from fresh ``stats`` snapshots."""
        pid = current_pid()
        with self._lock:
            scrape = next(self._scrapes)
            for key in [key for key, series in self._series.items() if series.pid != pid]:
                del self._series[key]  # the parent's, in a forked child
            todo = [
                (member, obj)
                for series in self._series.values()
                for member in series.members
                if not member.closed and (obj := member.ref()) is not None
            ]
        # stats outside the lock: a producer's takes its own locks
        taken = []
        for member, obj in todo:
            closed = _stopped(obj)  # read first: a stopped object's snapshot is its final one
            stats = obj.stats() if isinstance(obj, Producer) else obj.stats
            taken.append((member, stats, closed))
        with self._lock:
            for member, stats, closed in taken:
                if scrape > member.taken:
                    member.last, member.taken = stats, scrape
                member.closed = member.closed or closed
            rows: dict[str, list[tuple[tuple[Any, ...], dict[str, float], dict[str, float]]]] = {
                "producer": [],
                "consumer": [],
            }
            for key, series in list(self._series.items()):
                kind, labels = key
                counters, gauges = (
                    (_PRODUCER_COUNTERS, _PRODUCER_GAUGES)
                    if kind == "producer"
                    else (_CONSUMER_COUNTERS, _CONSUMER_GAUGES)
                )
                row = self._row(series, counters, gauges)
                if row is None:
                    del self._series[key]  # every object of it was garbage-collected
                elif row[0]:
                    rows[kind].append((labels, *row))
        yield from _families(
            rows["producer"], ["namespace", "producer_id"], _PRODUCER_COUNTERS, _PRODUCER_GAUGES
        )
        yield from _families(
            rows["consumer"],
            ["namespace", "dp_rank", "cp_rank"],
            _CONSUMER_COUNTERS,
            _CONSUMER_GAUGES,
        )

    @staticmethod
    def _row(
        series: _Series, counters: dict[str, Any], gauges: dict[str, Any]
    ) -> tuple[dict[str, float], dict[str, float]] | None:
        """The series' counters and gauges (``None``: nothing of it is left). Lock held."""
        alive = []
        for member in series.members:
            if member.ref() is None:  # collected: its last figures still count
                if member.last is not None:
                    for attr in counters:
                        value = float(getattr(member.last, attr))
                        series.gone[attr] = series.gone.get(attr, 0.0) + value
            else:
                alive.append(member)
        series.members = alive
        if not alive:
            return None
        seen = [member for member in alive if member.last is not None]
        totals = {
            attr: series.gone.get(attr, 0.0)
            + sum(float(getattr(member.last, attr)) for member in seen)
            for attr in counters
        }
        if not seen and not series.gone:
            return {}, {}  # tracked since this scrape began: nothing to show yet
        current = [member.last for member in seen if not member.closed]
        if not current and seen:  # all closed: the last tracked one's final figures
            current = [max(seen, key=lambda member: member.order).last]
        values: dict[str, float] = {}
        for attr, (_, _, summed) in gauges.items():
            found = [float(v) for s in current if (v := getattr(s, attr)) is not None]
            if found:
                values[attr] = sum(found) if summed else sum(found) / len(found)
        return totals, values


def _families(
    rows: list[tuple[tuple[Any, ...], dict[str, float], dict[str, float]]],
    labels: list[str],
    counters: dict[str, Any],
    gauges: dict[str, Any],
) -> Iterator[Metric]:
    """One family per counter and gauge, one sample per row (label values, counters, gauges)."""
    families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
    for attr, (name, doc) in counters.items():
        families[attr] = CounterMetricFamily(f"batchweave_{name}", doc, labels=labels)
    amplification = None
    if "bytes_delivered" in counters:
        amplification = GaugeMetricFamily(
            "batchweave_consumer_read_amplification",
            "bytes_read / bytes_delivered (1.0: only the rank's slices were read).",
            labels=labels,
        )
    for attr, (name, doc, _) in gauges.items():
        families[attr] = GaugeMetricFamily(f"batchweave_{name}", doc, labels=labels)
    for key, totals, values in rows:
        label_values = [str(part) for part in key]
        for attr, value in (*totals.items(), *values.items()):
            families[attr].add_metric(label_values, value)
        if amplification is not None:
            delivered = totals["bytes_delivered"]
            amplification.add_metric(
                label_values, totals["bytes_read"] / delivered if delivered else 0.0
            )
    for attr in counters:
        yield families[attr]
    if amplification is not None:
        yield amplification
    for attr in gauges:
        yield families[attr]


def _ours(obj: Producer | Consumer) -> bool:
    """Whether ``obj`` was created in this process, not in the parent of a ``fork()``.

    A forked child inherits the parent's tracked objects, whose threads stay in the parent: a
    producer's ``stats()`` refuses to run there (every scrape failed with HTTP 500) and a
    consumer's counters are the parent's, frozen at the fork. The child serves its own.
    """
    return getattr(obj, "_pid", None) == current_pid()


class _Metrics:
    """The metric objects of one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.collector = BatchWeaveCollector()
        registry.register(self.collector)
        self.window = Histogram(
            "batchweave_fragile_window_seconds_hist",
            "Fragile window of each commit attempt.",
            ["policy"],
            buckets=_WINDOW_BUCKETS,
            registry=registry,
        )
        self.gap = Histogram(
            "batchweave_commit_gap_seconds_hist",
            "Post-attempt gap chosen after each commit attempt.",
            ["policy"],
            buckets=_GAP_BUCKETS,
            registry=registry,
        )
        self.outcomes = Counter(
            "batchweave_policy_attempts",
            "Commit attempts seen by instrumented policies, by outcome.",
            ["policy", "outcome"],
            registry=registry,
        )
        self.passes = Counter(
            "batchweave_reclaim_passes", "Reclaimer passes.", ["namespace"], registry=registry
        )
        self.reclaim_errors = Counter(
            "batchweave_reclaim_errors",
            "Reclaimer passes that failed (retried by the next pass; the log says why).",
            ["namespace"],
            registry=registry,
        )
        self.reclaim_last_success = Gauge(
            "batchweave_reclaim_last_success_timestamp_seconds",
            "Wall-clock time the last reclaimer pass completed (alert when it stops moving).",
            ["namespace"],
            registry=registry,
        )
        self.reclaim_boundary = Gauge(
            "batchweave_reclaim_boundary",
            "Reclamation boundary (minimum watermark step) seen by the last pass.",
            ["namespace"],
            registry=registry,
        )
        self.reclaim_base_step = Gauge(
            "batchweave_reclaim_base_step",
            "The manifest's base_step after the last pass (steps below it are deleted).",
            ["namespace"],
            registry=registry,
        )
        self.reclaimed_objects = Counter(
            "batchweave_reclaimed_objects",
            "Objects deleted by the reclaimer.",
            ["namespace", "kind"],
            registry=registry,
        )
        self.reclaimed_bytes = Counter(
            "batchweave_reclaimed_bytes",
            "Bytes deleted by the reclaimer.",
            ["namespace", "kind"],
            registry=registry,
        )

    def observe_reclaim(
        self, namespace: str, report: ReclaimReport, *, succeeded: bool = True
    ) -> None:
        """Count a pass's deletions; a pass that failed after deleting (``succeeded=False``:
        keys the store refused, or it stopped part-way) still counts them but is no successful
        pass."""
        if succeeded:
            self.passes.labels(namespace).inc()
            self.reclaim_last_success.labels(namespace).set_to_current_time()
        self.reclaim_boundary.labels(namespace).set(report.boundary)
        self.reclaim_base_step.labels(namespace).set(report.base_step_after)
        for kind, count, nbytes in (
            ("tgb", report.tgbs_deleted, report.tgb_bytes_deleted),
            ("orphan", report.orphans_deleted, report.orphan_bytes_deleted),
            ("segment", report.segments_deleted, report.segment_bytes_deleted),
            ("manifest", report.manifests_deleted, report.manifest_bytes_deleted),
        ):
            self.reclaimed_objects.labels(namespace, kind).inc(count)
            self.reclaimed_bytes.labels(namespace, kind).inc(nbytes)


_METRICS_ATTR: Final = "_batchweave_metrics"
"""The attribute of a registry that holds its :class:`_Metrics`: they live and die with it (a
table keyed by registry kept every registry a job or test made alive for ever)."""
_registries_lock = threading.Lock()
_tracked_reclaimers: weakref.WeakKeyDictionary[Reclaimer, weakref.WeakSet[CollectorRegistry]] = (
    weakref.WeakKeyDictionary()
)
"""Registries each reclaimer's ``run_once`` already reports to."""


def metrics(registry: CollectorRegistry | None = None) -> _Metrics:
    """The BatchWeave metric objects registered in ``registry`` (default: prometheus' global)."""
    reg = REGISTRY if registry is None else registry
    with _registries_lock:
        found: _Metrics | None = getattr(reg, _METRICS_ATTR, None)
        if found is None:
            found = _Metrics(reg)
            setattr(reg, _METRICS_ATTR, found)
        return found


def track_metrics(obj: _T, *, registry: CollectorRegistry | None = None) -> _T:
    """Export ``obj``'s figures (a Producer, Consumer or Reclaimer) and return it.

    A reclaimer is tracked by wrapping its ``run_once`` (also used by its background thread).
    """
    m = metrics(registry)
    if isinstance(obj, Producer):
        m.collector.add_producer(obj)
    elif isinstance(obj, Consumer):
        m.collector.add_consumer(obj)
    elif isinstance(obj, Reclaimer):
        with _registries_lock:
            tracked_in = _tracked_reclaimers.setdefault(obj, weakref.WeakSet())
            if m.registry in tracked_in:
                return obj  # tracked twice must not count every pass twice
            tracked_in.add(m.registry)
            m.reclaim_errors.labels(obj.namespace)  # exported as 0 before the first failure
        original = obj.run_once
        namespace = obj.namespace
        reclaimer = obj
        lock = threading.Lock()  # keeps ``last_report`` before and after from one pass

        def run_once() -> ReclaimReport:
            with lock:
                before = reclaimer.last_report
                try:
                    report = original()
                except BaseException:  # Ctrl-C too: what the pass deleted is gone all the same
                    m.reclaim_errors.labels(namespace).inc()
                    partial = reclaimer.last_report
                    if partial is not None and partial is not before:
                        # the pass failed after deleting (the store refused some keys, or
                        # failed part-way): count what it deleted, which no later pass counts
                        m.observe_reclaim(namespace, partial, succeeded=False)
                    raise
                m.observe_reclaim(namespace, report)
                return report

        obj.run_once = run_once  # type: ignore[method-assign]
    else:
        raise TypeError(
            f"cannot track {type(obj).__name__}; expected Producer, Consumer or Reclaimer"
        )
    return obj


class InstrumentedPolicy(PolicyWrapper):
    """A commit policy that records every attempt's fragile window and gap in histograms.

    Every other hook is passed on unchanged: instrumenting a policy must not change its pacing.
    """

    name = "instrumented"

    def __init__(self, inner: CommitPolicy, *, registry: CollectorRegistry | None = None) -> None:
        super().__init__(inner)
        self._metrics = metrics(registry)
        self._label = inner.name

    def record(self, outcome: AttemptOutcome) -> None:
        """Delegates, then observes the window, the new gap and the outcome."""
        self.inner.record(outcome)
        self._metrics.window.labels(self._label).observe(outcome.fragile_window)
        self._metrics.gap.labels(self._label).observe(self.inner.gap)
        result = "committed" if outcome.committed else "conflict"
        self._metrics.outcomes.labels(self._label, result).inc()


def instrument_policy(
    policy: str | CommitPolicy = "dac",
    *,
    registry: CollectorRegistry | None = None,
    **options: Any,
) -> InstrumentedPolicy:
    """``policy`` (a name, built with ``options``, or an instance) with histograms attached.

    Pass the result as ``Producer(..., policy=instrument_policy("dac"))``.
    """
    inner = resolve_policy(policy, **options)
    return InstrumentedPolicy(inner, registry=registry)


class MetricsServer:
    """A running metrics HTTP endpoint; :meth:`close` stops it.

    A process ``fork()``ed from one that serves metrics (DataLoader workers) does not keep
    the listening socket: it is closed in the child as it starts, so :meth:`close` in the
    parent releases the port while children live, and no scrape reaches a child that has no
    serving thread. The child's :meth:`close` does nothing.
    """

    def __init__(self, server: Any, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self._pid = current_pid()
        self._lock = threading.Lock()
        self._stopped = False
        with _servers_lock:
            _serving[id(self)] = server

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self._server.server_port)

    def close(self) -> None:
        """Stop serving and release the port. Idempotent."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        with _servers_lock:
            _serving.pop(id(self), None)
        if self._pid != current_pid():
            # a forked child: the socket was closed at the fork, the thread serving it is in
            # the parent (shutdown() would wait for it forever)
            self._server.server_close()
            return
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_serving: dict[int, Any] = {}
"""The HTTP servers of the open :class:`MetricsServer` objects of this process (held strongly:
their threads serve them whether or not anything references the MetricsServer)."""
_servers_lock = threading.Lock()


def _close_sockets_in_child() -> None:
    """After ``fork()``, in the child: close the inherited listening sockets (the threads that
    serve them stayed in the parent), so that the parent's ``close()`` releases its port."""
    global _servers_lock
    _servers_lock = threading.Lock()  # may have been held by another thread at the fork
    servers = list(_serving.values())
    _serving.clear()
    for server in servers:
        with contextlib.suppress(OSError):
            server.socket.close()


os.register_at_fork(after_in_child=_close_sockets_in_child)


def start_metrics_server(
    port: int, addr: str = "127.0.0.1", *, registry: CollectorRegistry | None = None
) -> MetricsServer:
    """Serve ``/metrics`` on ``addr:port`` in a daemon thread (``port=0``: any free port).

    Binds to loopback by default: expose it deliberately (``addr="0.0.0.0"``) only on a trusted
    network. The BatchWeave metrics are registered in ``registry`` first, so the endpoint shows
    them even before anything is tracked.

    A ``port`` that is no integer (``"9100"``) or an ``addr`` that is no string is a
    ``TypeError``, a port outside ``0..65535`` a ``ValueError``, before anything is registered.
    An address that cannot be served on (taken, not of this machine, not resolvable) is an
    ``OSError`` naming ``addr:port`` and what to change.
    """
    port = as_int("port", port)
    if not 0 <= port <= _MAX_PORT:
        raise ValueError(
            f"port must be a TCP port in 0..{_MAX_PORT} (0: any free port), got {port}"
        )
    if not isinstance(addr, str):
        raise TypeError(
            f"addr must be a str, the IP address or host name of this machine to serve on "
            f"(e.g. '127.0.0.1'), got the {type(addr).__name__} {addr!r}"
        )
    reg = REGISTRY if registry is None else registry
    metrics(reg)
    try:
        server, thread = start_http_server(port, addr=addr, registry=reg)
    except OSError as exc:
        raise _bind_error(exc, addr, port) from exc
    return MetricsServer(server, thread)


_MAX_PORT = 65535
_LOCAL_ADDRESSES = (
    "addr must be an IP address or host name of this machine: '127.0.0.1' (loopback, the "
    "default), '0.0.0.0' (every interface) or one of its interfaces' addresses"
)


def _bind_error(exc: OSError, addr: str, port: int) -> OSError:
    """``exc`` (from serving on ``addr:port``) as an error of the same kind (errno, and
    ``socket.gaierror`` for an address that does not resolve) saying what to change."""
    if isinstance(exc, socket.gaierror):
        hint = f"; {addr!r} does not resolve: {_LOCAL_ADDRESSES}"
    elif exc.errno == errno.EADDRINUSE:
        hint = (
            "; another process (or a metrics server not closed) holds it: pick another port, or "
            "0 for any free one"
        )
    elif exc.errno == errno.EADDRNOTAVAIL:
        hint = f"; no interface of this machine has the address {addr!r}: {_LOCAL_ADDRESSES}"
    elif exc.errno == errno.EACCES:
        hint = "; a port below 1024 needs privileges: pick a port of 1024 or more, or 0"
    else:
        hint = ""
    message = f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc}{hint}"
    if isinstance(exc, socket.gaierror):
        return socket.gaierror(exc.errno, message)
    return OSError(exc.errno, message)  # a PermissionError for EACCES, as raised

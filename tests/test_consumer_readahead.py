"""When the consumer reads ahead: only while a step's reads are slow *and* mostly wait.

Reads here move a fake wall clock and a fake CPU clock forward by set amounts, so a "2 ms read
with 1.8 ms of CPU" (a page-cache copy on a busy machine) and a "2 ms read with 0.1 ms of CPU"
(a network read) cost no real time and no real CPU.

Steps whose slices lie in several objects are read on pool threads, so their CPU share is not
measured: such streams follow the latency rule alone, and slow reads are still read ahead.
"""

from __future__ import annotations

import threading

import pytest
from fake_time import FakeTime
from manifest_helpers import one_object_per_chunk
from prometheus_client import CollectorRegistry
from test_consumer import parse, produce

from batchweave import (
    ByteRange,
    Consumer,
    MemoryStore,
    Mesh,
    ObjectStore,
    StoreWrapper,
    track_metrics,
)
from batchweave._manifest import Committed, ManifestLog

STEPS = 40
MULTI_OBJECT_STEPS = 20
ANY = 1 << 30
"""A read budget no number of consumers left open by other tests of this process can exhaust."""


@pytest.fixture(scope="module")
def steps() -> MemoryStore:
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2), tgbs=STEPS)
    return store


class TimedReads(StoreWrapper):
    """Each range read moves the fake wall clock by ``wall`` and the fake CPU clock by ``cpu``
    seconds, and records the thread that issued it."""

    def __init__(self, inner: ObjectStore, *, wall: float, cpu: float) -> None:
        super().__init__(inner)
        self.time = FakeTime()
        self.wall = wall
        self.cpu = cpu
        self.cpu_now = 0.0
        self.cpu_reads = 0
        self.threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def cpu_clock(self) -> float:
        with self._lock:
            self.cpu_reads += 1
            return self.cpu_now

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        with self._lock:
            self.cpu_now += self.cpu
            self.threads.add(threading.current_thread())
        self.time.advance(self.wall)
        return self.inner.get_range(key, rng)


def _reader(store: TimedReads, **options: float) -> Consumer:
    options = {"prefetch_min_latency": 0.001, "prefetch": 4, **options}
    return Consumer(
        store,
        "run",
        mesh=Mesh(dp=2),
        dp_rank=1,
        ramp_every=1,
        max_process_reads=ANY,
        clock=store.time.clock,
        sleep=store.time.sleep,
        cpu_clock=store.cpu_clock,
        **options,  # type: ignore[arg-type]
    )


def test_slow_reads_that_are_cpu_work_stay_on_the_callers_thread(steps: MemoryStore) -> None:
    store = TimedReads(steps, wall=0.002, cpu=0.0018)  # a page-cache copy on a busy machine
    c = _reader(store)
    in_flight = []
    for step, data in c:
        assert parse(data)[1] == step
        in_flight.append(c.stats.in_flight)
    assert in_flight == [0] * STEPS
    assert store.threads == {threading.current_thread()}
    stats = c.stats
    assert stats.read_latency is not None
    assert stats.read_latency >= 0.002
    assert stats.read_cpu_share == pytest.approx(0.9)
    c.close()


def test_slow_reads_that_wait_are_read_ahead(steps: MemoryStore) -> None:
    store = TimedReads(steps, wall=0.002, cpu=0.0001)  # a network read
    c = _reader(store)
    in_flight = [c.stats.in_flight for _ in c]
    assert min(in_flight[1:20]) >= 2
    assert len(store.threads) > 1
    share = c.stats.read_cpu_share
    assert share is not None
    assert share == pytest.approx(0.05)
    c.close()


def test_read_ahead_follows_the_cpu_share_as_it_moves(steps: MemoryStore) -> None:
    store = TimedReads(steps, wall=0.002, cpu=0.0018)
    c = _reader(store)
    in_flight = []
    for step, _ in c:
        in_flight.append(c.stats.in_flight)
        if step == 7:
            store.cpu = 0.0001  # the same reads now wait: worth reading ahead
        elif step == 17:
            store.cpu = 0.0018  # and now they are CPU work again
    assert in_flight[:8] == [0] * 8
    assert max(in_flight[8:18]) >= 2
    # Read ahead all the way, the last steps would drain 4, 3, 2, 1, 0 steps in flight.
    assert in_flight[-8:] == [0] * 8
    c.close()


def test_one_slow_read_among_fast_cpu_reads_starts_no_read_ahead(steps: MemoryStore) -> None:
    # Page-cache copies of 100 us, one of them descheduled for 10 ms (a busy machine): the
    # latency average jumps past 1 ms while no CPU share is known (fast reads are not
    # measured). Reading ahead then would hand CPU work to threads; the next read is measured
    # on the caller's thread instead, shows the reads are CPU work, and all stay inline.
    store = TimedReads(steps, wall=0.0001, cpu=0.0001)
    c = _reader(store)
    in_flight = []
    for step, _ in c:
        in_flight.append(c.stats.in_flight)
        store.wall, store.cpu = (0.01, 0.0001) if step == 9 else (0.0001, 0.0001)
    assert in_flight == [0] * STEPS
    assert store.threads == {threading.current_thread()}
    c.close()


def test_the_cpu_clock_is_not_read_while_reads_are_fast(steps: MemoryStore) -> None:
    store = TimedReads(steps, wall=0.0001, cpu=0.0001)  # 100 us: far below 1 ms
    c = _reader(store)
    assert [parse(d)[1] for _, d in c] == list(range(STEPS))
    # Only the first step is measured (no moving average yet): two readings, none after, and
    # the share of that first step is forgotten when the second is not measured.
    assert store.cpu_reads == 2
    assert c.stats.read_cpu_share is None
    c.close()


def test_the_cpu_clock_is_read_from_half_the_latency_threshold(steps: MemoryStore) -> None:
    store = TimedReads(steps, wall=0.0006, cpu=0.0006)  # above half of 1 ms, below 1 ms
    c = _reader(store)
    in_flight = [c.stats.in_flight for _ in c]
    assert in_flight == [0] * STEPS  # below the latency threshold: inline whatever the share
    assert store.cpu_reads == 2 * STEPS
    c.close()


def test_the_first_steps_count_alike_in_the_cpu_share(steps: MemoryStore) -> None:
    store = TimedReads(steps, wall=0.002, cpu=0.0001)
    c = _reader(store, prefetch=0)  # nothing read ahead: each share is read after its step
    shares = []
    for step, _ in c:
        shares.append(c.stats.read_cpu_share)
        store.cpu = 0.0018 if step < 5 else 0.0001
    # The mean of the first five steps (0.05, then 0.9 four times), then a moving average in
    # which each new step weighs 0.2. A moving average from the first step on would leave the
    # share of one unrepresentative first step (with every rank starting at once) in charge.
    assert shares[:3] == pytest.approx([0.05, 0.475, 0.6166667])
    assert shares[4] == pytest.approx(0.73)
    assert shares[5] == pytest.approx(0.73 + 0.2 * (0.9 - 0.73))
    assert shares[6] == pytest.approx(shares[5] + 0.2 * (0.05 - shares[5]))


@pytest.mark.parametrize("options", [{"prefetch_min_latency": 0}, {"prefetch_max_cpu_share": 1}])
def test_either_threshold_at_its_limit_turns_the_cpu_rule_off(
    steps: MemoryStore, options: dict[str, float]
) -> None:
    store = TimedReads(steps, wall=0.002, cpu=0.002)  # all CPU: inline under the rule
    c = _reader(store, **options)
    in_flight = [c.stats.in_flight for _ in c]
    assert max(in_flight) >= 2
    assert store.cpu_reads == 0
    assert c.stats.read_cpu_share is None
    c.close()


@pytest.mark.parametrize("share", [0, -0.5, 1.01, float("nan")])
def test_a_prefetch_max_cpu_share_outside_0_1_is_refused(share: float) -> None:
    with pytest.raises(ValueError, match=r"prefetch_max_cpu_share must be in \(0, 1\], got"):
        Consumer(MemoryStore(), "run", mesh=Mesh(dp=1), dp_rank=0, prefetch_max_cpu_share=share)


def test_the_cpu_share_is_exported_as_a_metric(steps: MemoryStore) -> None:
    store = TimedReads(steps, wall=0.002, cpu=0.0018)
    registry = CollectorRegistry()
    c = track_metrics(_reader(store), registry=registry)
    for _ in c:
        pass
    labels = {"namespace": "run", "dp_rank": "1", "cp_rank": "0"}
    exported = registry.get_sample_value("batchweave_consumer_read_cpu_share", labels)
    assert exported == c.stats.read_cpu_share
    assert exported == pytest.approx(0.9)
    c.close()


# -- steps whose slices lie in several objects -------------------------------------------------


class _SlowNetworkReads(StoreWrapper):
    """Every range read takes 2 ms of (fake) wall time and 0.1 ms of (fake) CPU: a network read."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.time = FakeTime()
        self.cpu_now = 0.0
        self._lock = threading.Lock()

    def cpu_clock(self) -> float:
        with self._lock:
            return self.cpu_now

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        with self._lock:
            self.cpu_now += 0.0001
        self.time.advance(0.002)
        return self.inner.get_range(key, rng)


def _two_objects_per_tgb(store: ObjectStore, namespace: str) -> None:
    """A sealed namespace (mesh dp=1, cp=2) whose TGBs each hold CP chunk ``c`` in object ``c``.

    The format allows a TGB to be several objects (``TgbObjectRef.first_slice``); a consumer
    with ``cp=1`` then reads both chunks of a step from two objects, on pool threads.
    """
    log = ManifestLog(store, namespace)
    base = log.create_or_open(Mesh(dp=1, cp=2))
    for step in range(MULTI_OBJECT_STEPS):
        chunks = [f"{step}:{chunk}".encode() for chunk in range(2)]
        desc = one_object_per_chunk(log, step, chunks)
        result = log.commit(base, append=[desc], seal=step == MULTI_OBJECT_STEPS - 1)
        assert isinstance(result, Committed)
        base = result.manifest


def test_steps_in_several_objects_are_read_ahead_when_reads_wait() -> None:
    # docs/consumer.md: steps whose slices lie in several objects are read on pool threads, so
    # their CPU share is not measured, "and such streams follow the latency rule alone". Slow
    # reads (2 ms, above prefetch_min_latency) are then read ahead; no read-ahead at all
    # would leave every step's latency on the training loop.
    inner = MemoryStore()
    _two_objects_per_tgb(inner, "multi")
    store = _SlowNetworkReads(inner)
    c = Consumer(
        store,
        "multi",
        mesh=Mesh(dp=1, cp=1),
        dp_rank=0,
        prefetch=4,
        ramp_every=1,
        max_process_reads=1 << 30,
        clock=store.time.clock,
        sleep=store.time.sleep,
        cpu_clock=store.cpu_clock,
    )
    in_flight = []
    for step, data in c:
        assert data == [f"{step}:0".encode(), f"{step}:1".encode()]
        in_flight.append(c.stats.in_flight)
    c.close()
    assert len(in_flight) == MULTI_OBJECT_STEPS
    assert c.stats.read_cpu_share is None  # never measured: the latency rule alone decides
    assert max(in_flight) >= 2

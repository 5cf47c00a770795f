"""The consumer's read pipeline: staggered prefetch, concurrency, nested jobs, footer cache."""

from __future__ import annotations

import gc
import threading
import time
from concurrent.futures import CancelledError, ThreadPoolExecutor

import pytest
from fake_time import FakeTime
from test_consumer import parse, produce

from batchweave import ByteRange, Consumer, MemoryStore, Mesh, ObjectStore, StoreWrapper
from batchweave._consumer._prefetch import Job, SingleFlightCache, Workers, gather
from batchweave._consumer._registry import OPEN_CONSUMERS, _OpenConsumers


class ConcurrencyProbe(StoreWrapper):
    """Passes through to ``inner`` and records the most range reads ever in flight at once."""

    def __init__(self, inner: ObjectStore, latency: float) -> None:
        super().__init__(inner)
        self.latency = latency
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        with self._lock:
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            time.sleep(self.latency)  # simulated network latency, not synchronization
            return self.inner.get_range(key, rng)
        finally:
            with self._lock:
                self.in_flight -= 1


ANY = 1 << 30
"""A read budget no number of consumers left open by other tests of this process can exhaust."""


@pytest.fixture(scope="module")
def ten_steps() -> MemoryStore:
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2), tgbs=10)
    return store


def _reader(
    store: ObjectStore,
    *,
    prefetch: int,
    dp_rank: int = 0,
    ramp_every: int = 1,
    min_latency: float = 0,
    budget: int = ANY,
    fake: FakeTime | None = None,
) -> Consumer:
    """A rank-``dp_rank`` consumer of the ten-step namespace ``run`` for the read-ahead tests.

    By default it reads ahead however fast reads are (memory reads are fast) and whatever other
    tests of this process left open; ``fake`` puts it on a fake clock.
    """
    return Consumer(
        store,
        "run",
        mesh=Mesh(dp=2),
        dp_rank=dp_rank,
        prefetch=prefetch,
        ramp_every=ramp_every,
        prefetch_min_latency=min_latency,
        max_process_reads=budget,
        clock=time.monotonic if fake is None else fake.clock,
        sleep=time.sleep if fake is None else fake.sleep,
    )


def test_prefetch_ramps_up_one_step_per_ramp_every(ten_steps: MemoryStore) -> None:
    c = _reader(ten_steps, prefetch=3, ramp_every=2)
    depth, in_flight = [], []
    for _ in c:
        depth.append(c.stats.prefetch_depth)
        in_flight.append(c.stats.in_flight)
    assert depth == [1, 2, 2, 3, 3, 3, 3, 3, 3, 3]
    # steps in flight while the caller works on the step just delivered: none after the first
    # (time to first batch: no worker is started before it returns), then bounded by the depth,
    # and draining at the end of the sealed stream
    assert in_flight == [0, 2, 2, 3, 3, 3, 3, 2, 1, 0]
    c.close()


def test_prefetch_zero_reads_on_demand(ten_steps: MemoryStore) -> None:
    c = Consumer(ten_steps, "run", mesh=Mesh(dp=2), dp_rank=1, prefetch=0)
    in_flight = [c.stats.in_flight for _ in c]
    assert in_flight == [0] * 10
    c.close()


def test_reads_of_later_steps_overlap(ten_steps: MemoryStore) -> None:
    store = ConcurrencyProbe(ten_steps, latency=0.05)
    c = _reader(store, prefetch=4, dp_rank=1, min_latency=0.001)  # 50 ms reads: read ahead
    assert [parse(d)[1] for _, d in c] == list(range(10))
    assert store.max_in_flight >= 3
    c.close()


class SlowReads(StoreWrapper):
    """Each range read moves a fake clock forward by ``latency`` seconds (no real waiting)."""

    def __init__(self, inner: ObjectStore, time: FakeTime, latency: float) -> None:
        super().__init__(inner)
        self.time = time
        self.latency = latency

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        self.time.advance(self.latency)
        return self.inner.get_range(key, rng)


def test_fast_reads_are_done_inline_and_prefetching_resumes_when_they_slow_down(
    ten_steps: MemoryStore,
) -> None:
    store = SlowReads(ten_steps, FakeTime(), latency=0.0001)  # a page-cache read: 100 us
    c = _reader(store, prefetch=4, dp_rank=1, min_latency=0.001, fake=store.time)
    seen = []
    for step, data in c:
        seen.append((step, parse(data)[1], c.stats.in_flight))
        if step == 4:
            store.latency = 0.01  # the same reads now take 10 ms: worth prefetching
    assert [(s, v) for s, v, _ in seen] == [(s, s) for s in range(10)]
    stats = c.stats
    assert stats.read_latency is not None
    assert stats.read_latency > 0.001
    in_flight = [n for _, _, n in seen]
    assert in_flight[:5] == [0] * 5  # fast: read on the caller's thread, nothing ahead
    assert max(in_flight[5:]) >= 2  # slow: read ahead again
    c.close()


class ThreadRecorder(StoreWrapper):
    """Passes through to ``inner`` and records which threads issued range reads."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.threads: set[threading.Thread] = set()

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        self.threads.add(threading.current_thread())
        return self.inner.get_range(key, rng)


def test_fast_reads_never_leave_the_callers_thread(ten_steps: MemoryStore) -> None:
    store = ThreadRecorder(ten_steps)
    c = _reader(store, prefetch=4, dp_rank=1, min_latency=60.0)  # every read counts as fast
    assert [(s, parse(d)[1]) for s, d in c] == [(s, s) for s in range(10)]
    assert store.threads == {threading.current_thread()}
    c.close()


def test_reads_slower_than_the_threshold_are_prefetched(ten_steps: MemoryStore) -> None:
    store = SlowReads(ten_steps, FakeTime(), latency=0.002)
    c = _reader(store, prefetch=3, min_latency=0.001, fake=store.time)
    in_flight = [c.stats.in_flight for _ in c]
    assert min(in_flight[1:7]) >= 2  # read ahead from the second step on
    latency = c.stats.read_latency
    assert latency is not None
    assert latency >= 0.002  # at least one read each (the shared fake clock may add others')
    c.close()


def test_open_consumers_of_a_process_share_its_read_budget(ten_steps: MemoryStore) -> None:
    def consumer(budget: int) -> Consumer:
        return _reader(ten_steps, prefetch=4, budget=budget)

    gc.collect()  # no consumer another test dropped unclosed may be collected mid-test
    others = [consumer(ANY) for _ in range(3)]
    open_now = OPEN_CONSUMERS.count
    # A budget of one read per open consumer leaves nothing to read ahead: every step is read
    # when the caller asks, on the caller's thread.
    tight = consumer(open_now + 1)
    assert [tight.stats.in_flight for _ in tight] == [0] * 10
    tight.close()
    # Room for two reads per open consumer: one step ahead each.
    loose = consumer(2 * (open_now + 1))
    assert max(loose.stats.in_flight for _ in loose) == 1
    for c in [loose, *others]:
        c.close()
    assert OPEN_CONSUMERS.count == open_now - 3
    tight.close()  # closing twice releases nothing twice
    assert OPEN_CONSUMERS.count == open_now - 3


def test_a_consumer_never_closed_releases_its_share_when_collected(
    ten_steps: MemoryStore,
) -> None:
    gc.collect()  # consumers other tests dropped without closing: collected now, not below
    before = OPEN_CONSUMERS.count
    c = Consumer(ten_steps, "run", mesh=Mesh(dp=2), dp_rank=0)
    assert OPEN_CONSUMERS.count == before + 1
    del c
    gc.collect()
    assert OPEN_CONSUMERS.count == before


def test_a_negative_prefetch_min_latency_is_refused() -> None:
    with pytest.raises(ValueError, match="prefetch_min_latency must be >= 0 seconds, got -1"):
        Consumer(MemoryStore(), "run", mesh=Mesh(dp=1), dp_rank=0, prefetch_min_latency=-1)


def test_gather_runs_jobs_concurrently_and_in_order() -> None:
    barrier = threading.Barrier(4, timeout=10)

    def job(i: int) -> int:
        barrier.wait()  # passes only if all four run at the same time
        return i * i

    pool = Workers(3, name="test")
    assert gather(pool, [lambda i=i: job(i) for i in range(4)]) == [0, 1, 4, 9]
    pool.close()


def test_nested_gather_on_a_single_worker_does_not_deadlock() -> None:
    pool = Workers(1, name="test")
    results: dict[int, list[int]] = {}
    all_done = threading.Event()

    def parent(i: int) -> None:
        results[i] = gather(pool, [lambda j=j: 10 * i + j for j in range(3)])
        if len(results) == 3:
            all_done.set()

    for i in range(3):  # all three parents run on the one worker, never on this thread
        pool.submit(Job(lambda i=i: parent(i)))
    assert all_done.wait(10)
    assert results == {0: [0, 1, 2], 1: [10, 11, 12], 2: [20, 21, 22]}
    pool.close()


def test_gather_raises_the_first_failure_after_all_jobs_finished() -> None:
    finished = []

    def ok() -> int:
        time.sleep(0.01)
        finished.append(1)
        return 1

    def bad() -> int:
        raise KeyError("boom")

    pool = Workers(2, name="test")
    with pytest.raises(KeyError, match="boom"):
        gather(pool, [bad, ok, ok])
    assert finished == [1, 1]
    pool.close()


def test_gather_on_closed_workers_runs_everything_on_the_caller() -> None:
    pool = Workers(2, name="test")
    pool.close()
    me = threading.get_ident()
    assert gather(pool, [threading.get_ident] * 3) == [me, me, me]
    assert pool.threads == ()


def test_single_flight_cache_loads_once_for_concurrent_callers() -> None:
    cache: SingleFlightCache[str, int] = SingleFlightCache(4)
    loads = []
    release = threading.Event()

    def load() -> int:
        loads.append(1)
        release.wait(10)
        return 42

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(cache.get, "k", load) for _ in range(8)]
        release.set()
        results = [f.result(timeout=10) for f in futures]
    assert loads == [1]
    assert sorted(results) == [(42, False)] + [(42, True)] * 7


def test_single_flight_cache_failure_is_not_cached_and_lru_is_bounded() -> None:
    cache: SingleFlightCache[int, int] = SingleFlightCache(2)

    def fail() -> int:
        raise OSError("transient")

    with pytest.raises(OSError, match="transient"):
        cache.get(1, fail)
    assert cache.get(1, lambda: 1) == (1, False)
    assert cache.get(2, lambda: 2) == (2, False)
    assert cache.get(1, lambda: -1) == (1, True)  # refreshes 1: 2 is now the oldest
    assert cache.get(3, lambda: 3) == (3, False)
    assert len(cache) == 2
    assert cache.get(2, lambda: 20) == (20, False)  # 2 was evicted
    assert cache.get(3, lambda: -3) == (3, True)


def test_a_job_no_worker_has_started_runs_on_the_caller() -> None:
    release = threading.Event()
    pool = Workers(1, name="test")
    pool.submit(Job(release.wait))  # the only worker is busy
    job = Job(threading.get_ident)
    pool.submit(job)
    assert job.result() == threading.get_ident()
    release.set()
    pool.close()
    for thread in pool.threads:
        thread.join(10)
        assert not thread.is_alive()
    # the worker reached the job after the caller had run it: nothing ran twice
    assert job.result() == threading.get_ident()


def test_a_job_runs_exactly_once_whether_a_worker_or_the_caller_claims_it() -> None:
    runs: list[int] = []
    pool = Workers(2, name="test")

    def work(i: int) -> int:
        runs.append(i)
        return i

    jobs = [Job(lambda i=i: work(i)) for i in range(500)]
    for job in jobs:
        pool.submit(job)
    assert [job.result() for job in jobs] == list(range(500))  # races the workers
    pool.close()
    for thread in pool.threads:
        thread.join(10)
    assert sorted(runs) == list(range(500))
    assert 1 <= len(pool.threads) <= 2


def test_a_job_result_waits_for_the_worker_running_it_and_reraises_its_error() -> None:
    started, release = threading.Event(), threading.Event()

    def fail() -> None:
        started.set()
        release.wait(10)
        raise KeyError("boom")

    pool = Workers(1, name="test")
    job = Job(fail)
    pool.submit(job)
    assert started.wait(10)
    threading.Timer(0.01, release.set).start()
    with pytest.raises(KeyError, match="boom"):
        job.result()  # the worker claimed it: the caller waits instead of running it again
    assert release.is_set()
    pool.close()


def test_a_cancelled_job_never_runs() -> None:
    ran: list[int] = []
    job = Job(lambda: ran.append(1))
    job.cancel()
    job.run_if_unclaimed()
    assert ran == []
    with pytest.raises(CancelledError):
        job.result()


def test_cancelling_a_running_job_lets_it_finish() -> None:
    started, release = threading.Event(), threading.Event()

    def work() -> int:
        started.set()
        release.wait(10)
        return 7

    pool = Workers(1, name="test")
    job = Job(work)
    pool.submit(job)
    assert started.wait(10)
    job.cancel()  # too late: ignored
    release.set()
    assert job.result() == 7
    pool.close()


def test_workers_start_at_most_max_workers_threads_and_stop_when_closed() -> None:
    release = threading.Event()
    pool = Workers(3, name="test")
    jobs = [Job(lambda: release.wait(10)) for _ in range(6)]
    for job in jobs:
        pool.submit(job)
    assert len(pool.threads) == 3
    release.set()
    assert all(job.result() for job in jobs)
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(Job(threading.get_ident))
    for thread in pool.threads:
        thread.join(10)
        assert not thread.is_alive()


def test_workers_collected_without_close_stop_their_threads() -> None:
    pool = Workers(1, name="test")
    done = threading.Event()
    pool.submit(Job(done.set))
    assert done.wait(10)
    threads = pool.threads
    del pool
    gc.collect()
    for thread in threads:
        thread.join(10)
        assert not thread.is_alive()


class WorkerGate(StoreWrapper):
    """Range reads on threads other than ``caller`` wait for ``gate``; records who read what."""

    def __init__(self, inner: ObjectStore, caller: threading.Thread) -> None:
        super().__init__(inner)
        self.caller = caller
        self.gate = threading.Event()
        self.worker_waiting = threading.Event()
        self.worker_keys: list[str] = []

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        if threading.current_thread() is not self.caller:
            self.worker_keys.append(key)
            self.worker_waiting.set()
            assert self.gate.wait(10)
        return self.inner.get_range(key, rng)


def test_close_cancels_the_steps_no_worker_has_started_and_stops_the_workers(
    ten_steps: MemoryStore,
) -> None:
    store = WorkerGate(ten_steps, threading.current_thread())
    c = Consumer(
        store, "run", mesh=Mesh(dp=2), dp_rank=0, prefetch=4, ramp_every=1,
        prefetch_min_latency=0, max_process_reads=ANY, max_workers=1,
    )  # fmt: skip
    next(c)
    next(c)  # read on this thread; then steps 2 to 4 are handed to the one worker
    assert c.stats.in_flight == 3
    assert store.worker_waiting.wait(10)  # the worker is in step 2's read; 3 and 4 are queued
    workers = c._pool
    assert workers is not None
    c.close()
    store.gate.set()
    for thread in workers.threads:
        thread.join(10)
        assert not thread.is_alive()
    assert len(set(store.worker_keys)) == 1  # step 2's object only: 3 and 4 never started


def test_closing_a_consumer_in_the_middle_of_opening_another_never_blocks() -> None:
    # close() may run in a signal handler (SIGTERM) or a finalizer of an unclosed consumer,
    # between two bytecodes of the same thread's opened(). A lock held by opened() would hang
    # it there forever; set operations are atomic at that level.
    counter = _OpenConsumers()
    first = counter.opened()

    class InterruptedAdd(set[object]):
        def add(self, item: object) -> None:
            counter.closed(first)  # what the handler does, mid-opened()
            super().add(item)

    counter._tokens = InterruptedAdd(counter._tokens)
    second = counter.opened()
    assert counter.count == 1
    counter.closed(second)
    counter.closed(second)  # a second close of one consumer releases nothing more
    assert counter.count == 0

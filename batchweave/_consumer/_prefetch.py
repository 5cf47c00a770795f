"""Concurrency helpers of the consumer's read pipeline: nested parallel jobs, single-flight cache.

The consumer runs every read on one bounded set of worker threads (:class:`Workers`). A step's
fetch may fan out (one read per object, several part reads per large slice) and wait for its
sub-reads, which on a bounded pool can deadlock when every worker is a waiting parent.
:func:`gather` avoids that: a job is *claimed* by whichever thread gets to it first, a worker or
the waiting parent, which runs every unclaimed job itself. A parent therefore only ever waits for
jobs that are already running, so progress never depends on a free worker.

Read-ahead hands one job per step to a worker, so these are built for that path's CPU cost: a
:class:`Job` is its own work item and result (one lock, no ``Future``), and submitting one is an
append to a queue.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from queue import SimpleQueue
from typing import Any, Generic, TypeVar, cast

__all__ = ["Job", "SingleFlightCache", "Workers", "gather"]

T = TypeVar("T")
K = TypeVar("K")


class Job(Generic[T]):
    """One callable that runs at most once, on whichever thread claims it first.

    Submit it to :class:`Workers` and call :meth:`result` from the thread that needs the result:
    if no worker has started the job yet, the caller runs it itself instead of waiting for a
    worker to be scheduled.
    """

    __slots__ = ("_error", "_fn", "_lock", "_result")

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn: Callable[[], T] | None = fn
        # Held while the job runs, so it doubles as the completion signal: :meth:`result`
        # acquires it to wait for a running job, or to run an unclaimed one.
        self._lock = threading.Lock()
        self._result: T | None = None
        self._error: BaseException | None = None

    def run_if_unclaimed(self) -> None:
        """Run the job on this thread unless it ran, runs or was cancelled: then return at once."""
        if self._lock.acquire(blocking=False):
            try:
                self._run()
            finally:
                self._lock.release()

    def result(self) -> T:
        """The job's return value (or exception), running it here if no thread has started it.

        Waits for a job running on another thread; raises :class:`CancelledError` if cancelled.
        """
        with self._lock:
            self._run()
        if self._error is not None:
            raise self._error
        return cast(T, self._result)

    def cancel(self) -> None:
        """Make sure the job never starts; one already running finishes and is ignored."""
        if self._lock.acquire(blocking=False):
            if self._fn is not None:
                self._fn = None
                self._error = CancelledError()
            self._lock.release()

    def _run(self) -> None:
        """Run the job unless it already ran (or was cancelled); the caller holds the lock."""
        fn, self._fn = self._fn, None  # also drops what the callable holds once it ran
        if fn is None:
            return
        try:
            self._result = fn()
        except BaseException as exc:
            self._error = exc


class Workers:
    """Up to ``max_workers`` daemon threads running submitted jobs in submission order.

    A lean stand-in for a ``ThreadPoolExecutor`` of :class:`Job`: a job is already its own work
    item and result, so a submission is a queue put (no ``Future``, no work item, no lock in the
    common case). A thread is started only when no started one is idle, like the executor does.
    The threads are daemons: one blocked on a store read must not hold up interpreter exit (an
    executor's threads are joined at exit instead, which is what a daemon avoids).
    """

    def __init__(self, max_workers: int, *, name: str) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.max_workers = max_workers
        self._name = name
        self._queue: SimpleQueue[Job[Any] | None] = SimpleQueue()
        # One token per worker waiting for a job (deque appends and pops are atomic).
        self._idle: deque[None] = deque()
        self._threads: list[threading.Thread] = []
        self._spawn_lock = threading.Lock()
        self._closed = False
        # Also stops the threads of workers that are collected without being closed.
        self._stop = weakref.finalize(self, _stop, self._queue, self._threads)

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The worker threads started so far."""
        return tuple(self._threads)

    def submit(self, job: Job[Any]) -> None:
        """Queue ``job`` for a worker; raises ``RuntimeError`` after :meth:`close`."""
        if self._closed:
            raise RuntimeError(f"{self._name} workers are closed")
        try:
            self._idle.pop()  # a waiting worker will take this job
        except IndexError:
            self._spawn()
        self._queue.put(job)

    def close(self) -> None:
        """Let every worker exit once the queued jobs are done; returns at once. Idempotent.

        Jobs still queued are run by workers as usual: cancel those nobody should run first.
        Never waits for a lock: a signal handler may call it on a thread that is in
        :meth:`_spawn` (``_stop`` runs once however often it is called).
        """
        self._closed = True
        self._stop()

    def _spawn(self) -> None:
        with self._spawn_lock:
            if self._closed or len(self._threads) >= self.max_workers:
                return
            thread = threading.Thread(
                target=_work,
                args=(self._queue, self._idle),
                name=f"{self._name}-{len(self._threads)}",
                daemon=True,
            )
            thread.start()
            self._threads.append(thread)
            if self._closed:  # close() ran meanwhile and may not have counted this thread
                self._queue.put(None)


def _stop(queue: SimpleQueue[Job[Any] | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        queue.put(None)  # one exit signal per worker, behind the queued jobs


def _work(queue: SimpleQueue[Job[Any] | None], idle: deque[None]) -> None:
    """A worker's loop. It holds the queue, not the :class:`Workers`, so that can be collected."""
    while (job := queue.get()) is not None:
        job.run_if_unclaimed()
        del job  # do not keep the finished job (and its result) alive while waiting
        idle.append(None)


def gather(workers: Workers | None, fns: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``fns`` concurrently on ``workers`` and the calling thread; return results in order.

    Safe to call from inside a job running on the same workers (see the module docstring). The
    first failure is raised after every job has finished, so no job still writes into a buffer
    its caller has given up on.
    """
    if workers is None or len(fns) <= 1:
        return [fn() for fn in fns]
    jobs = [Job(fn) for fn in fns]
    for job in jobs[1:]:
        try:
            workers.submit(job)
        except RuntimeError:  # the workers are closed: run the rest on this thread
            break
    for job in jobs:  # run every unclaimed job before waiting for any running one
        job.run_if_unclaimed()
    results: list[T] = []
    first: BaseException | None = None
    for job in jobs:
        try:
            results.append(job.result())
        except BaseException as exc:  # raised below, once every job has finished
            first = exc if first is None else first
    if first is not None:
        raise first
    return results


class SingleFlightCache(Generic[K, T]):
    """A bounded LRU cache whose misses are loaded once, however many threads ask at once.

    Concurrent requests for a key being loaded wait for that load; if it fails they load again
    themselves (the failure belongs to the first caller's context, not theirs).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"cache capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        self._entries: OrderedDict[K, Future[T]] = OrderedDict()
        self._closed = False

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        """Forget every entry and cache nothing from now on: :meth:`get` just loads. Loads in
        flight still finish for their callers."""
        with self._lock:
            self._closed = True
            self._entries.clear()

    def get(self, key: K, load: Callable[[], T]) -> tuple[T, bool]:
        """Return ``(value, hit)``: the cached value, or ``load()``'s, which is then cached."""
        while True:
            with self._lock:
                if self._closed:
                    break
                entry = self._entries.get(key)
                owner = entry is None
                if entry is None:
                    entry = self._entries[key] = Future()
                    while len(self._entries) > self.capacity:
                        self._entries.popitem(last=False)
                else:
                    self._entries.move_to_end(key)
            if owner:
                return self._load(key, entry, load), False
            if entry.exception() is None:  # waits for the owner's load
                return entry.result(), True
        return load(), False

    def _load(self, key: K, entry: Future[T], load: Callable[[], T]) -> T:
        try:
            value = load()
        except BaseException as exc:
            with self._lock:
                if self._entries.get(key) is entry:
                    del self._entries[key]
            entry.set_exception(exc)
            raise
        entry.set_result(value)
        return value

"""Concurrency helpers of the consumer's read pipeline: nested parallel jobs, single-flight cache.

The consumer runs every read on one bounded thread pool. A step's fetch may fan out (one read
per object, several part reads per large slice) and wait for its sub-reads, which on a bounded
pool can deadlock when every worker is a waiting parent. :func:`gather` avoids that: a job is
*claimed* by whichever thread gets to it first, the submitting pool worker or the waiting parent,
which runs every unclaimed job itself. A parent therefore only ever waits for jobs that are
already running, so progress never depends on a free worker.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Generic, TypeVar

__all__ = ["Job", "SingleFlightCache", "gather"]

T = TypeVar("T")
K = TypeVar("K")


class Job(Generic[T]):
    """One callable that runs at most once, on whichever thread claims it first.

    Submit :meth:`run_if_unclaimed` to a pool and call it again from the thread that needs the
    result: if no worker has started the job yet, the caller runs it itself instead of waiting
    for a worker to be scheduled.
    """

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._claim = threading.Lock()
        self.done: Future[T] = Future()

    def run_if_unclaimed(self) -> None:
        if not self._claim.acquire(blocking=False):
            return
        try:
            result = self._fn()
        except BaseException as exc:
            self.done.set_exception(exc)
        else:
            self.done.set_result(result)

    def cancel(self) -> None:
        """Make sure the job never starts; one already running finishes and is ignored."""
        if self._claim.acquire(blocking=False):
            self.done.cancel()


def gather(executor: Executor | None, fns: Sequence[Callable[[], T]]) -> list[T]:
    """Run ``fns`` concurrently on ``executor`` and the calling thread; return results in order.

    Safe to call from inside a job running on the same bounded executor (see the module
    docstring). The first failure is raised after every job has finished, so no job still writes
    into a buffer its caller has given up on.
    """
    if executor is None or len(fns) <= 1:
        return [fn() for fn in fns]
    jobs = [Job(fn) for fn in fns]
    for job in jobs[1:]:
        try:
            executor.submit(job.run_if_unclaimed)
        except RuntimeError:  # the executor is shutting down: run the rest on this thread
            break
    for job in jobs:
        job.run_if_unclaimed()
    errors = [job.done.exception() for job in jobs]
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return [job.done.result() for job in jobs]


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

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def get(self, key: K, load: Callable[[], T]) -> tuple[T, bool]:
        """Return ``(value, hit)``: the cached value, or ``load()``'s, which is then cached."""
        while True:
            with self._lock:
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

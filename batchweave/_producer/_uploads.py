"""The producer's upload threads: a queue that a Ctrl-C in ``append`` cannot leave half fed.

A ``ThreadPoolExecutor`` runs Python-level lock code in the submitting thread on every
``submit`` (its idle-worker semaphore, a ``Future``'s condition): a ``KeyboardInterrupt``
landing between such a lock's acquire and its release leaves the lock held by the caller's
thread for ever, and the upload threads then block on it, so ``close()`` waits for ever. Here a
submission is one call into C, ``SimpleQueue.put`` (queued, or not at all), plus a C ``deque``
pop that claims an idle thread. Only when none is idle does ``submit`` start one (at most
``max_workers - 1`` times: the first thread starts with the pool): a Ctrl-C in that
``Thread.start`` can at worst leave that one thread stuck before it takes any job, and it is
then neither counted nor joined. The threads are daemons, like the commit thread: the
producer's exit hook closes or aborts them (``_lifetime``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from queue import Empty, SimpleQueue
from typing import Any

__all__ = ["UploadThreads"]

_LOG = logging.getLogger("batchweave.producer")

_Job = tuple[Callable[..., None], tuple[Any, ...]]


class UploadThreads:
    """Up to ``max_workers`` daemon threads running submitted calls in submission order."""

    def __init__(self, max_workers: int, *, name: str) -> None:
        self.max_workers = max_workers
        self._name = name
        self._queue: SimpleQueue[_Job | None] = SimpleQueue()
        self._idle: deque[None] = deque()
        """One token per thread waiting for a job (``deque`` appends and pops are atomic)."""
        self._threads: list[threading.Thread] = []
        """The threads started (each counts one stop signal)."""
        self._working: list[threading.Thread] = []
        """The threads that began taking jobs: the ones ``shutdown`` joins."""
        self._spawn_lock = threading.Lock()
        self._closed = False
        self._spawn(idle=True)
        # Also stops the threads of a pool collected without shutdown() (a producer freed).
        weakref.finalize(self, _stop, self._queue, self._threads)

    @property
    def threads(self) -> tuple[threading.Thread, ...]:
        """The threads started so far."""
        return tuple(self._threads)

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Queue ``fn(*args)``; ``RuntimeError`` once the pool is shut down."""
        if self._closed:
            raise RuntimeError("cannot schedule new uploads after shutdown")
        self._queue.put((fn, args))  # one C call: queued, or not at all
        try:
            self._idle.pop()  # a waiting thread takes it
            return
        except IndexError:
            pass
        try:
            self._spawn(idle=False)
        except RuntimeError:
            # The OS refused another thread (a container's pids limit): the running ones take
            # the job when free, with less parallelism. Only a pool without any is stuck.
            if not self._threads:
                raise

    def shutdown(self, *, wait: bool = True, cancel: bool = False) -> None:
        """Let the threads end once the queued calls are done. ``cancel``: drop the calls not
        started (their submitter accounts for them); ``wait``: join the threads (not the
        calling one)."""
        with self._spawn_lock:  # a submit() starting a thread now either sees it closed or
            self._closed = True  # is counted below, and gets its stop signal
        if cancel:
            while True:
                try:
                    job = self._queue.get_nowait()
                except Empty:
                    break
                if job is None:  # an earlier shutdown's stop signal: keep it, and the rest
                    self._queue.put(None)
                    break
        _stop(self._queue, self._threads)
        if wait:
            current = threading.current_thread()
            for thread in list(self._working):
                if thread is not current:
                    thread.join()

    def _spawn(self, *, idle: bool) -> None:
        with self._spawn_lock:
            if self._closed or len(self._threads) >= self.max_workers:
                return
            thread = threading.Thread(
                target=_work,
                args=(self._queue, self._idle, self._working),
                name=f"{self._name}_{len(self._threads)}",
                daemon=True,
            )
            if idle:
                self._idle.append(None)
            # Counted first: a Ctrl-C in start() must not leave a running thread without its
            # stop signal (one that got stuck starting has an extra signal, never joined).
            self._threads.append(thread)
            try:
                thread.start()
            except RuntimeError:  # "can't start new thread": it never ran, so it needs no signal
                self._threads.remove(thread)
                if idle:
                    self._idle.pop()
                raise


def _stop(queue: SimpleQueue[_Job | None], threads: list[threading.Thread]) -> None:
    for _ in threads:
        queue.put(None)  # one stop signal per thread, behind the queued calls


def _work(
    queue: SimpleQueue[_Job | None], idle: deque[None], working: list[threading.Thread]
) -> None:
    """One upload thread. It holds the queue, not the pool (which can be collected), and a
    job (so its producer) only while running it."""
    working.append(threading.current_thread())
    while (job := queue.get()) is not None:
        fn, args = job
        try:
            fn(*args)
        except BaseException:  # the producer's _upload stores its own failures
            _LOG.exception("a producer upload thread's job failed")
        del job, fn, args
        idle.append(None)

"""Worker processes for the benchmarks, and a store wrapper that times every request.

:class:`WorkerPool` starts its processes once (importing batchweave and boto3 costs about a CPU
second per process, which would dominate short runs on a 2-core machine) and reuses them. A run
sends one task to each of ``n`` workers; every worker prepares (opens its store, starts its
producer or consumers), reports ready, and waits for a common "go", so set-up is never timed and
all workers start together. Times are ``time.monotonic()``, one system-wide clock on Linux, so
timestamps from different workers are comparable.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from batchweave import ByteRange, ObjectStore, PutMode, StoreWrapper

_LIVENESS_CHECK = 2.0
"""Seconds between checks that the workers a run waits for are still alive."""

Task = Callable[[dict[str, Any], Callable[[], None]], Any]
"""``task(params, ready)``: prepare, call ``ready()`` (blocks until go), measure, return a
picklable result."""


def _die_with_parent(parent: int) -> None:
    """Ask Linux to SIGTERM this worker when the benchmark process dies (no orphans)."""
    if sys.platform == "linux":
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PDEATHSIG
    if os.getppid() != parent:  # the parent died before the request above took effect
        os._exit(1)


def _worker_main(inbox: Any, outbox: Any, wid: int, parent: int) -> None:
    _die_with_parent(parent)
    while True:
        item = inbox.get()
        if item is None:
            return
        fn, params = item

        def ready() -> None:
            outbox.put(("ready", wid, None))
            if inbox.get() != "go":
                raise RuntimeError("worker expected 'go'")

        try:
            outbox.put(("done", wid, fn(params, ready)))
        except BaseException:
            outbox.put(("error", wid, traceback.format_exc()))


class WorkerPool:
    """``size`` spawned processes that run tasks in lock step (see the module docstring)."""

    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")
        self._outbox = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(size)]
        self._procs = [
            ctx.Process(target=_worker_main, args=(q, self._outbox, i, os.getpid()), daemon=True)
            for i, q in enumerate(self._inboxes)
        ]
        for p in self._procs:
            p.start()

    @property
    def size(self) -> int:
        return len(self._procs)

    def run(self, fn: Task, params: list[dict[str, Any]], *, timeout: float = 1800.0) -> list[Any]:
        """Run ``fn`` with ``params[i]`` on worker ``i``; start all together; return results."""
        if len(params) > self.size:
            raise ValueError(f"{len(params)} tasks for a pool of {self.size} workers")
        for inbox, p in zip(self._inboxes, params, strict=False):
            inbox.put((fn, p))
        n = len(params)
        results: list[Any] = [None] * n
        finished = [False] * n
        ready = done = 0
        deadline = time.monotonic() + timeout
        while done < n:
            try:
                kind, wid, value = self._outbox.get(timeout=_LIVENESS_CHECK)
            except queue.Empty:
                self._check_alive(finished)
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"benchmark run not finished after {timeout:.0f} s ({done} of {n} "
                        "workers done)"
                    ) from None
                continue
            if kind == "error":
                self._drain(n - done - 1)
                raise RuntimeError(f"benchmark worker {wid} failed:\n{value}")
            if kind == "ready":
                ready += 1
                if ready == n:
                    for inbox in self._inboxes[:n]:
                        inbox.put("go")
            else:
                results[wid] = value
                finished[wid] = True
                done += 1
        return results

    def _check_alive(self, finished: list[bool]) -> None:
        """Fail the run if a worker that still owes a result has died (the OOM killer, a
        crash in native code): it will never send one."""
        for wid, (proc, done) in enumerate(zip(self._procs, finished, strict=False)):
            if not done and not proc.is_alive():
                raise RuntimeError(
                    f"benchmark worker {wid} died (exit code {proc.exitcode}) before finishing "
                    "its task; out of memory?"
                )

    def _drain(self, others: int) -> None:
        """After a failure, let the other workers finish (release them if they wait for go)."""
        for inbox in self._inboxes:
            inbox.put("go")
        end = time.monotonic() + 120
        while others > 0 and time.monotonic() < end:
            try:
                kind, _, _ = self._outbox.get(timeout=5)
            except Exception:
                break
            if kind != "ready":
                others -= 1

    def close(self, *, wait: float = 10.0) -> None:
        """Stop the workers: let each finish its task for up to ``wait`` seconds, then kill it."""
        for inbox in self._inboxes:
            inbox.put(None)
        deadline = time.monotonic() + wait
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        # After a failure or an interrupt nothing the workers do is wanted any more.
        self.close(wait=10.0 if exc_type is None else 0.0)


@dataclass(frozen=True)
class Event:
    """One request: operation, key, start and duration (seconds), bytes, success."""

    op: str
    key: str
    start: float
    seconds: float
    nbytes: int
    ok: bool


class TimedStore(StoreWrapper):
    """Passes every call to ``inner`` and records an :class:`Event` for it. Thread-safe.

    ``keep`` decides, per (op, key), whether to record (recording 100,000 events is cheap, but
    there is no need to keep what no table reports).
    """

    def __init__(self, inner: ObjectStore, keep: Callable[[str, str], bool] | None = None) -> None:
        super().__init__(inner)
        self.events: list[Event] = []
        self._keep = keep or (lambda op, key: True)
        self._lock = threading.Lock()

    def _record(self, op: str, key: str, start: float, nbytes: int, ok: bool) -> None:
        if self._keep(op, key):
            event = Event(op, key, start, time.monotonic() - start, nbytes, ok)
            with self._lock:
                self.events.append(event)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.put_parts(key, (data,), mode=mode)

    def put_parts(
        self,
        key: str,
        parts: Sequence[bytes | memoryview],
        *,
        mode: PutMode = PutMode.OVERWRITE,
    ) -> None:
        start = time.monotonic()
        ok = False
        try:
            self.inner.put_parts(key, parts, mode=mode)
            ok = True
        finally:
            nbytes = sum(memoryview(p).nbytes for p in parts)
            self._record("cput" if mode is PutMode.CREATE else "put", key, start, nbytes, ok)

    def get(self, key: str) -> bytes:
        start = time.monotonic()
        data = self.inner.get(key)
        self._record("get", key, start, len(data), True)
        return data

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        start = time.monotonic()
        data = self.inner.get_range(key, rng)
        self._record("get_range", key, start, len(data), True)
        return data

    # StoreWrapper does not forward these two (a wrapper that changes data must not be bypassed);
    # timing them is all this wrapper does, so it passes them on and records them as range reads.
    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        began = time.monotonic()
        n = self.inner.get_range_into(key, start, buffer)
        self._record("get_range", key, began, n, True)
        return n

    def map_range(self, key: str, start: int, end: int) -> memoryview | None:
        began = time.monotonic()
        view = self.inner.map_range(key, start, end)
        if view is not None:
            self._record("get_range", key, began, len(view), True)
        return view

"""A script for tests/test_producer_lifetime_and_builders.py (run as a script, not collected).

``python _exit_thread_worker.py STORE_URL NAMESPACE N MODE [EXIT_CLOSE_TIMEOUT]``: the main
thread starts a worker thread that enters ``with bw.Producer(...) as p:``, waits until it is
inside, and returns. ``MODE``:

- ``appends``: a non-daemon thread appends offsets ``0 .. N-1`` (flushing now and then) only
  once the interpreter began to exit, then leaves the block: the producer is the worker's, so
  the exit must wait for the worker to close it, as the interpreter waits for the thread.
- ``pool``: a ``ThreadPoolExecutor`` task enters the block on an ``ExitStack`` nobody closes,
  appends ``N`` offsets and returns: the pool's idle thread stays alive until
  ``concurrent.futures``' own exit hook, which runs after BatchWeave's, so the exit cannot wait
  for it to close the producer; it must close it after ``EXIT_CLOSE_TIMEOUT`` without progress.
- ``outage``: a non-daemon thread's ``append`` blocks for ever (every data PUT fails with
  ``StoreUnavailable``, retried, and ``max_inflight_bytes=1``): the exit must not wait for it
  for ever, but close (and so abort) the producer after ``EXIT_CLOSE_TIMEOUT`` without progress.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import batchweave as bw
from batchweave._producer import _lifetime

MESH = bw.Mesh(dp=2, cp=1)
_WAIT = 30.0
"""Longest wait for what must happen (a bound on a failure, never a synchronisation)."""

_KEPT: list[object] = []
exiting = threading.Event()
"""Set by an exit hook that runs before BatchWeave's (registered later, so run earlier)."""


def payloads(offset: int) -> list[bytes]:
    return [f"{offset}/{i}".encode() for i in range(MESH.slices)]


class _Outage(bw.StoreWrapper):
    """Every data PUT fails as an unreachable store does (retried by the producer for ever)."""

    def put_parts(self, key: str, parts: Any, *args: Any, **kwargs: Any) -> None:
        if "/data/" in key:
            raise bw.StoreUnavailable("connection refused (simulated outage)")
        super().put_parts(key, parts, *args, **kwargs)

    def put(self, key: str, data: Any, *args: Any, **kwargs: Any) -> None:
        if "/data/" in key:
            raise bw.StoreUnavailable("connection refused (simulated outage)")
        super().put(key, data, *args, **kwargs)


def main() -> None:
    url, namespace, count, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if len(sys.argv) > 5:
        _lifetime.EXIT_CLOSE_TIMEOUT = float(sys.argv[5])
    store = bw.open_store(url)
    inside = threading.Event()

    def appends() -> None:
        with bw.Producer(store, namespace, producer_id="w", mesh=MESH, policy="naive") as p:
            inside.set()
            if not exiting.wait(_WAIT):
                raise RuntimeError("the interpreter never began to exit")
            for offset in range(count):
                p.append(payloads(offset), offset=offset)
                if offset % 5 == 4:
                    p.flush()
        print("worker done", flush=True)

    def outage() -> None:
        producer = bw.Producer(
            _Outage(store), namespace, producer_id="w", mesh=MESH, max_inflight_bytes=1
        )
        try:
            with producer as p:
                inside.set()
                for offset in range(count):
                    p.append(payloads(offset), offset=offset)
        except bw.BatchWeaveError as exc:
            print(f"worker ended with {type(exc).__name__}", flush=True)

    if mode == "pool":
        stack = contextlib.ExitStack()  # never closed: the producer stays in its with block

        def start() -> None:
            p = stack.enter_context(bw.Producer(store, namespace, producer_id="w", mesh=MESH))
            for offset in range(count):
                p.append(payloads(offset), offset=offset)

        pool = ThreadPoolExecutor(max_workers=1)
        _KEPT.append(pool)  # as a long-lived pool is: a collected pool's thread ends at once
        pool.submit(start).result(_WAIT)
        inside.set()
    else:
        target = {"appends": appends, "outage": outage}[mode]
        threading.Thread(target=target, name="exit-worker").start()  # not a daemon
    if not inside.wait(_WAIT):
        raise SystemExit("the worker never entered its with block")
    threading._register_atexit(exiting.set)  # type: ignore[attr-defined]
    print("main returns", flush=True)


if __name__ == "__main__":
    main()

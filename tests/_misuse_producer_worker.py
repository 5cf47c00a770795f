"""A script for tests/test_misuse_producer.py (run as a script, not collected by pytest).

``python _misuse_producer_worker.py MODE STORE_URL`` misuses a producer the way a script can:

- ``exit-without-close``: appends offsets ``resume_offset ..`` + 5 (``fixed100`` commits none of
  them by itself) and exits without ``close()``;
- ``exit-during-outage``: appends offset 0 while every data upload raises ``StoreUnavailable``,
  then dies of an unhandled exception, still without ``close()`` (``EXIT_CLOSE_TIMEOUT`` 0.5 s);
- ``atexit-close-during-outage``: the same outage, with ``close()`` registered by ``atexit``
  (which runs after BatchWeave's exit hook): prints what that ``close()`` raised;
- ``fork``: creates and uses a producer, then calls it from a ``fork()``ed child, which prints
  one JSON line: for each call, how long it took and what it raised.
"""

from __future__ import annotations

import atexit
import json
import multiprocessing
import multiprocessing.connection
import os
import sys
import time
from collections.abc import Callable, Iterable

import batchweave as bw
from batchweave._producer import _lifetime

MESH = bw.Mesh(dp=2, cp=1)


def payloads(offset: int) -> list[bytes]:
    return [f"{offset}/{i}".encode() for i in range(MESH.slices)]


class DataUploadsDown(bw.StoreWrapper):
    """The store is unreachable for data uploads (manifests still work: the start commits)."""

    def put_parts(self, key: str, parts: Iterable[bytes | memoryview], **kwargs: object) -> None:
        if "/data/" in key:
            raise bw.StoreUnavailable("connection refused (injected outage)")
        super().put_parts(key, parts, **kwargs)  # type: ignore[arg-type]


def exit_without_close(url: str) -> None:
    p = bw.Producer(bw.open_store(url), "ns", producer_id="p0", mesh=MESH, policy="fixed100")
    for offset in range(p.resume_offset, p.resume_offset + 5):
        p.append(payloads(offset), offset=offset)
    print("appended", p.committed_offset, flush=True)


def exit_during_outage(url: str) -> None:
    _lifetime.EXIT_CLOSE_TIMEOUT = 0.5
    store = DataUploadsDown(bw.open_store(url))
    p = bw.Producer(store, "ns", producer_id="p0", mesh=MESH, backoff=lambda attempt: 0.05)
    p.append(payloads(0), offset=0)
    print("appended", flush=True)
    raise RuntimeError("the script's own bug, after append")


def atexit_close_during_outage(url: str) -> None:
    _lifetime.EXIT_CLOSE_TIMEOUT = 0.5
    store = DataUploadsDown(bw.open_store(url))
    p = bw.Producer(store, "ns", producer_id="p0", mesh=MESH, backoff=lambda attempt: 0.05)

    def close() -> None:
        try:
            p.close()
            print("atexit close: returned", flush=True)
        except bw.ProducerError as exc:
            print(f"atexit close: {type(exc).__name__}: {exc}", flush=True)

    atexit.register(close)
    p.append(payloads(0), offset=0)
    print("appended", flush=True)


def _child(p: bw.Producer, conn: multiprocessing.connection.Connection) -> None:
    calls: dict[str, Callable[[], object]] = {
        "append": lambda: p.append(payloads(1), offset=1),
        "flush": lambda: p.flush(timeout=10),
        "stats": p.stats,
        "close": p.close,
    }
    results = {}
    for name, call in calls.items():
        began = time.monotonic()
        try:
            call()
            outcome = "returned"
        except BaseException as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        results[name] = [time.monotonic() - began, outcome]
    conn.send(results)


def fork(url: str) -> None:
    p = bw.Producer(bw.open_store(url), "ns", producer_id="p0", mesh=MESH)
    p.append(payloads(0), offset=0)
    p.flush()
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_child, args=(p, child))
    proc.start()
    ok = parent.poll(20)
    results = parent.recv() if ok else None
    print(json.dumps({"parent": os.getpid(), "child": proc.pid, "results": results}), flush=True)
    proc.join(20)
    if proc.is_alive():
        proc.kill()
    p.close()


if __name__ == "__main__":
    modes = {"exit-without-close": exit_without_close, "exit-during-outage": exit_during_outage}
    modes["atexit-close-during-outage"] = atexit_close_during_outage
    modes["fork"] = fork
    modes[sys.argv[1]](sys.argv[2])

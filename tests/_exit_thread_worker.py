"""A script for tests/test_producer_lifetime_and_builders.py (run as a script, not collected).

``python _exit_thread_worker.py STORE_URL NAMESPACE N``: the main thread starts a non-daemon
worker thread, waits until the worker is inside ``with bw.Producer(...) as p:``, and returns.
Only once the interpreter began to exit (its exit hooks run) does the worker append offsets
``0 .. N-1``, flushing now and then, and leave the ``with`` block: the producer is the worker's,
so the exit must wait for the worker to close it, as the interpreter waits for the thread.
"""

from __future__ import annotations

import sys
import threading
import time

import batchweave as bw

MESH = bw.Mesh(dp=2, cp=1)
_EXIT_WAIT = 30.0


def payloads(offset: int) -> list[bytes]:
    return [f"{offset}/{i}".encode() for i in range(MESH.slices)]


def main() -> None:
    url, namespace, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
    inside = threading.Event()

    def work() -> None:
        store = bw.open_store(url)
        with bw.Producer(store, namespace, producer_id="w", mesh=MESH, policy="naive") as p:
            inside.set()
            # Wait for the interpreter's exit to begin: threading's shutdown flag is set just
            # before its exit hooks (BatchWeave's among them) run. A poll, not a
            # synchronisation: the appends below must come after it in any order.
            deadline = time.monotonic() + _EXIT_WAIT
            while not getattr(threading, "_SHUTTING_DOWN", True):
                if time.monotonic() > deadline:
                    raise RuntimeError("the interpreter never began to exit")
                time.sleep(0.005)
            for offset in range(count):
                p.append(payloads(offset), offset=offset)
                if offset % 5 == 4:
                    p.flush()
        print("worker done", flush=True)

    threading.Thread(target=work, name="exit-worker").start()  # not a daemon
    if not inside.wait(_EXIT_WAIT):
        raise SystemExit("the worker never entered its with block")
    print("main returns", flush=True)


if __name__ == "__main__":
    main()

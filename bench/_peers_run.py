"""Process plumbing for ``bench/peers.py``: ranks as fresh processes, CPU/RSS accounting, NATS.

Every rank (and every writer) is a *fresh spawned* process, so its peak RSS is what that system
costs and nothing leaks between systems. A process imports what it needs, reports ready, and
waits for a common "go": imports and start-up are never timed, everything after "go" is (for a
reader, constructing the dataset/consumer counts toward time to first batch). CPU seconds are
``os.times()`` deltas from "go" to the end, children included (WebDataset's ``curl``). Server
CPU is read from the server's PID with psutil, before "go" and after the last rank finished.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import resource
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil

_CTX = mp.get_context("spawn")


def cpu_seconds() -> float:
    """User+system CPU of this process and of its waited-for children (microsecond resolution)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def peak_rss_mb() -> float:
    """Peak RSS of this process in MB (``VmHWM``: unlike ``ru_maxrss`` it is not inherited
    across the ``exec`` that starts a spawned process), or of its largest child if larger."""
    hwm = 0.0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return max(hwm, kids)


def _entry(
    fn: Callable[..., dict[str, Any]], params: dict[str, Any], rank: int, q: Any, go: Any
) -> None:
    try:
        os.environ.update(params.get("env", {}))

        def ready() -> float:
            q.put(("ready", rank, None))
            go.wait()
            return time.monotonic()

        q.put(("done", rank, fn(params, rank, ready)))
    except BaseException:
        q.put(("error", rank, traceback.format_exc()))


def run_ranks(
    fn: Callable[..., dict[str, Any]],
    params: dict[str, Any],
    n: int,
    *,
    server_pids: list[int] | tuple[int, ...] = (),
    timeout: float = 1800.0,
) -> tuple[list[dict[str, Any]], float]:
    """Run ``fn(params, rank, ready)`` in ``n`` fresh processes started together.

    ``fn`` calls ``ready()`` when prepared; it returns the monotonic "go" time. Returns the
    per-rank results (rank order) and the CPU seconds the ``server_pids`` spent meanwhile.
    """
    q = _CTX.Queue()
    go = _CTX.Event()
    procs = []
    master_port = str(_free_port())  # torch.distributed rendezvous (MosaicML initializes it)
    for rank in range(n):
        env = {
            **params.get("env", {}),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(n),
            "LOCAL_WORLD_SIZE": str(n),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": master_port,
        }
        p = _CTX.Process(target=_entry, args=(fn, {**params, "env": env}, rank, q, go), daemon=True)
        p.start()
        procs.append(p)
    results: dict[int, dict[str, Any]] = {}
    errors: list[str] = []
    try:
        ready = 0
        deadline = time.monotonic() + timeout

        def get() -> tuple[str, int, Any]:
            while True:
                try:
                    return q.get(timeout=1.0)  # type: ignore[no-any-return]
                except queue.Empty:
                    dead = [
                        (r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)
                    ]
                    if dead:
                        return ("error", dead[0][0], f"process died with exit code {dead[0][1]}")
                    if time.monotonic() > deadline:
                        return ("error", -1, f"timed out after {timeout:.0f}s")

        while ready < n:
            kind, rank, payload = get()
            if kind == "ready":
                ready += 1
            elif kind == "error":
                errors.append(f"rank {rank}:\n{payload}")
                break
        server_before = server_cpu(server_pids)
        if not errors:
            go.set()
        while len(results) + len(errors) < n and not (errors and not go.is_set()):
            kind, rank, payload = get()
            if kind == "done":
                results[rank] = payload
            elif kind == "error":
                errors.append(f"rank {rank}:\n{payload}")
        server = server_cpu(server_pids) - server_before
    finally:
        # Results are in: a rank still alive is only tearing down (MosaicML's exit can take
        # seconds), so bound the total wait and kill what is left.
        stop = time.monotonic() + (5.0 if not errors else 0.5)
        for p in procs:
            p.join(timeout=max(0.0, stop - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(n)], server


def run_one(
    fn: Callable[..., dict[str, Any]], params: dict[str, Any], **kw: Any
) -> tuple[dict[str, Any], float]:
    """:func:`run_ranks` with one process (writers)."""
    results, server = run_ranks(fn, params, 1, **kw)
    return results[0], server


def server_cpu(pids: list[int] | tuple[int, ...]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
    return total


def child_pids(name: str) -> list[int]:
    """PIDs of this process's descendants named ``name`` (the SeaweedFS server we started)."""
    return [p.pid for p in psutil.Process().children(recursive=True) if _name(p) == name]


def _name(p: psutil.Process) -> str:
    try:
        return p.name()
    except psutil.Error:
        return ""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


NATS_MAX_PAYLOAD = 64 << 20
"""nats-server refuses a ``max_payload`` above 64 MB: one message cannot be larger."""


@contextlib.contextmanager
def nats_server() -> Iterator[tuple[str, int] | None]:
    """Start ``nats-server`` with JetStream file storage in a temp dir on 127.0.0.1.

    Yields ``(url, pid)``, or ``None`` when the binary is missing (``apt-get install
    nats-server``). Stopped by its PID on exit.
    """
    binary = shutil.which("nats-server")
    if binary is None:
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="bw-nats-") as tmp:
        port = _free_port()
        conf = Path(tmp) / "nats.conf"
        conf.write_text(
            f'listen: "127.0.0.1:{port}"\n'
            f"max_payload: {NATS_MAX_PAYLOAD}\n"
            "max_pending: 268435456\n"
            f'jetstream {{ store_dir: "{tmp}/js", max_file_store: 64G, max_memory_store: 256M }}\n'
        )
        log = open(Path(tmp) / "nats.log", "wb")  # noqa: SIM115 - closed below
        proc = subprocess.Popen([binary, "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                with (
                    contextlib.suppress(OSError),
                    socket.create_connection(("127.0.0.1", port), 0.2),
                ):
                    break
                if proc.poll() is not None:
                    raise RuntimeError((Path(tmp) / "nats.log").read_text()[-2000:])
                time.sleep(0.05)
            yield f"nats://127.0.0.1:{port}", proc.pid
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()

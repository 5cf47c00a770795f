"""The test-server helpers: endpoints hide secrets, servers answer, and stop when done."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest

from batchweave import S3Store
from batchweave.testing import S3Endpoint, free_port, moto_server


def _accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_endpoint_repr_hides_the_secret() -> None:
    endpoint = S3Endpoint("http://127.0.0.1:1", "key-id", "the-secret")
    assert "the-secret" not in repr(endpoint)
    assert endpoint.store_options()["secret_access_key"] == "the-secret"


def test_free_port_with_offset_returns_a_bindable_pair() -> None:
    port = free_port(also_free_at_offset=10000)
    for p in (port, port + 10000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.moto_server
def test_moto_server_serves_and_stops() -> None:
    with moto_server() as endpoint:
        port = int(endpoint.endpoint_url.rsplit(":", 1)[1])
        endpoint.create_bucket("lifecycle")
        endpoint.create_bucket("lifecycle")  # already owned is fine
        store = S3Store("lifecycle", **endpoint.store_options())
        store.put("k", b"v")
        assert store.get("k") == b"v"
    assert not _accepts_connections(port)


def _child_pids() -> set[int]:
    """The PIDs of this process's children (any of its threads')."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):
            pids.update(int(p) for p in (task / "children").read_text().split())
    return pids


@pytest.mark.moto_server
@pytest.mark.timeout(120)
@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux-only")
def test_a_server_outlives_the_thread_that_started_it() -> None:
    # PR_SET_PDEATHSIG fires when the forking *thread* exits: a server entered from a worker
    # thread was SIGTERMed as soon as that thread ended, while the test still used it.
    before = _child_pids()
    stack = contextlib.ExitStack()
    started: list[object] = []

    def start() -> None:
        started.append(stack.enter_context(moto_server(startup_timeout=60.0)))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(90.0)
    ours = _child_pids() - before
    try:
        assert not thread.is_alive()
        assert started
        endpoint = started[0]
        assert isinstance(endpoint, S3Endpoint)
        port = int(endpoint.endpoint_url.rsplit(":", 1)[1])
        # The server process is signalled when the thread exits; give it time to die.
        time.sleep(1.0)
        assert ours
        endpoint.create_bucket("outlives", timeout=10.0)
        assert _accepts_connections(port)
        stack.close()
        assert not _accepts_connections(port)
    finally:
        stack.close()
        for pid in ours & _child_pids():  # still ours and unreaped: its PID cannot be reused
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)

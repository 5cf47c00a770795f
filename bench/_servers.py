"""Storage backends for the benchmarks: a ``file://`` directory and a local SeaweedFS server.

A :class:`StoreSpec` is a picklable description of how to open a store, so worker processes
open their own client (one per process, as real producers and ranks do). The SeaweedFS server is
started by :func:`storages` itself (``batchweave.testing.seaweedfs_server``: ``weed mini`` on
127.0.0.1 free ports, stopped by its PID) and removed with its data when the run ends; what a
killed run left behind is removed by the next one (:func:`remove_stale`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchweave import ObjectStore, open_store

STORAGES = ("file", "seaweedfs")
"""Where the data lives: a local directory, or SeaweedFS (``weed mini``) over S3."""

BUCKET = "bench"
PREFIX = "bw-bench-"
"""The name of every run's directory starts with this."""
OWNER_FILE = "owner"
"""In a run's directory: ``<hostname> <pid>`` of the benchmark process that made it."""


@dataclass(frozen=True)
class StoreSpec:
    """How to open one store: ``client`` is ``file``, ``boto3`` or ``obstore``.

    ``label`` names the (storage, client) pair in result tables, e.g. ``seaweedfs/boto3``.
    """

    label: str
    client: str
    url: str
    options: dict[str, Any] = field(default_factory=dict, repr=False)
    root: str | None = None
    """The local directory of a ``file://`` store (to delete namespaces between runs)."""

    def open(self, **extra: Any) -> ObjectStore:
        """A new store instance (a new client and connection pool)."""
        if self.client == "obstore":
            from batchweave import ObstoreS3Store

            bucket, _, prefix = self.url.removeprefix("s3://").partition("/")
            return ObstoreS3Store(bucket, prefix, **self.options)
        return open_store(self.url, verify_conditional_writes=False, **self.options, **extra)

    def clean(self, namespace: str) -> None:
        """Free the disk space of ``namespace`` on a ``file://`` store (S3 data is left until
        the server stops: deleting it would cost as much server time as writing it)."""
        if self.root is not None:
            shutil.rmtree(Path(self.root) / namespace, ignore_errors=True)


def obstore_available() -> bool:
    """Whether the optional obstore S3 backend can be used."""
    try:
        import obstore  # noqa: F401
    except ImportError:
        return False
    return True


def add_file_root_option(p: argparse.ArgumentParser) -> None:
    """``--file-root``: where :func:`storages` puts the ``file://`` store (and SeaweedFS's data)."""
    p.add_argument(
        "--file-root",
        default=None,
        help="directory for the file:// store (default: the temp dir; /dev/shm takes the disk "
        "and its fsyncs out of the measurement)",
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale(parent: Path) -> list[Path]:
    """Delete the directories under ``parent`` left by benchmark runs of this host that died
    without cleaning up (SIGKILL, the OOM killer); return them.

    Under ``--file-root /dev/shm`` a leftover is memory taken from every later run. Only
    directories whose owner file names this host and a process that no longer exists are
    removed: a directory without one may belong to anything.
    """
    removed = []
    for path in parent.glob(f"{PREFIX}*"):
        try:
            host, pid = (path / OWNER_FILE).read_text().split()
            dead = host == socket.gethostname() and not _alive(int(pid))
        except (OSError, ValueError):
            continue
        if dead:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


@contextlib.contextmanager
def storages(
    names: Sequence[str], *, clients: Sequence[str] = ("boto3",), file_root: str | None = None
) -> Iterator[dict[str, list[StoreSpec]]]:
    """Start the named storages; yield ``{storage: [StoreSpec per client]}``.

    ``file`` always has the one ``file`` client; ``seaweedfs`` gets one spec per entry of
    ``clients`` (``boto3``, and ``obstore`` when installed). ``file_root`` is the directory the
    ``file`` store (and SeaweedFS's data) lives under (default: the system temp directory).
    Everything is removed on exit.
    """
    unknown = sorted(set(names) - set(STORAGES))
    if unknown:
        raise SystemExit(f"unknown storage(s) {unknown}; choose from {', '.join(STORAGES)}")
    if threading.current_thread() is threading.main_thread():
        # Make `kill <pid>` unwind the context managers: stop SeaweedFS, delete the data.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    for path in remove_stale(Path(file_root or tempfile.gettempdir())):
        print(f"removed {path}, left by a benchmark run that was killed")
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=PREFIX, dir=file_root)))
        (tmp / OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}")
        out: dict[str, list[StoreSpec]] = {}
        for name in names:
            if name == "file":
                root = tmp / "file"
                root.mkdir()
                out[name] = [StoreSpec("file", "file", f"file://{root}", root=str(root))]
                continue
            from batchweave.testing import seaweedfs_server

            endpoint = stack.enter_context(seaweedfs_server(tmp))
            endpoint.create_bucket(BUCKET)
            options = endpoint.store_options()
            specs = []
            for client in clients:
                if client == "obstore" and not obstore_available():
                    print("obstore is not installed: skipping the obstore client")
                    continue
                opts = dict(options)
                if client == "boto3":
                    opts["max_pool_connections"] = 256
                specs.append(StoreSpec(f"{name}/{client}", client, f"s3://{BUCKET}", opts))
            # Pay SeaweedFS's slow first PUT into a new bucket outside any measurement.
            warm = specs[0].open()
            warm.put("warmup", b"x")
            warm.close()
            out[name] = specs
        yield out

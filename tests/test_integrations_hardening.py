"""Integrations under interruption, fork() and failure: the Lance export, metrics, test servers."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

import batchweave as bw
from batchweave.testing import moto_server, seaweedfs_server

lance = pytest.importorskip("lance")
pa = pytest.importorskip("pyarrow")

from batchweave.lance import LanceSource, export_history  # noqa: E402

# Lance warns at every fork(), subprocesses included; nothing forked here uses Lance.
pytestmark = pytest.mark.filterwarnings("ignore:lance is not fork-safe:UserWarning")

STEPS = 200


def _history_store(root: Path, steps: int = STEPS) -> str:
    url = (root / "store").as_uri()
    store = bw.open_store(url)
    with bw.Producer(store, "ns", producer_id="p", mesh=bw.Mesh(dp=2), policy="naive") as p:
        for offset in range(steps):
            p.append([b"a" * 10, b"b" * 10], offset=offset)
    return url


_EXPORT_CHILD = """
import os, signal, sys, time
import batchweave as bw
from batchweave.lance import export_history

url, dest, signame = sys.argv[1:4]
calls = []

def progress(done, total):
    calls.append(done)
    if len(calls) == 1:  # the export has started: the user presses Ctrl-C (or kill PID)
        sig = getattr(signal, signame)
        os.kill(os.getpid(), sig)
        # Go on only once the export's handler has taken the signal (a condition, not a
        # pause): the steps left must then stop at the next batch.
        taken = signal.getsignal(sig).__self__.received
        deadline = time.monotonic() + 30
        while not taken and time.monotonic() < deadline:
            time.sleep(0.001)

try:
    rows = export_history(bw.open_store(url), "ns", dest, progress=progress)
    print("finished", rows, flush=True)
except KeyboardInterrupt as exc:
    print("interrupted", type(exc).__name__, len(calls), os.path.exists(dest), flush=True)
"""


def _run_export_child(
    tmp_path: Path, signame: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    url = _history_store(tmp_path)
    dest = tmp_path / "history.lance"
    proc = subprocess.run(
        [sys.executable, "-c", _EXPORT_CHILD, url, str(dest), signame],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc, dest


def test_ctrl_c_during_export_history_raises_keyboard_interrupt_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    proc, dest = _run_export_child(tmp_path, "SIGINT")
    # Before: the KeyboardInterrupt left Lance's thread reading rows into interpreter shutdown:
    # "Fatal Python error: PyGILState_Release", exit 134, and a partial dataset directory.
    assert "Fatal Python error" not in proc.stderr
    assert proc.returncode == 0, proc.stderr
    words = proc.stdout.split()
    assert words[:2] == ["interrupted", "KeyboardInterrupt"], proc.stdout
    assert int(words[2]) < STEPS  # stopped mid-export, not after the last step
    assert words[3] == "False"
    assert not dest.exists()


def test_sigterm_during_export_history_ends_the_process_after_removing_the_dataset(
    tmp_path: Path,
) -> None:
    proc, dest = _run_export_child(tmp_path, "SIGTERM")
    assert "Fatal Python error" not in proc.stderr
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stdout, proc.stderr)
    assert "finished" not in proc.stdout
    assert not dest.exists()


def test_export_history_restores_the_signal_handlers(tmp_path: Path) -> None:
    store = bw.open_store(_history_store(tmp_path, steps=3))
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    assert export_history(store, "ns", tmp_path / "history.lance") == 6
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_a_failed_export_removes_only_the_directory_it_created(tmp_path: Path) -> None:
    store = bw.open_store(_history_store(tmp_path, steps=3))
    existing = tmp_path / "existing.lance"
    assert export_history(store, "ns", existing) == 6
    with pytest.raises(Exception, match="exist"):  # mode="create" on an existing dataset
        export_history(store, "ns", existing)
    assert lance.dataset(str(existing)).count_rows() == 6  # left alone

    store.delete_many([sorted(m.key for m in store.list("ns/data/"))[1]])
    fresh = tmp_path / "fresh.lance"
    with pytest.raises(bw.ObjectNotFound):
        export_history(store, "ns", fresh)
    assert not fresh.exists()


class _PathLike(os.PathLike[str]):
    """A path-like object that is not a ``pathlib.Path`` (its ``str()`` is not the path)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return self.path


def test_lance_accepts_any_path_like(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.lance"
    lance.write_dataset(pa.table({"id": list(range(10))}), str(corpus))
    source = LanceSource(_PathLike(str(corpus)), rows_per_batch=2)  # was: "not found"
    assert source.take(0).num_rows == 2

    store = bw.open_store(_history_store(tmp_path, steps=2))
    dest = tmp_path / "history.lance"
    assert export_history(store, "ns", _PathLike(str(dest))) == 4  # was: a dir named by repr
    assert lance.dataset(str(dest)).count_rows() == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.lance", "history.lance", "store"]


# -- metrics after fork() --------------------------------------------------------------------


def _scrape_in_child(url: str, queue: Any) -> None:
    from prometheus_client import generate_latest

    try:
        registry = _INHERITED[0]  # the parent's, with its producer and consumer tracked
        store = bw.open_store(url)
        with bw.Producer(store, "child-ns", producer_id="child", mesh=bw.Mesh(dp=1)) as p:
            bw.track_metrics(p, registry=registry)  # created after the fork, as the docs say
            p.append([b"x"], offset=0)
            queue.put(("ok", generate_latest(registry).decode()))
    except BaseException as exc:  # reported to the test
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


_INHERITED: list[Any] = []
"""The registry the forked child inherits."""


def test_objects_tracked_before_fork_do_not_break_the_childs_scrape(tmp_path: Path) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    url = _history_store(tmp_path, steps=2)
    store = bw.open_store(url)
    registry = CollectorRegistry()
    mesh = bw.Mesh(dp=2)
    parent = bw.track_metrics(
        bw.Producer(store, "ns", producer_id="parent", mesh=mesh), registry=registry
    )
    consumer = bw.track_metrics(bw.Consumer(store, "ns", mesh=mesh, dp_rank=0), registry=registry)
    next(consumer)
    assert 'producer_id="parent"' in generate_latest(registry).decode()
    _INHERITED[:] = [registry]
    try:
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_scrape_in_child, args=(url, queue))
        child.start()
        status, body = queue.get(timeout=60)
        child.join(30)
    finally:
        _INHERITED.clear()
        consumer.close()
        parent.close()
    # Before: the parent's producer.stats() raised ProducerError in the child: HTTP 500.
    assert status == "ok", body
    assert 'producer_id="child"' in body
    assert 'producer_id="parent"' not in body
    assert "batchweave_consumer_steps_total{" not in body  # the parent's, frozen at the fork


# -- test servers ----------------------------------------------------------------------------


def _fake_moto(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server_py: str) -> None:
    package = tmp_path / "fakemods" / "moto"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "server.py").write_text(textwrap.dedent(server_py))
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(package.parent), *([path] if path else [])])
    )


def test_moto_server_explains_a_missing_server_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_moto(
        tmp_path,
        monkeypatch,
        'raise ModuleNotFoundError("No module named \'flask\'", name="flask")\n',
    )
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info, moto_server(startup_timeout=60):
        pass
    message = str(info.value)
    # Before: "did not report its port within 60s (exit code None)", after 0.0 s.
    assert "exited with code 1" in message
    assert "within" not in message
    assert "pip install 'moto[server]'" in message
    assert "ModuleNotFoundError: No module named 'flask'" in message
    assert time.monotonic() - started < 30


def test_moto_server_timeout_quotes_the_childs_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_moto(
        tmp_path,
        monkeypatch,
        """
        import sys, time
        print("fake moto warming up", file=sys.stderr, flush=True)
        time.sleep(600)
        """,
    )
    with pytest.raises(RuntimeError) as info, moto_server(startup_timeout=1):
        pass
    message = str(info.value)
    assert "did not report its port within 1s" in message
    assert "fake moto warming up" in message
    assert "pip install" not in message
    pid = int(message.split("(pid ")[1].split(")")[0])
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped (and reaped), not left sleeping


def _weed_child() -> tuple[int, list[str]]:
    """The pid and command line of the ``weed`` process this process started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == os.getpid() and Path(cmdline[0]).name == "weed":
            return int(entry.name), cmdline
    raise AssertionError("no weed child process found")


def _server_files(directory: str, numbers: set[str]) -> set[str]:
    """Names in ``directory`` a weed server creates (logs, sockets) that name a number of its."""
    found = set()
    for name in os.listdir(directory):
        if name.startswith(("weed.", "seaweedfs-")):
            tokens = set(name.replace("-", ".").split("."))
            if tokens & numbers:
                found.add(name)
    return found


@pytest.mark.skipif(shutil.which("weed") is None, reason="needs the weed binary")
def test_seaweedfs_server_leaves_no_files_in_the_temp_dir(tmp_path: Path) -> None:
    temp_dirs = sorted({tempfile.gettempdir(), "/tmp"})
    before = {d: set(os.listdir(d)) for d in temp_dirs}
    with seaweedfs_server(tmp_path) as endpoint:
        endpoint.create_bucket("bucket")
        pid, cmdline = _weed_child()
    ports = {int(arg.rpartition("=")[2]) for arg in cmdline if ".port=" in arg}
    numbers = {str(pid)} | {str(p) for p in ports if p} | {str(p + 10000) for p in ports if p}
    leftovers = {d: _server_files(d, numbers) & (set(os.listdir(d)) - before[d]) for d in temp_dirs}
    # Before: /tmp/weed.<host>.<user>.log.INFO.<date>.<pid> and /tmp/seaweedfs-*-<port>.sock.
    assert leftovers == {d: set() for d in temp_dirs}
    assert (tmp_path / next(p.name for p in tmp_path.iterdir()) / "weed.log").exists()

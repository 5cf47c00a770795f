"""The CLI on one realistic namespace, as an operator runs it: counts, Ctrl-C, exports, progress.

The namespace has 120 steps from three producers and two watermarks. Pinned here: ``verify``
counts every byte it reads and goes on past an old version of another mesh, ``inspect`` still
shows the namespace when a segment is missing; Ctrl-C is one line and its own exit status (not
"check failed"); an interrupted or failed export (Lance, or to a missing directory) leaves
nothing that blocks a rerun and keeps an existing dataset; and long commands show progress on a
terminal only.
"""

from __future__ import annotations

import functools
import io
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cli_helpers import run_on_terminal
from click.testing import CliRunner, Result
from rich.console import Console

import batchweave as bw
import batchweave.lance as bw_lance
from batchweave._history import membership_batches
from batchweave._manifest import ManifestLog, encode_manifest, manifest_key
from batchweave.cli import _app
from batchweave.cli import _common as cli_common
from batchweave.cli._app import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_TERMINATED, cli
from batchweave.cli._verify import verify_namespace

NS = "runs/ops"
MESH = bw.Mesh(dp=2, cp=2)
PRODUCERS = 3
PER_PRODUCER = 40
STEPS = PRODUCERS * PER_PRODUCER


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A namespace of 120 steps from three producers, with two watermarks (never modified)."""
    root = tmp_path_factory.mktemp("namespace") / "store"
    root.mkdir()
    store = bw.open_store(root.as_uri())
    for p in range(PRODUCERS):
        with bw.Producer(
            store, NS, producer_id=f"prep-{p}", mesh=MESH, policy="naive", tail_limit=16
        ) as producer:
            for offset in range(PER_PRODUCER):
                producer.append(
                    [f"{p}:{offset}:{s}".encode() * 8 for s in range(MESH.slices)], offset=offset
                )
    marks = bw.Watermarks(store, NS)
    marks.record("ckpt-30", step=30)
    marks.record("ckpt-60", step=60)
    return root


@pytest.fixture
def root(built: Path, tmp_path: Path) -> Path:
    """A private copy of the built namespace, free to damage."""
    copy = tmp_path / "store"
    subprocess.run(["cp", "-r", str(built), str(copy)], check=True)
    return copy


def interrupt_after(monkeypatch: pytest.MonkeyPatch, root: Path, reads: int) -> None:
    """Make the CLI's store raise KeyboardInterrupt (Ctrl-C) at its ``reads``-th read."""
    store = bw.open_store(root.as_uri())
    count = 0

    def interrupting(original: Callable[..., bytes]) -> Callable[..., bytes]:
        def read(*args: Any) -> bytes:
            nonlocal count
            count += 1
            if count == reads:
                raise KeyboardInterrupt
            return original(*args)

        return read

    monkeypatch.setattr(store, "get", interrupting(store.get))
    monkeypatch.setattr(store, "get_range", interrupting(store.get_range))
    monkeypatch.setattr(_app, "_open", lambda *args, **kwargs: store)


# -- numbers that must agree -------------------------------------------------------------------


def test_verify_counts_every_byte_it_reads(root: Path) -> None:
    """A full verify reads each live object exactly once: footer, trailer and every slice.

    It reported the footers without their trailers, 32 bytes short per object.
    """
    inspected = json.loads(run("inspect", str(root), NS, "--json").output)
    verified = json.loads(run("verify", str(root), NS, "--json").output)
    assert verified["ok"] is True
    assert verified["steps"] == inspected["live_steps"] == STEPS
    assert verified["objects"] == STEPS
    assert verified["bytes_read"] == inspected["live_tgb_bytes"]
    data_bytes = sum(r["bytes"] for r in inspected["storage"] if r["prefix"].startswith("data/"))
    assert inspected["live_tgb_bytes"] == data_bytes


def test_inspect_still_shows_the_namespace_when_a_segment_is_missing(root: Path) -> None:
    """inspect exited 2 with only the missing segment's key: no producers, watermarks or
    storage, just when the operator needs them, and no pointer to ``verify``."""
    manifest = ManifestLog(bw.open_store(root.as_uri()), NS).latest()
    assert manifest.segments, "the namespace needs segments"
    segment = root / NS / manifest.segments[0].key
    segment.unlink()
    result = run("inspect", str(root), NS)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert segment.name in text
    assert "run `batchweave verify`" in text
    for shown in ("prep-2", "ckpt-30", "storage by prefix"):
        assert shown in text
    data = json.loads(run("inspect", str(root), NS, "--json").output)
    assert segment.name in data["steps_error"]
    assert data["live_tgb_bytes"] is None
    assert {p["live_steps"] for p in data["producers"]} == {None}
    assert data["watermarks"][0]["checkpoint_id"] == "ckpt-30"
    assert run("verify", str(root), NS).exit_code == 1


# -- Ctrl-C ------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_ctrl_c_is_one_line_and_not_the_check_failed_status(
    root: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """Ctrl-C printed click's "Aborted!" and exited 1, the status of "verify found problems"."""
    interrupt_after(monkeypatch, root, reads=5)
    result = CliRunner().invoke(cli, [command, str(root), NS])
    assert result.exit_code == EXIT_INTERRUPTED == 130, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert lines == ["batchweave: interrupted; the command is safe to run again"]
    assert "Aborted" not in result.output


def test_an_interrupted_lance_export_leaves_nothing_that_blocks_a_rerun(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export interrupted after Lance created the dataset directory left it behind, and the
    re-run refused it ("exists; pass --overwrite") though no dataset was ever written."""
    monkeypatch.setattr(
        bw_lance, "membership_batches", functools.partial(membership_batches, batch_rows=16)
    )
    dest = tmp_path / "history.lance"
    interrupt_after(monkeypatch, root, reads=40)  # after a few batches have gone to Lance
    result = CliRunner().invoke(cli, ["export", str(root), NS, str(dest)])
    assert result.exit_code == EXIT_INTERRUPTED, result.output
    assert not dest.exists()
    monkeypatch.undo()
    rerun = run("export", str(root), NS, str(dest))
    assert rerun.exit_code == 0, rerun.output
    assert f"exported {STEPS * MESH.slices} rows (lance)" in rerun.output


SIGNAL_AT_READ = """
import functools, os, signal, sys, time
import batchweave as bw
import batchweave.lance as bw_lance
from batchweave._history import membership_batches
from batchweave._manifest import ManifestLog
from batchweave.cli import _app
url, namespace, dest, at, signame = sys.argv[1:]
bw_lance.membership_batches = functools.partial(membership_batches, batch_rows=16)
store = bw.open_store(url)
original, reads = store.get_range, 0
def get_range(key, rng):
    global reads
    reads += 1
    if reads == int(at):
        os.kill(os.getpid(), getattr(signal, signame))
    if reads >= int(at):
        time.sleep(0.01)  # an S3 read, not a page-cache hit: the export is still running
    return original(key, rng)
store.get_range = get_range
_app._open = lambda *args, **kwargs: store
sys.argv = ["batchweave", "export", url, namespace, dest]
_app.main()
"""


def test_a_real_ctrl_c_during_a_lance_export_exits_cleanly(root: Path, tmp_path: Path) -> None:
    """A real SIGINT while Lance pulled rows on its own thread raised in the main thread and
    left that thread running into interpreter shutdown: "Fatal Python error:
    PyGILState_Release" and SIGABRT (status 134) in about one run of three."""
    dest = tmp_path / "history.lance"
    for _ in range(3):
        proc = subprocess.run(
            [sys.executable, "-c", SIGNAL_AT_READ, root.as_uri(), NS, str(dest), "60", "SIGINT"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == EXIT_INTERRUPTED, proc.stderr
        assert proc.stderr == "batchweave: interrupted; the command is safe to run again\n"
        assert not dest.exists()


STALL_WHILE_IMPORTING = """
import importlib.abc, runpy, sys, time
class Stall(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "batchweave.cli._verify":  # one of the command modules the CLI loads
            sys.stderr.write("importing\\n")
            sys.stderr.flush()
            time.sleep(60)  # Ctrl-C arrives here
        return None
sys.meta_path.insert(0, Stall())
sys.argv = ["batchweave", "inspect", sys.argv[1], sys.argv[2]]
runpy.run_module("batchweave.cli", run_name="__main__", alter_sys=True)
"""


def _sigint_as_on_a_terminal() -> None:  # runs in the child, between fork and exec
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_while_the_command_modules_load_is_one_line(root: Path) -> None:
    """Ctrl-C during the CLI's imports (a noticeable moment at startup) printed a traceback and
    ended the process by SIGINT (status -2) instead of the one line and status 130."""
    proc = subprocess.Popen(
        [sys.executable, "-c", STALL_WHILE_IMPORTING, str(root), NS],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # As from a terminal: a test run started in the background (a CI job) has SIGINT
        # ignored, which children inherit, and Python then installs no Ctrl-C handler.
        preexec_fn=_sigint_as_on_a_terminal,
    )
    try:
        ready, _, _ = select.select([proc.stderr], [], [], 60)
        assert ready, "the CLI never reached its imports"
        assert proc.stderr is not None
        assert proc.stderr.readline() == "importing\n"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert err == "batchweave: interrupted; the command is safe to run again\n"
    assert out == ""


@pytest.mark.parametrize("args", [("inspect",), ("inspect", "--json"), ("verify",)])
def test_a_closed_pipe_exits_141_quietly(root: Path, args: tuple[str, ...]) -> None:
    """``batchweave inspect ... | head -1`` exited 1 (rich's broken-pipe handler), the status
    of "a check failed"; ``--json`` printed a one-line OSError and exited 2."""
    proc = _run_with_closed_stdout(args[0], str(root), NS, *args[1:])
    assert proc.returncode == EXIT_BROKEN_PIPE == 141, proc.stderr
    assert proc.stderr == ""


@pytest.mark.parametrize("args", [("--help",), ("--version",), ("inspect", "--help")])
def test_a_closed_pipe_exits_141_for_help_and_version_too(args: tuple[str, ...]) -> None:
    """``batchweave --help`` and ``--version`` exited 1 ("a check failed"): they print while
    the group parses its own options, before any command runs, where click's handler sat."""
    proc = _run_with_closed_stdout(*args)
    assert proc.returncode == EXIT_BROKEN_PIPE, proc.stderr
    assert proc.stderr == ""


def _run_with_closed_stdout(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI with ``args``, its stdout a pipe whose reader has gone before the first write
    (every write fails)."""
    reader, writer = os.pipe()
    os.close(reader)
    try:
        return subprocess.run(
            [sys.executable, "-m", "batchweave.cli", *args],
            stdout=writer,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(writer)


def test_sigterm_during_a_lance_export_cleans_up_as_ctrl_c_does(root: Path, tmp_path: Path) -> None:
    """SIGTERM (``kill PID``, ``timeout``, a cancelled CI job) ended the process at once: no
    cleanup ran, so the half-written dataset directory stayed and blocked the rerun."""
    dest = tmp_path / "history.lance"
    proc = subprocess.run(
        [sys.executable, "-c", SIGNAL_AT_READ, root.as_uri(), NS, str(dest), "60", "SIGTERM"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == EXIT_TERMINATED == 143, proc.stderr
    assert proc.stderr == "batchweave: terminated (SIGTERM); the command is safe to run again\n"
    assert not dest.exists()


def test_a_failed_lance_export_leaves_no_dataset_directory(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same for a store problem midway (a missing object): nothing is left to refuse later."""
    monkeypatch.setattr(
        bw_lance, "membership_batches", functools.partial(membership_batches, batch_rows=16)
    )
    victim = sorted((root / NS / "data" / "prep-2").rglob("*.tgb"))[-1]
    victim.unlink()
    dest = tmp_path / "history.lance"
    result = run("export", str(root), NS, str(dest))
    assert result.exit_code == 2
    assert victim.name in result.output
    assert not dest.exists()


def test_an_interrupted_overwrite_keeps_the_existing_lance_dataset(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    dest = tmp_path / "history.lance"
    assert run("export", str(root), NS, str(dest), "--stop", "10").exit_code == 0
    interrupt_after(monkeypatch, root, reads=3)
    result = CliRunner().invoke(cli, ["export", str(root), NS, str(dest), "--overwrite"])
    assert result.exit_code == EXIT_INTERRUPTED
    import lance

    assert lance.dataset(str(dest)).count_rows() == 10 * MESH.slices


def test_export_to_a_missing_directory_names_the_directory(root: Path, tmp_path: Path) -> None:
    """The error named a temporary ``.partial-...`` file the operator never asked for."""
    dest = tmp_path / "no-such-dir" / "history.parquet"
    result = run("export", str(root), NS, str(dest))
    assert result.exit_code == 2
    assert "partial" not in result.output
    assert f"{dest.parent} does not exist" in result.output


# -- progress ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "label"),
    [
        (("verify",), "verifying"),
        (("export", "{dest}"), "exporting"),
    ],
)
def test_long_commands_show_progress_on_a_terminal_only(
    root: Path, tmp_path: Path, args: tuple[str, ...], label: str
) -> None:
    """``export`` (one footer read per TGB) ran silently for minutes on a large namespace."""
    fill: Callable[[str], str] = lambda a: a.format(dest=tmp_path / "h.parquet")  # noqa: E731
    command = [args[0], str(root), NS, *map(fill, args[1:])]
    status, stdout, terminal = run_on_terminal(*command)
    assert status == 0, (stdout, terminal)
    assert label in terminal
    assert label not in stdout
    if args[0] == "export":
        (tmp_path / "h.parquet").unlink()
    quiet = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", *command],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stderr == ""


@pytest.mark.parametrize(("quiet", "terminal"), [(False, False), (True, True)])
def test_no_progress_display_exists_off_a_terminal_or_with_json(
    monkeypatch: pytest.MonkeyPatch, quiet: bool, terminal: bool
) -> None:
    # Before: a disabled rich Progress was started and stopped all the same, and rich 13 and 14
    # (which pyproject allows) then write one "\n" to stderr: docs/cli.md promises nothing.
    def no_progress(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a rich Progress was made although nothing is to be drawn")

    stderr = io.StringIO()
    console = Console(file=stderr, force_terminal=terminal)
    monkeypatch.setattr(cli_common, "err_console", lambda: console)
    monkeypatch.setattr(cli_common, "Progress", no_progress)
    with cli_common.progress_bar("verifying", quiet=quiet) as progress:
        progress(1, 2)
    assert stderr.getvalue() == ""


def test_verify_lists_an_old_version_of_another_mesh_and_goes_on(tmp_path: Path) -> None:
    # Before: the first such version stopped verify with one NamespaceMismatch (exit 2), so the
    # operator saw neither the other problems nor that everything else checked out.
    store = bw.open_store(tmp_path.as_uri())
    with bw.Producer(store, "ns", producer_id="p", mesh=bw.Mesh(dp=2), policy="fixed10") as p:
        for offset in range(3):
            p.append([b"a", b"b"], offset=offset)
            p.flush()
    log = ManifestLog(store, "ns")
    latest = log.latest()
    old = log.read(1)
    forged = old.model_copy(update={"mesh": bw.Mesh(dp=1, cp=2)})
    store.put(log.key(manifest_key(1)), encode_manifest(forged))
    report = verify_namespace(store, "ns")
    assert [p for p in report.problems if "version 1:" in p and "mesh" in p], report.problems
    assert report.versions == latest.version + 1

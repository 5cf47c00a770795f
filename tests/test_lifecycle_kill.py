"""A reclaimer SIGKILLed at a deletion point and run again ends where an uninterrupted one does."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _reclaimer_worker import Writer, expected_slice

import batchweave as bw
from batchweave._manifest import ManifestLog, decode_manifest

NS = "runs/kill"
GRACE = 150.0
WORKER = str(Path(__file__).with_name("_reclaimer_worker.py"))


def build(root: Path) -> None:
    """A namespace with TGBs below the boundary, orphans, rolled segments and old manifests."""
    store = bw.FileStore(str(root))
    mesh = bw.Mesh(dp=2, cp=1)
    writer = Writer(store, NS, mesh)
    writer.log = ManifestLog(store, NS, tail_limit=4)
    for _ in range(15):
        writer.publish(2)
    writer.orphan()
    writer.orphan()
    marks = bw.Watermarks(store, NS)
    marks.record("ckpt-old", 10, version=6)
    marks.record("ckpt-new", 22, version=12)
    marks.release("ckpt-old")


def snapshot(root: Path) -> dict[str, object]:
    """Every object's bytes; manifests decoded without their random ``commit_id``."""
    state: dict[str, object] = {}
    for path in sorted(root.rglob("*")):
        if path.is_file():
            key = str(path.relative_to(root))
            data = path.read_bytes()
            if key.endswith(".manifest"):
                state[key] = decode_manifest(data, key=key).model_dump(exclude={"commit_id"})
            else:
                state[key] = data
    return state


def run_worker(root: Path, now: float, kill_after: int | None = None) -> int:
    args = [sys.executable, WORKER, str(root), NS, repr(now), repr(GRACE)]
    if kill_after is not None:
        args.append(str(kill_after))
    proc = subprocess.run(args, capture_output=True, timeout=120, check=False)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr.decode()
    return proc.returncode


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, float, dict[str, object]]:
    """The prepared namespace, the frozen 'now', and the state one uninterrupted pass leaves."""
    pristine = tmp_path_factory.mktemp("pristine")
    build(pristine)
    now = time.time() + 10 * GRACE  # everything is older than the grace periods
    done = tmp_path_factory.mktemp("uninterrupted")
    shutil.copytree(pristine, done, dirs_exist_ok=True)
    assert run_worker(done, now) == 0
    return pristine, now, snapshot(done)


def test_uninterrupted_pass_reclaims_every_kind(
    reference: tuple[Path, float, dict[str, object]],
) -> None:
    pristine, _, final = reference
    before = snapshot(pristine)
    gone = set(before) - set(final)
    assert {k.split("/")[2] for k in gone} == {"_manifests", "_segments", "data"}
    assert sum("/data/w0/0/00000000001" in k for k in gone) == 2  # the two orphans
    kinds = [k.split("/")[2] for k in gone]
    assert (kinds.count("data"), kinds.count("_segments"), kinds.count("_manifests")) == (24, 5, 12)
    store = bw.FileStore(str(pristine))
    assert ManifestLog(store, NS).latest().base_step == 0


# One pass deletes 22 TGB objects, then 2 orphans, 5 segments and 12 manifest versions: kill it
# in each phase, including right after the cut was committed (first deletion) and near the end.
@pytest.mark.parametrize("kill_after", [1, 23, 27, 33, 40])
def test_killed_and_restarted_pass_converges(
    reference: tuple[Path, float, dict[str, object]], tmp_path: Path, kill_after: int
) -> None:
    pristine, now, final = reference
    shutil.copytree(pristine, tmp_path, dirs_exist_ok=True)
    assert run_worker(tmp_path, now, kill_after) == -signal.SIGKILL
    assert snapshot(tmp_path) != final  # the kill really interrupted the pass
    assert run_worker(tmp_path, now) == 0
    assert snapshot(tmp_path) == final

    store = bw.FileStore(str(tmp_path))
    latest = ManifestLog(store, NS).latest()
    assert latest.base_step == 22
    for step in (22, latest.next_step - 1):
        with bw.Consumer(store, NS, mesh=latest.mesh, dp_rank=1, start_step=step) as consumer:
            assert next(consumer) == (step, expected_slice("w0", step, 1))

"""Every script in ``examples/`` runs to success as a subprocess, at a small size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lance
import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

SMALL_ARGS: dict[str, list[list[str]]] = {
    "quickstart.py": [["--steps", "20"]],
    "train_resume.py": [["--steps", "40", "--every", "5", "--max-lag", "15", "--kill-after", "15"]],
    "producer_worker.py": [["--store", "{tmp}/store", "--batches", "6", "--seq-len", "64"]],
    "consumer_training_loop.py": [["--steps", "20", "--every", "5"]],
    "local_s3.py": [
        ["--server", "moto", "--steps", "3"],
        ["--server", "seaweedfs", "--steps", "3"],
    ],
}
"""Arguments per example (one run per entry); a new example must be added here."""

_MARKS = {"moto": pytest.mark.moto_server, "seaweedfs": pytest.mark.seaweedfs}

CASES = [
    pytest.param(
        name,
        args,
        id=f"{name}-{i}",
        marks=[_MARKS[a] for a in args if a in _MARKS],
    )
    for name, runs in sorted(SMALL_ARGS.items())
    for i, args in enumerate(runs)
]


def test_every_example_is_covered() -> None:
    assert {p.name for p in EXAMPLES.glob("*.py")} == set(SMALL_ARGS)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "args"), CASES)
def test_example_runs(name: str, args: list[str], tmp_path: Path) -> None:
    argv = [a.format(tmp=tmp_path) for a in args]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *argv],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def test_producer_worker_resumes_where_it_stopped(tmp_path: Path) -> None:
    script = [sys.executable, str(EXAMPLES / "producer_worker.py"), "--store", str(tmp_path / "s")]
    small = ["--seq-len", "32", "--rows", "4"]
    first = subprocess.run(
        [*script, "--batches", "3", "--metrics-port", "0", *small],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert first.returncode == 0, first.stderr
    assert "epoch 1, resuming at offset 0 of 3" in first.stdout  # its epoch commit: version 1
    # With port 0 the kernel picks one: the worker says which, or nobody could scrape it.
    assert re.search(r"metrics at http://127\.0\.0\.1:[1-9]\d*/metrics", first.stdout)
    pinned = re.search(r"version (\d+) \(restart with --dataset-version (\d+)\)", first.stdout)
    assert pinned is not None, first.stdout
    assert pinned[1] == pinned[2]
    second = subprocess.run(
        [*script, "--batches", "5", "--seal", "--dataset-version", pinned[1], *small],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert second.returncode == 0, second.stderr
    assert "epoch 2, resuming at offset 3 of 5" in second.stdout
    assert "committed offset 4" in second.stdout


def test_producer_worker_restart_names_the_version_it_was_started_on(tmp_path: Path) -> None:
    """After the dataset gained a version, a restart printed "restart with --dataset-version 2"
    (the newest version, the very one refused) and then died with a SourceMismatch traceback."""
    script = [sys.executable, str(EXAMPLES / "producer_worker.py"), "--store", str(tmp_path / "s")]
    small = ["--seq-len", "32", "--rows", "4"]

    def worker(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*script, *small, *args], capture_output=True, text=True, timeout=120)

    first = worker("--batches", "2")
    assert first.returncode == 0, first.stderr
    assert "version 1 (restart with --dataset-version 1)" in first.stdout
    corpus = str(tmp_path / "s-corpus.lance")
    lance.write_dataset(lance.dataset(corpus).to_table(limit=4), corpus, mode="append")
    refused = worker("--batches", "4")
    assert refused.returncode != 0
    assert "Traceback" not in refused.stderr, refused.stderr
    assert "started on version 1" in refused.stderr
    assert "Restart with --dataset-version 1," in refused.stderr
    assert "--dataset-version 2" not in refused.stdout + refused.stderr
    again = worker("--batches", "4", "--dataset-version", "1")
    assert again.returncode == 0, again.stderr
    assert "version 1 (restart with --dataset-version 1)" in again.stdout
    assert "epoch 2, resuming at offset 2 of 4" in again.stdout


@pytest.mark.slow
def test_consumer_training_loop_runs_as_two_torchrun_ranks(tmp_path: Path) -> None:
    """The torchrun command the example's docstring and the quickstart show: each rank derives
    its own coordinates, resumes at its checkpoint, and rank 0's hook records the watermarks."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLES / "consumer_training_loop.py"),
            "--root",
            str(tmp_path / "ctl"),
            "--steps",
            "20",
            "--every",
            "5",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    out = proc.stdout
    assert "rank 0 of 2: dp_rank=0, cp_rank=0" in out
    assert "rank 1 of 2: dp_rank=1, cp_rank=0" in out
    for rank in (0, 1):
        assert f"rank {rank}: resumed at step 10 (crash after 13): no step lost or repeated" in out
    assert "rank 0: watermark 'step-20' keeps step 20" in out
    assert "rank 1: watermark" not in out  # only rank 0 writes watermarks
    assert "live watermarks (keep_last=2): [('step-15', 15), ('step-20', 20)]" in out


def test_quickstart_root_keeps_a_namespace_the_cli_can_inspect(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py"), "--steps", "6", "--root", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    shown = re.search(r"^inspect it: batchweave inspect (\S+) (\S+)$", proc.stdout, re.M)
    assert shown is not None, proc.stdout
    inspect = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", "inspect", shown[1], shown[2], "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert inspect.returncode == 0, inspect.stderr
    assert '"sealed": true' in inspect.stdout


def test_producer_workers_started_together_share_one_synthetic_dataset(tmp_path: Path) -> None:
    """The docstring's two-worker command: both start at once, both write the synthetic corpus,
    and both publish their shard (a plain check-then-write made one fail reading a half-written
    dataset)."""
    script = [sys.executable, str(EXAMPLES / "producer_worker.py"), "--store", str(tmp_path / "s")]
    small = ["--batches", "4", "--seq-len", "32", "--rows", "4", "--shards", "2"]
    workers = [
        subprocess.Popen(
            [*script, "--producer-id", f"prep-{i}", "--shard", str(i), *small],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for i, worker in enumerate(workers):
        out, err = worker.communicate(timeout=120)
        assert worker.returncode == 0, err[-3000:]
        assert f"prep-{i}: committed offset 3" in out
    assert not list(tmp_path.glob("*.tmp"))

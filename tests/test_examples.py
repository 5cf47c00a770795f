"""Every script in ``examples/`` runs to success as a subprocess, at a small size."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

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

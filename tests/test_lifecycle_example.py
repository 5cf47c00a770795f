"""End to end: the crash-and-resume training example, DCP checkpoints, the lifecycle benchmark."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _reclaimer_worker import Writer, expected_slice

import batchweave as bw

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_train_resume_example_resumes_exactly_and_bounds_storage() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "train_resume.py"),
            "--steps",
            "80",
            "--kill-after",
            "35",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{") : proc.stdout.rindex("}") + 1])
    assert summary["checks_failed"] == []
    assert summary["resumed_at_step"] == 30
    assert summary["replayed_steps"] == 6
    assert summary["peak_stored_tgb_bytes"] < summary["produced_tgb_bytes"]
    assert "OK: main resumed at step 30" in proc.stdout


def test_hook_after_a_torch_distributed_checkpoint(tmp_path: Path) -> None:
    store = bw.MemoryStore("dcp")
    mesh = bw.Mesh(dp=1, cp=1)
    Writer(store, "ns", mesh).publish(6)
    marks = bw.Watermarks(store, "ns")
    model = torch.nn.Linear(2, 2)
    with bw.Consumer(store, "ns", mesh=mesh, dp_rank=0, timeout=0) as consumer:
        next(consumer)
        next(consumer)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # single process: no process group
            dcp.save({"model": model, "data": consumer}, checkpoint_id=tmp_path)
        mark = bw.checkpoint_hook(consumer, marks, "ckpt-2", environ={"RANK": "0"})
    assert mark is not None
    assert mark.step == 2
    with bw.Consumer(store, "ns", mesh=mesh, dp_rank=0, timeout=0) as resumed:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({"model": model, "data": resumed}, checkpoint_id=tmp_path)
        assert next(resumed) == (2, expected_slice("w0", 2, 0))


def test_lifecycle_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "lifecycle.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "lifecycle.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["deletion"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows[True]["peak_bytes"] < 0.28 * rows[False]["peak_bytes"]
    assert rows[True]["reclaimed_bytes"] > 0

"""The crash-and-resume training example runs end to end and its own checks pass."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_resume.py"


@pytest.mark.slow
def test_train_resume_example_resumes_exactly_and_bounds_storage() -> None:
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "80", "--kill-after", "35"],
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

"""The chaos soak (``bench/soak.py``) at CI size: about two minutes of faults on SeaweedFS.

Producers, a dp=2 x cp=2 mesh of consumers and the reclaimer run as processes against a SeaweedFS
server the soak starts itself, while it SIGKILLs workers of every kind, restarts the server, and
the workers' stores inject slow, failing and ambiguous requests. The soak exits non-zero on any
violated invariant; this test also checks that every fault kind really happened, so a soak that
silently stopped injecting could not pass.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from batchweave import Mesh

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"


def _load_soak() -> ModuleType:
    sys.path.insert(0, str(SOAK.parent))
    spec = importlib.util.spec_from_file_location("bench_soak", SOAK)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


soak = _load_soak()

INVARIANTS = {
    "batchweave verify passes",
    "every step delivered once per rank, in order",
    "every committed offset delivered exactly once per rank",
    "all ranks agree on every step",
    "payloads intact (checked by every rank)",
    "no worker failed",
    "nothing readable lost before its boundary",
    "storage bounded",
}


@pytest.mark.seaweedfs
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_minute_soak_with_every_fault_kind(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--smoke", "--minutes", "1.5", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=560,
        check=False,
    )
    assert proc.returncode == 0, f"soak failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    result = json.loads(out.read_text())
    assert result["ok"] is True
    assert result["problems"] == {}
    rows = {(r["section"], r["name"]): r for r in result["rows"]}
    for invariant in INVARIANTS:
        assert rows[("invariant", invariant)]["result"] == "pass", invariant
    faults = {name: row["count"] for (section, name), row in rows.items() if section == "fault"}
    for kind in ("SIGKILL producer", "SIGKILL consumer", "SIGKILL reclaimer", "SeaweedFS restart"):
        assert faults.get(kind, 0) >= 1, f"{kind} was never injected: {faults}"
    injected = result["injected"]
    for kind in ("transient", "ambiguous_put", "failed_put_after_delay", "slow_request"):
        assert injected.get(kind, 0) >= 1, f"{kind} was never injected: {injected}"
    # The server restart was seen, reported and recovered from by the workers themselves.
    assert result["outage_log_lines"]["unreachable"] >= 1
    assert result["outage_log_lines"]["reachable again"] >= 1
    last = result["samples"][-1]
    assert last["next_step"] > 100, "the soak published too little to mean anything"


# The judge must be able to fail: each tampering of correct logs is caught by its invariant.

EXPECTED = [(0, 0), (0, 1), (1, 0)]
GOOD = [(0, 0, 0), (1, 1, 0), (2, 0, 1)]


def _judge(logs: list[list[tuple[int, int, int]]]) -> set[str]:
    return {invariant for invariant, _ in soak.delivery_problems(logs, 3, EXPECTED)}


def test_judge_accepts_correct_logs() -> None:
    assert _judge([GOOD, list(GOOD)]) == set()


ORDER = "every step delivered once per rank, in order"
ONCE = "every committed offset delivered exactly once per rank"
AGREE = "all ranks agree on every step"


@pytest.mark.parametrize(
    ("tamper", "caught"),
    [
        (lambda rows: [*rows, rows[-1]], ORDER),
        (lambda rows: rows[:-1], ORDER),
        (lambda rows: [rows[1], rows[0], rows[2]], ORDER),
        (lambda rows: [*rows[:2], (2, 0, 0)], ONCE),
        (lambda rows: [*rows[:2], (2, 1, 0)], AGREE),
    ],
)
def test_judge_catches_each_violation(tamper: Any, caught: str) -> None:
    assert caught in _judge([GOOD, tamper(list(GOOD))])


def test_slice_check_rejects_foreign_and_corrupt_payloads() -> None:
    mesh = Mesh(dp=2, cp=2)
    slices = soak.tgb_payloads(3, 17, mesh, 256)
    assert soak.check_slice(slices[3], 1, 1, 256) == (3, 17)
    with pytest.raises(ValueError, match=r"rank \(0, 1\) got slice \(1, 1\)"):
        soak.check_slice(slices[3], 0, 1, 256)
    corrupt = bytearray(slices[3])
    corrupt[-1] ^= 1
    with pytest.raises(ValueError, match="corrupt bytes"):
        soak.check_slice(bytes(corrupt), 1, 1, 256)

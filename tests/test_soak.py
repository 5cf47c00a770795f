"""The chaos soak (``bench/soak.py``) at CI size: about two minutes of faults on SeaweedFS.

Producers, a dp=2 x cp=2 mesh of consumers and the reclaimer run as processes against a SeaweedFS
server the soak starts itself, while it SIGKILLs workers of every kind, restarts the server, and
the workers' stores inject slow, failing and ambiguous requests. The soak exits non-zero on any
violated invariant; this test also checks that every fault kind really happened, so a soak that
silently stopped injecting could not pass.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parent.parent / "bench" / "soak.py"

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

"""The producer, consumer and manifest benchmarks run end to end at smoke sizes and write sane JSON.

Each benchmark runs as a subprocess exactly as ``nox -s bench`` runs it, so a broken import,
worker-pool protocol or report column shows up here rather than in a long manual run.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


def _run(script: str, out: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"{script} failed:\n{proc.stdout}\n{proc.stderr}"
    payload: dict[str, Any] = json.loads(out.read_text())
    assert payload["rows"], f"{script} wrote no rows"
    for row in payload["rows"]:
        missing = [c for c in payload["columns"] if c not in row]
        assert not missing, f"{script}: row {row} lacks columns {missing}"
    return payload


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(150)
def test_producers_smoke(tmp_path: Path) -> None:
    out = tmp_path / "producers.json"
    payload = _run("producers.py", out)
    expected = {"storage", "producers", "payload", "policy", "segmented", "MB/s", "raw MB/s"}
    assert expected | {"vs_raw", "success", "commit p50 ms", "visible p95 ms"} <= set(
        payload["columns"]
    )
    for row in payload["rows"]:
        # Every planned TGB was committed: 20 per run, split over the producers.
        assert row["tgbs"] == 20
        assert _positive(row["MB/s"])
        assert _positive(row["raw MB/s"])
        assert 0 < row["success"] <= 1
        assert row["attempts"] >= 1
        assert row["commit p50 ms"] <= row["commit p95 ms"]
        assert _positive(row["mf KB/commit first"])
    assert {(r["policy"], r["segmented"]) for r in payload["rows"]} == {
        ("dac", "yes"),
        ("dac", "no"),
        ("naive", "yes"),
        ("naive", "no"),
    }
    assert any("DAC commit success" in note for note in payload["notes"])

    long_run = json.loads(out.with_name("producers_longrun.json").read_text())
    (row,) = long_run["rows"]
    assert row["tgbs"] == 200
    assert _positive(row["first tenth TGB/s"])
    assert _positive(row["last tenth TGB/s"])
    assert row["last/first"] == pytest.approx(row["last tenth TGB/s"] / row["first tenth TGB/s"])
    assert _positive(row["ingest first TGB/s"])
    assert row["ingest last/first"] == pytest.approx(
        row["ingest last TGB/s"] / row["ingest first TGB/s"]
    )


@pytest.mark.timeout(150)
def test_consumers_smoke(tmp_path: Path) -> None:
    payload = _run("consumers.py", tmp_path / "consumers.json")
    rows = {r["mode"]: r for r in payload["rows"]}
    assert set(rows) == {"batchweave", "dense", "raw-range", "raw-inline", "raw-verify"}
    for row in rows.values():
        assert row["world"] == 4
        assert _positive(row["rank MB/s"])
        assert _positive(row["ttfb ms"])
        assert row["slowest rank MB/s"] <= row["rank MB/s"]
    # Read amplification as the counting store sees it: a raw range read fetches exactly the
    # slice, dense reads fetch the whole 4-slice TGB, BatchWeave adds manifest and footer reads.
    assert rows["raw-range"]["amp"] == pytest.approx(1.0)
    assert rows["raw-inline"]["amp"] == pytest.approx(1.0)
    assert rows["raw-verify"]["amp"] == pytest.approx(1.0)  # verifying reads nothing more
    assert rows["dense"]["amp"] == pytest.approx(4.0, rel=0.05)
    assert 1.0 < rows["batchweave"]["amp"] < 1.5
    assert _positive(rows["batchweave"]["vs dense"])
    assert _positive(rows["batchweave"]["vs raw"])
    fastest_raw = max(rows[m]["agg MB/s"] for m in ("raw-range", "raw-inline"))
    assert rows["batchweave"]["vs raw"] == pytest.approx(
        rows["batchweave"]["agg MB/s"] / fastest_raw
    )


@pytest.mark.timeout(150)
def test_manifests_smoke(tmp_path: Path) -> None:
    payload = _run("manifests.py", tmp_path / "manifests.json")
    for row in payload["rows"]:
        assert _positive(row["afresh us"])
        assert _positive(row["with previous us"])
        assert row["speed-up"] == pytest.approx(row["afresh us"] / row["with previous us"])


def test_consumers_dense_ceiling_note(load_bench: Callable[[str], ModuleType]) -> None:
    # The 5x-dense target's ceiling: per slice size at W=32, the faster raw mode's per-rank
    # MB/s over dense, so a reader sees whether any slice reader with the client reaches 5x.
    consumers = load_bench("consumers")

    def row(mode: str, world: int, size: str, vs_dense: float) -> dict[str, Any]:
        return {
            "client": "c",
            "world": world,
            "slice": size,
            "mode": mode,
            "amp": 1.0,
            "vs dense": vs_dense,
            "vs raw": 1.0,
        }

    rows = [
        row("batchweave", 32, "100KB", 2.0),
        row("raw-range", 32, "100KB", 1.5),
        row("raw-inline", 32, "100KB", 2.25),
        row("raw-verify", 32, "100KB", 9.0),  # verifies: not a bare slice reader
        row("raw-inline", 32, "1MB", 7.0),
        row("raw-range", 32, "1MB", math.nan),
        row("raw-inline", 8, "100KB", 40.0),  # another world size
    ]
    (note,) = [n for n in consumers.targets(rows) if "any slice reader" in n]
    assert note.endswith("100KB 2.25x, 1MB 7.00x")

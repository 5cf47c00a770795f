"""The long run's ingestion ratios in ``bench/producers.py``, on made-up timelines.

The 20,000-TGB run judges flat commit cost by comparing throughput over the last tenth of the
TGBs with the first tenth. These tests pin what each ratio measures, so a change to the
benchmark cannot silently turn a slow-down into a pass.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest

PAYLOAD = 1_000
INFLIGHT = 3_000  # three appends of each producer return at once, before its queue is full


def _producer(start: float, gaps: list[float]) -> dict[str, Any]:
    """A producer whose queued appends return at ``start``, then one append per gap."""
    appended = [start] * (INFLIGHT // PAYLOAD)
    t = start
    for gap in gaps:
        t += gap
        appended.append(t)
    return {"appended": appended}


def test_each_producer_is_judged_against_itself(producers: ModuleType) -> None:
    steady = _producer(0.0, [0.01] * 100)
    # Twice as slow over its last tenth (from the append that opens that tenth on).
    slowing = _producer(0.0, [0.01] * 91 + [0.02] * 9)
    ratios = producers._producer_ingest_ratios([steady, slowing], PAYLOAD, INFLIGHT)
    assert ratios == [pytest.approx(1.0), pytest.approx(0.5)]


def test_a_straggler_lowers_the_aggregate_but_not_the_producers(producers: ModuleType) -> None:
    # Two producers, each at its own steady rate, with equal shares: the slower one finishes
    # later, so the run's last tenth is its appends alone.
    fast = _producer(0.0, [0.01] * 100)
    slow = _producer(0.0, [0.015] * 100)
    first, last = producers._ingest_tenths([fast, slow], PAYLOAD, INFLIGHT)
    assert last / first < 0.85
    ratios = producers._producer_ingest_ratios([fast, slow], PAYLOAD, INFLIGHT)
    assert ratios == [pytest.approx(1.0), pytest.approx(1.0)]


def test_too_short_a_run_has_no_producer_ratio(producers: ModuleType) -> None:
    assert producers._producer_ingest_ratios([_producer(0.0, [0.01] * 15)], PAYLOAD, INFLIGHT) == []


def test_raw_tenths_are_puts_completed_per_second(producers: ModuleType) -> None:
    done = [0.1 * (i + 1) for i in range(50)] + [5.0 + 0.2 * (i + 1) for i in range(50)]
    first, last = producers._raw_tenths([{"t0": 0.0, "done": done}])
    assert first == pytest.approx(10 / 1.0)
    assert last == pytest.approx(10 / 2.0)  # the last ten took 0.2 s each


def test_the_target_note_names_the_worst_producer(producers: ModuleType) -> None:
    row = {
        "storage": "s",
        "segmented": "yes",
        "tgbs": 20_000,
        "producer ingest last/first": 0.8,
        "raw last/first": 1.1,
        "ingest last/first": 0.9,
        "last/first": 1.2,
    }
    notes = producers.targets([], [row])
    (note,) = [n for n in notes if "ingestion of each producer" in n]
    assert "NOT MET" in note
    assert "worst producer 0.80" in note
    assert "raw PUT's last/first in the same run 1.10" in note


def test_commit_cost_is_per_published_tgb(producers: ModuleType) -> None:
    # 20 commits of 10 TGBs, each 10 ms in its window writing 1 KB; a lost 30 ms attempt before
    # the last commit is charged to it.
    log = [(float(i + 1), True, 0.010, 10) for i in range(19)]
    log += [(19.5, False, 0.030, 10), (20.0, True, 0.010, 10)]
    writes = [(t - 0.005, 1_000) for t, _, _, _ in log if t != 19.5]
    ms, kb = producers._commit_cost_by_tenth([{"log": log, "writes": writes}])
    assert ms[:9] == [pytest.approx(100.0)] * 9  # 20 ms per 20 TGBs
    assert ms[9] == pytest.approx((10 + 30 + 10) * 100 / 20)
    assert kb == [pytest.approx(10.0)] * 10  # 2 KB per 20 TGBs

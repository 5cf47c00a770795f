"""Commit policies under simulated contention (virtual clock, no real time).

Time is in units of the mean fragile window (``window=1.0``), so the figures hold for any store.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest

from batchweave._dac_sim import SimResult, format_table, policy_factory, simulate, sweep
from batchweave._policy import AttemptOutcome, CommitPolicy, DacPolicy

# Time here is in units of the mean window W, so DAC's absolute visibility bound (``max_gap``,
# 10 s by default) would cap g* at 10 W: these tests check the conflict model itself, unbounded.
# ``test_max_gap_bounds_visibility_and_lets_conflicts_exceed_the_budget`` covers the bound.
DAC = policy_factory("dac", max_gap=math.inf)


def dac_run(producers: int, eps: float, seed: int, **options: Any) -> SimResult:
    # With eps=0.1 and N=16 one attempt cycle is W + g* ~ 143 W, so 12,000 W give each producer
    # ~85 attempts, ~1,300 in all; tgb_rate=0.1 per W keeps a TGB pending at every gap expiry.
    return simulate(
        policy_factory("dac", conflict_budget=eps, max_gap=math.inf),
        producers,
        window=1.0,
        duration=12_000 * (0.1 / eps),
        seed=seed,
        tgb_rate=0.1,
        warmup=200.0,
        **options,
    )


# The model's p(g*) = eps counts every attempt by another producer that lands in our window; only
# the ones that win conflict with us, and about eps of them lose, so the expected measured rate is
# between eps(1-eps) and eps. With >= 1,300 attempts the binomial standard deviation is at most
# sqrt(0.1*0.9/1300) = 0.0083 (0.083 eps at eps=0.1): [0.6 eps, 1.4 eps] is > 3.5 sigma wide
# on either side of that expectation.
LOW, HIGH = 0.6, 1.4


@pytest.mark.parametrize("producers", [8, 16])
@pytest.mark.parametrize("seed", range(4))
def test_dac_conflict_rate_lands_near_budget(producers: int, seed: int) -> None:
    result = dac_run(producers, 0.1, seed)
    assert result.attempts >= 1200
    assert LOW * 0.1 <= result.conflict_rate <= HIGH * 0.1, result


@pytest.mark.parametrize("eps", [0.05, 0.2])
def test_dac_conflict_rate_follows_other_budgets(eps: float) -> None:
    result = dac_run(8, eps, seed=11)
    assert LOW * eps <= result.conflict_rate <= HIGH * eps, result


def test_dac_with_fixed_windows_and_no_spread() -> None:
    result = dac_run(8, 0.1, seed=5, window_spread=0.0)
    assert LOW * 0.1 <= result.conflict_rate <= HIGH * 0.1, result


def test_dac_keeps_its_budget_as_the_window_grows() -> None:
    # The mean window grows by 0.005 W per committed version: from 1 W to ~5 W over the run
    # (~800 commits).
    # DAC's EMA follows it, so the conflict rate stays on budget; FIXED10 does not adapt.
    options: dict[str, Any] = {"window_growth": 0.005, "tgb_rate": 2.0, "warmup": 200.0}
    dac = simulate(DAC, 8, 1.0, 20_000.0, seed=3, **options)
    fixed = simulate("fixed10", 8, 1.0, 20_000.0, seed=3, **options)
    assert dac.commits > 250
    assert LOW * 0.1 <= dac.conflict_rate <= HIGH * 0.1, dac
    assert fixed.conflict_rate > 3 * dac.conflict_rate, (fixed, dac)


@pytest.mark.parametrize("producers", [8, 16])
def test_naive_conflicts_far_more_than_dac(producers: int) -> None:
    # Naive attempts back to back: the other N-1 producers commit about once per W between them,
    # so most of its attempts lose. Same store, same TGB stream, same seed.
    options: dict[str, Any] = {"tgb_rate": 5.0, "warmup": 50.0}
    naive = simulate("naive", producers, 1.0, 1_000.0, seed=1, **options)
    dac = simulate(DAC, producers, 1.0, 1_000.0, seed=1, **options)
    assert naive.conflict_rate > 0.6
    assert naive.conflict_rate > 5 * dac.conflict_rate
    assert naive.attempts_per_second > 20 * dac.attempts_per_second


def test_blocking_producers_lose_throughput_to_naive_retries() -> None:
    # In the paper's single-loop model a producer makes nothing while committing: Naive spends
    # most of its time in doomed attempts, DAC about d(g*) = k/(N-1) = 1.5% of it.
    options: dict[str, Any] = {"tgb_rate": 0.5, "warmup": 50.0, "blocking": True}
    naive = simulate("naive", 8, 1.0, 2_000.0, seed=2, **options)
    dac = simulate(DAC, 8, 1.0, 2_000.0, seed=2, **options)
    assert naive.duty > 0.5
    assert dac.duty < 0.05
    assert dac.tgbs_per_second > 2 * naive.tgbs_per_second


def test_max_gap_bounds_visibility_and_lets_conflicts_exceed_the_budget() -> None:
    # A 1 s window at N=16 asks for g* = 141 s; the default max_gap (10 s) bounds the jittered
    # gap instead, trading conflicts (p(10 s) = 1 - exp(-15/11) = 74% in the model) for TGBs
    # visible within seconds rather than minutes.
    options: dict[str, Any] = {"tgb_rate": 1.0, "warmup": 100.0}
    bounded = simulate("dac", 16, 1.0, 2_000.0, seed=4, **options)
    unbounded = simulate(DAC, 16, 1.0, 2_000.0, seed=4, **options)
    assert bounded.mean_gap <= 10.0
    assert unbounded.mean_gap > 100.0
    assert bounded.conflict_rate > 0.2
    assert unbounded.conflict_rate < 0.2
    # Measured: p50 15 W against 78 W, p95 62 W against 203 W.
    assert bounded.latency_p50 < unbounded.latency_p50 / 3
    assert bounded.latency_p95 < unbounded.latency_p95 / 2


def test_count_based_policies_commit_in_batches() -> None:
    result = simulate("fixed100", 2, 1.0, 5_000.0, seed=4, tgb_rate=1.0, warmup=500.0)
    # 2 producers x 1 TGB/W x 5,000 W = ~10,000 TGBs in commits of >= 100 TGBs each
    assert 8_000 < result.tgbs_produced < 12_000
    assert result.commits <= result.tgbs_committed / 100
    assert result.tgbs_committed > 0.9 * result.tgbs_produced
    assert result.mean_gap == 0.0


def test_single_dac_producer_is_paced_by_the_duty_budget() -> None:
    # N=1: never a conflict, and g* = W (1/delta - 1) = 9 W, so about one attempt per 10 W.
    result = simulate(DAC, 1, 1.0, 10_000.0, seed=6, tgb_rate=1.0, warmup=100.0)
    assert result.conflicts == 0
    assert result.attempts_per_second == pytest.approx(0.1, rel=0.1)
    assert result.duty == pytest.approx(0.1, rel=0.1)


def test_simulation_is_deterministic() -> None:
    a = simulate("dac", 4, 0.05, 60.0, seed=9)
    b = simulate("dac", 4, 0.05, 60.0, seed=9)
    c = simulate("dac", 4, 0.05, 60.0, seed=10)
    assert a == b
    assert a != c


def test_policy_factories_get_distinct_random_sources() -> None:
    seen: list[float] = []

    def factory(rng: random.Random) -> CommitPolicy:
        seen.append(rng.random())
        return DacPolicy(rng=rng)

    simulate(factory, 5, 1.0, 10.0, seed=0)
    assert len(set(seen)) == 5


class Recorder(CommitPolicy):
    """Counts what the simulator tells a policy; attempts every 3 pending TGBs."""

    name = "recorder"

    def __init__(self) -> None:
        self.outcomes: list[AttemptOutcome] = []

    def ready(self, pending: int, since_last_attempt: float) -> bool:
        assert pending >= 1
        assert since_last_attempt >= 0
        return pending >= 3

    def record(self, outcome: AttemptOutcome) -> None:
        self.outcomes.append(outcome)


def test_simulator_reports_what_it_told_the_policies() -> None:
    policies: list[Recorder] = []

    def factory(rng: random.Random) -> CommitPolicy:
        policies.append(Recorder())
        return policies[-1]

    result = simulate(factory, 3, 2.0, 500.0, seed=1, tgb_rate=1.0, window_spread=0.25)
    outcomes = [o for p in policies for o in p.outcomes]
    assert result.attempts == len(outcomes)
    assert result.commits == sum(o.committed for o in outcomes)
    assert result.tgbs_committed == sum(o.tgbs for o in outcomes if o.committed)
    assert all(o.tgbs >= 3 and o.active_producers == 3 for o in outcomes)
    assert all(1.5 <= o.fragile_window <= 2.5 for o in outcomes)
    assert result.window_time == pytest.approx(sum(o.fragile_window for o in outcomes))
    assert result.latency_p50 <= result.latency_p95


def test_sweep_and_table() -> None:
    results = sweep(["naive", "dac"], [2, 4], window=0.05, duration=20.0, seed=1)
    assert [(r.policy, r.producers) for r in results] == [
        ("naive", 2),
        ("naive", 4),
        ("dac", 2),
        ("dac", 4),
    ]
    table = format_table(results)
    assert table.count("\n") == 5
    assert "| dac | 4 |" in table
    report = results[0].as_dict()
    assert report["conflict_rate"] == results[0].conflict_rate
    assert math.isfinite(report["commits_per_second"])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"producers": 0}, "producers"),
        ({"window": 0.0}, "window"),
        ({"window_spread": 1.0}, "window_spread"),
        ({"window_growth": -1.0}, "window_growth"),
        ({"duration": 0.0}, "duration"),
        ({"tgb_rate": 0.0}, "tgb_rate"),
    ],
)
def test_simulate_validates(kwargs: dict[str, float], message: str) -> None:
    args: dict[str, Any] = {"producers": 2, "window": 1.0, "duration": 10.0, "seed": 0}
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        simulate("dac", **args)


def test_unknown_policy_name() -> None:
    with pytest.raises(ValueError, match="unknown commit policy 'x'"):
        simulate("x", 2, 1.0, 10.0, seed=0)

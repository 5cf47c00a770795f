"""Commit policies: the DAC gap formula, its online estimates, and the paper's baselines."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

import batchweave
from batchweave import AttemptOutcome, CommitPolicy, DacPolicy, dac_gap, make_policy, policy_names
from batchweave._policy import (
    DEFAULT_CONFLICT_BUDGET,
    DEFAULT_DUTY_BUDGET,
    DEFAULT_MIN_SLOT_WINDOW,
    AimdPolicy,
    Fixed10Policy,
    Fixed100Policy,
    IncrPolicy,
    NaivePolicy,
    conflict_probability,
    duty,
)


class FixedDraw:
    """A UniformSource that always returns the same fraction of the interval, and logs calls."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction
        self.calls: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.calls.append((a, b))
        return a + (b - a) * self.fraction


def outcome(
    committed: bool = True, window: float = 0.1, producers: int = 8, tgbs: int = 1
) -> AttemptOutcome:
    return AttemptOutcome(
        committed=committed, fragile_window=window, active_producers=producers, tgbs=tgbs
    )


# --- the pure formula --------------------------------------------------------------------------


def test_gap_hand_computed_conflict_bound_decides() -> None:
    # W=0.1 s, N=8, eps=0.1, delta=0.1:
    #   k = -ln(0.9) = 0.105360515657826
    #   conflict bound = 0.1 * (7 / 0.105360515657826 - 1) = 0.1 * (66.438551067 - 1) = 6.5438551067
    #   duty bound     = 0.1 * (1 / 0.1 - 1) = 0.9
    #   g* = max(0, 6.5438551067, 0.9) = 6.5438551067
    assert dac_gap(0.1, 8, 0.1, 0.1) == pytest.approx(6.5438551067, rel=1e-9)


def test_gap_hand_computed_other_budget() -> None:
    # W=0.05, N=16, eps=0.05: k = -ln(0.95) = 0.0512932943876;
    #   conflict bound = 0.05 * (15 / 0.0512932943876 - 1) = 0.05 * 291.435886193 = 14.5717943097
    assert dac_gap(0.05, 16, 0.05, 0.5) == pytest.approx(14.5717943097, rel=1e-9)


def test_single_producer_duty_bound_decides() -> None:
    # N=1: conflict bound = W * (0/k - 1) = -W <= 0, so only the duty bound is left:
    #   W=0.2, delta=0.25 -> 0.2 * (1/0.25 - 1) = 0.2 * 3 = 0.6
    assert dac_gap(0.2, 1, 0.1, 0.25) == pytest.approx(0.6, rel=1e-12)
    # and with the default duty budget 0.1: 0.2 * (10 - 1) = 1.8
    assert dac_gap(0.2, 1) == pytest.approx(1.8, rel=1e-12)


def test_single_producer_with_no_duty_limit_never_waits() -> None:
    # delta=1 -> duty bound = W * (1/1 - 1) = 0; N=1 -> conflict bound = -W; g* = max(0, ...) = 0
    assert dac_gap(0.2, 1, 0.1, 1.0) == 0.0


def test_duty_budget_one_leaves_the_conflict_bound() -> None:
    # delta=1 removes the duty bound: g* is the conflict bound alone (6.5438551067 from above)
    assert dac_gap(0.1, 8, 0.1, 1.0) == pytest.approx(6.5438551067, rel=1e-9)


def test_conflict_budget_close_to_one() -> None:
    # eps=0.999: k = -ln(0.001) = 6.90775527898; N=4, W=2:
    #   conflict bound = 2 * (3 / 6.90775527898 - 1) = 2 * (0.434294481903 - 1) = -1.1314 < 0
    #   delta=1 -> duty bound 0, so g* = 0: a near-certain conflict budget never waits
    assert dac_gap(2.0, 4, 0.999, 1.0) == 0.0
    # with a duty budget the duty bound decides: 2 * (1/0.5 - 1) = 2
    assert dac_gap(2.0, 4, 0.999, 0.5) == pytest.approx(2.0)


def test_zero_window_means_zero_gap() -> None:
    assert dac_gap(0.0, 64, 0.01, 0.01) == 0.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"conflict_budget": 0.0}, "conflict_budget"),
        ({"conflict_budget": 1.0}, "conflict_budget"),
        ({"conflict_budget": -0.1}, "conflict_budget"),
        ({"duty_budget": 0.0}, "duty_budget"),
        ({"duty_budget": 1.5}, "duty_budget"),
    ],
)
def test_gap_rejects_budgets_outside_their_range(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dac_gap(0.1, 4, **kwargs)


def test_gap_rejects_bad_window_and_producers() -> None:
    with pytest.raises(ValueError, match="fragile window"):
        dac_gap(-0.1, 4)
    with pytest.raises(ValueError, match="fragile window"):
        dac_gap(math.nan, 4)
    with pytest.raises(ValueError, match="producer count"):
        dac_gap(0.1, 0)


def test_model_functions_hand_computed() -> None:
    # W=1, g=3, N=5: (N-1) W/(W+g) = 4/4 = 1 -> p = 1 - e^-1 = 0.632120558829; d = 1/4
    assert conflict_probability(1.0, 3.0, 5) == pytest.approx(1 - math.exp(-1))
    assert duty(1.0, 3.0) == pytest.approx(0.25)
    assert conflict_probability(1.0, 3.0, 1) == 0.0  # nobody to conflict with
    assert conflict_probability(0.0, 0.0, 5) == 0.0
    assert duty(0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="gap"):
        duty(1.0, -1.0)


budgets = st.floats(min_value=1e-4, max_value=0.999)


@given(
    window=st.floats(min_value=1e-6, max_value=100.0),
    producers=st.integers(min_value=1, max_value=1024),
    eps=budgets,
    delta=st.floats(min_value=1e-4, max_value=1.0),
)
def test_gap_meets_both_budgets_and_is_the_smallest_that_does(
    window: float, producers: int, eps: float, delta: float
) -> None:
    g = dac_gap(window, producers, eps, delta)
    assert g >= 0
    assert conflict_probability(window, g, producers) <= eps * (1 + 1e-9)
    assert duty(window, g) <= delta * (1 + 1e-9)
    if g > 1e-9 * window:  # below that, 1% of g is lost in floating-point rounding
        # a gap 1% shorter breaks at least one budget: g* is the freshest feasible cadence
        shorter = g * 0.99
        assert (
            conflict_probability(window, shorter, producers) > eps or duty(window, shorter) > delta
        )


@given(
    window=st.floats(min_value=1e-3, max_value=10.0),
    producers=st.integers(min_value=1, max_value=256),
    eps=budgets,
)
def test_gap_grows_with_window_and_producers(window: float, producers: int, eps: float) -> None:
    g = dac_gap(window, producers, eps, 0.5)
    assert dac_gap(window * 2, producers, eps, 0.5) >= g
    assert dac_gap(window, producers + 1, eps, 0.5) >= g


# --- the online policy -------------------------------------------------------------------------


def test_defaults_are_documented_values() -> None:
    policy = DacPolicy()
    assert policy.conflict_budget == DEFAULT_CONFLICT_BUDGET == 0.1
    assert policy.duty_budget == DEFAULT_DUTY_BUDGET == 0.1
    assert policy.ema_alpha == 0.2
    assert policy.jitter == 0.2


def test_first_attempt_is_immediate_and_gap_follows_measurements() -> None:
    policy = DacPolicy(jitter=0.0)
    assert policy.gap == 0.0
    assert policy.window is None
    assert policy.ready(1, math.inf)
    policy.record(outcome(window=0.1, producers=8))
    # first measurement seeds the EMA: W = 0.1, so g* = 6.5438551067 (hand-computed above)
    assert policy.window == pytest.approx(0.1)
    assert policy.producers == 8
    assert policy.gap == pytest.approx(6.5438551067, rel=1e-9)
    assert not policy.ready(5, 6.5)
    assert policy.ready(1, 6.55)
    assert not policy.ready(0, 100.0)


def test_ema_update() -> None:
    policy = DacPolicy(ema_alpha=0.2, jitter=0.0, initial_window=1.0)
    policy.record(outcome(window=2.0, producers=1))
    # W = 0.8 * 1.0 + 0.2 * 2.0 = 1.2
    assert policy.window == pytest.approx(1.2)
    policy.record(outcome(window=0.2, producers=1))
    # W = 0.8 * 1.2 + 0.2 * 0.2 = 0.96 + 0.04 = 1.0
    assert policy.window == pytest.approx(1.0)
    # N=1, delta=0.1: g = W * 9 = 9.0
    assert policy.gap == pytest.approx(9.0)


def test_alpha_one_tracks_the_last_window() -> None:
    policy = DacPolicy(ema_alpha=1.0, jitter=0.0, initial_window=5.0)
    policy.record(outcome(window=0.3, producers=1))
    assert policy.window == pytest.approx(0.3)


def test_conflict_burst_widens_the_gap() -> None:
    policy = DacPolicy(jitter=0.0, max_gap=math.inf)
    policy.record(outcome(window=0.1, producers=4))
    before = policy.gap
    policy.record(outcome(committed=False, window=0.3, producers=8))
    assert policy.producers == 8
    assert policy.gap > before
    # The first samples are averaged (bias-corrected EMA): W = (0.1 + 0.3) / 2 = 0.2, N=8 ->
    # 0.2 * (7/0.105360515657826 - 1) = 13.0877...
    assert policy.gap == pytest.approx(0.2 * (7 / 0.105360515657826 - 1), rel=1e-9)


def test_the_first_window_samples_are_averaged_then_the_ema_takes_over() -> None:
    # A start-up seed measured before the data load (1 ms) must not dominate the first 1/a
    # attempts: until 1/a = 5 samples are in, W is their plain mean.
    policy = DacPolicy(jitter=0.0, rng=FixedDraw(0.5))
    policy.start(0.001, 16)
    samples = [0.001]
    for w in (0.05, 0.05, 0.05, 0.05):
        policy.record(outcome(window=w, producers=16))
        samples.append(w)
        assert policy.window == pytest.approx(sum(samples) / len(samples))
    # From the fifth sample on, the weight stays at a = 0.2.
    before = policy.window
    policy.record(outcome(window=0.1, producers=16))
    assert policy.window == pytest.approx(0.8 * before + 0.2 * 0.1)


def test_one_outlier_window_is_clamped_to_k_times_the_estimate() -> None:
    # A window measured while contended PUTs stall (1 s against a typical 0.1 s) counts as at
    # most window_clamp (4) x W: W = 0.8*0.1 + 0.2*0.4 = 0.16, not 0.28.
    policy = DacPolicy(jitter=0.0, initial_window=0.1)
    policy.record(outcome(committed=False, window=1.0, producers=8))
    assert policy.window == pytest.approx(0.16)
    # A sustained slowdown is still followed: each sample may raise W by up to 60 %.
    for _ in range(20):
        policy.record(outcome(window=1.0, producers=8))
    assert policy.window == pytest.approx(1.0, rel=0.05)
    unclamped = DacPolicy(jitter=0.0, initial_window=0.1, window_clamp=math.inf)
    unclamped.record(outcome(committed=False, window=1.0, producers=8))
    assert unclamped.window == pytest.approx(0.28)


def test_won_attempts_and_a_zero_estimate_are_not_clamped() -> None:
    # A won attempt measures what an attempt costs: it counts in full (0.8*0.1 + 0.2*1.0).
    policy = DacPolicy(jitter=0.0, initial_window=0.1)
    policy.record(outcome(committed=True, window=1.0, producers=8))
    assert policy.window == pytest.approx(0.28)
    # A start-up window too short for the clock (0) must not pin W at 0 for ever.
    seeded_zero = DacPolicy(jitter=0.0, rng=FixedDraw(0.5))
    seeded_zero.start(0.0, 4)
    assert seeded_zero.gap == 0.0
    seeded_zero.record(outcome(committed=False, window=0.5, producers=4))
    assert seeded_zero.window == pytest.approx(0.25)  # the mean of the first two samples


def test_max_gap_bounds_the_jittered_gap_but_not_the_target() -> None:
    # W = 1 s, N = 16: g* = 141 s. The default bound (10 s) holds after jitter, too.
    for fraction in (0.0, 0.5, 1.0):
        policy = DacPolicy(rng=FixedDraw(fraction))
        policy.record(outcome(window=1.0, producers=16))
        assert policy.target_gap == pytest.approx(dac_gap(1.0, 16))
        assert policy.gap == pytest.approx(10.0 / 1.2 * (0.8 + 0.4 * fraction))
        assert policy.gap <= policy.max_gap == 10.0
        assert policy.forced_gap == pytest.approx(0.125 / 1.2 * (0.8 + 0.4 * fraction))
        assert policy.forced_gap <= policy.max_forced_gap == 0.125


def test_forced_gap_equals_the_gap_when_the_gap_is_short() -> None:
    policy = DacPolicy(jitter=0.0)
    policy.record(outcome(window=0.01, producers=1))  # g* = 9 W = 0.09 s
    assert policy.forced_gap == policy.gap == pytest.approx(0.09)


def test_start_seeds_the_window_and_desynchronizes_the_first_attempt() -> None:
    draw = FixedDraw(0.25)
    policy = DacPolicy(rng=draw)
    policy.start(0.1, 8)
    assert draw.calls == [(0.0, 1.0)]
    assert policy.window == pytest.approx(0.1)
    assert policy.producers == 8
    # A quarter of the (bounded) start gap: producers started together spread their attempts.
    assert policy.gap == pytest.approx(0.25 * 6.5438551067, rel=1e-9)
    assert not policy.ready(3, 0.25 * 6.5)
    assert policy.ready(1, 0.25 * 6.55)
    # The next measurement is averaged with the seed (not clamped: it is < 4 W).
    policy.record(outcome(window=0.2, producers=8))
    assert policy.window == pytest.approx(0.15)


def test_start_with_a_rank_puts_each_producer_in_its_own_slice_of_the_gap() -> None:
    target = dac_gap(0.01, 4)
    for rank in range(4):
        policy = DacPolicy(rng=FixedDraw(0.5))
        policy.start(0.01, 4, rank)
        assert policy.gap == pytest.approx((rank + 0.5) / 4 * target)
    with pytest.raises(ValueError, match="rank"):
        DacPolicy().start(0.01, 4, 4)


def test_start_keeps_an_explicit_initial_window() -> None:
    policy = DacPolicy(jitter=0.0, initial_window=0.05, rng=FixedDraw(1.0))
    policy.start(3.0, 1)
    assert policy.window == 0.05
    assert policy.gap == pytest.approx(0.45)


def test_count_policies_ignore_start() -> None:
    for name in ("naive", "fixed10", "incr", "aimd"):
        policy = make_policy(name)
        policy.start(1.0, 16)
        assert policy.gap == policy.forced_gap == 0.0


def test_producers_leaving_shrinks_the_gap() -> None:
    policy = DacPolicy(jitter=0.0, initial_window=0.1)
    policy.record(outcome(window=0.1, producers=16))
    wide = policy.gap
    policy.record(outcome(window=0.1, producers=2))
    assert policy.gap < wide


@pytest.mark.parametrize(("fraction", "factor"), [(0.0, 0.8), (0.5, 1.0), (1.0, 1.2)])
def test_jitter_scales_the_target_by_one_plus_u(fraction: float, factor: float) -> None:
    draw = FixedDraw(fraction)
    policy = DacPolicy(jitter=0.2, rng=draw)
    policy.record(outcome(window=0.1, producers=8))
    assert draw.calls == [(-0.2, 0.2)]
    assert policy.target_gap == pytest.approx(6.5438551067, rel=1e-9)
    assert policy.gap == pytest.approx(6.5438551067 * factor, rel=1e-9)


def test_zero_jitter_draws_nothing() -> None:
    draw = FixedDraw(1.0)
    policy = DacPolicy(jitter=0.0, rng=draw)
    policy.record(outcome())
    assert draw.calls == []
    assert policy.gap == policy.target_gap


@given(
    jitter=st.floats(min_value=0.0, max_value=0.99),
    seed=st.integers(min_value=0, max_value=2**32),
    window=st.floats(min_value=1e-4, max_value=10.0),
    producers=st.integers(min_value=1, max_value=128),
)
def test_jittered_gap_stays_within_bounds(
    jitter: float, seed: int, window: float, producers: int
) -> None:
    policy = DacPolicy(jitter=jitter, seed=seed, max_gap=math.inf)
    for _ in range(5):
        policy.record(outcome(window=window, producers=producers))
        target = policy.target_gap
        assert target * (1 - jitter) * (1 - 1e-12) <= policy.gap
        assert policy.gap <= target * (1 + jitter) * (1 + 1e-12)


def test_seeded_policies_repeat_and_differ() -> None:
    def gaps(seed: int) -> list[float]:
        policy = DacPolicy(seed=seed)
        out = []
        for _ in range(4):
            policy.record(outcome())
            out.append(policy.gap)
        return out

    assert gaps(1) == gaps(1)
    assert gaps(1) != gaps(2)


def test_random_random_is_an_accepted_source() -> None:
    policy = DacPolicy(rng=random.Random(7))
    policy.record(outcome())
    assert policy.gap > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"conflict_budget": 0.0}, "conflict_budget"),
        ({"conflict_budget": 1.0}, "conflict_budget"),
        ({"duty_budget": 0.0}, "duty_budget"),
        ({"duty_budget": 1.01}, "duty_budget"),
        ({"jitter": -0.1}, "jitter"),
        ({"jitter": 1.0}, "jitter"),
        ({"ema_alpha": 0.0}, "ema_alpha"),
        ({"ema_alpha": 1.5}, "ema_alpha"),
        ({"initial_window": -1.0}, "fragile window"),
        ({"rng": random.Random(1), "seed": 1}, "either rng or seed"),
        ({"max_gap": 0.0}, "max_gap"),
        ({"max_forced_gap": -1.0}, "max_forced_gap"),
        ({"max_gap": 0.5, "max_forced_gap": 1.0}, "max_forced_gap"),
        ({"window_clamp": 0.5}, "window_clamp"),
        ({"min_slot_window": -0.001}, "min_slot_window"),
        ({"min_slot_window": math.inf}, "min_slot_window"),
    ],
)
def test_dac_validates_parameters(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DacPolicy(**kwargs)  # type: ignore[arg-type]


def test_dac_budget_limits_are_accepted() -> None:
    DacPolicy(conflict_budget=0.999999, duty_budget=1.0, jitter=0.0)
    DacPolicy(conflict_budget=1e-9, duty_budget=1e-9, jitter=0.999)


def test_record_rejects_impossible_measurements() -> None:
    policy = DacPolicy()
    with pytest.raises(ValueError, match="fragile window"):
        policy.record(outcome(window=-0.5))
    with pytest.raises(ValueError, match="producer count"):
        policy.record(outcome(producers=0))
    for producers in (math.nan, math.inf, 2.5):
        with pytest.raises(ValueError, match="producer count"):
            policy.record(outcome(producers=producers))  # type: ignore[arg-type]


def test_model_functions_reject_nan() -> None:
    # NaN passed "gap < 0" and "producers < 1": p and d came out NaN, dac_gap(0.05, nan) 0.45.
    with pytest.raises(ValueError, match="gap"):
        conflict_probability(0.05, math.nan, 4)
    with pytest.raises(ValueError, match="gap"):
        duty(0.05, math.nan)
    for producers in (math.nan, math.inf, 1.5):
        with pytest.raises(ValueError, match="producer count"):
            dac_gap(0.05, producers)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="producer count"):
            conflict_probability(0.05, 1.0, producers)  # type: ignore[arg-type]
    assert conflict_probability(0.05, math.inf, 4) == 0.0  # an endless gap is still a gap
    assert dac_gap(0.05, 4.0) == dac_gap(0.05, 4)  # type: ignore[arg-type]


def test_dac_refuses_an_rng_without_uniform() -> None:
    # Accepted, it failed later with AttributeError in the producer's commit thread.
    with pytest.raises(TypeError, match="uniform"):
        DacPolicy(rng=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uniform"):
        make_policy("dac", rng=object())
    DacPolicy(rng=FixedDraw(0.5))


def test_slot_periods_survive_overflowing_windows_and_gaps() -> None:
    # A finite window of 1e307 s makes N s and g* overflow to inf: log2(inf) raised OverflowError.
    policy = DacPolicy(seed=1)
    policy.record(outcome(window=1e307, producers=16))
    assert policy.gap <= policy.max_gap
    assert policy.slot_period == policy.regular_period == 8.0  # the longest within max_gap
    assert policy.forced_wait(1.0, 1000.0, 0) >= 0
    assert policy.regular_wait(1.0, 1000.0, 0) is not None
    # g* overflows with a tiny duty budget; with max_gap=inf the period is inf, no grid to use.
    unbounded = DacPolicy(seed=1, duty_budget=1e-310, max_gap=math.inf)
    unbounded.start(0.01, 4, 1)
    assert unbounded.regular_period == math.inf
    assert unbounded.regular_wait(1.0, 1000.0, 1) is None
    assert 0 <= unbounded.forced_wait(0.0, 1000.0, 1) <= unbounded.max_forced_gap
    # N s itself overflows the grid's exponent range (ratio to a tiny base beyond 2^1024).
    tiny_base = DacPolicy(seed=1, max_gap=math.inf, max_forced_gap=1e-300)
    tiny_base.record(outcome(window=1e10, producers=16))
    assert tiny_base.slot_period == math.inf
    assert tiny_base.forced_wait(0.0, 1000.0, 1) <= 1e-300


# --- baselines ---------------------------------------------------------------------------------


def test_naive_attempts_whenever_something_is_pending() -> None:
    policy = NaivePolicy()
    assert policy.ready(1, 0.0)
    policy.record(outcome(committed=False))
    assert policy.ready(1, 0.0)
    assert not policy.ready(0, math.inf)
    assert policy.gap == 0.0


@pytest.mark.parametrize(("cls", "every"), [(Fixed10Policy, 10), (Fixed100Policy, 100)])
def test_fixed_policies_wait_for_their_count_and_never_adapt(
    cls: type[Fixed10Policy], every: int
) -> None:
    policy = cls()
    assert not policy.ready(every - 1, math.inf)
    assert policy.ready(every, 0.0)
    for committed in (False, False, True):
        policy.record(outcome(committed=committed))
    assert policy.interval == every
    assert policy.ready(every, 0.0)
    assert policy.gap == 0.0


def test_incr_grows_by_one_per_conflict_only() -> None:
    policy = IncrPolicy()
    assert policy.interval == 10
    policy.record(outcome(committed=False))
    policy.record(outcome(committed=False))
    assert policy.interval == 12
    policy.record(outcome(committed=True))
    assert policy.interval == 12
    assert not policy.ready(11, math.inf)
    assert policy.ready(12, 0.0)


def test_aimd_adds_on_success_and_halves_on_conflict() -> None:
    policy = AimdPolicy()
    assert policy.interval == 10
    policy.record(outcome(committed=True))
    policy.record(outcome(committed=True))
    assert policy.interval == 12  # 10 + 1 + 1
    policy.record(outcome(committed=False))
    assert policy.interval == 6  # 12 / 2
    assert policy.ready(6, 0.0)
    assert not policy.ready(5, math.inf)
    for _ in range(10):
        policy.record(outcome(committed=False))
    assert policy.interval == 1  # 6 -> 3 -> 1.5 -> 1 (floor)
    assert policy.ready(1, 0.0)


def test_aimd_options() -> None:
    policy = AimdPolicy(initial=4, addend=2.5, decrease=0.25, minimum=2)
    policy.record(outcome(committed=True))
    assert policy.interval == 6.5
    policy.record(outcome(committed=False))
    assert policy.interval == 2  # max(2, 6.5 * 0.25 = 1.625)


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("aimd", {"decrease": 1.0}, "decrease"),
        ("aimd", {"addend": -1.0}, "addend"),
        ("aimd", {"minimum": 0.5}, "minimum"),
        ("aimd", {"initial": 0.0}, "interval"),
        ("aimd", {"addend": math.inf}, "addend"),
        ("incr", {"step": -1}, "step"),
        ("incr", {"step": math.inf}, "step"),
        ("incr", {"step": math.nan}, "step"),
        ("incr", {"initial": 0}, "interval"),
        ("fixed10", {"every": 0}, "interval"),
    ],
)
def test_baselines_validate_parameters(name: str, kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_policy(name, **kwargs)


# --- registry ----------------------------------------------------------------------------------


def test_registry_holds_the_six_policies() -> None:
    assert policy_names() == ["aimd", "dac", "fixed10", "fixed100", "incr", "naive"]
    for name in policy_names():
        policy = make_policy(name)
        assert isinstance(policy, CommitPolicy)
        assert policy.name == name


def test_make_policy_passes_options() -> None:
    policy = make_policy("dac", conflict_budget=0.05, jitter=0.0, seed=3)
    assert isinstance(policy, DacPolicy)
    assert policy.conflict_budget == 0.05
    incr = make_policy("incr", initial=3)
    assert isinstance(incr, IncrPolicy)
    assert incr.interval == 3


def test_make_policy_errors_are_clear() -> None:
    with pytest.raises(ValueError, match=r"unknown commit policy 'tcp'.*aimd, dac, fixed10"):
        make_policy("tcp")
    with pytest.raises(ValueError, match=r"bad options.*'naive'"):
        make_policy("naive", conflict_budget=0.1)


def test_public_exports() -> None:
    for name in (
        "DacPolicy",
        "CommitPolicy",
        "AttemptOutcome",
        "make_policy",
        "policy_names",
        "dac_gap",
    ):
        assert name in batchweave.__all__
        assert getattr(batchweave, name) is not None


# --- flush()/close() slots ---------------------------------------------------------------------


def _slotted(window: float, producers: int, **kw: float) -> DacPolicy:
    """A DAC policy started with ``window``; slots sized by measurements alone unless ``kw`` sets
    ``min_slot_window``."""
    kw.setdefault("min_slot_window", 0.0)
    policy = DacPolicy(jitter=0.0, rng=FixedDraw(0.5), **kw)
    policy.start(window, producers, 0)
    return policy


def test_slot_period_is_n_slots_rounded_up_to_the_forced_gap_grid() -> None:
    # Won window 3 ms, N = 16, slot_factor 2: N s = 0.096 s, within the shortest period, 0.125 s.
    assert _slotted(0.003, 16).slot_period == pytest.approx(0.125)
    # Beyond it, the period doubles as often as needed: 0.32 s -> 0.5 s, 1.6 s -> 2 s.
    assert _slotted(0.01, 16).slot_period == pytest.approx(0.5)
    assert _slotted(0.05, 16).slot_period == pytest.approx(2.0)
    # A slow store: beyond max_gap (10 s) the period is the longest grid value within it, 8 s.
    assert _slotted(1.0, 16).slot_period == pytest.approx(8.0)
    assert _slotted(0.01, 16, max_forced_gap=0.1).slot_period == pytest.approx(0.4)
    assert _slotted(1.0, 16, max_gap=math.inf).slot_period == pytest.approx(0.125 * 2**8)
    assert DacPolicy().slot_period == 0.0


def test_slot_window_is_the_shortest_recent_win_doubled_per_lost_slot() -> None:
    policy = _slotted(0.01, 4)
    policy.record(outcome(committed=False, window=0.04, producers=4))
    assert policy.window == pytest.approx(0.025)  # lost attempts count in W ...
    assert policy.slot_window == pytest.approx(0.01)  # ... not in the slot size
    policy.record(outcome(committed=True, window=0.005, producers=4))
    assert policy.slot_window == pytest.approx(0.005)
    # A lost slotted attempt doubles the slot, until an attempt wins again.
    policy.record(AttemptOutcome(False, 0.05, 4, 1, forced=True))
    policy.record(AttemptOutcome(False, 0.05, 4, 1, forced=True))
    assert policy.slot_window == pytest.approx(0.02)
    policy.record(outcome(committed=True, window=0.03, producers=4))
    assert policy.slot_window == pytest.approx(0.005)
    # Only the latest wins count: eight longer ones push the short one out.
    for _ in range(8):
        policy.record(outcome(committed=True, window=0.03, producers=4))
    assert policy.slot_window == pytest.approx(0.03)
    # A loaded_window seeds W (the gap) but not the slots.
    seeded = DacPolicy(jitter=0.0, rng=FixedDraw(0.5))
    seeded.start(0.01, 4, 1, loaded_window=0.1)
    assert seeded.window == pytest.approx(0.1)
    assert seeded.slot_window == pytest.approx(0.01)


def test_only_a_lost_slotted_attempt_that_overran_its_slot_doubles_it() -> None:
    # 16 closers on the 0.125 s grid: slots of 7.8 ms, an attempt starts at a slot's middle.
    policy = _slotted(0.003, 16)
    assert policy.slot_period / 16 == pytest.approx(0.0078125)
    # Lost, but ended inside its slot (3 ms < 3.9 ms): another attempt overran into it, and a
    # longer slot would only make this closer wait longer.
    policy.record(AttemptOutcome(False, 0.003, 16, 1, forced=True))
    assert policy.slot_window == pytest.approx(0.003)
    # Lost after running past its slot's end (5 ms): the slot is too short and doubles.
    policy.record(AttemptOutcome(False, 0.005, 16, 1, forced=True))
    assert policy.slot_window == pytest.approx(0.006)
    # The doubled slot (15.6 ms) holds a 5 ms attempt: losing one again doubles nothing.
    policy.record(AttemptOutcome(False, 0.005, 16, 1, forced=True))
    assert policy.slot_window == pytest.approx(0.006)
    # Regular (not slotted) attempts never touch the slot.
    policy.record(AttemptOutcome(False, 0.5, 16, 1))
    assert policy.slot_window == pytest.approx(0.006)


def test_the_fastest_data_put_is_a_floor_under_the_slot_window() -> None:
    # A start-up commit made before the data load (1 ms) would put 16 closers on 7.8 ms slots,
    # while their fastest 100 KB upload under load took 40 ms (SeaweedFS): a commit writing
    # about a 64 KiB manifest counts as at least half that PUT, 20 ms: 16 x 2 x 20 ms = 0.64 s,
    # the 1 s grid.
    policy = _slotted(0.001, 16)
    policy.observe_put(0.04, 100_000)
    assert policy.put_floor == pytest.approx(0.02)
    assert policy.slot_window == pytest.approx(0.02)
    assert policy.slot_period == pytest.approx(1.0)
    # Once a commit won, its bytes scale the floor: 20 KB is a fifth of that PUT.
    policy.record(AttemptOutcome(True, 0.03, 16, 10, bytes_written=20_000))
    assert policy.put_floor == pytest.approx(0.008)
    assert policy.slot_window == pytest.approx(0.008)
    # A lost slotted attempt doubles the slot, floor included.
    policy.record(AttemptOutcome(False, 0.03, 16, 10, forced=True))
    assert policy.slot_window == pytest.approx(0.016)
    # 10 MB uploads say little about a 64 KiB commit: the floor (0.3 ms) leaves the start-up
    # window in charge.
    big = _slotted(0.002, 16)
    big.observe_put(0.05, 10_000_000)
    assert big.put_floor == pytest.approx(0.05 * 65536 / 10_000_000)
    assert big.slot_window == pytest.approx(0.002)
    assert _slotted(0.002, 16).put_floor == 0.0  # no PUT seen yet


def test_slots_hold_at_least_the_minimum_slot_window() -> None:
    # 16 closers whose start-up commits took 1-3 ms (before the data load) would sit on 7.8 ms
    # slots; their close commits take about 10 ms. The 5 ms floor: 16 x 2 x 5 ms = 0.16 s, the
    # 0.25 s grid, slots of 15.6 ms.
    policy = _slotted(0.002, 16, min_slot_window=DEFAULT_MIN_SLOT_WINDOW)
    assert policy.slot_window == pytest.approx(0.005)
    assert policy.slot_period == pytest.approx(0.25)
    # A lost slotted attempt that overran its slot doubles it, floor included.
    policy.record(AttemptOutcome(False, 0.02, 16, 1, forced=True))
    assert policy.slot_window == pytest.approx(0.01)
    # Measurements above the floor size the slots as before; few producers keep the 0.125 s grid.
    assert _slotted(0.008, 16, min_slot_window=0.005).slot_window == pytest.approx(0.008)
    assert _slotted(0.002, 4, min_slot_window=0.005).slot_period == pytest.approx(0.125)
    assert DacPolicy().min_slot_window == DEFAULT_MIN_SLOT_WINDOW == 0.005


def test_the_fastest_data_put_bounds_the_slot_window() -> None:
    # A start-up commit slowed by producers starting together (40 ms) alone would put this
    # producer on the 2 s grid: 16 x 2 x 40 ms = 1.28 s, rounded up.
    policy = _slotted(0.04, 16)
    assert policy.put_window is None
    assert policy.slot_period == pytest.approx(2.0)
    # Its fastest upload (a PUT of comparable size on the same store) took 0.75 ms; a commit
    # makes up to four requests: 3 ms, 16 x 2 x 3 ms = 0.096 s, the 0.125 s grid.
    for seconds in (0.01, 0.00075, 0.02):
        policy.observe_put(seconds, 100_000)
    assert policy.put_window == pytest.approx(0.003)
    assert policy.slot_window == pytest.approx(0.003)
    assert policy.slot_period == pytest.approx(0.125)
    # Scaled to the bytes the latest won commit wrote, when those are more than four PUTs'.
    policy.record(AttemptOutcome(True, 0.05, 16, 10, bytes_written=300_000))
    assert policy.put_window == pytest.approx(0.003)
    policy.record(AttemptOutcome(True, 0.05, 16, 10, bytes_written=1_000_000))
    assert policy.put_window == pytest.approx(0.0075)
    assert policy.slot_window == pytest.approx(0.0075)
    # A lost slotted attempt still doubles the slot; a shorter won window still wins.
    policy.record(AttemptOutcome(False, 0.05, 16, 10, forced=True))
    assert policy.slot_window == pytest.approx(0.015)
    policy.record(AttemptOutcome(True, 0.002, 16, 1))  # bytes unknown: the scale is kept
    assert policy.put_window == pytest.approx(0.0075)
    assert policy.slot_window == pytest.approx(0.002)
    # A fast start-up commit still counts: the PUT estimate only bounds slow samples.
    quick = _slotted(0.001, 16)
    quick.observe_put(0.002, 100_000)
    assert quick.put_window == pytest.approx(0.008)
    assert quick.slot_window == pytest.approx(0.001)
    with pytest.raises(ValueError, match="fragile window"):
        policy.observe_put(-1.0, 10)
    with pytest.raises(ValueError, match="nbytes"):
        policy.observe_put(0.1, -1)
    # Count-based policies accept and ignore it.
    make_policy("naive").observe_put(0.1, 10)


def test_forced_waits_put_producers_in_disjoint_slots_of_one_grid() -> None:
    n, window = 8, 0.01
    policies = [DacPolicy(jitter=0.0, rng=FixedDraw(0.5), slot_factor=2.0) for _ in range(n)]
    for rank, policy in enumerate(policies):
        policy.start(window, n, rank)
    period = policies[0].slot_period
    slot = period / n
    assert period == pytest.approx(0.25)  # 8 x 20 ms = 0.16 s, rounded up to 0.25 s
    for now in (1.7e9 + 0.0123, 1.7e9 + 3.75, 1.7e9 + 100.001):
        starts = []
        for rank, policy in enumerate(policies):
            wait = policy.forced_wait(math.inf, now, rank)
            assert 0 <= wait < period
            start = now + wait
            # The attempt starts inside the producer's own slot, with one W of it left.
            phase = (start - rank * slot) % period
            assert phase <= slot - window + 1e-9 or phase >= period - 1e-9
            starts.append(start)
        # Different producers' attempts start at least W apart modulo the grid: if each attempt
        # lasts at most W, none overlaps another.
        for i in range(n):
            for j in range(i + 1, n):
                gap = abs(starts[i] - starts[j]) % period
                assert min(gap, period - gap) >= window - 1e-9


def test_forced_wait_falls_back_to_the_forced_gap_alone_or_without_a_rank() -> None:
    lone = DacPolicy(jitter=0.0, initial_window=0.01)
    lone.record(outcome(window=0.01, producers=1))
    assert lone.forced_wait(0.05, 1.7e9, 0) == pytest.approx(lone.forced_gap - 0.05)
    assert lone.forced_wait(1.0, 1.7e9, 0) == 0.0
    crowd = _slotted(0.01, 8)
    assert crowd.forced_wait(0.0, 1.7e9, None) == pytest.approx(crowd.forced_gap)
    assert crowd.forced_wait(0.0, 1.7e9, 8) == pytest.approx(crowd.forced_gap)  # out of range
    for name in ("naive", "fixed10", "incr", "aimd"):
        assert make_policy(name).forced_wait(0.0, 1.7e9, 3) == 0.0


def test_regular_period_is_the_bounded_gap_on_the_grid() -> None:
    # W = 10 ms, N = 16: g* = 1.41 s, rounded up to 0.125 * 2^i: 2 s (the nearest was 1 s).
    policy = _slotted(0.01, 16)
    assert policy.target_gap == pytest.approx(dac_gap(0.01, 16))
    assert policy.regular_period == pytest.approx(2.0)
    # A slow store: g* = 42 s is held at max_gap's grid value, 8 s (<= max_gap = 10 s).
    assert _slotted(0.3, 16).regular_period == pytest.approx(8.0)
    # Never shorter than the slot period (a slot must hold a window).
    assert (
        _slotted(0.01, 16, conflict_budget=0.99).regular_period
        >= _slotted(0.01, 16, conflict_budget=0.99).slot_period
    )


@pytest.mark.parametrize("producers", [2, 3, 4, 8, 16])
@pytest.mark.parametrize("window", [0.003, 0.0375, 0.05, 0.055, 0.07, 0.15, 0.3, 0.6])
def test_the_regular_period_keeps_both_budgets(window: float, producers: int) -> None:
    # One attempt per period: rounded to the nearest grid value the period was up to 1.41x
    # shorter than g*, and two producers spent 1.5x their duty budget (0.15 at W = 37.5 ms).
    policy = _slotted(window, producers)
    period = policy.regular_period
    cycle = window + policy.target_gap  # an attempt, then the gap
    assert period >= min(cycle, policy._longest_period)
    assert period < 2 * max(cycle, policy.slot_period)
    if cycle <= policy._longest_period:  # max_gap did not cut it
        assert duty(window, period - window) <= policy.duty_budget + 1e-12
        assert conflict_probability(window, period - window, producers) <= (
            policy.conflict_budget + 1e-12
        )


def test_regular_waits_put_each_producer_in_its_own_slot_once_per_period() -> None:
    n, window = 8, 0.01
    policies = [DacPolicy(jitter=0.0, rng=FixedDraw(0.5)) for _ in range(n)]
    for rank, policy in enumerate(policies):
        policy.start(window, n, rank)
    period = policies[0].regular_period
    slot = period / n
    assert slot >= 2 * window
    now = 1.7e9 + 12.345
    starts = []
    for rank, policy in enumerate(policies):
        wait = policy.regular_wait(math.inf, now, rank)
        assert wait is not None
        assert 0 <= wait < period
        starts.append(now + wait)
        # Just after an attempt in its slot, a producer waits for the slot's next turn.
        again = policy.regular_wait(0.0, now + wait, rank)
        assert again is not None
        assert period - slot < again <= period + 1e-9
    for i in range(n):
        for j in range(i + 1, n):
            gap = abs(starts[i] - starts[j]) % period
            assert min(gap, period - gap) >= window - 1e-9
    # A lone producer, an unknown rank and the count-based policies use ready() and the gap.
    assert policies[0].regular_wait(math.inf, now, None) is None
    lone = DacPolicy(initial_window=0.01)
    lone.record(outcome(window=0.01, producers=1))
    assert lone.regular_wait(math.inf, now, 0) is None
    assert make_policy("fixed10").regular_wait(math.inf, now, 0) is None

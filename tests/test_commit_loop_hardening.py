"""The commit loop and the commit policies against clocks, stores and callables that misbehave.

Each test failed on the code before its fix: a clock stepping back killed a producer (a negative
duration reached the policy); a throttled commit counted as a lost race; a lone DAC producer
woke every 20 ms through its gap; option values inside their documented ranges overflowed;
bad answers of ``backoff=`` and of custom policies stopped or hung the producer without naming
them; a frozen clock kept regular attempts from ever starting; a non-numeric option of a
baseline policy or a model function raised a Python error naming no parameter; a DAC
``max_gap`` beyond half the ``active_horizon`` undercounted ``N``; a wall clock that stands
still or ticks in whole seconds kept DAC's slots from ever opening.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from fake_time import FakeTime
from manifest_helpers import FaultyPutStore, descriptor

import batchweave as bw
from batchweave._errors import ConcurrentWriteConflict, TransientStoreError
from batchweave._manifest import Committed, Conflict, ManifestLog
from batchweave._policy import (
    AimdPolicy,
    AttemptOutcome,
    DacPolicy,
    Fixed10Policy,
    Fixed100Policy,
    IncrPolicy,
    NaivePolicy,
    PolicyWrapper,
    conflict_probability,
    dac_gap,
    duty,
    make_policy,
)
from batchweave._store._memory import MemoryStore

MESH = bw.Mesh(dp=1, cp=1)
NS = "ns"


def _producer(store: bw.ObjectStore, **options: Any) -> bw.Producer:
    return bw.Producer(store, NS, producer_id="p0", mesh=MESH, **options)


# -- 1. a clock stepping backwards ---------------------------------------------------------------


class _SteppingClock:
    """Monotonic time that a test can step back (as an NTP step moves ``time.time``)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset


class _StepBackDuring(bw.StoreWrapper):
    """Steps ``clock`` back an hour during the first write whose key contains ``match``."""

    def __init__(self, inner: bw.ObjectStore, clock: _SteppingClock, match: str) -> None:
        super().__init__(inner)
        self.clock, self.match = clock, match
        self.armed = self.done = False

    def put(
        self, key: str, data: bytes | memoryview, *, mode: bw.PutMode = bw.PutMode.OVERWRITE
    ) -> None:
        self.inner.put(key, data, mode=mode)
        if self.armed and self.match in key and not self.done:
            self.done = True
            self.clock.offset -= 3600.0


def test_a_measured_duration_is_never_negative() -> None:
    from batchweave._policy import measured_duration

    assert measured_duration(10.0, 12.5) == 2.5
    assert measured_duration(10.0, 10.0 - 3600) == 0.0


@pytest.mark.parametrize("policy", ["dac", "naive"])
@pytest.mark.parametrize("during", ["data/", "manifest"])
def test_a_clock_stepping_back_does_not_stop_the_producer(policy: str, during: str) -> None:
    clock = _SteppingClock()
    store = _StepBackDuring(MemoryStore(), clock, during)
    p = _producer(store, policy=policy, clock=clock)
    store.armed = True  # after start-up: during the next upload or commit
    try:
        for offset in range(3):
            p.append([b"x" * 10], offset=offset)
        p.flush(10)
        assert store.done
        assert p.stats().tgbs_published == 3
    finally:
        p.abort()


def test_policies_still_refuse_negative_windows_from_a_caller() -> None:
    policy = DacPolicy(seed=1)
    with pytest.raises(ValueError, match="fragile window"):
        policy.record(AttemptOutcome(True, -1.0, 1, 1))
    with pytest.raises(ValueError, match="fragile window"):
        policy.start(-1.0, 1)


# -- 2. a throttled commit is a retried failure, not a lost race -------------------------------


class _ThrottledCommits(bw.StoreWrapper):
    """The next ``n`` conditional manifest PUTs fail with a 503."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.n = 0

    def put(
        self, key: str, data: bytes | memoryview, *, mode: bw.PutMode = bw.PutMode.OVERWRITE
    ) -> None:
        if mode == bw.PutMode.CREATE and "manifest" in key and self.n > 0:
            self.n -= 1
            raise TransientStoreError(f"503 SlowDown on {key}")
        self.inner.put(key, data, mode=mode)


class _Recording(PolicyWrapper):
    def __init__(self, inner: bw.CommitPolicy) -> None:
        super().__init__(inner)
        self.outcomes: list[AttemptOutcome] = []

    def record(self, outcome: AttemptOutcome) -> None:
        self.outcomes.append(outcome)
        super().record(outcome)


def test_a_throttled_commit_counts_as_a_transient_error_not_a_conflict() -> None:
    store = _ThrottledCommits(MemoryStore())
    policy = _Recording(NaivePolicy())
    p = _producer(store, policy=policy, backoff=lambda attempt: 0.01)
    store.n = 3  # after start-up
    try:
        p.append([b"x"], offset=0)
        p.flush(30)
        stats = p.stats()
        assert (stats.conflicts, stats.transient_errors) == (0, 3)
        assert stats.tgbs_published == 1
        # The policy learns only from the attempt that reached the store's answer.
        assert [o.committed for o in policy.outcomes] == [True]
    finally:
        p.close()


def test_a_throttled_epoch_commit_counts_as_a_transient_error() -> None:
    inner = MemoryStore()
    ManifestLog(inner, NS).create_or_open(MESH)  # the epoch commit, not the creation, fails
    store = _ThrottledCommits(inner)
    store.n = 2
    p = _producer(store, policy="naive", backoff=lambda attempt: 0.01)
    try:
        assert p.stats().transient_errors == 2
        assert p.epoch == 1
    finally:
        p.close()


@pytest.mark.parametrize(
    ("error", "failed"),
    [(TransientStoreError("503 slow down"), True), (ConcurrentWriteConflict("409"), False)],
)
def test_a_commit_says_whether_the_store_failed_it_or_a_race_was_lost(
    error: Exception, failed: bool
) -> None:
    inner = MemoryStore()
    m0 = ManifestLog(inner, NS).create_or_open(MESH)
    result = ManifestLog(FaultyPutStore(inner, lambda key: (False, error)), NS).commit(
        m0, append=[descriptor("a", 0)]
    )
    assert isinstance(result, Conflict)
    assert result.winner is None
    assert (result.failure is error) is failed
    assert result.failure is None or failed


def test_a_lost_race_has_no_failure() -> None:
    inner = MemoryStore()
    m0 = ManifestLog(inner, NS).create_or_open(MESH)
    assert isinstance(ManifestLog(inner, NS).commit(m0, append=[descriptor("b", 0)]), Committed)
    result = ManifestLog(inner, NS).commit(m0, append=[descriptor("a", 0)])
    assert isinstance(result, Conflict)
    assert result.winner is not None
    assert result.failure is None


# -- 3. a lone DAC producer does not poll through its gap -----------------------------------------


def test_a_lone_dac_producer_does_not_poll_during_its_gap() -> None:
    sleeps: list[float] = []
    lock = threading.Lock()

    def sleep(seconds: float) -> None:
        with lock:
            sleeps.append(seconds)
        time.sleep(seconds)

    policy = DacPolicy(initial_window=0.5, seed=1)  # lone: a gap of about 9 W, 3-4.5 s
    p = _producer(MemoryStore(), policy=policy, sleep=sleep)
    try:
        p.append([b"x"], offset=0)
        p.flush(10)
        p.append([b"y"], offset=1)  # pending through the gap after that commit
        time.sleep(0.3)
        with lock:
            sleeps.clear()
        time.sleep(1.5)
        with lock:
            wakeups = len(sleeps)
        assert p.stats().commits == 1, policy.gap  # still inside the gap
        # Chunks of 0.25 s: about 6 in 1.5 s (polling every 20 ms: about 75).
        assert wakeups <= 10, f"{wakeups} wake-ups in 1.5 s of a {policy.gap:.2f} s gap"
    finally:
        p.abort()


def test_a_flush_wakes_a_lone_producer_waiting_its_gap_at_once() -> None:
    policy = DacPolicy(initial_window=0.5, seed=1)  # lone: a gap of about 4.5 s
    p = _producer(MemoryStore(), policy=policy)  # real sleep: the loop waits on the condition
    try:
        p.append([b"x"], offset=0)
        p.flush(10)
        p.append([b"y"], offset=1)
        time.sleep(0.5)  # its forced gap (at most 0.125 s) has passed, its gap has not
        assert p.stats().commits == 1
        began = time.monotonic()
        p.flush(10)
        assert time.monotonic() - began < 0.2
    finally:
        p.abort()


# -- 4. option values inside their documented ranges -----------------------------------------------


def test_a_huge_max_gap_does_not_overflow_the_slot_arithmetic() -> None:
    policy = DacPolicy(max_gap=1e308, seed=1)
    policy.start(0.01, 1, 0, 0.02)
    assert policy.regular_wait(0.0, 1.7e9, 0) is None
    policy.start(0.01, 4, 1, 0.02)
    policy.record(AttemptOutcome(True, 0.05, 4, 1))
    assert policy.regular_wait(0.0, 1.7e9, 1) is not None


def test_a_tiny_max_forced_gap_does_not_overflow() -> None:
    policy = DacPolicy(max_forced_gap=5e-324, seed=1)
    policy.start(0.01, 4, 1, 0.02)
    policy.record(AttemptOutcome(True, 0.05, 4, 1))
    assert policy.gap > 0


def test_a_tiny_ema_alpha_with_an_initial_window() -> None:
    policy = DacPolicy(ema_alpha=1e-310, initial_window=0.05, seed=1)
    policy.record(AttemptOutcome(True, 1.0, 1, 1))
    assert policy.window == pytest.approx(0.05)  # settled: the tiny weight is used at once


def test_an_initial_window_is_settled_whatever_ema_alpha() -> None:
    for alpha in (0.2, 0.3, 0.4, 0.7, 1.0):
        policy = DacPolicy(ema_alpha=alpha, initial_window=1.0, seed=1)
        policy.record(AttemptOutcome(True, 0.0, 1, 1))
        assert policy.window == pytest.approx(1 - alpha)


def test_a_producer_with_a_huge_max_gap_commits() -> None:
    policy = DacPolicy(max_gap=1e308, initial_window=0.001, seed=1)
    p = _producer(MemoryStore(), policy=policy, active_horizon=math.inf)
    try:
        for offset in range(3):
            p.append([b"x"], offset=offset)
            time.sleep(0.1)
        p.flush(5)
        assert p.stats().tgbs_published == 3
    finally:
        p.abort()


@pytest.mark.parametrize(
    ("max_gap", "horizon"), [(math.inf, 60.0), (31.0, 60.0), (10.0, 5.0), (1e308, 1e308)]
)
def test_a_max_gap_beyond_half_the_active_horizon_is_refused(
    max_gap: float, horizon: float
) -> None:
    # DAC's N counts producers that committed within active_horizon: one waiting max_gap
    # between its commits dropped out of the others' N, and DAC undercounted it.
    for policy in (DacPolicy(max_gap=max_gap), PolicyWrapper(DacPolicy(max_gap=max_gap))):
        with pytest.raises(ValueError, match=r"max_gap.*active_horizon >= 2 \* max_gap"):
            _producer(MemoryStore(), policy=policy, active_horizon=horizon)


@pytest.mark.parametrize(("max_gap", "horizon"), [(math.inf, math.inf), (30.0, 60.0), (10.0, 60.0)])
def test_a_max_gap_within_half_the_active_horizon_is_accepted(
    max_gap: float, horizon: float
) -> None:
    _producer(MemoryStore(), policy=DacPolicy(max_gap=max_gap), active_horizon=horizon).close()
    _producer(MemoryStore(), policy="naive", active_horizon=1.0).close()  # no max_gap


def test_a_small_max_gap_alone_is_accepted_and_bounds_the_forced_gap() -> None:
    policy = make_policy("dac", max_gap=0.1)
    assert isinstance(policy, DacPolicy)
    assert (policy.max_gap, policy.max_forced_gap) == (0.1, 0.1)
    assert DacPolicy().max_forced_gap == 0.125
    with pytest.raises(ValueError, match="max_forced_gap"):
        DacPolicy(max_gap=0.1, max_forced_gap=0.125)


# -- 5. bad values from callables and options ----------------------------------------------------


class _FailFirstUpload(bw.StoreWrapper):
    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.n = 1

    def put(
        self, key: str, data: bytes | memoryview, *, mode: bw.PutMode = bw.PutMode.OVERWRITE
    ) -> None:
        if "/data/" in key and self.n:
            self.n -= 1
            raise TransientStoreError("503")
        self.inner.put(key, data, mode=mode)


@pytest.mark.parametrize("value", [-0.01, math.nan, math.inf])
def test_a_bad_backoff_answer_is_refused_naming_backoff(value: float) -> None:
    p = _producer(_FailFirstUpload(MemoryStore()), policy="naive", backoff=lambda attempt: value)
    try:
        p.append([b"x"], offset=0)
        with pytest.raises(bw.ProducerError, match=r"backoff=.* got (-0\.01|nan|inf)"):
            p.flush(10)
    finally:
        p.abort()


def test_a_bad_backoff_answer_in_a_commit_retry_is_refused() -> None:
    store = _ThrottledCommits(MemoryStore())
    p = _producer(store, policy="naive", backoff=lambda attempt: -1.0)
    store.n = 1
    try:
        p.append([b"x"], offset=0)
        with pytest.raises(ValueError, match=r"backoff=.* got -1\.0"):
            p.flush(10)
    finally:
        p.abort()


class _NanForcedWait(PolicyWrapper):
    def forced_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float:
        return math.nan


class _NanGap(PolicyWrapper):
    @property
    def gap(self) -> float:
        return math.nan

    def ready(self, pending: int, since_last_attempt: float) -> bool:
        return since_last_attempt >= self.gap


class _NanRegularWait(PolicyWrapper):
    def regular_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float | None:
        return math.nan


@pytest.mark.parametrize(
    ("cls", "method"),
    [(_NanForcedWait, "forced_wait"), (_NanGap, "gap"), (_NanRegularWait, "regular_wait")],
)
def test_a_policy_answering_nan_is_an_error_naming_it_not_a_hang(
    cls: type[PolicyWrapper], method: str
) -> None:
    p = _producer(MemoryStore(), policy=cls(DacPolicy(seed=1)))

    def append_for_5_s() -> None:
        # No flush(): a regular wait is asked too. append() re-raises the loop's failure.
        deadline = time.monotonic() + 5.0
        for offset in range(1000):
            p.append([b"x"], offset=offset)
            if time.monotonic() > deadline:
                return  # neither attempted nor failed: a hang
            time.sleep(0.05)

    try:
        with pytest.raises(ValueError, match=rf"{cls.__name__}.*{method} must return"):
            append_for_5_s()
    finally:
        p.abort()


class _NeverRegular(PolicyWrapper):
    """Never attempts on its own (an infinite gap); flush() attempts at once."""

    @property
    def gap(self) -> float:
        return math.inf

    def ready(self, pending: int, since_last_attempt: float) -> bool:
        return False

    def forced_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float:
        return 0.0


def test_an_infinite_gap_is_a_legitimate_answer() -> None:
    p = _producer(MemoryStore(), policy=_NeverRegular(NaivePolicy()))
    try:
        p.append([b"x"], offset=0)
        p.flush(5)
        assert p.stats().tgbs_published == 1
    finally:
        p.close()


@pytest.mark.parametrize("value", [-1.0, math.nan, math.inf])
def test_a_bad_initial_window_names_the_parameter(value: float) -> None:
    with pytest.raises(ValueError, match="initial_window"):
        DacPolicy(initial_window=value)


@pytest.mark.parametrize(
    "option",
    [
        {"max_gap": "10"},
        {"conflict_budget": None},
        {"duty_budget": "0.1"},
        {"jitter": "0.1"},
        {"ema_alpha": None},
        {"initial_window": "0.05"},
        {"max_forced_gap": "0.1"},
        {"window_clamp": None},
        {"slot_factor": "2"},
        {"min_slot_window": None},
    ],
)
def test_an_option_that_is_not_a_number_names_the_parameter(option: dict[str, Any]) -> None:
    with pytest.raises(TypeError, match=next(iter(option))):
        DacPolicy(**option)
    with pytest.raises(ValueError, match=next(iter(option))):  # make_policy says ValueError
        make_policy("dac", **option)


@pytest.mark.parametrize(
    ("build", "error", "named"),
    [
        (lambda: Fixed10Policy(every="5"), TypeError, "fixed10: every must be a number"),
        (lambda: Fixed100Policy(every=None), TypeError, "fixed100: every must be a number"),
        (lambda: IncrPolicy(initial="10"), TypeError, "incr: initial must be a number"),
        (lambda: IncrPolicy(step="1"), TypeError, "incr: step must be a number"),
        (lambda: AimdPolicy(addend="1"), TypeError, "aimd: addend must be a number"),
        (lambda: AimdPolicy(decrease="0.5"), TypeError, "aimd: decrease must be a number"),
        (lambda: AimdPolicy(minimum=None), TypeError, "aimd: minimum must be a number"),
        (lambda: dac_gap(0.05, "3"), TypeError, "producers .* must be a number"),
        (lambda: dac_gap(0.05, 10**400), ValueError, "producers .* within the float range"),
        (lambda: dac_gap(10**400, 2), ValueError, "fragile window must be within"),
        (lambda: conflict_probability(0.05, "1", 2), TypeError, "gap must be a number"),
        (lambda: conflict_probability(0.05, 1.0, None), TypeError, "producers .* a number"),
        (lambda: duty(0.05, None), TypeError, "gap must be a number"),
        (lambda: duty(0.05, 10**400), ValueError, "gap must be within the float range"),
        (lambda: Fixed10Policy(every=10**400), ValueError, "every must be within the float"),
        (lambda: DacPolicy(max_gap=10**400), ValueError, "max_gap must be within the float"),
    ],
)
def test_a_bad_number_for_a_baseline_or_the_model_names_the_parameter(
    build: Callable[[], object], error: type[Exception], named: str
) -> None:
    # Before: "must be real number, not str", "'<' not supported between instances of 'int'
    # and 'str'" or an OverflowError, naming no parameter.
    with pytest.raises(error, match=named):
        build()


def test_make_policy_names_a_baseline_option_that_is_not_a_number() -> None:
    with pytest.raises(ValueError, match="fixed10: every must be a number"):
        make_policy("fixed10", every="5")


# -- 6. a clock that stands still ----------------------------------------------------------------


def test_a_frozen_clock_still_lets_regular_attempts_happen() -> None:
    policy = DacPolicy(initial_window=0.02, seed=1)  # lone: a gap of about 0.18 s
    p = _producer(MemoryStore(), policy=policy, clock=lambda: 1000.0)
    try:
        for offset in range(3):
            p.append([b"x"], offset=offset)
            time.sleep(0.1)
        deadline = time.monotonic() + 3.0
        while p.stats().tgbs_published < 3 and time.monotonic() < deadline:
            time.sleep(0.05)  # no flush(): regular attempts only
        assert p.stats().tgbs_published == 3
    finally:
        p.abort()


def test_a_frozen_clock_with_an_injected_sleep_still_lets_regular_attempts_happen() -> None:
    policy = DacPolicy(initial_window=0.02, seed=1)
    p = _producer(MemoryStore(), policy=policy, clock=lambda: 1000.0, sleep=lambda s: time.sleep(s))
    try:
        p.append([b"x"], offset=0)
        deadline = time.monotonic() + 3.0
        while p.stats().tgbs_published < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert p.stats().tgbs_published == 1
    finally:
        p.abort()


# -- 7. a wall clock that stands still or ticks in whole seconds ---------------------------------


def _wall_clocks(fake: FakeTime) -> dict[str, Callable[[], float]]:
    return {
        "frozen": lambda: 1_800_000_000.3,  # as a test injects a constant
        "seconds": lambda: float(int(fake.wall())),  # a clock of 1 s resolution
    }


def _dac_pair(fake: FakeTime, wall: str, **policy: Any) -> list[bw.Producer]:
    store = MemoryStore()
    wall_clock = _wall_clocks(fake)[wall]
    return [
        bw.Producer(
            store,
            NS,
            producer_id=f"p{i}",
            mesh=MESH,
            clock=fake.clock,
            sleep=fake.sleep,
            wall_clock=wall_clock,
            policy=DacPolicy(seed=i, **policy),
        )
        for i in range(2)
    ]


def _wait_until(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


@pytest.mark.parametrize("wall", ["frozen", "seconds"])
def test_dac_slots_take_regular_turns_on_a_wall_clock_that_does_not_move(wall: str) -> None:
    # Two producers know their ranks, so DAC paces regular attempts by wall-clock slots (a 2 s
    # period with W = 0.2 s). A slot that never opens on this clock kept them waiting forever;
    # now the wait first computed is slept (on the injected sleep: no real time) and then taken.
    fake = FakeTime(1000.0)
    ps = _dac_pair(fake, wall, initial_window=0.2)
    try:
        for p in ps:
            p.append([b"x"], offset=0)
        assert _wait_until(lambda: all(p.stats().committed_offset == 0 for p in ps))
        # Each attempt waited at most one regular period of fake time since its first data.
        assert fake.now - 1000.0 < 4 * ps[0]._policy.regular_period  # type: ignore[attr-defined]
    finally:
        for p in ps:
            p.abort()


@pytest.mark.parametrize("wall", ["frozen", "seconds"])
def test_dac_flush_ends_on_a_wall_clock_that_does_not_move(wall: str) -> None:
    fake = FakeTime(1000.0)
    # Slots sized for 0.5 s windows: a 2 s grid of 1 s slots, waits longer than a sleep chunk.
    ps = _dac_pair(fake, wall, initial_window=0.5, min_slot_window=0.5)
    errors: list[BaseException] = []

    def flush(p: bw.Producer) -> None:
        try:
            p.flush(5)
        except BaseException as exc:  # reported by the assertion below
            errors.append(exc)

    try:
        for p in ps:
            p.append([b"x"], offset=0)
        threads = [threading.Thread(target=flush, args=(p,)) for p in ps]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert errors == []
        assert all(p.stats().committed_offset == 0 for p in ps)
    finally:
        for p in ps:
            p.abort()

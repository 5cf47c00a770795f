"""DAC, BatchWeave's Decentralized Adaptive Commit (``docs/dac.md``): its model and its policy.

A post-attempt gap derived in closed form from a conflict budget and a duty budget
(:func:`dac_gap`; :func:`conflict_probability` and :func:`duty` evaluate the model), taken as
turns on a wall-clock grid by producers that know their rank (:class:`DacPolicy`). It
implements the interface of ``_base.py`` and shares nothing with the count-based baselines
(``_baselines.py``).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from typing import ClassVar, Protocol

from batchweave._policy._base import AttemptOutcome, CommitPolicy, register
from batchweave._policy._base import check_number as _check_number

__all__ = [
    "DEFAULT_CONFLICT_BUDGET",
    "DEFAULT_DUTY_BUDGET",
    "DEFAULT_MAX_FORCED_GAP",
    "DEFAULT_MAX_GAP",
    "DEFAULT_MIN_SLOT_WINDOW",
    "DEFAULT_SLOT_FACTOR",
    "DEFAULT_WINDOW_CLAMP",
    "DacPolicy",
    "UniformSource",
    "conflict_probability",
    "dac_gap",
    "duty",
]

DEFAULT_CONFLICT_BUDGET = 0.1
"""``eps``: at most one attempt in ten is expected to lose its conditional PUT."""

DEFAULT_DUTY_BUDGET = 0.1
"""``delta``: at most a tenth of a producer's wall time is spent inside a fragile window.

The paper calls this the overhead budget. It bounds the manifest request rate of a producer that
has no competition (``N = 1``, where the conflict bound is ``<= 0``) to one attempt per ``10 W``,
so a lone producer neither hammers the store with manifest PUTs nor piles up one manifest object
per TGB, while keeping TGBs visible within about ``10 W`` (half a second for a 50 ms window). With
``eps = 0.1`` the two bounds cross near ``N = 1 + k / delta ~ 2``: from three producers on the
conflict budget decides and the duty budget is slack.
"""

DEFAULT_MAX_GAP = 10.0
"""``G``: the longest post-attempt gap in seconds, the bound on how long DAC keeps TGBs invisible.

``g*`` grows like ``W (N-1) / k``: 141 ``W`` at 16 producers, minutes on a store whose fragile
window is a second. Past ten seconds freshness matters more than the conflict budget; a lost
attempt costs one more conditional PUT, an invisible TGB stalls consumers.
"""

DEFAULT_MAX_FORCED_GAP = 0.125
"""The shortest slot period of ``flush()``/``close()`` (and the longest gap a lone producer's flush
waits): they end a stream and a caller is waiting. 16 producers with windows of up to 7.8 ms fit
in it; larger ``N W`` double the period as often as needed. A ``max_gap`` below it lowers the
default to ``max_gap``."""

DEFAULT_SLOT_FACTOR = 2.0
"""A ``flush()``/``close()`` slot lasts at least this many won windows: an attempt starts in the
middle of its slot and must end inside it (rounding the period up to the grid adds up to 2x)."""

DEFAULT_MIN_SLOT_WINDOW = 0.005
"""The least window a ``flush()``/``close()`` slot is sized for, in seconds, whatever was measured.

The measured estimates come from moments with less load than a close (a start-up commit takes
0.5-3 ms on ``file://``), while closers commit while other producers still upload: 16 producers'
close commits on one disk took 3.6-25 ms, 9-11 ms at the median, and overran the 7.8 ms slots
sized from start-up commits, losing 4-9 of 20-25 close attempts per run. A commit makes two to
four requests, each a round trip or a synced write, so a few milliseconds is what one costs under
load on any store; with the slot factor every slot then holds at least 10 ms."""

_RECENT_WON = 8
_PUT_REQUESTS = 4.0
"""Requests of a commit, each costing about a data PUT: probe, parent check, segment, manifest."""
_MAX_SLOT_BACKOFF = 10
_FLOOR_PUT_SHARE = 0.5
"""At most this share of the fastest data PUT's time counts towards :attr:`DacPolicy.put_floor`."""
_TYPICAL_COMMIT_BYTES = 64 << 10
"""What a commit writes, for sizing slots before this producer won one: about a manifest whose
tail is at the default byte bound (``DEFAULT_TAIL_BYTES_LIMIT``)."""

DEFAULT_WINDOW_CLAMP = 4.0
"""A lost attempt's fragile window counts as at most this many times the current estimate ``W``.

Losers' windows measured while contended conditional PUTs stall (SeaweedFS holds them for about a
second) are outliers, not the window of a typical attempt. Clamped, one of them raises ``W`` by at
most ``a (4 - 1) = 60 %`` (``a = 0.2``); won attempts count in full, so a real slowdown is
tracked as fast as the EMA allows.
"""


class UniformSource(Protocol):
    """A random source for jitter; :class:`random.Random` is one. Injected to make tests exact."""

    def uniform(self, a: float, b: float) -> float:
        """A number drawn uniformly from ``[a, b]``."""
        ...


# --- DAC model -------------------------------------------------------------------------------


def _check_window(window: float, name: str = "fragile window") -> None:
    _check_number(name, window)
    if not (math.isfinite(window) and window >= 0):
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {window!r}")


def _check_producers(producers: int, name: str = "active producer count") -> None:
    _check_number(name, producers)
    if not (producers >= 1 and math.isfinite(producers) and producers == math.floor(producers)):
        raise ValueError(f"{name} must be a finite integer >= 1, got {producers!r:.100}")


def _check_gap(gap: float) -> None:
    _check_number("gap", gap)
    if not gap >= 0:
        raise ValueError(f"gap must be >= 0 seconds, got {gap!r}")


def _check_budgets(conflict_budget: float, duty_budget: float) -> None:
    _check_number("conflict_budget", conflict_budget)
    _check_number("duty_budget", duty_budget)
    if not 0 < conflict_budget < 1:
        raise ValueError(
            "conflict_budget must be in (0, 1) (a probability per attempt), "
            f"got {conflict_budget!r}"
        )
    if not 0 < duty_budget <= 1:
        raise ValueError(
            f"duty_budget must be in (0, 1] (a fraction of wall time), got {duty_budget!r}"
        )


def conflict_probability(window: float, gap: float, producers: int) -> float:
    """``p(g) = 1 - exp(-(N-1) W / (W+g))``: the chance that an attempt loses its conditional PUT.

    Models each of the other ``N-1`` producers' attempt starts as a Poisson process of rate
    ``1/(W+g)``; an attempt conflicts if any of them lands in its fragile window ``W``.
    """
    _check_window(window)
    _check_producers(producers, "producers (the active producer count)")
    _check_gap(gap)
    if window == 0:
        return 0.0
    return -math.expm1(-(producers - 1) * window / (window + gap))


def duty(window: float, gap: float) -> float:
    """``d(g) = W / (W+g)``: the fraction of a producer's time spent inside fragile windows."""
    _check_window(window)
    _check_gap(gap)
    if window == 0:
        return 0.0
    return window / (window + gap)


def dac_gap(
    window: float,
    producers: int,
    conflict_budget: float = DEFAULT_CONFLICT_BUDGET,
    duty_budget: float = DEFAULT_DUTY_BUDGET,
) -> float:
    """The smallest gap ``g*`` with ``p(g) <= eps`` and ``d(g) <= delta`` (no jitter).

    With ``k = -ln(1-eps)``: ``p <= eps`` iff ``g >= W((N-1)/k - 1)``, ``d <= delta`` iff
    ``g >= W(1/delta - 1)``; ``g* = max(0, both)``. Both ``p`` and ``d`` fall as ``g`` grows, so
    the larger bound is the smallest feasible gap: the freshest cadence inside both budgets.
    """
    _check_window(window)
    _check_producers(producers, "producers (the active producer count)")
    _check_budgets(conflict_budget, duty_budget)
    k = -math.log1p(-conflict_budget)
    conflict_bound = window * ((producers - 1) / k - 1)
    duty_bound = window * (1 / duty_budget - 1)
    return max(0.0, conflict_bound, duty_bound)


def _grid_period(base: float, ratio: float, to_int: Callable[[float], int]) -> float:
    """``base * 2^to_int(log2(ratio))`` for ``ratio >= 1``; ``inf`` where that overflows.

    An absurd (if finite) window, or a ``g*`` that overflows to ``inf``, must not make the slot
    arithmetic raise ``OverflowError``: callers bound the answer by ``_longest_period``.
    """
    if not math.isfinite(ratio):
        return math.inf
    exponent = to_int(math.log2(ratio))
    return base * 2.0**exponent if exponent < 1024 else math.inf


def _slot_wait(period: float, n: int, rank: int, now: float, window: float, allowed: bool) -> float:
    """Seconds until ``now`` is at the middle of slot ``rank`` of ``n`` on a grid of ``period``.

    Attempts start at the middle of their slot (or up to ``slot / 2 - window`` later, so they
    still end inside it; at least ``slot / 4`` later when slots are shorter than that), which
    makes grids whose periods differ by powers of two interleave: on the grid of period ``P 2^k``
    slot middles fall at odd multiples of ``2^(k-1) P / n`` (``k >= 1``), on the grid of period
    ``P`` at odd multiples of ``P / (2n)``, so producers on different grids of one family never
    start together; they start at least half a slot of the finer grid apart. ``allowed=False``
    (the slot's last turn was used) waits for the next turn.
    """
    slot = period / n
    phase = (now - (rank + 0.5) * slot) % period  # 0 at the middle of the slot
    if allowed and phase <= max(slot / 2 - window, slot / 4):
        return 0.0
    return period - phase


@register
class DacPolicy(CommitPolicy):
    """Decentralized Adaptive Commit: wait ``g = min(g*, G)(1+u)`` after every attempt.

    ``W`` is an exponential moving average of measured fragile windows (``W <- (1-a)W + a w``,
    a lost attempt's ``w`` clamped to ``window_clamp * W`` so a single window measured in a
    conflict storm cannot dominate it), ``N`` the active producer count of the latest committed
    manifest; ``g*`` is :func:`dac_gap` and ``u ~ Uniform(-jitter, jitter)`` keeps producers from
    falling into lock step. The gap is recomputed after every attempt, so growing manifests
    (larger ``W``) and joining producers (larger ``N``) widen it with no messages between
    producers.

    ``max_gap`` (``G``) bounds the jittered gap: it is the visibility-latency bound. When
    ``W * N`` is so large that ``g*`` exceeds it, DAC deliberately lets the conflict rate exceed
    ``eps`` rather than leave TGBs invisible for minutes.

    A producer that knows its rank among the ``N`` active producers takes turns instead of
    attempting at random phases: :meth:`regular_wait` puts its attempts in its own ``1/N`` of a
    wall-clock grid whose period is the gap (:attr:`regular_period`), and ``flush()``/``close()``
    use a finer grid sized by short uncontended windows (:meth:`forced_wait`,
    :attr:`slot_period`), so producers that end a stream together neither collide nor wait a
    gap.

    :meth:`start`, called at the producer's first data, seeds ``W`` (unless ``initial_window``
    was given) and makes the first gap a random fraction of the seeded gap, stratified by the
    producer's rank, so producers started together do not all attempt at once. The first
    ``1/a`` window samples are averaged (a bias-corrected EMA). See ``docs/dac.md``.
    """

    name: ClassVar[str] = "dac"

    def __init__(
        self,
        conflict_budget: float = DEFAULT_CONFLICT_BUDGET,
        duty_budget: float = DEFAULT_DUTY_BUDGET,
        ema_alpha: float = 0.2,
        jitter: float = 0.2,
        initial_window: float | None = None,
        rng: UniformSource | None = None,
        seed: int | None = None,
        max_gap: float = DEFAULT_MAX_GAP,
        max_forced_gap: float | None = None,
        window_clamp: float = DEFAULT_WINDOW_CLAMP,
        slot_factor: float = DEFAULT_SLOT_FACTOR,
        min_slot_window: float = DEFAULT_MIN_SLOT_WINDOW,
    ) -> None:
        for option, value in (
            ("ema_alpha", ema_alpha),
            ("jitter", jitter),
            ("max_gap", max_gap),
            ("window_clamp", window_clamp),
            ("slot_factor", slot_factor),
            ("min_slot_window", min_slot_window),
        ):
            _check_number(option, value)
        _check_budgets(conflict_budget, duty_budget)
        if not 0 < ema_alpha <= 1:
            raise ValueError(f"ema_alpha must be in (0, 1], got {ema_alpha!r}")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1) so the gap stays positive, got {jitter!r}")
        if initial_window is not None:
            _check_window(initial_window, "initial_window (the starting fragile window)")
        if rng is not None and seed is not None:
            raise ValueError("pass either rng or seed to DacPolicy, not both")
        if rng is not None and not callable(getattr(rng, "uniform", None)):
            # Refused here, not by the producer's commit thread at its first attempt.
            raise TypeError(
                f"rng must have a uniform(a, b) method (e.g. random.Random), got {rng!r:.100}"
            )
        if not max_gap > 0:
            raise ValueError(f"max_gap must be > 0 seconds (or math.inf), got {max_gap!r}")
        if max_forced_gap is None:  # the default follows a max_gap below it
            max_forced_gap = min(DEFAULT_MAX_FORCED_GAP, max_gap)
        _check_number("max_forced_gap", max_forced_gap)
        if not 0 <= max_forced_gap <= max_gap:
            raise ValueError(
                f"max_forced_gap must be in [0, max_gap={max_gap!r}] seconds, "
                f"got {max_forced_gap!r}"
            )
        if not window_clamp >= 1:
            raise ValueError(
                f"window_clamp must be >= 1 (or math.inf to disable it), got {window_clamp!r}"
            )
        self.conflict_budget = conflict_budget
        self.duty_budget = duty_budget
        self.ema_alpha = ema_alpha
        self.jitter = jitter
        self.max_gap = max_gap
        self.max_forced_gap = max_forced_gap
        if not (math.isfinite(slot_factor) and slot_factor > 0):
            raise ValueError(f"slot_factor must be a finite number > 0, got {slot_factor!r}")
        if not (math.isfinite(min_slot_window) and min_slot_window >= 0):
            raise ValueError(
                f"min_slot_window must be a finite number >= 0 seconds, got {min_slot_window!r}"
            )
        self.window_clamp = window_clamp
        self.slot_factor = slot_factor
        self.min_slot_window = min_slot_window
        self._rng: UniformSource = rng if rng is not None else random.Random(seed)
        self._window = initial_window
        self._samples: float = 0 if initial_window is None else math.inf
        """Window samples in ``W`` so far (an explicit ``initial_window`` counts as settled: the
        EMA weight ``max(a, 1 / samples)`` is then ``a`` from the first sample on)."""
        self._won_windows: deque[float] = deque(maxlen=_RECENT_WON)
        """The windows of the latest won attempts (the start-up commit counts): slot sizing."""
        self._slot_backoff = 0
        """Lost forced (slotted) attempts in a row that overran their slot: each doubles it."""
        self._fastest_put: tuple[float, int] | None = None
        """``(seconds, bytes)`` of the fastest data PUT seen (:meth:`observe_put`)."""
        self._commit_bytes = 0
        """Bytes the latest won attempt wrote inside its window (0: unknown)."""
        self._producers = 1
        self._target = 0.0
        self._gap = 0.0
        self._forced_gap = 0.0

    @property
    def window(self) -> float | None:
        """The EMA of the fragile window in seconds (None before the first measurement)."""
        return self._window

    @property
    def producers(self) -> int:
        """The active producer count ``N`` from the latest attempt."""
        return self._producers

    @property
    def target_gap(self) -> float:
        """``g*``, the gap before jitter and before the ``max_gap`` bound."""
        return self._target

    @property
    def gap(self) -> float:
        """``g = min(g*, G')(1+u)`` with ``G' = max_gap / (1+jitter)``: at most ``max_gap``."""
        return self._gap

    @property
    def forced_gap(self) -> float:
        """The gap ``flush()``/``close()`` wait: like :attr:`gap`, bounded by ``max_forced_gap``."""
        return self._forced_gap

    def ready(self, pending: int, since_last_attempt: float) -> bool:
        return pending >= 1 and since_last_attempt >= self._gap

    def observe_put(self, seconds: float, nbytes: int) -> None:
        _check_window(seconds)
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")
        if self._fastest_put is None or seconds < self._fastest_put[0]:
            self._fastest_put = (seconds, nbytes)

    @property
    def put_window(self) -> float | None:
        """What a commit should cost judging by the fastest data PUT (None: no PUT seen).

        The fastest PUT's duration times ``max(4, b / p)``: ``b`` the bytes the latest won
        commit wrote (its manifest, and a segment when its tail rolled), ``p`` those of that
        PUT. A commit makes up to four requests (the probe for a newer base, the parent check
        for a base not just listed as the newest, the segment PUT when its tail rolls, the
        conditional PUT) and encodes its manifest; it is still a low estimate (the fastest PUT
        was made at the quietest moment), which the slot backoff corrects.
        """
        if self._fastest_put is None:
            return None
        seconds, nbytes = self._fastest_put
        ratio = self._commit_bytes / nbytes if nbytes > 0 else 0.0
        return seconds * max(_PUT_REQUESTS, ratio)

    @property
    def put_floor(self) -> float:
        """The least a commit costs judging by the fastest data PUT (0 before any PUT).

        The fastest PUT's duration times ``min(1/2, b / p)``: ``b`` the bytes the latest won
        commit wrote (64 KiB, about a manifest at the default tail bound, before one is known),
        ``p`` those of that PUT. A floor under :attr:`slot_window`: the start-up commit, made
        before the data load, can be far shorter than a commit under it. The share is capped at
        half a PUT because small objects cost mostly a round trip, whatever their size; large
        uploads (10 MB) leave the floor far below the start-up commit.
        """
        if self._fastest_put is None:
            return 0.0
        seconds, nbytes = self._fastest_put
        if nbytes <= 0:
            return 0.0
        return seconds * min(
            _FLOOR_PUT_SHARE, (self._commit_bytes or _TYPICAL_COMMIT_BYTES) / nbytes
        )

    @property
    def slot_window(self) -> float:
        """The window a slot must hold: a low estimate of an uncontended attempt, doubled per loss.

        Producers flush and close together when their data load ends (a job's end, a
        checkpoint), so the window a slot must hold is the uncontended one, usually far shorter
        than ``W`` under load. The estimate is the shortest of the last won windows (the
        start-up commit counts), bounded from above by :attr:`put_window` and from below by
        :attr:`put_floor` and ``min_slot_window`` (:data:`DEFAULT_MIN_SLOT_WINDOW`). A producer
        whose first commit comes at ``close()`` has only its start-up commit among its won
        windows, a noisy sample made before the data load: 0.5-61 ms on ``file://`` for
        producers started together (alone, it put closers on slot periods from 0.125 s to 2 s),
        and 1-5 ms on SeaweedFS where close-time commits took 10-35 ms (8 ms slots: a third of
        the close attempts lost). The fastest upload, a PUT made in the same run under the load,
        bounds it on both sides, and the fixed minimum from below. Estimating low costs at
        most a lost attempt: a lost slotted attempt that ran past its slot's end (longer than
        half a slot, as it starts at the middle) shows the slot was too short, and doubles it
        until an attempt wins again (binary exponential backoff, over grids that stay nested);
        a loser that ended inside its slot was hit by one that did not, and keeps its slot.
        Estimating high costs every closer a longer wait. 0 before any measurement.
        """
        put = self.put_window
        candidates = [*self._won_windows, *([] if put is None else [put])]
        if not candidates:
            return self._window or 0.0
        floor = max(self.put_floor, self.min_slot_window)
        return max(min(candidates), floor) * 2.0**self._slot_backoff

    @property
    def slot_period(self) -> float:
        """The period ``P`` of the ``flush()``/``close()`` slots (0 with no estimate of ``W``).

        A conflict-free turn for every producer takes ``N`` slots of ``s = slot_factor *
        slot_window``: ``P`` is ``N s`` rounded up to ``max_forced_gap * 2^i`` (``i >= 0``), at
        most the longest such period within ``max_gap``. Rounding to a few fixed values is what
        makes producers agree on the grid although each has its own estimate of ``W`` (on a fast
        store all of them use ``max_forced_gap``), and periods a power of two apart interleave
        (see :func:`_slot_wait`); a shorter period would only trade waiting for conflicts, and a
        lost slot costs a whole period.
        """
        raw = self.slot_factor * self.slot_window * self._producers
        base = self.max_forced_gap
        if raw <= 0 or base <= 0:
            return 0.0
        if raw <= base:
            return base
        return min(self._longest_period, _grid_period(base, raw / base, math.ceil))

    @property
    def _longest_period(self) -> float:
        """The longest period on the grid ``max_forced_gap * 2^i`` that ``max_gap`` allows."""
        if not math.isfinite(self.max_gap):
            return math.inf
        base = self.max_forced_gap
        # inf where max_gap / base overflows (max_gap near 1e308, or a subnormal base).
        return _grid_period(base, self.max_gap / base, lambda x: math.floor(x + 1e-9))

    @property
    def regular_period(self) -> float:
        """The period of the regular slots: ``W + g*`` on the grid of :attr:`slot_period`.

        One attempt per period is a cycle of the model (a window, then the gap), so the period
        is ``min(W + g*, max_gap)`` rounded up to ``max_forced_gap * 2^i`` (less than twice
        that), at least :attr:`slot_period` (a slot must hold an attempt) and at most the
        longest grid period within ``max_gap``; 0 without an estimate of ``W``. Up, not to the
        nearest: the cadence must stay within the duty and conflict budgets, which ``g*`` just
        meets (``g*`` rounded to the nearest grid value, up to 1.41x shorter, spent 1.5x the
        duty budget at ``N = 2``). Only ``max_gap`` cuts it shorter, as it bounds the gap.
        """
        if self._window is None:
            return 0.0
        gap = min(self._window + self._target, self.max_gap)
        base = self.max_forced_gap
        if gap <= 0 or base <= 0:
            return max(gap, self.slot_period)
        period = _grid_period(base, max(1.0, gap / base), math.ceil)
        return min(self._longest_period, max(period, self.slot_period))

    def regular_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float | None:
        """Wait for this producer's slot on the wall-clock grid of period :attr:`regular_period`.

        The gap formula assumes attempt starts at random (Poisson) times and buys a conflict
        budget with a long gap. Producers that agree on ``N``, their ranks and the grid can do
        better at the same gap: each attempts once per period, in its own ``1/N`` of it, so
        attempts never overlap while a slot holds a window (``period / N >= W``: ``g* / N`` is
        about ``9.5 W`` with the defaults, and ``G / N`` holds a 0.5 s window at 16 producers).
        Where they disagree (different estimates of ``W``, skewed clocks, a producer that has
        not seen a join yet), phases are effectively random, as the formula assumes. ``None``
        (use :meth:`ready` and :attr:`gap`) for a lone producer, an unknown rank or an infinite
        period (``max_gap=math.inf`` with an overflowing ``g*``).
        """
        n = self._producers
        period = self.regular_period
        if rank is None or n < 2 or not 0 <= rank < n or not 0 < period < math.inf:
            return None
        return _slot_wait(
            period, n, rank, now, self._window or 0.0, since_last_attempt >= period / n
        )

    def forced_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float:
        """Wait for this producer's slot on a wall-clock grid shared by all producers.

        Producers that flush or close together (the end of a job, a checkpoint) would otherwise
        attempt in a burst. The grid has period :attr:`slot_period`, split into ``N`` slots; the
        producer of ``rank`` owns slot ``rank`` and attempts while at least one ``W`` (or half
        of it) is left. Slots do not overlap, so producers agreeing on ``N``, ranks and the grid
        do not conflict at all; skewed clocks or disagreeing views make the phases effectively
        random, which is what the gap formula assumes anyway. A lone producer (or an unknown
        rank) waits :attr:`forced_gap` as before.
        """
        n = self._producers
        period = self.slot_period
        if rank is None or n < 2 or not 0 <= rank < n or not 0 < period < math.inf:
            return super().forced_wait(since_last_attempt, now, rank)
        return _slot_wait(period, n, rank, now, self.slot_window, True)

    def start(
        self,
        window: float,
        active_producers: int,
        rank: int | None = None,
        loaded_window: float | None = None,
    ) -> None:
        """Seed ``W`` and draw the first gap (see :meth:`CommitPolicy.start`).

        ``window`` (the start-up commit, an attempt that won) seeds both ``W`` and the recent
        won windows that size ``flush()``/``close()`` slots; ``loaded_window``, a conservative
        estimate of ``W`` under the data load (the producer passes its first upload's duration),
        seeds ``W`` if larger.
        """
        _check_window(window)
        _check_producers(active_producers)
        if loaded_window is not None:
            _check_window(loaded_window)
        if rank is not None and not 0 <= rank < active_producers:
            raise ValueError(
                f"rank must be in [0, active_producers={active_producers}), got {rank!r}"
            )
        if self._window is None:
            self._window = max(window, loaded_window or 0.0)
            self._samples = 1
        if not self._won_windows:
            self._won_windows.append(window)
        self._producers = active_producers
        # Producers started together would all attempt at once and all but one would lose (and
        # measure their windows under that contention): spread first attempts over one gap, each
        # producer in its own 1/N of it when its rank is known (stratified: neighbours are on
        # average one slot apart instead of clustering as independent draws do).
        u = self._rng.uniform(0.0, 1.0)
        fraction = u if rank is None else (rank + u) / active_producers
        self._set_gaps(self._window, fraction)

    def record(self, outcome: AttemptOutcome) -> None:
        _check_window(outcome.fragile_window)
        _check_producers(outcome.active_producers)
        # The slot the attempt was made in, before this outcome changes the estimates.
        slot = self.slot_period / self._producers
        sample = outcome.fragile_window
        if self._window is None:
            self._window = sample
            self._samples = 1
        else:
            if not outcome.committed and self._window > 0:
                sample = min(sample, self.window_clamp * self._window)
            # Bias-corrected start: until 1/a samples are in, W is their plain mean, so a seed
            # measured before the data load began (the start-up commit) fades after a few
            # attempts instead of dominating the first 1/a of them.
            self._samples += 1
            a = max(self.ema_alpha, 1 / self._samples)
            self._window = (1 - a) * self._window + a * sample
        if outcome.committed:
            self._won_windows.append(outcome.fragile_window)
            self._slot_backoff = 0
            if outcome.bytes_written > 0:
                self._commit_bytes = outcome.bytes_written
        elif outcome.forced and outcome.fragile_window > slot / 2:
            # Started at the middle of its slot, the attempt ran past the slot's end: the slot
            # is too short. A loser that ended inside its slot was hit by an attempt that did
            # not (whose producer backs off itself), so doubling would only lengthen its wait.
            self._slot_backoff = min(self._slot_backoff + 1, _MAX_SLOT_BACKOFF)
        self._producers = outcome.active_producers
        u = self._rng.uniform(-self.jitter, self.jitter) if self.jitter else 0.0
        self._set_gaps(self._window, 1 + u)

    def _set_gaps(self, window: float, factor: float) -> None:
        """``g*`` from ``window`` and ``N``; the gaps are the bounded target times ``factor``."""
        self._target = dac_gap(window, self._producers, self.conflict_budget, self.duty_budget)
        spread = 1 + self.jitter  # the largest factor, so the bounds hold after jitter
        self._gap = min(self._target, self.max_gap / spread) * factor
        self._forced_gap = min(self._target, self.max_forced_gap / spread) * factor

    def __repr__(self) -> str:
        return (
            f"DacPolicy(conflict_budget={self.conflict_budget}, duty_budget={self.duty_budget}, "
            f"max_gap={self.max_gap}, window={self._window}, producers={self._producers}, "
            f"gap={self._gap:.6g})"
        )

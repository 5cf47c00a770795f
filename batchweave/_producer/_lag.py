"""The ``max_lag`` back-pressure: ``append`` waits while readers lag too far behind.

A producer with ``max_lag`` blocks ``append`` while the visible steps exceed the reclamation
boundary (the oldest live watermark) by more than ``max_lag``. Such a wait is normal
back-pressure, but also how a misconfigured job shows: one whose trainer never records a
watermark, or whose ``max_lag`` is too small for the trainer ever to reach its next checkpoint.
:class:`LagGate` owns the wait, its counters and its log lines; :func:`diagnose` reads from the
watermarks who holds the boundary back and whether the job can progress at all.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from collections.abc import Callable, Sequence

from batchweave._errors import FormatError
from batchweave._policy._base import measured_duration
from batchweave._producer._retry import RETRYABLE, Retries
from batchweave._watermarks import Watermark, Watermarks, recorded_ago

__all__ = ["LAG_WARN_AFTER", "LAG_WARN_LONG", "LAG_WARN_STUCK", "LagGate", "diagnose"]

_LOG = logging.getLogger("batchweave.producer")

LAG_WARN_AFTER = 60.0
"""Seconds an ``append`` blocked by ``max_lag`` with no watermark recorded waits before the
producer says so once at WARNING (its periodic lines are INFO)."""
LAG_WARN_LONG = 600.0
"""Seconds after which any one ``max_lag`` wait is said once at WARNING: a watermark that
stopped advancing (a trainer that never calls ``checkpoint_hook`` after its first mark)."""
LAG_WARN_STUCK = 30.0
"""Seconds a ``max_lag`` wait whose watermarks show that training cannot reach its next
checkpoint (``max_lag`` below about keep_last x the checkpoint interval) lasts, with those
watermarks unchanged, before the producer says so once at WARNING."""


def diagnose(
    marks: Sequence[Watermark], visible: int, max_lag: int, now: float
) -> tuple[str, str | None]:
    """Who holds the reclamation boundary back, and why a ``max_lag`` wait cannot end.

    ``marks`` are the live watermarks, oldest first (at least one), ``visible`` the steps
    visible to readers and ``now`` the wall clock. The second part is ``None`` unless the
    watermarks show that the wait cannot end: the boundary is the *oldest* live watermark,
    which a keep-last-K trainer releases only after its next checkpoint, about one interval
    past its newest; if the producers stop (``boundary + max_lag``) before that step, the
    trainer never gets there.
    """
    oldest = marks[0]
    holder = (
        f"the oldest is {oldest.checkpoint_id!r} at step {oldest.step}, {recorded_ago(oldest, now)}"
    )
    steps = sorted({m.step for m in marks})
    if len(steps) < 2:
        return holder, None  # one checkpoint step: no interval to estimate
    newest = max(marks, key=lambda m: (m.step, m.recorded_at))
    interval = steps[-1] - steps[-2]  # the two newest checkpoints' distance
    target = newest.step + interval  # the step after the newest's next checkpoint
    if oldest.step + max_lag >= target or visible >= target:
        return holder, None
    need = target - oldest.step
    return (
        holder,
        f"This job cannot progress: the trainer must read to step {target - 1} and "
        f"checkpoint there (the newest watermark {newest.checkpoint_id!r} at step "
        f"{newest.step} plus a checkpoint interval of about {interval} steps, the distance "
        f"of the two newest watermarks) before the oldest watermark "
        f"{oldest.checkpoint_id!r} at step {oldest.step} is released, but producers "
        f"publish at most max_lag {max_lag} steps past that one ({visible} visible "
        f"now), unless another reader holds it. Raise max_lag to at least {need} (about "
        f"keep_last x checkpoint interval, in TGB steps), keep fewer checkpoints "
        f"(Watermarks keep_last), or checkpoint more often",
    )


class LagGate:
    """Blocks one producer's ``append`` calls while ``max_lag`` is exceeded.

    The boundary comes from ``boundary``: the namespace's :class:`Watermarks` (whose live
    marks its log lines name), or the producer's ``boundary=`` function. Its counters
    (``blocked``, ``blocked_seconds``) and log pacing are guarded by the producer's lock
    ``lock`` (taken with ``with lock``, a C-level ``RLock``, never ``with cond``: see
    :class:`Retries`); ``cond``, the producer's condition on that lock, is notified when an
    ``append`` becomes blocked: the commit loop then publishes what blocks it. It waits with
    ``retries.backoff`` and ``retries.sleep``. It holds no reference to the producer (see
    :class:`Retries`).

    Its log lines are paced per producer, not per ``append``: at most one every
    ``log_interval`` seconds of ``clock`` across all waits (a producer blocked briefly on every
    ``append`` would otherwise log, and LIST the watermarks, once per call).
    """

    def __init__(
        self,
        producer_id: str,
        lock: threading.RLock,
        cond: threading.Condition,
        retries: Retries,
        *,
        boundary: Watermarks | Callable[[], int],
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        log_interval: float,
    ) -> None:
        self._producer_id = producer_id
        self._lock = lock
        self._cond = cond
        self._retries = retries
        self._watermarks = boundary if isinstance(boundary, Watermarks) else None
        """The namespace's watermarks when they give the boundary (named in max_lag logs)."""
        self._boundary_fn = boundary.boundary if isinstance(boundary, Watermarks) else boundary
        self._clock = clock
        self._wall_clock = wall_clock
        self._log_interval = log_interval
        self._boundary_value = 0
        self.blocked = 0
        """How many ``append`` calls are blocked by ``max_lag`` right now."""
        self.blocked_seconds = 0.0
        """Total time ``append`` spent blocked by ``max_lag``."""
        self._last_log = -math.inf
        """``clock()`` of the last blocked line, of any wait: lines are paced per producer."""
        self._warned = False
        """Whether a line of the current wait was a WARNING. Reset when an ``append`` becomes
        blocked while no other is: appends blocked together are one wait, warned once."""

    def wait(self, max_lag: int, visible: Callable[[], int], rebase: Callable[[], None]) -> None:
        """Return once ``visible()`` steps exceed the boundary by at most ``max_lag``.

        ``visible()`` counts the steps readers will see, the producer's uncommitted TGBs
        included (and raises once it cannot append); ``rebase()`` reads the newest manifest and
        adopts it, after each read of the boundary. Store failures of those reads are retried.
        """
        refreshed = False
        counted = False  # whether this append is counted in ``blocked``
        # Seconds blocked so far: clock() differences summed per round, each clamped at 0, so a
        # clock stepped back (an NTP step under clock=time.time) costs at most one round and
        # never shows a negative wait or postpones the WARNING by the size of the step.
        waited = 0.0
        last_seen = 0.0
        # The last diagnosis that this wait cannot end (the same text: the same watermarks),
        # and ``waited`` when it was first made.
        stalled: str | None = None
        stalled_since = -math.inf
        attempt = 0
        try:
            while True:
                steps = visible()
                if steps - self._boundary_value <= max_lag:
                    return
                if refreshed:
                    now = self._clock()
                    with self._lock:
                        if not counted:
                            counted, last_seen = True, now
                            if self.blocked == 0:
                                self._warned = False  # a new wait
                            self.blocked += 1
                            self._cond.notify_all()  # the commit loop publishes what blocks us
                        # A clock stepped back since the last line leaves its age unknown: log.
                        due = not 0 <= now - self._last_log < self._log_interval
                        if due:
                            self._last_log = now
                    waited += measured_duration(last_seen, now)
                    last_seen = now
                    if due:
                        holder, unmarked, stall = self._holder(steps, max_lag)
                        if stall != stalled:  # a new diagnosis, or the watermarks moved
                            stalled, stalled_since = stall, waited
                        # Blocking is normal back-pressure (INFO); a minute with no watermark at
                        # all, or ten with one that does not move, looks like a job that does not
                        # checkpoint, so say it once where default logging shows it; so is half
                        # a minute on watermarks that show training cannot reach its next
                        # checkpoint (max_lag below about keep_last x the checkpoint interval).
                        loud = (
                            waited >= LAG_WARN_LONG
                            or (unmarked and waited >= LAG_WARN_AFTER)
                            or (stall is not None and waited - stalled_since >= LAG_WARN_STUCK)
                        )
                        with self._lock:
                            loud = loud and not self._warned
                            self._warned = self._warned or loud
                        _LOG.log(
                            logging.WARNING if loud else logging.INFO,
                            "producer %r blocked by max_lag: %d visible steps, reclamation "
                            "boundary %d, max_lag %d (waiting %.0f s so far; checkpoints must "
                            "advance the watermarks: %s)%s",
                            self._producer_id,
                            steps,
                            self._boundary_value,
                            max_lag,
                            waited,
                            holder,
                            "" if stall is None else f". {stall}",
                        )
                    attempt += 1
                    self._retries.sleep(min(self._retries.backoff(attempt), 1.0))
                    after = self._clock()
                    with self._lock:
                        self.blocked_seconds += measured_duration(now, after)
                try:
                    self._boundary_value = self._checked_boundary(self._boundary_fn())
                    rebase()
                except RETRYABLE as exc:
                    attempt += 1
                    self._retries.note("checking max_lag", exc, attempt)
                    continue
                refreshed = True
        finally:
            if counted:
                # A count: another append may still be blocked (and need what it waits on
                # committed) after this one goes.
                with self._lock:
                    self.blocked -= 1

    def _checked_boundary(self, value: object) -> int:
        """``value``, a boundary read, as an int step; ``TypeError`` naming ``boundary=`` if not
        one (``None`` for "no checkpoint yet" would otherwise fail deep in the arithmetic)."""
        if type(value) is int:
            return value
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(
                f"producer {self._producer_id!r}: the boundary= callable must return an int "
                f"step (the reclamation boundary; 0 while nothing is checkpointed), got the "
                f"{type(value).__name__} {value!r:.100}"
            )
        return int(value)

    def _holder(self, visible: int, max_lag: int) -> tuple[str, bool, str | None]:
        """Who holds the reclamation boundary back, for the max_lag log line (one LIST).

        Also whether no watermark is recorded at all: the wait that ends only once a trainer
        calls ``checkpoint_hook``, which a misconfigured job never does. And, when the
        watermarks show it, why this wait cannot end (else ``None``; see :func:`diagnose`).
        """
        if self._watermarks is None:
            return "the boundary comes from the boundary= callable", False, None
        try:
            marks = self._watermarks.live()
        except (*RETRYABLE, FormatError) as exc:
            return f"the watermarks cannot be read ({exc})", False, None
        if not marks:
            none_yet = (
                "no watermark is recorded yet: the boundary stays 0 until rank 0 of the "
                "trainer calls checkpoint_hook after a checkpoint"
            )
            return none_yet, True, None
        holder, stall = diagnose(marks, visible, max_lag, self._wall_clock())
        return holder, False, stall

"""The paper's baseline commit policies, which count pending TGBs instead of timing attempts.

``naive`` (attempt whenever a TGB is pending), ``fixed10``/``fixed100`` (every 10/100 TGBs),
``incr`` (every ``k`` TGBs, ``k`` starting at 10 and growing by one per conflict) and ``aimd``
(interval grows by an addend on success and halves on conflict). They are the comparison points
for DAC (``_dac.py``), exactly as the paper states them, and share none of its model.
"""

from __future__ import annotations

import math
from typing import ClassVar

from batchweave._policy._base import AttemptOutcome, CommitPolicy, check_number, register

__all__ = [
    "AimdPolicy",
    "Fixed100Policy",
    "Fixed10Policy",
    "FixedCountPolicy",
    "IncrPolicy",
    "NaivePolicy",
]


@register
class NaivePolicy(CommitPolicy):
    """Attempt whenever at least one TGB is pending, back to back (the paper's Naive)."""

    name: ClassVar[str] = "naive"

    def ready(self, pending: int, since_last_attempt: float) -> bool:
        return pending >= 1

    def record(self, outcome: AttemptOutcome) -> None:
        pass


class _IntervalPolicy(CommitPolicy):
    """Attempt once ``interval`` TGBs are pending; subclasses decide how the interval moves."""

    def __init__(self, interval: float, option: str = "interval") -> None:
        check_number(f"{self.name}: {option}", interval)
        if not (math.isfinite(interval) and interval >= 1):
            raise ValueError(
                f"{self.name}: {option}, the commit interval, must be a finite number of TGBs "
                f">= 1, got {interval!r:.100}"
            )
        self._interval = float(interval)

    @property
    def interval(self) -> float:
        """TGBs that must be pending before the next attempt."""
        return self._interval

    def ready(self, pending: int, since_last_attempt: float) -> bool:
        return pending >= self._interval

    def __repr__(self) -> str:
        return f"{type(self).__name__}(interval={self._interval:g})"


class FixedCountPolicy(_IntervalPolicy):
    """Attempt every ``every`` TGBs, never adapting (the paper's FIXED10/FIXED100)."""

    name: ClassVar[str] = "fixed"

    def __init__(self, every: int) -> None:
        super().__init__(every, "every")

    def record(self, outcome: AttemptOutcome) -> None:
        pass


@register
class Fixed10Policy(FixedCountPolicy):
    """Attempt every 10 TGBs."""

    name: ClassVar[str] = "fixed10"

    def __init__(self, every: int = 10) -> None:
        super().__init__(every)


@register
class Fixed100Policy(FixedCountPolicy):
    """Attempt every 100 TGBs."""

    name: ClassVar[str] = "fixed100"

    def __init__(self, every: int = 100) -> None:
        super().__init__(every)


@register
class IncrPolicy(_IntervalPolicy):
    """Attempt every ``k`` TGBs; ``k`` starts at ``initial`` and grows by ``step`` per conflict.

    The paper's INCR: it only ever backs off, so it never recovers freshness once contention
    passes.
    """

    name: ClassVar[str] = "incr"

    def __init__(self, initial: int = 10, step: int = 1) -> None:
        super().__init__(initial, "initial")
        check_number("incr: step", step)
        if not (math.isfinite(step) and step >= 0):
            raise ValueError(f"incr: step must be a finite number of TGBs >= 0, got {step!r}")
        self.step = step

    def record(self, outcome: AttemptOutcome) -> None:
        if not outcome.committed:
            self._interval += self.step


@register
class AimdPolicy(_IntervalPolicy):
    """The paper's AIMD: interval (in TGBs) ``+addend`` on success, ``*decrease`` on conflict.

    Exactly as the paper states it ("increase the interval by a fixed addend on success, halve it
    on conflict"), floored at ``minimum`` TGBs. Defaults: start at 10 TGBs like INCR, addend 1,
    decrease 0.5, minimum 1.
    """

    name: ClassVar[str] = "aimd"

    def __init__(
        self,
        initial: float = 10.0,
        addend: float = 1.0,
        decrease: float = 0.5,
        minimum: float = 1.0,
    ) -> None:
        super().__init__(initial, "initial")
        for option, value in (("addend", addend), ("decrease", decrease), ("minimum", minimum)):
            check_number(f"aimd: {option}", value)
        if not (math.isfinite(addend) and addend >= 0):
            raise ValueError(f"aimd: addend must be a finite number of TGBs >= 0, got {addend!r}")
        if not 0 < decrease < 1:
            raise ValueError(f"aimd: decrease must be in (0, 1), got {decrease!r}")
        if not (math.isfinite(minimum) and 1 <= minimum <= initial):
            raise ValueError(
                f"aimd: minimum must be in [1, initial={initial!r}] TGBs, got {minimum!r}"
            )
        self.addend = addend
        self.decrease = decrease
        self.minimum = minimum

    def record(self, outcome: AttemptOutcome) -> None:
        if outcome.committed:
            self._interval += self.addend
        else:
            self._interval = max(self.minimum, self._interval * self.decrease)

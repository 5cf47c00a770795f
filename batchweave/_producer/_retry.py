"""Retried store failures: which ones a producer retries, its backoff, and how it says so.

Starting, uploading, committing and the ``max_lag`` check all retry the same failures with the
same backoff, count them in one counter (``ProducerStats.transient_errors``) and log them the
same way (one line per outage, one per other retry); :class:`Retries` is that shared part, so
each of them uses it without owning it for the others. ``_outage.is_outage`` says which failures are
an outage: waited out however long they last, spending none of ``max_retries``.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
from collections.abc import Callable

from batchweave._errors import AmbiguousWriteError, StoreUnavailable, TransientStoreError
from batchweave._outage import OutageLog, is_outage

__all__ = ["RETRYABLE", "Retries", "default_backoff"]

_LOG = logging.getLogger("batchweave.producer")

RETRYABLE = (TransientStoreError, AmbiguousWriteError, StoreUnavailable)
"""Store failures after which retrying later may succeed; nothing pending is dropped."""


def default_backoff(attempt: int) -> float:
    """Capped exponential backoff: 0.05 s, 0.1 s, ... up to 5 s."""
    return float(min(5.0, 0.05 * (2 ** min(attempt, 10))))


class Retries:
    """Counts and logs one producer's retried store failures, then sleeps their backoff.

    It also holds the producer's ``backoff`` and ``sleep``, for its other backoff waits (after a
    lost epoch commit or commit conflict, and while ``max_lag`` blocks). ``count`` is guarded by the
    producer's lock ``lock``, taken with ``with lock`` (a C-level ``RLock``: a Ctrl-C cannot
    land between its acquire and release, as it can inside ``Condition.__exit__``). It holds no
    reference to the producer: a producer dropped without ``close()`` must be freed without the
    cycle collector.
    """

    def __init__(
        self,
        producer_id: str,
        lock: threading.RLock,
        outage: OutageLog,
        *,
        backoff: Callable[[int], float],
        sleep: Callable[[float], None],
    ) -> None:
        self._producer_id = producer_id
        self._lock = lock
        self._outage = outage
        self.backoff = _checked_backoff(backoff)
        """Seconds to wait before retry ``attempt`` (1, 2, ...): the producer's ``backoff``,
        whose every answer is checked (``ValueError`` naming ``backoff=`` and the value)."""
        self.sleep = sleep
        """The producer's ``sleep``, for the waits between retries."""
        self.count = 0
        """Store failures that were retried: while starting, uploading, committing or checking
        ``max_lag``."""

    def note(
        self,
        what: str,
        exc: BaseException,
        attempt: int,
        *,
        sleep: Callable[[float], None] | None = None,
        outage: bool | None = None,
    ) -> None:
        """Count and log a retried failure, then sleep the backoff (with ``sleep``, if given).

        ``outage``: whether it is one (default: :func:`~batchweave._outage.is_outage`), logged
        once per outage; any other failure gets a line of its own, naming ``what``.
        """
        delay = self.backoff(attempt)
        sleep = self.sleep if sleep is None else sleep
        with self._lock:
            self.count += 1
        if is_outage(exc) if outage is None else outage:
            self._outage.failed(what, exc)  # one line per outage, not one per retry
            sleep(delay)
            return
        _LOG.warning(
            "producer %r: %s failed (attempt %d, %s: %s); retrying in %.2f s, nothing pending "
            "is dropped",
            self._producer_id,
            what,
            attempt,
            type(exc).__name__,
            exc,
            delay,
        )
        sleep(delay)


def _checked_backoff(backoff: Callable[[int], float]) -> Callable[[int], float]:
    """``backoff``, refusing an answer that is not a finite number of seconds >= 0.

    Every wait of the producer takes its length from here (retries, conflicts, ``max_lag``): a
    jitter formula that can dip below 0, or a NaN, would otherwise stop the producer with
    ``sleep``'s own error naming neither ``backoff=`` nor the value, or be slept as no wait.
    """

    def checked(attempt: int) -> float:
        seconds = backoff(attempt)
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, numbers.Real)
            or not (math.isfinite(seconds) and seconds >= 0)
        ):
            raise ValueError(
                f"backoff={backoff!r:.100} must return a finite number of seconds >= 0, got "
                f"{seconds!r:.100} for attempt {attempt}"
            )
        return float(seconds)

    return checked

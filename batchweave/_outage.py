"""Telling the operator about a store outage: one line when it starts, a reminder, one at the end.

An unreachable object store is waited out, never a reason to drop data: producers keep their
pending TGBs, consumers keep their position. What the operator needs is to *see* it, without a
line per retry: :class:`OutageLog` logs a warning when the first failure of an outage is seen,
a reminder every ``interval`` seconds while it lasts, and an info line when a request succeeds
again. A store that fails and answers by turns (one of two endpoints down) is reported at most
once per ``interval``: an outage starting within ``interval`` of the last reported start is
counted, not logged, unless it lasts until ``interval`` has passed, and the next line says how
many failed requests and short outages there were meanwhile.

:func:`no_answer` tells a request that got no answer in time (a hung or overloaded
endpoint, a wrong port) from a store that answered with an error: for a client that waits for
the store, the first is an outage like a refused connection.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from batchweave._errors import AmbiguousWriteError, StoreTimeout, StoreUnavailable

__all__ = ["OutageLog", "is_outage", "no_answer"]


def no_answer(exc: BaseException) -> bool:
    """Whether the store error ``exc`` says its request got no answer in time (a read timeout).

    Both S3 backends raise :class:`~batchweave.StoreTimeout` (a ``TransientStoreError``, not
    ``StoreUnavailable``) for a read, listing or delete that timed out, and an
    :class:`~batchweave.AmbiguousWriteError` with ``timed_out`` set for a write: the request may
    have reached a server, so a write is ambiguous and a single slow answer is retried. But an
    endpoint that accepts connections and never answers is as unreachable as one that refuses
    them: a client waiting for the store counts it as an outage, and must not blame what it was
    waiting for.
    """
    if isinstance(exc, StoreTimeout):
        return True
    return isinstance(exc, AmbiguousWriteError) and exc.timed_out


def is_outage(exc: BaseException) -> bool:
    """Whether the store failure ``exc`` is an outage rather than a failing request.

    An unreachable store (:class:`~batchweave.StoreUnavailable`) and one that accepts
    connections but never answers (a hung server: :func:`no_answer`, a ``StoreTimeout`` or a
    timed-out write) are waited out with one log line per outage. A timed-out write is
    ambiguous, and retrying it is safe all the same: an upload writes the same bytes to the same
    key again, and a commit resolves its outcome by reading the version back
    (``ManifestLog.commit``) before anything is retried.
    """
    return isinstance(exc, StoreUnavailable) or no_answer(exc)


class OutageLog:
    """Tracks one client's view of a store outage and logs its start, progress and end.

    ``who`` names the client in every line (``"producer 'p0'"``); ``clock`` is monotonic seconds.
    Thread-safe: a client's threads share one instance so an outage is reported once.

    The start of an outage is logged at once unless another start was logged less than
    ``interval`` ago: a flapping store (every other request refused) would otherwise log a
    warning and an info line per request. Such an outage is counted silently; if it lasts until
    ``interval`` has passed since the last reported start it is reported then, and short ones
    are summed up in the next line logged (a start, or a warning "fails intermittently" at the
    first success once ``interval`` has passed).
    """

    def __init__(
        self,
        logger: logging.Logger,
        who: str,
        *,
        clock: Callable[[], float],
        interval: float = 30.0,
    ) -> None:
        self._logger = logger
        self._who = who
        self._clock = clock
        self._interval = interval
        self._lock = threading.Lock()
        self._since: float | None = None
        """When the outage in progress began (reported or not)."""
        self._reported = False
        """Whether the outage in progress was logged."""
        self._last_log = 0.0
        self._last_start: float | None = None
        """When the last start of an outage was logged."""
        self._failures = 0
        self._unreported_outages = 0
        """Outages that ended unlogged since the last start was logged, and their failed
        requests:"""
        self._unreported_failures = 0

    @property
    def down(self) -> bool:
        """Whether the last request this client made failed as part of an outage."""
        with self._lock:
            return self._since is not None

    def _meanwhile(self, now: float) -> str:
        """The short outages that ended unlogged since the last start was logged (and resets
        their count): ``"unreachable 3 times briefly in the last 30 s (3 failed requests, not
        logged one by one)"``, or ``""``."""
        outages, failures = self._unreported_outages, self._unreported_failures
        if not outages:
            return ""
        self._unreported_outages = self._unreported_failures = 0
        assert self._last_start is not None
        return (
            f"unreachable {outages} times briefly in the last "
            f"{max(0.0, now - self._last_start):.0f} s ({failures} failed requests, not logged "
            "one by one)"
        )

    def failed(self, what: str, exc: BaseException) -> None:
        """Record a failed request (``what`` says what the client was doing)."""
        now = self._clock()
        with self._lock:
            self._failures += 1
            if self._since is None:
                self._since = now
                self._reported = False
            if not self._reported:
                if self._last_start is not None and now - self._last_start < self._interval:
                    return  # another start was logged just now: counted, not logged yet
                meanwhile = self._meanwhile(now)
                if meanwhile:
                    meanwhile = f"; it fails intermittently: {meanwhile}"
                self._reported = True
                self._last_start = self._last_log = now
                lasting = now - self._since
                self._logger.warning(
                    "%s: the object store is unreachable while %s (%s: %s)%s; waiting for it to "
                    "come back, nothing is dropped%s",
                    self._who,
                    what,
                    type(exc).__name__,
                    exc,
                    f" for {lasting:.0f} s ({self._failures} failed requests)"
                    if lasting >= 1.0
                    else "",
                    meanwhile,
                )
            elif now - self._last_log >= self._interval:
                self._last_log = now
                self._logger.warning(
                    "%s: the object store is still unreachable after %.0f s (%d failed "
                    "requests); still waiting while %s",
                    self._who,
                    max(0.0, now - self._since),  # a clock stepped back: no negative outage
                    self._failures,
                    what,
                )

    def recovered(self) -> None:
        """Record a successful request; ends the outage if one was in progress."""
        if self._since is None and not self._unreported_outages:
            return  # the common case, checked without the lock
        with self._lock:
            if self._since is not None and self._reported:
                self._logger.info(
                    "%s: the object store is reachable again after %.1f s (%d failed requests); "
                    "resuming",
                    self._who,
                    max(0.0, self._clock() - self._since),
                    self._failures,
                )
            elif self._since is not None:  # a short outage nobody was told about
                self._unreported_outages += 1
                self._unreported_failures += self._failures
            self._since = None
            self._reported = False
            self._failures = 0
            if not self._unreported_outages:
                return
            now = self._clock()
            assert self._last_start is not None
            if now - self._last_start >= self._interval:  # flapping: at most once an interval
                meanwhile = self._meanwhile(now)
                self._last_start = now  # a new start waits an interval more to be logged
                self._logger.warning(
                    "%s: the object store fails intermittently: %s; reachable now",
                    self._who,
                    meanwhile,
                )

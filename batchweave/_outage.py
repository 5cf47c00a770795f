"""Telling the operator about a store outage: one line when it starts, a reminder, one at the end.

An unreachable object store is waited out, never a reason to drop data: producers keep their
pending TGBs, consumers keep their position. What the operator needs is to *see* it, without a
line per retry: :class:`OutageLog` logs a warning when the first failure of an outage is seen,
a reminder every ``interval`` seconds while it lasts, and an info line when a request succeeds
again. :func:`no_answer` tells a request that got no answer in time (a hung or overloaded
endpoint, a wrong port) from a store that answered with an error: for a client that waits for
the store, the first is an outage like a refused connection.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from batchweave._errors import AmbiguousWriteError, StoreTimeout

__all__ = ["OutageLog", "no_answer"]


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


class OutageLog:
    """Tracks one client's view of a store outage and logs its start, progress and end.

    ``who`` names the client in every line (``"producer 'p0'"``); ``clock`` is monotonic seconds.
    Thread-safe: a client's threads share one instance so an outage is reported once.
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
        self._last_log = 0.0
        self._failures = 0

    @property
    def down(self) -> bool:
        """Whether the last request this client made failed as part of an outage."""
        with self._lock:
            return self._since is not None

    def failed(self, what: str, exc: BaseException) -> None:
        """Record a failed request (``what`` says what the client was doing)."""
        now = self._clock()
        with self._lock:
            self._failures += 1
            if self._since is None:
                self._since = self._last_log = now
                self._logger.warning(
                    "%s: the object store is unreachable while %s (%s: %s); waiting for it to "
                    "come back, nothing is dropped",
                    self._who,
                    what,
                    type(exc).__name__,
                    exc,
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
        if self._since is None:  # the common case, checked without the lock
            return
        with self._lock:
            if self._since is None:
                return
            self._logger.info(
                "%s: the object store is reachable again after %.1f s (%d failed requests); "
                "resuming",
                self._who,
                max(0.0, self._clock() - self._since),
                self._failures,
            )
            self._since = None
            self._failures = 0

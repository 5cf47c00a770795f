"""The registry of unclosed producers, and the interpreter-exit hook that closes them.

A producer that is never closed must still commit what it was given: the registry keeps one
holding uncommitted TGBs alive, and the exit hook closes each one left open as the interpreter
exits, within ``EXIT_CLOSE_TIMEOUT`` for all. This is process-wide state, apart from any one
producer, which only reports itself in and out of it.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  # registers the upload pools' join: see the end
import math
import threading
import time
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchweave._producer._client import Producer

__all__ = [
    "EXIT_CLOSE_TIMEOUT",
    "add_busy",
    "add_unclosed",
    "discard_busy",
    "discard_unclosed",
]

EXIT_CLOSE_TIMEOUT = 30.0
"""Seconds the interpreter's exit spends, for all producers together, committing what producers
that were neither closed nor aborted had appended (read when the interpreter exits). Whatever is
not committed by then is named in an ERROR line, and the producers are aborted."""

_UNCLOSED: weakref.WeakSet[Producer] = weakref.WeakSet()
"""The producers of this process not yet closed or aborted (weak: dropping one still frees it)."""
_BUSY: set[Producer] = set()
"""The open producers holding TGBs not known to be committed: kept alive while they do, so one
dropped without ``close()`` commits them first (and its threads end after that); the exit hook
names what such a producer could not commit. A commit turn removes its producer once idle."""


def add_unclosed(producer: Producer) -> None:
    """Register a started ``producer``, for the exit hook to close if nobody does."""
    _UNCLOSED.add(producer)


def discard_unclosed(producer: Producer) -> None:
    """Forget ``producer``: it was closed, aborted or freed."""
    _UNCLOSED.discard(producer)


def add_busy(producer: Producer) -> None:
    """Keep ``producer`` alive: it holds TGBs not known to be committed."""
    _BUSY.add(producer)


def discard_busy(producer: Producer) -> None:
    """Let ``producer`` be freed once dropped: nothing of it is left to commit."""
    _BUSY.discard(producer)


def _close_unclosed_at_exit() -> None:
    """At interpreter exit: close the producers that were neither closed nor aborted.

    Within ``EXIT_CLOSE_TIMEOUT`` seconds for all together; each says what it commits and what
    it could not (``Producer._close_at_exit``). A Ctrl-C here stops the rest without waiting.
    """
    deadline = time.monotonic() + EXIT_CLOSE_TIMEOUT
    for producer in list(_UNCLOSED):
        try:
            failure = producer._close_at_exit(deadline)
        except BaseException as exc:  # e.g. a Ctrl-C while logging: never block the exit
            failure = exc
        if isinstance(failure, KeyboardInterrupt):
            deadline = -math.inf


# Run before the interpreter joins its non-daemon threads, the upload pools' among them
# (``concurrent.futures.thread``, imported above, registers that join the same way, earlier,
# and these run in reverse order, so it runs after this):
# as an ``atexit`` function this would run only after that join, which waits for ever for an
# upload retrying through an outage, and after which no upload could finish what is pending.
try:
    getattr(threading, "_register_atexit", atexit.register)(_close_unclosed_at_exit)
except RuntimeError:  # imported while the interpreter already exits: too late for the join
    atexit.register(_close_unclosed_at_exit)

"""The registry of unclosed producers, and the interpreter-exit hook that closes them.

A producer that is never closed must still commit what it was given: the registry keeps one
dropped holding uncommitted TGBs alive until it committed them, and the exit hook closes each
one left open as the interpreter exits, within ``EXIT_CLOSE_TIMEOUT`` for all, after waiting
for the live non-daemon threads whose ``with`` block still holds one (they close their own, and
the interpreter waits for them). This is process-wide state, apart from any one producer,
which only reports itself in and out of it.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  # registers the upload pools' join: see the end
import contextlib
import logging
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
    "enter_with",
    "leave_with",
]

EXIT_CLOSE_TIMEOUT = 30.0
"""Seconds the interpreter's exit spends, for all producers together, committing what producers
that were neither closed nor aborted had appended (read when the interpreter exits). Whatever is
not committed by then is named in an ERROR line, and the producers are aborted."""

_UNCLOSED: weakref.WeakSet[Producer] = weakref.WeakSet()
"""The producers of this process not yet closed or aborted (weak: dropping one still frees it)."""
_BUSY: set[Producer] = set()
"""The producers dropped without ``close()`` while holding TGBs not known to be committed: kept
alive (``Producer.__del__`` resurrects one here) while they commit them, forced as by ``flush()``
whatever the policy's pacing. Its commit thread removes one, and frees it, once it has nothing
left to commit or failed (nothing can commit its TGBs any more). A producer still referenced is
never here: ``__del__`` is what says it was dropped."""

_WITH_THREADS: weakref.WeakKeyDictionary[Producer, list[threading.Thread]] = (
    weakref.WeakKeyDictionary()
)
"""For each producer inside a ``with`` block, the threads running those blocks, innermost last
(guarded by ``_WITH_LOCK``): the exit hook waits for a live non-daemon one to close its own."""
_WITH_LOCK = threading.Lock()
_LOG = logging.getLogger("batchweave.producer")
_OWNER_POLL = 0.1
"""Longest wait for a ``with`` thread at exit before checking again whether its producer was
closed (a thread's end ends the wait at once)."""


def add_unclosed(producer: Producer) -> None:
    """Register a started ``producer``, for the exit hook to close if nobody does."""
    _UNCLOSED.add(producer)


def discard_unclosed(producer: Producer) -> None:
    """Forget ``producer``: it was closed, aborted or freed."""
    _UNCLOSED.discard(producer)


def add_busy(producer: Producer) -> None:
    """Keep ``producer``, dropped without ``close()``, alive: it holds TGBs to commit."""
    _BUSY.add(producer)


def discard_busy(producer: Producer) -> None:
    """Let ``producer`` be freed: nothing of it is left to commit, or nothing can commit it."""
    _BUSY.discard(producer)


def enter_with(producer: Producer) -> None:
    """The current thread entered a ``with`` block on ``producer``."""
    with _WITH_LOCK:
        _WITH_THREADS.setdefault(producer, []).append(threading.current_thread())


def leave_with(producer: Producer) -> None:
    """The current thread left its innermost ``with`` block on ``producer`` (closed or aborted
    it): the exit hook no longer waits for the thread because of it."""
    current = threading.current_thread()
    with _WITH_LOCK:
        threads = _WITH_THREADS.get(producer)
        if not threads:
            return
        for i in range(len(threads) - 1, -1, -1):
            if threads[i] is current:
                del threads[i]
                break
        else:  # left by another thread than the one that entered it: its innermost block
            threads.pop()
        if not threads:
            del _WITH_THREADS[producer]


def _owner(
    exiting: threading.Thread, given_up: list[Producer]
) -> tuple[Producer, threading.Thread] | None:
    """An unclosed producer inside a ``with`` block of a live non-daemon thread other than
    ``exiting``, with that thread, not one of ``given_up``; ``None`` if there is none."""
    with _WITH_LOCK:
        held = list(_WITH_THREADS.items())
    for producer, threads in held:
        if producer not in _UNCLOSED or any(producer is p for p in given_up):
            continue  # closed or aborted (its thread is leaving the block), or given up on
        for thread in reversed(threads):
            if thread is not exiting and not thread.daemon and thread.is_alive():
                return producer, thread
    return None


def _wait_for_with_threads() -> None:
    """Wait until no unclosed producer is inside a ``with`` block of a live non-daemon thread.

    Such a thread still uses its producer, and the interpreter waits for it anyway (after this
    hook): the producer is the thread's to close. So wait while it is in use: until it is
    closed or aborted or the thread ends, or until it has neither taken an append nor
    published a TGB for ``EXIT_CLOSE_TIMEOUT`` seconds. Then it is closed like any unclosed
    producer: a thread blocked in ``append`` through an outage, or an idle pool thread that
    entered the block (``ThreadPoolExecutor`` workers end only after this hook), would
    otherwise keep the process from ever exiting. A Ctrl-C (``KeyboardInterrupt`` raised from
    here) ends the wait.
    """
    exiting = threading.current_thread()
    given_up: list[Producer] = []
    while (held := _owner(exiting, given_up)) is not None:
        producer, thread = held
        progress, since = producer._progress(), time.monotonic()
        while producer in _UNCLOSED and thread.is_alive():
            thread.join(_OWNER_POLL)
            now = producer._progress()
            if now != progress:
                progress, since = now, time.monotonic()
            elif time.monotonic() - since >= EXIT_CLOSE_TIMEOUT:
                _LOG.warning(
                    "producer %r is held in a `with` block by thread %r, which has neither "
                    "appended nor published a TGB for %g s (EXIT_CLOSE_TIMEOUT) while the "
                    "interpreter exits: closing it",
                    producer.producer_id,
                    thread.name,
                    EXIT_CLOSE_TIMEOUT,
                )
                given_up.append(producer)
                break


def _close_unclosed_at_exit() -> None:
    """At interpreter exit: close the producers that were neither closed nor aborted.

    First waits for the producers inside a ``with`` block of a live non-daemon thread (other
    than the exiting one) until that thread closes them or ends (``_wait_for_with_threads``);
    a Ctrl-C ends that wait. Then closes those still open within ``EXIT_CLOSE_TIMEOUT`` seconds
    for all together, counted from then; each says what it commits and what it could not
    (``Producer._close_at_exit``). A Ctrl-C here stops the rest without waiting.
    """
    # A Ctrl-C stops waiting for those threads: what is left is closed as without them.
    with contextlib.suppress(KeyboardInterrupt):
        _wait_for_with_threads()
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
# Also, while this waits for a ``with`` thread, the upload pools still take that thread's TGBs:
# ``concurrent.futures`` refuses new work once its own hook has run.
try:
    getattr(threading, "_register_atexit", atexit.register)(_close_unclosed_at_exit)
except RuntimeError:  # imported while the interpreter already exits: too late for the join
    atexit.register(_close_unclosed_at_exit)

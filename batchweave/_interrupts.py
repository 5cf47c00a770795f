"""Ctrl-C and SIGTERM during work that runs on a thread the interpreter cannot interrupt.

Lance pulls the rows of ``lance.write_dataset`` from a Python generator on a thread of its own
while the main thread waits in Rust. A ``KeyboardInterrupt`` raised in the main thread leaves
that thread running into interpreter shutdown, which aborts the process ("Fatal Python error:
PyGILState_Release"). :func:`deferred_interrupt` turns the signals into a flag instead, which
the generator checks: the write stops from inside and the main thread regains control.

Shared by :mod:`batchweave.lance` and the command line (``batchweave export``, ``check``).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PendingInterrupt", "Terminated", "deferred_interrupt", "interruption"]

_SIGNALS: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM)


class Terminated(KeyboardInterrupt):
    """SIGTERM (``kill PID``, ``timeout``, a cancelled CI job), raised where Ctrl-C would be.

    A ``KeyboardInterrupt`` so that every cleanup Ctrl-C runs (child processes stopped,
    partial outputs and work directories removed) runs for SIGTERM too.
    """


def interruption(signum: int) -> KeyboardInterrupt:
    """The exception standing for signal ``signum``: :class:`Terminated` for SIGTERM."""
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


class PendingInterrupt:
    """The signals a :func:`deferred_interrupt` block received; calling it raises the first."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.previous: dict[int, signal._HANDLER] = {}
        """The handlers the block replaced (empty outside the main thread)."""

    def __call__(self) -> None:
        """Raise ``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM) if a signal came."""
        if self.received:
            raise interruption(self.received[0])

    def redeliver(self) -> None:
        """After the block: hand the signal received to the handler the block replaced.

        A default SIGTERM then ends the process as it would have without the block, a default
        SIGINT raises ``KeyboardInterrupt``, an application's own handler runs. If that handler
        returns (or ignores the signal), raise as :meth:`__call__` does: the work was stopped.
        """
        if not self.received:
            return
        signum = self.received[0]
        if signum in self.previous:
            signal.raise_signal(signum)  # runs the restored handler before returning
        self()

    def _on_signal(self, signum: int, frame: object) -> None:
        if self.received:
            raise interruption(signum)  # a second signal interrupts at once
        self.received.append(signum)


@contextmanager
def deferred_interrupt() -> Iterator[PendingInterrupt]:
    """Turn Ctrl-C and SIGTERM into a flag that the yielded ``check()`` raises.

    For work that runs on a thread the interpreter cannot interrupt (see the module docs):
    calling ``check()`` from that thread stops the work from inside, raising
    ``KeyboardInterrupt`` (:class:`Terminated` for SIGTERM). A second signal interrupts at
    once. A signal whose handler is ``SIG_IGN`` stays ignored. Outside the main thread (where
    signals are never delivered) ``check()`` does nothing. The previous handlers are back when
    the block ends.
    """
    pending = PendingInterrupt()
    if threading.current_thread() is not threading.main_thread():
        yield pending
        return
    for sig in _SIGNALS:
        handler = signal.getsignal(sig)
        if handler is not None and handler != signal.SIG_IGN:  # None: not set from Python
            pending.previous[sig] = signal.signal(sig, pending._on_signal)
    try:
        yield pending
    finally:
        for signum, previous in pending.previous.items():
            signal.signal(signum, previous)

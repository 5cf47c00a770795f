"""The process's open consumers: they share one budget of reads in flight.

Separate from :class:`~batchweave._consumer._core.Consumer` because it is process-wide state,
kept correct across forks and safe to update from a signal handler or a finalizer.
"""

from __future__ import annotations

import os
from typing import Final

__all__ = ["OPEN_CONSUMERS"]


class _OpenConsumers:
    """How many consumers this process has open: they share one budget of reads in flight.

    A set of tokens, not a counter behind a lock: ``closed`` also runs from a signal handler
    (``close()`` on SIGTERM) or a garbage-collection finalizer, possibly while the same thread
    is inside ``opened``, where a lock would deadlock. One set operation is atomic there.
    """

    def __init__(self) -> None:
        self._tokens: set[object] = set()

    @property
    def count(self) -> int:
        return len(self._tokens)

    def opened(self) -> object:
        """Count one more open consumer; pass the token returned to :meth:`closed`."""
        token = object()
        self._tokens.add(token)
        return token

    def closed(self, token: object) -> None:
        """Count one consumer fewer (once per token, however often it is called)."""
        self._tokens.discard(token)

    def forget_all(self) -> None:
        """Count none: in a forked child, the consumers the parent had open are unusable."""
        self._tokens.clear()


OPEN_CONSUMERS: Final = _OpenConsumers()
"""The consumers this process has open."""

# The parent's consumers cannot read in a forked child (see Consumer._check_process): they take
# no share of the child's reads.
os.register_at_fork(after_in_child=OPEN_CONSUMERS.forget_all)

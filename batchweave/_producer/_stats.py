"""What a producer reports: the :class:`ProducerStats` snapshot and its ambiguous-write count.

Plain records and a counting store wrapper, apart from the producer's threads and commit loop
that fill them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from batchweave._errors import AmbiguousWriteError
from batchweave._store._base import ObjectStore, PutMode
from batchweave._store._wrappers import StoreWrapper

__all__ = ["AmbiguityCounter", "ProducerStats"]


@dataclass(frozen=True)
class ProducerStats:
    """A snapshot of one producer's counters (see :meth:`Producer.stats`)."""

    producer_id: str
    epoch: int
    attempts: int
    """Manifest commit attempts that reached the store (won, lost, or resolved ambiguous)."""
    commits: int
    """Attempts that committed a new manifest version."""
    conflicts: int
    """Attempts that lost to another writer (412/409 or a lost ambiguous write)."""
    ambiguous: int
    """Attempts whose outcome was unknown and had to be resolved by reading back."""
    transient_errors: int
    """Store failures that were retried: while starting, uploading, committing or checking
    ``max_lag``."""
    tgbs_published: int
    """TGBs of this incarnation visible in committed manifests."""
    bytes_published: int
    pending: int
    """TGBs appended but not yet committed (uploading or waiting for a commit)."""
    inflight_bytes: int
    """Encoded bytes waiting for or in upload (bounded by ``max_inflight_bytes``)."""
    last_fragile_window: float
    """Seconds from reading the base to the end of the last conditional PUT."""
    gap: float
    """The commit policy's current post-attempt gap in seconds."""
    lag_blocked_seconds: float
    """Total time ``append`` spent blocked by ``max_lag``."""
    lag_blocked: bool
    """Whether an ``append`` is blocked by ``max_lag`` right now."""
    committed_offset: int | None
    """Highest offset of this producer id in the newest manifest this producer has seen."""


class AmbiguityCounter(StoreWrapper):
    """Passes every call to ``inner``; counts writes whose outcome came back unknown.

    The manifest log resolves ambiguous conditional writes itself; this is how the producer
    still sees (and reports) how many of its commit attempts needed that resolution. It keeps
    the count itself: a callback into the producer would make a reference cycle, and a producer
    dropped without ``close()`` would then wait for the cycle collector to be freed.
    """

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self.count = 0

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        try:
            self.inner.put(key, data, mode=mode)
        except AmbiguousWriteError:
            with self._lock:
                self.count += 1
            raise

    def close(self) -> None:
        """Do nothing: the store belongs to the caller, who closes it."""

"""What a producer reports: the :class:`ProducerStats` snapshot, and what its commit PUTs did.

Plain records and a noting store wrapper, apart from the producer's threads and commit loop
that fill them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from batchweave._errors import AmbiguousWriteError, StoreError, StoreUnavailable
from batchweave._store._base import ObjectStore, PutMode
from batchweave._store._wrappers import StoreWrapper

__all__ = ["CommitPuts", "ProducerStats"]


@dataclass(frozen=True)
class ProducerStats:
    """A snapshot of one producer's counters (see :meth:`Producer.stats`)."""

    producer_id: str
    epoch: int
    attempts: int
    """Manifest commit attempts that reached the store (won, lost, failed by the store, or
    resolved ambiguous): those whose conditional manifest PUT was sent, and those lost to a base
    found reclaimed just before it. Not one that failed earlier (writing its segments, reading
    its base), nor the epoch commit at start."""
    commits: int
    """Attempts that committed a new manifest version."""
    conflicts: int
    """Attempts that lost to another writer (412/409, a lost ambiguous write, or a reclaimed
    base)."""
    ambiguous: int
    """Attempts whose conditional manifest PUT had an unknown outcome, resolved by reading back
    (counted once per attempt, however often the PUT was re-sent; at most ``attempts``)."""
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


class CommitPuts(StoreWrapper):
    """Passes every call to ``inner``; notes what one commit attempt's manifest PUTs did.

    The manifest log sends a commit's conditional PUT itself (and sends it again after an
    ambiguous outcome it could not resolve by reading back); this is how the producer still
    sees whether an attempt's PUT reached the store (:attr:`reached`) and whether one came back
    ambiguous (:attr:`ambiguous`), for ``ProducerStats.attempts`` and ``ambiguous``. Only the
    create-PUTs of the manifest version named by :meth:`begin`, made by the thread that called
    it, until :meth:`end`, are noted: the log's other writes (segments, merges) and those at
    start (the namespace's version 0, the epoch commit) are passed through unnoted. It holds
    no reference to the producer: a producer dropped without ``close()`` must be freed without
    the cycle collector.
    """

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self._key: str | None = None
        self._thread: int | None = None
        self.reached = False
        """Whether a noted PUT reached the store: it returned, or failed with anything but
        ``StoreUnavailable`` (a 412, a 503, an ambiguous outcome...)."""
        self.ambiguous = False
        """Whether a noted PUT's outcome came back unknown (``AmbiguousWriteError``)."""

    def begin(self, key: str) -> None:
        """Note the create-PUTs of ``key`` this thread makes from now on."""
        self.reached = self.ambiguous = False
        self._thread = threading.get_ident()
        self._key = key

    def end(self) -> None:
        """Stop noting (:attr:`reached` and :attr:`ambiguous` keep what was noted)."""
        self._key = self._thread = None

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        if key != self._key or mode is not PutMode.CREATE or self._thread != threading.get_ident():
            self.inner.put(key, data, mode=mode)
            return
        try:
            self.inner.put(key, data, mode=mode)
        except StoreUnavailable:
            raise  # the store could not be reached
        except AmbiguousWriteError:
            self.reached = self.ambiguous = True
            raise
        except StoreError:
            self.reached = True
            raise
        self.reached = True

    def close(self) -> None:
        """Do nothing: the store belongs to the caller, who closes it."""

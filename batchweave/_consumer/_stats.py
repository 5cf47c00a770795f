"""What a consumer has done so far: the :class:`ConsumerStats` snapshot and its running totals.

Separate from the consumer's reading and waiting: the reading threads and the caller's thread
only add to :class:`Counters`, and :attr:`Consumer.stats` reads a consistent snapshot of them.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

__all__ = ["ConsumerStats", "Counters"]

_LATENCY_WEIGHT: Final = 0.2
"""Weight of the newest step in :attr:`ConsumerStats.read_latency` and
:attr:`ConsumerStats.read_cpu_share` (exponential averages)."""


@dataclass(frozen=True)
class ConsumerStats:
    """A snapshot of what a consumer has done so far (see :attr:`Consumer.stats`)."""

    steps: int
    """Steps delivered."""
    bytes_delivered: int
    """Stored bytes of the slices delivered: what the rank needed to read."""
    bytes_read: int
    """Bytes returned by range reads: footers, slices and parts, including retried reads."""
    requests: int
    """Range reads issued (footers, slices, parts), including failed attempts."""
    footer_reads: int
    """Footers fetched from the store (one exact range read each)."""
    footer_cache_hits: int
    """Footer lookups answered by the cache."""
    retries: int
    """Transient read or poll failures that were retried."""
    manifest_refreshes: int
    """Checks for a newer manifest version."""
    stall_seconds: float
    """Time the caller spent blocked in ``next()``: waiting for data or for producers, including
    a ``next()`` still blocked now (so it grows while producers never deliver)."""
    time_to_first_batch: float | None
    """Seconds from construction to the first delivered step (``None`` before it)."""
    prefetch_depth: int
    """Steps currently allowed in flight ahead of the caller (ramps up to ``prefetch``)."""
    read_latency: float | None
    """Moving average of the seconds one step's reads take (``None`` before the first step);
    below ``prefetch_min_latency`` steps are read on the caller's thread, without prefetching."""
    read_cpu_share: float | None
    """Moving average of the share of a step's read time its reading thread spent on CPU
    (``None`` until measured, and again after a step that was not); above
    ``prefetch_max_cpu_share`` steps are read on the caller's thread. Measured only on
    single-object steps while ``read_latency`` is unknown or at least half of
    ``prefetch_min_latency`` (see :class:`Consumer`)."""
    in_flight: int
    """Steps being read (or read and waiting) ahead of the caller right now."""

    @property
    def read_amplification(self) -> float:
        """``bytes_read / bytes_delivered``; 1.0 means nothing but the rank's slices was read."""
        return self.bytes_read / self.bytes_delivered if self.bytes_delivered else math.nan


class Counters:
    """Thread-safe running totals behind :class:`ConsumerStats`.

    ``clock`` (monotonic seconds, the consumer's) times the calls to ``next()``: a call still
    blocked counts in :meth:`stall_now` from the moment it began, so a consumer waiting for
    producers that never come shows a growing stall rather than a flat one.
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self.lock = threading.Lock()
        self._clock = clock
        self._tokens = itertools.count()
        self._waiting: dict[int, float] = {}
        """Start times of the ``next()`` calls blocked now, by token (normally one)."""
        self.steps = 0
        self.bytes_delivered = 0
        self.bytes_read = 0
        self.requests = 0
        self.footer_reads = 0
        self.footer_cache_hits = 0
        self.retries = 0
        self.manifest_refreshes = 0
        self.stall_seconds = 0.0
        self.time_to_first_batch: float | None = None
        self.read_latency: float | None = None
        self.read_cpu_share: float | None = None
        self.cpu_samples = 0
        """Steps averaged into ``read_cpu_share`` since it was last forgotten."""
        self.cpu_pending = False
        """``read_cpu_share`` was forgotten by a step skipped as fast, and the next slow step
        measures it (not by one read in several objects: such steps are never measured)."""

    def add(self, **deltas: float) -> None:
        with self.lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    # The per-step path uses these rather than add(): no keyword dict, no getattr/setattr.

    def read_failed(self) -> None:
        """A range read was issued and failed."""
        with self.lock:
            self.requests += 1

    def read_returned(self, nbytes: int) -> None:
        """A range read was issued and returned ``nbytes``."""
        with self.lock:
            self.requests += 1
            self.bytes_read += nbytes

    # The clock is read under the lock in all three, so a snapshot taken while a call is
    # blocked never shows more stall than the call adds when it ends: the total never drops.

    def wait_began(self) -> int:
        """A ``next()`` began; returns the token that ends it (:meth:`stalled`,
        :meth:`delivered`)."""
        with self.lock:
            token = next(self._tokens)
            self._waiting[token] = self._clock()
            return token

    def stall_now(self) -> float:
        """``stall_seconds`` plus the time the ``next()`` calls blocked now have waited so far.
        Call with :attr:`lock` held."""
        if not self._waiting:
            return self.stall_seconds
        now = self._clock()
        return self.stall_seconds + sum(max(0.0, now - t) for t in self._waiting.values())

    def stalled(self, token: int) -> None:
        """The ``next()`` of ``token`` (:meth:`wait_began`) ended delivering nothing."""
        with self.lock:
            self.stall_seconds += max(0.0, self._clock() - self._waiting.pop(token))

    def delivered(self, token: int, nbytes: int, created_at: float) -> None:
        """The ``next()`` of ``token`` (:meth:`wait_began`) delivered one step of ``nbytes``
        stored bytes; the consumer was created at ``created_at`` (clock seconds)."""
        with self.lock:
            now = self._clock()
            self.steps += 1
            self.bytes_delivered += nbytes
            self.stall_seconds += max(0.0, now - self._waiting.pop(token))
            if self.time_to_first_batch is None:
                self.time_to_first_batch = now - created_at

    def read_took(
        self, seconds: float, cpu_seconds: float | None = None, *, measurable: bool = True
    ) -> None:
        """One step's reads took ``seconds``, ``cpu_seconds`` of them on its thread's CPU
        (``None``: not measured, which forgets the CPU share: it would be stale when measuring
        resumes, e.g. from a first step that parsed footers to slow network reads).
        ``measurable=False``: no step like this one is measured (its reads ran on several
        threads), so no share is coming."""
        with self.lock:
            old = self.read_latency
            self.read_latency = seconds if old is None else old + _LATENCY_WEIGHT * (seconds - old)
            if cpu_seconds is None:
                self.read_cpu_share = None
                self.cpu_samples = 0
                self.cpu_pending = measurable
            elif seconds > 0:  # a clock that did not move tells nothing about the share
                share = min(1.0, max(0.0, cpu_seconds / seconds))
                # The plain mean of the first samples, then the moving average: the first step
                # (which also opens the namespace, with every rank starting at once) alone
                # would outweigh the next four.
                self.cpu_samples += 1
                old = self.read_cpu_share
                weight = max(_LATENCY_WEIGHT, 1 / self.cpu_samples)
                self.read_cpu_share = share if old is None else old + weight * (share - old)

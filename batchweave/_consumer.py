"""The per-rank consumer: each training rank reads exactly its own slice of every step.

A :class:`Consumer` follows a namespace's manifest, projects every logical step onto the TGB
slices its rank owns (:mod:`batchweave._projection`), fetches them with one range read per object
(after one cached footer read per TGB object) and yields ``(step, data)`` strictly in step order
while a bounded window of later steps is already being read. See ``docs/consumer.md``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import os
import struct
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from batchweave._checks import (
    as_count,
    as_fraction,
    as_int,
    as_seconds,
    as_size,
    check_namespace,
    check_store,
)
from batchweave._errors import (
    ChecksumMismatch,
    ConsumerError,
    ConsumerTimeout,
    FormatError,
    NamespaceMismatch,
    NamespaceNotFound,
    ObjectNotFound,
    StepReclaimed,
    StoreUnavailable,
    TransientStoreError,
)
from batchweave._fork import current_pid
from batchweave._format._checksum import checksum
from batchweave._format._tgb import (
    TRAILER_SIZE,
    SliceEntry,
    SliceSpan,
    TgbFooter,
    decode_entry,
    parse_footer,
)
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import Manifest, SliceTable, TgbDescriptor, TgbObjectRef
from batchweave._manifest._segments import find_segment
from batchweave._mesh import Mesh, check_mesh
from batchweave._outage import OutageLog, no_answer
from batchweave._prefetch import Job, SingleFlightCache, Workers, gather
from batchweave._projection import (
    DEFAULT_RANK_ORDER,
    Projection,
    SliceLocation,
    _parse_order,
    coordinates_from_env,
    resume_anchor,
)
from batchweave._store._base import Bounded, ObjectStore

__all__ = ["STATE_FORMAT", "Consumer", "ConsumerStats"]

_log = logging.getLogger("batchweave.consumer")

STATE_FORMAT: Final = 1
"""Version of the dict :meth:`Consumer.state_dict` returns."""

_MIB: Final = 1 << 20
_RETRYABLE: Final = (TransientStoreError, StoreUnavailable)

_T = TypeVar("_T")


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


_OPEN: Final = _OpenConsumers()

# The parent's consumers cannot read in a forked child (see Consumer._check_process): they take
# no share of the child's reads.
os.register_at_fork(after_in_child=_OPEN.forget_all)

_LATENCY_WEIGHT: Final = 0.2
"""Weight of the newest step in :attr:`ConsumerStats.read_latency` and
:attr:`ConsumerStats.read_cpu_share` (exponential averages)."""

# The trailer starts with the footer length, a little-endian u64 (docs/format.md).
_U64: Final = struct.Struct("<Q")

_UNREACHABLE: Final = (
    "The object store was unreachable or did not answer at the last attempt (see the warnings "
    "logged): check its endpoint and the network."
)
"""Why a wait timed out when the store, not the producers, was the problem."""

_OVERRUN: Final = 1.0
"""Seconds past ``timeout`` from which a timeout error says how long the wait really took."""

_RESTORE: Final = "restore it, or resume past this step"
"""What to do about a committed object that is no longer what the manifest recorded."""


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
    """Time the caller spent blocked in ``next()``: waiting for data or for producers."""
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


class _Counters:
    """Thread-safe running totals behind :class:`ConsumerStats`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
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

    def stalled(self, seconds: float) -> None:
        """The caller was blocked in a ``next()`` that delivered nothing for ``seconds``."""
        with self.lock:
            self.stall_seconds += seconds

    def delivered(self, nbytes: int, stalled: float, since_created: float) -> None:
        """One step of ``nbytes`` stored bytes was delivered after the caller was blocked in
        ``next()`` for ``stalled`` seconds, ``since_created`` seconds in."""
        with self.lock:
            self.steps += 1
            self.bytes_delivered += nbytes
            self.stall_seconds += stalled
            if self.time_to_first_batch is None:
                self.time_to_first_batch = since_created

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


# Every step creates a budget, but only failed reads spend one: a lock shared by all budgets
# costs nothing, a lock per budget would be created on every step.
_BUDGET_LOCK: Final = threading.Lock()


class _Budget:
    """The retries one step may still spend, shared by all of its reads."""

    __slots__ = ("_left", "limit")

    def __init__(self, retries: int) -> None:
        self.limit = retries
        self._left = retries

    def spend(self) -> int | None:
        """Take one retry; return how many were used so far, or ``None`` if none is left."""
        with _BUDGET_LOCK:
            if self._left <= 0:
                return None
            self._left -= 1
            return self.limit - self._left


@dataclass
class _Pending:
    step: int
    location: SliceLocation
    manifest: Manifest
    job: Job[tuple[Any, int]] | None
    """``None`` if not handed to the pool: the caller reads the step itself when it gets to it."""


class Consumer:
    """Reads one training rank's slices of a namespace, step by step, in the global order.

    ``mesh`` is the *consumer's* mesh (the training job's DP and CP degrees); it may differ from
    the mesh the namespace was written with (see ``docs/consumer.md``, "Resharding"). The rank's
    coordinates are ``dp_rank``/``cp_rank``, or derived from ``RANK``/``WORLD_SIZE`` with the
    job's ``tp`` and ``pp`` degrees laid out by ``rank_order`` (fastest-varying first); TP and PP
    peers read the same slice.

    Iterating yields ``(step, data)`` for logical steps ``start_step, start_step + stride, ...``
    (``stride`` > 1 splits one rank's steps among several readers, e.g. DataLoader workers):
    ``data`` is the decoded slice (``bytes``, ``pyarrow.Table`` or ``dict`` of numpy arrays), or a
    list of ``stored_cp / cp`` decoded chunks when the consumer's ``cp`` is smaller than the
    stored one. At the head of the stream the consumer polls for new manifest versions (backoff
    from ``poll_interval`` to ``max_poll_interval``); iteration ends after the last complete step
    of a sealed namespace; with ``timeout`` set, waiting longer than that for one step raises
    :class:`ConsumerTimeout`.

    Up to ``prefetch`` steps are read ahead on a pool of ``max_workers`` threads, starting with
    one and adding one per ``ramp_every`` delivered steps, as long as a step's reads take at
    least ``prefetch_min_latency`` seconds (a moving average): faster reads (the page cache,
    local NVMe) are done on the caller's thread when it asks, since handing them to a worker and
    back costs more CPU than they take, and prefetching resumes when reads slow down. Slow reads
    are read ahead only while they mostly *wait*: reads whose thread spends more than
    ``prefetch_max_cpu_share`` of their time on CPU (a moving average of each step's CPU time
    over its wall time, measured with ``cpu_clock``) are memory copies or decoding, and reading
    them ahead only adds thread hand-offs (a 10 MB page-cache read takes 1-2 ms on a busy
    machine, but there is nothing to overlap); 1 turns that rule off. All open
    consumers of a process share ``max_process_reads`` reads in flight: each keeps its caller's
    next read, and reads ahead by at most its share of the rest. Reads of at least
    ``map_threshold`` bytes are mapped instead of copied on stores that can map objects
    (``file://``): no second copy of a huge slice in memory (below 32 MiB a ``pread`` into a fresh
    buffer is faster: mapping pays a page fault per 4 KiB page). Elsewhere, reads of at least
    ``split_threshold`` bytes are split into ``part_size`` range reads filling one preallocated
    buffer. Transient store errors are retried with exponential backoff (``retry_backoff``
    doubling up to ``max_retry_backoff``), at most ``retry_budget`` times per step. The last
    ``footer_cache`` parsed footers are kept: while streaming each TGB is needed only by
    consecutive steps, and a footer holds one object per slice, so keeping many costs memory and
    garbage-collector time that grows with the world size. An unreachable store
    (:class:`StoreUnavailable`: an outage) spends no budget: the consumer keeps its position and
    waits for the store to return (bounded only by ``timeout`` at the head of the stream),
    logging when the outage starts and ends. ``clock`` and ``sleep`` are injectable so tests
    need no real waiting, and ``cpu_clock`` (the calling thread's CPU seconds) so they need no
    real CPU work; it is read only while steps take at least half of ``prefetch_min_latency``,
    so fast inline reads pay nothing for it.

    Implements torch's ``Stateful`` protocol (:meth:`state_dict`, :meth:`load_state_dict`).
    """

    def __init__(
        self,
        store: ObjectStore,
        namespace: str,
        *,
        mesh: Mesh,
        dp_rank: int | None = None,
        cp_rank: int | None = None,
        tp: int = 1,
        pp: int = 1,
        rank_order: str = DEFAULT_RANK_ORDER,
        environ: Mapping[str, str] | None = None,
        start_step: int = 0,
        stride: int = 1,
        prefetch: int = 4,
        ramp_every: int = 2,
        prefetch_min_latency: float = 0.001,
        prefetch_max_cpu_share: float = 0.3,
        max_process_reads: int = 64,
        max_workers: int = 8,
        map_threshold: int = 32 * _MIB,
        split_threshold: int = 64 * _MIB,
        part_size: int = 16 * _MIB,
        footer_cache: int = 16,
        poll_interval: float = 0.05,
        max_poll_interval: float = 2.0,
        timeout: float | None = None,
        retry_budget: int = 8,
        retry_backoff: float = 0.05,
        max_retry_backoff: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        cpu_clock: Callable[[], float] = time.thread_time,
    ) -> None:
        check_store(store)
        check_namespace(namespace)
        # Every count, size and number of seconds, checked before anything is made: a float
        # size (part_size=16e6) or a string timeout would otherwise fail at a later next(),
        # deep inside. Plain ints and floats: start_step ends up in state_dict(), which must
        # survive json and torch.load(weights_only=True); a numpy integer would not.
        options = _check_options(
            start_step=start_step,
            stride=stride,
            prefetch=prefetch,
            ramp_every=ramp_every,
            prefetch_min_latency=prefetch_min_latency,
            prefetch_max_cpu_share=prefetch_max_cpu_share,
            max_process_reads=max_process_reads,
            max_workers=max_workers,
            map_threshold=map_threshold,
            split_threshold=split_threshold,
            part_size=part_size,
            footer_cache=footer_cache,
            poll_interval=poll_interval,
            max_poll_interval=max_poll_interval,
            timeout=timeout,
            retry_budget=retry_budget,
            retry_backoff=retry_backoff,
            max_retry_backoff=max_retry_backoff,
        )
        self.mesh = mesh
        self.dp_rank, self.cp_rank = _resolve_coordinates(
            mesh, dp_rank, cp_rank, tp=tp, pp=pp, order=rank_order, environ=environ
        )
        self._store = store
        self._log = ManifestLog(store, namespace)
        self._pid = current_pid()
        self.namespace = namespace
        self.stride: int = options["stride"]
        self.prefetch: int = options["prefetch"]
        self.ramp_every: int = options["ramp_every"]
        self.prefetch_min_latency: float = options["prefetch_min_latency"]
        self.prefetch_max_cpu_share: float = options["prefetch_max_cpu_share"]
        self.max_process_reads: int = options["max_process_reads"]
        self.max_workers: int = options["max_workers"]
        self.map_threshold: int = options["map_threshold"]
        self.split_threshold: int = options["split_threshold"]
        self.part_size: int = options["part_size"]
        self.poll_interval: float = options["poll_interval"]
        self.max_poll_interval: float = options["max_poll_interval"]
        self.timeout: float | None = options["timeout"]
        self.retry_budget: int = options["retry_budget"]
        self.retry_backoff: float = options["retry_backoff"]
        self.max_retry_backoff: float = options["max_retry_backoff"]
        self._clock = clock
        self._sleep = sleep
        self._cpu_clock = cpu_clock
        # CPU time is measured only from this read latency on (None: never); see _cpu_started.
        self._measure_cpu_from: float | None = (
            self.prefetch_min_latency / 2
            if self.prefetch_min_latency > 0 and self.prefetch_max_cpu_share < 1
            else None
        )
        footers: int = options["footer_cache"]
        self._footers: SingleFlightCache[str, TgbFooter] = SingleFlightCache(footers)
        self._counters = _Counters()
        self._created_at = clock()
        self._outage = OutageLog(
            _log, f"consumer dp_rank={self.dp_rank} cp_rank={self.cp_rank}", clock=clock
        )

        self._manifest: Manifest | None = None
        self._projection: Projection | None = None
        self._anchor_step = 0
        self._anchor_replica = 0
        self._next_step: int = options["start_step"]
        self._window: deque[_Pending] = deque()
        # Made now (it starts no thread before the first read ahead), so that a next() racing
        # close() on another thread finds it closed rather than making a new one.
        self._pool = Workers(self.max_workers, name="batchweave-consumer")
        # Held by next(): close() from another thread leaves the read window to it.
        self._reading = threading.Lock()
        self._depth: int = min(1, self.prefetch)
        self._delivered_since_ramp = 0
        self._delivered_any = False
        self._warned_partial_step = False
        self._poll_delay = self.poll_interval
        self._last_refresh = -math.inf
        self._closed = False
        self._unregister = weakref.finalize(self, _OPEN.closed, _OPEN.opened())  # also unclosed

    def __repr__(self) -> str:
        return (
            f"Consumer({self._store.url!r}, {self.namespace!r}, mesh=({self.mesh}), "
            f"dp_rank={self.dp_rank}, cp_rank={self.cp_rank}, step={self._next_step})"
        )

    # -- public surface ----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The next logical step :meth:`__next__` will deliver."""
        return self._next_step

    @property
    def namespace_id(self) -> str | None:
        """The namespace's id once it has been opened, else ``None``."""
        return None if self._manifest is None else self._manifest.namespace_id

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: this consumer reads nothing more."""
        return self._closed

    @property
    def manifest_version(self) -> int | None:
        """Version of the newest manifest this consumer has read (``None`` before opening)."""
        return None if self._manifest is None else self._manifest.version

    def resume_tgb_step(self, state: Mapping[str, Any] | None = None) -> int:
        """The first manifest (TGB) step that resuming from a consumer state would read.

        ``state`` defaults to the current :meth:`state_dict`; pass the one saved in a checkpoint
        when the loop may have moved on since (asynchronous checkpointing). This is what the
        checkpoint's watermark must keep readable (``batchweave.checkpoint_hook`` records it).
        Opens the namespace if needed (one manifest read); 0 if it does not exist yet (a malformed
        ``state`` is refused all the same). A state of another namespace is
        :class:`NamespaceMismatch`, as in :meth:`load_state_dict`: its step means nothing here,
        and a watermark recorded from it would hold the wrong data.
        """
        self._check_process("resume_tgb_step()")
        parsed = None if state is None else _parse_state(state)  # garbage is refused, always
        if self._manifest is None:
            try:
                self._ensure_open(wait=False)
            except NamespaceNotFound:
                return 0
        assert self._manifest is not None
        if parsed is None:
            assert self._projection is not None
            return self._projection.first_tgb_step(self._next_step)
        self._check_state_namespace(parsed)
        anchor_step, anchor_replica = self._resume_anchor(parsed)
        projection = Projection(
            stored=self._manifest.mesh,
            consumer=self.mesh,
            anchor_step=anchor_step,
            anchor_replica=anchor_replica,
        )
        return projection.first_tgb_step(parsed["step"])

    @property
    def stats(self) -> ConsumerStats:
        """Counters so far: bytes read and delivered, requests, retries, stall time, ..."""
        c = self._counters
        with c.lock:
            return ConsumerStats(
                steps=c.steps,
                bytes_delivered=c.bytes_delivered,
                bytes_read=c.bytes_read,
                requests=c.requests,
                footer_reads=c.footer_reads,
                footer_cache_hits=c.footer_cache_hits,
                retries=c.retries,
                manifest_refreshes=c.manifest_refreshes,
                stall_seconds=c.stall_seconds,
                time_to_first_batch=c.time_to_first_batch,
                prefetch_depth=self._depth,
                read_latency=c.read_latency,
                read_cpu_share=c.read_cpu_share,
                in_flight=len(self._window),
            )

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        return self

    def __next__(self) -> tuple[int, Any]:
        if self._pid != current_pid():
            self._check_process("next()")
        if self._closed:
            raise ConsumerError(
                f"{self!r} is closed; to continue, create a new Consumer and load this one's "
                "state_dict() into it"
            )
        started = self._clock()
        try:
            with self._reading:
                try:
                    step, data, nbytes = self._next()
                finally:
                    if self._closed:  # by another thread, during this call: drop what it read
                        self._drop_window()
        except BaseException:
            self._counters.stalled(self._clock() - started)
            raise
        now = self._clock()
        self._counters.delivered(nbytes, now - started, now - self._created_at)
        self._delivered_any = True
        return step, data

    def open(self, *, wait: bool = True) -> None:
        """Open the namespace now rather than at the first ``next()``.

        With ``wait`` it waits for the namespace to be created like ``next()`` does (``timeout``
        applies); without, a missing namespace raises :class:`NamespaceNotFound` at once. A
        consumer ``cp`` that does not fit the stored mesh raises :class:`NamespaceMismatch`.
        Idempotent; costs one manifest read the first time.
        """
        self._check_process("open()")
        self._ensure_open(wait=wait)

    def close(self) -> None:
        """Stop prefetching and release the read threads. Idempotent.

        May be called from another thread: a ``next()`` reading a step, or waiting for
        producers, for the namespace or for the end of an outage, then raises
        :class:`ConsumerError` once its current sleep (at most ``max_poll_interval`` or
        ``max_retry_backoff``) or store request ends.
        """
        self._closed = True
        self._unregister()  # runs once, however often close() is called
        if self._reading.acquire(blocking=False):
            try:
                self._drop_window()
            finally:
                self._reading.release()
        else:
            # A next() on another thread owns the window (and drops it when it sees the close):
            # only make sure nothing queued in it starts.
            for pending in tuple(self._window):
                if pending.job is not None:
                    pending.job.cancel()
        self._pool.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict[str, Any]:
        """The resume point: the next step to deliver, plus what it must be checked against.

        Taken right after the iterator yielded step ``s``, it holds ``s + 1``: prefetched but
        undelivered steps never count. Plain ints and strings only, so any checkpointer can store
        it. ``namespace_id`` is empty if the namespace was never opened (nothing was delivered).
        """
        return {
            "format": STATE_FORMAT,
            "namespace": self.namespace,
            "namespace_id": self.namespace_id or "",
            "step": self._next_step,
            "dp": self.mesh.dp,
            "cp": self.mesh.cp,
            "dp_rank": self.dp_rank,
            "cp_rank": self.cp_rank,
            "anchor_step": self._anchor_step,
            "anchor_replica": self._anchor_replica,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next step delivered is ``state["step"]``.

        The namespace is opened (one manifest read) to check the state belongs to it
        (:class:`NamespaceMismatch` otherwise) and that the step was not reclaimed
        (:class:`StepReclaimed`). A state saved with another data-parallel degree is re-anchored
        so the data continues exactly where it stopped (see ``docs/consumer.md``); prefetched
        steps are discarded.

        Call it before iterating or between steps, from the thread that iterates: while a
        ``next()`` runs on another thread it is refused (:class:`ConsumerError`), since that
        ``next()`` would deliver a step of neither position.
        """
        self._check_process("load_state_dict()")
        parsed = _parse_state(state)
        if not self._reading.acquire(blocking=False):
            raise ConsumerError(
                f"{self!r}: load_state_dict() was called while next() is reading a step on "
                "another thread; the state was not loaded. Call load_state_dict() before "
                "iterating, or between steps from the thread that iterates"
            )
        try:
            self._load_state(parsed)
        finally:
            if self._closed:  # by another thread, during this call: drop what it scheduled
                self._drop_window()
            self._reading.release()

    def _load_state(self, parsed: Mapping[str, Any]) -> None:
        """:meth:`load_state_dict` of a parsed state, holding the read lock."""
        step, old_dp = parsed["step"], parsed["dp"]
        if parsed["namespace_id"]:
            self._ensure_open(wait=False)
            self._check_state_namespace(parsed)
        anchor_step, anchor_replica = self._resume_anchor(parsed)
        if old_dp != self.mesh.dp:
            _log.info(
                "%s: state from dp=%d resumed with dp=%d at step %d: re-anchored at replica "
                "slice %d",
                self._where,
                old_dp,
                self.mesh.dp,
                step,
                anchor_replica,
            )
        before = (self._anchor_step, self._anchor_replica, self._next_step, self._projection)
        self._anchor_step, self._anchor_replica = anchor_step, anchor_replica
        self._next_step = step
        if self._manifest is not None:
            try:
                self._projection = self._make_projection(self._manifest)
                self._check_not_reclaimed(step)
            except BaseException:  # a refused state changes nothing
                self._anchor_step, self._anchor_replica, self._next_step, self._projection = before
                raise
        self._drop_window()
        self._depth = min(1, self.prefetch)
        self._delivered_since_ramp = 0
        self._delivered_any = False

    def _check_process(self, call: str) -> None:
        """Refuse use in a process forked from the one that made this consumer.

        Its read-ahead threads did not survive the fork: a step they were reading would be
        waited for forever (``timeout`` bounds only waits for producers).
        """
        if self._pid != current_pid():
            raise ConsumerError(
                f"{self!r} was created in process {self._pid} and {call} was called in process "
                f"{current_pid()}, forked from it; its read threads stay in the parent. Create the "
                "Consumer in the child process (after forking), and load the parent's "
                "state_dict() into it to continue from there"
            )

    def _check_state_namespace(self, parsed: Mapping[str, Any]) -> None:
        """Refuse a state (with a namespace id) taken from another namespace than this one's."""
        assert self._manifest is not None
        if parsed["namespace_id"] and parsed["namespace_id"] != self._manifest.namespace_id:
            raise NamespaceMismatch(
                f"consumer state belongs to namespace {parsed['namespace']!r} (id "
                f"{parsed['namespace_id']}), but this consumer reads {self._where} (id "
                f"{self._manifest.namespace_id}); load the state into a consumer of the "
                "namespace it was taken from"
            )

    def _resume_anchor(self, parsed: Mapping[str, Any]) -> tuple[int, int]:
        """The projection anchor with which this consumer's mesh continues a parsed state."""
        return resume_anchor(
            parsed["step"],
            dp=parsed["dp"],
            anchor_step=parsed["anchor_step"],
            anchor_replica=parsed["anchor_replica"],
            new_dp=self.mesh.dp,
        )

    # -- iteration ---------------------------------------------------------------------------

    def _next(self) -> tuple[int, Any, int]:
        """Read the next step: ``(step, data, stored bytes)``."""
        started = self._clock()  # ``timeout`` bounds the whole call: opening, polls and waits
        if self._manifest is None:
            self._ensure_open(wait=True, started=started)
        step = self._next_step
        self._check_not_reclaimed(step)
        depth = self._read_ahead() or 1
        self._top_up(depth, inline_head=True)
        if not self._window:
            if not self._await_step(step, started):
                raise StopIteration
            self._top_up(depth, inline_head=True)
        pending = self._window[0]
        if pending.step != step:  # not an assert: under python -O it would deliver wrong data
            self._drop_window()
            raise ConsumerError(
                f"{self._where}: step {step} is due but step {pending.step} was read for it; "
                "nothing was delivered. The consumer's position changed during next(): use a "
                "consumer from one thread at a time (then next() reads the step again)"
            )
        try:
            if pending.job is None:
                data, nbytes = self._fetch_step(step, pending.location, pending.manifest)
            else:
                data, nbytes = pending.job.result()  # runs here if no worker has started it
        except BaseException as exc:
            self._drop_window()  # the step is retried from scratch by the next call
            if isinstance(exc, CancelledError):  # only close() cancels the step in hand
                self._check_not_closed(f"reading step {step}")
            raise
        self._check_not_closed(f"reading step {step}")  # close() came from another thread
        self._window.popleft()
        self._next_step = step + self.stride
        try:
            if self._depth < self.prefetch:
                self._ramp()
            ahead = self._read_ahead()
            # The first step returns before any read is handed to the pool: starting a worker
            # thread costs the caller a scheduling round-trip on a busy machine, right when
            # time to first batch counts. Prefetching starts with the second call.
            if self._delivered_any and ahead:
                self._top_up(ahead)  # may poll the manifest: I/O after the step was read
        except Exception as exc:
            # Reading ahead is an optimisation: its error belongs to a later step and surfaces
            # there, when that step is read on demand. This step's data is in hand.
            self._drop_window()
            _log.debug("%s: reading ahead of step %d failed: %s", self._where, step, exc)
        except BaseException:
            # Ctrl-C (or SystemExit) before the step reached the caller: it was not delivered,
            # so state_dict() must not count it, or a resumed run would skip it.
            self._next_step = step
            self._drop_window()
            raise
        return step, data, nbytes

    def _read_ahead(self) -> int:
        """Steps to read ahead of the caller now (0: read each step when the caller asks).

        0 while reads are faster than ``prefetch_min_latency``, or while their thread spends
        more than ``prefetch_max_cpu_share`` of their time on CPU (memory copies and decoding:
        nothing to overlap), or while that share is not known yet: reads just became slow (one
        descheduled page-cache copy lifts the average past the threshold), and the next one,
        read inline, is measured (steps read from several objects are never measured: for them
        the latency rule alone decides). Otherwise the ramped depth, bounded by this consumer's
        share of ``max_process_reads``: every open consumer of the process keeps its own next
        read in flight, and read-ahead only adds to those. (64 consumers as threads of one
        process with 4 steps ahead each would queue 320 requests for a client's 64 connections
        and spend the difference on thread switches.)
        """
        counters = self._counters
        latency = counters.read_latency
        if latency is not None:
            if latency < self.prefetch_min_latency:
                return 0
            share = counters.read_cpu_share
            if self._measure_cpu_from is not None and (
                counters.cpu_pending if share is None else share > self.prefetch_max_cpu_share
            ):
                return 0
        process_share = self.max_process_reads // max(1, _OPEN.count) - 1
        return max(0, min(self._depth, process_share))

    def _ramp(self) -> None:
        """Count one more step delivered while ``_depth`` is below ``prefetch``."""
        self._delivered_since_ramp += 1
        if self._delivered_since_ramp >= self.ramp_every:
            self._delivered_since_ramp = 0
            self._depth += 1

    def _top_up(self, depth: int, *, inline_head: bool = False) -> None:
        """Schedule steps until ``depth`` are in flight or the visible steps run out.

        With ``inline_head`` the step the caller is about to wait for is not handed to a worker
        if it is scheduled now: the caller runs it, saving a thread hand-off per step.
        """
        assert self._manifest is not None
        assert self._projection is not None
        limit = self._next_step + depth * self.stride
        nxt = self._window[-1].step + self.stride if self._window else self._next_step
        if nxt >= limit:
            return
        end = self._projection.end_step(self._manifest.next_step)
        if (
            nxt >= end
            and not self._manifest.sealed
            and self._clock() - self._last_refresh >= self._poll_delay
        ):
            try:
                self._refresh()
            except _RETRYABLE as exc:
                self._counters.add(retries=1)
                _log.debug("%s: manifest refresh failed, will retry: %s", self._where, exc)
            except Exception as exc:
                if not self._window:
                    raise  # the step the caller is about to wait for needs this poll
                # Steps already in hand are delivered first: the error surfaces again at the
                # step that needs a newer version (when _await_step polls for it).
                _log.debug("%s: manifest refresh failed: %s", self._where, exc)
            end = self._projection.end_step(self._manifest.next_step)
        stop = min(limit, end)
        while nxt < stop:
            self._schedule(nxt, submit=not (inline_head and nxt == self._next_step))
            nxt += self.stride

    def _await_step(self, step: int, started: float) -> bool:
        """Block until ``step`` is complete (True) or the sealed stream ended before it (False).

        Polls the manifest no more often than the current poll delay, which doubles while
        nothing new arrives (up to ``max_poll_interval``) and resets when a version does.
        ``timeout`` counts from ``started``, when the caller's ``next()`` began.
        """
        assert self._manifest is not None
        assert self._projection is not None
        failures = 0
        while True:
            self._check_not_closed(f"waiting for step {step}")
            if step < self._projection.end_step(self._manifest.next_step):
                return True
            if self._manifest.sealed:
                self._log_sealed_end(step)
                return False
            now = self._clock()
            since = now - self._last_refresh
            if since < self._poll_delay:
                self._sleep_or_time_out(
                    started, self._poll_delay - since, lambda: self._timeout_error(step, started)
                )
            elif self.timeout is not None and now - started > self.timeout:
                # No sleep is due when a poll itself took the poll delay (a slow store, or
                # connection attempts timing out in an outage): the timeout holds all the same.
                raise self._timeout_error(step, started)
            try:
                self._refresh()
                failures = 0
                self._outage.recovered()
            except _RETRYABLE as exc:
                if isinstance(exc, StoreUnavailable) or no_answer(exc):
                    # An outage (also a store that stopped answering) is waited out, bounded
                    # only by ``timeout``, polling ever slower.
                    self._counters.add(retries=1)
                    self._outage.failed(f"waiting for step {step}", exc)
                    self._poll_delay = min(2 * self._poll_delay, self.max_poll_interval)
                else:
                    failures = self._manifest_read_failed(
                        failures, exc, f" while waiting for step {step}"
                    )

    def _log_sealed_end(self, step: int) -> None:
        """Say where the sealed stream ended, warning (once) about a trailing partial step."""
        assert self._manifest is not None
        assert self._projection is not None
        left = self._projection.undelivered(self._manifest.next_step)
        if not left or self._warned_partial_step:
            _log.info("%s: sealed stream ends before step %d", self._where, step)
            return
        self._warned_partial_step = True
        dp = self._manifest.mesh.dp
        _log.warning(
            "%s: sealed stream ends before step %d: its last %d replica slice(s) (global "
            "replica slices %d..%d, in TGB steps %d..%d) are fewer than the %d one step needs "
            "with consumer mesh (%s), so no rank delivers them; a run resumed from this "
            "state_dict() with a dp that divides %d reads them",
            self._where,
            step,
            len(left),
            left.start,
            left.stop - 1,
            left.start // dp,
            (left.stop - 1) // dp,
            self.mesh.dp,
            self.mesh,
            len(left),
        )

    def _manifest_read_failed(self, failures: int, exc: Exception, during: str) -> int:
        """Count one more consecutive failure to read the manifest; past the budget, give up."""
        failures += 1
        self._counters.add(retries=1)
        if failures > self.retry_budget:
            raise ConsumerError(
                f"{self._where}: cannot read the manifest{during}: {failures} consecutive "
                f"failures, last: {exc}"
            ) from exc
        return failures

    def _check_not_closed(self, doing: str) -> None:
        """Stop waiting or retrying once :meth:`close` was called (from another thread)."""
        if self._closed:
            raise ConsumerError(f"{self!r} was closed while {doing}")

    def _sleep_or_time_out(
        self, started: float, delay: float, error: Callable[[], ConsumerError]
    ) -> None:
        if self.timeout is not None:
            remaining = self.timeout - (self._clock() - started)
            if remaining <= 0:
                raise error()
            delay = min(delay, remaining)
        self._sleep(delay)

    def _overran(self, started: float) -> str:
        """How long a wait that timed out really took, if a request outlasted ``timeout``."""
        assert self.timeout is not None
        took = self._clock() - started
        if took < self.timeout + _OVERRUN:
            return ""
        return (
            f" (after {took:.1f} s: timeout cannot cut a store request short, and one that "
            "gets no answer lasts up to the store's read_timeout times its attempts)"
        )

    def _timeout_error(self, step: int, started: float) -> ConsumerTimeout:
        assert self._manifest is not None
        assert self._projection is not None
        first, end = self._projection.tgb_span(step)
        m = self._manifest
        return ConsumerTimeout(
            f"{self._where}: step {step} (TGB steps {first}..{end - 1}) did not become visible "
            f"within {self.timeout} s{self._overran(started)}; manifest version {m.version} "
            f"holds TGB steps {m.base_step}..{m.next_step - 1}. "
            + (
                _UNREACHABLE
                if self._outage.down
                else "Are the producers running? Producers with max_lag also wait for "
                "checkpoints to release the oldest live watermark, and log why they are blocked "
                "(logger batchweave.producer). max_lag must be at least the TGB steps from the "
                "oldest retained checkpoint to the next checkpoint (about keep_last x checkpoint "
                "interval), or training never reaches that checkpoint; and rank 0 must call "
                "checkpoint_hook after each checkpoint (batchweave inspect lists the watermarks "
                "that hold them)."
            )
        )

    def _open_timeout_error(self, started: float, failed: Exception | None) -> ConsumerTimeout:
        """``failed``: the last attempt's store error (``None``: it found no namespace)."""
        waiting = (
            f"within {self.timeout} s{self._overran(started)} while waiting for step "
            f"{self._next_step}"
        )
        if self._outage.down:
            return ConsumerTimeout(f"{self._where} could not be opened {waiting}. {_UNREACHABLE}")
        if failed is not None:  # the store answered, but with errors: nothing says "no namespace"
            return ConsumerTimeout(
                f"{self._where} could not be opened {waiting}: the store failed, last: {failed}"
            )
        return ConsumerTimeout(
            f"{self._where} was not created {waiting}; start a producer or check the namespace name"
        )

    def _refresh(self) -> None:
        """Look for a newer manifest version (one GET when up to date), adapting the backoff."""
        assert self._manifest is not None
        self._counters.add(manifest_refreshes=1)
        self._last_refresh = self._clock()
        latest = self._log.latest(self._manifest)
        if latest.version != self._manifest.version:
            self._manifest = latest
            self._poll_delay = self.poll_interval
        else:
            self._poll_delay = min(2 * self._poll_delay, self.max_poll_interval)

    # -- opening -----------------------------------------------------------------------------

    @property
    def _where(self) -> str:
        return f"namespace {self.namespace!r} in {self._store.url}"

    def _ensure_open(self, *, wait: bool, started: float | None = None) -> None:
        """Read the latest version if none is held yet; with ``wait``, wait for the namespace
        until ``timeout`` after ``started`` (default: now)."""
        if self._manifest is not None:
            return
        started = self._clock() if started is None else started
        failures = 0
        while True:
            failed: Exception | None = None
            try:
                manifest = self._log.latest()
                self._outage.recovered()
                break
            except NamespaceNotFound:
                self._outage.recovered()  # an answer: the store is up, the namespace is not
                if not wait:
                    raise
            except _RETRYABLE as exc:
                failed = exc
                if isinstance(exc, StoreUnavailable) or no_answer(exc):
                    self._counters.add(retries=1)
                    self._outage.failed(f"opening {self._where}", exc)
                else:
                    failures = self._manifest_read_failed(failures, exc, "")
            self._check_not_closed(f"waiting to open {self._where}")
            self._sleep_or_time_out(
                started,
                self._poll_delay,
                functools.partial(self._open_timeout_error, started, failed),
            )
            self._poll_delay = min(2 * self._poll_delay, self.max_poll_interval)
        self._poll_delay = self.poll_interval
        self._projection = self._make_projection(manifest)
        self._manifest = manifest

    def _make_projection(self, manifest: Manifest) -> Projection:
        try:
            projection = Projection(
                stored=manifest.mesh,
                consumer=self.mesh,
                anchor_step=self._anchor_step,
                anchor_replica=self._anchor_replica,
            )
        except ValueError as exc:
            raise NamespaceMismatch(f"{self._where}: {exc}") from exc
        if self._next_step < projection.anchor_step:
            raise ConsumerError(
                f"{self._where}: step {self._next_step} precedes the resume anchor step "
                f"{projection.anchor_step}"
            )
        return projection

    def _check_not_reclaimed(self, step: int) -> None:
        assert self._manifest is not None
        assert self._projection is not None
        first = self._projection.first_tgb_step(step)
        base = self._manifest.base_step
        if first < base:
            readable = self._projection.first_step_from(base)
            anchored = (self._projection.anchor_step, self._projection.anchor_replica) != (0, 0)
            raise StepReclaimed(
                f"{self._where}: step {step} needs TGB step {first}, but steps below "
                f"{base} were reclaimed (manifest version {self._manifest.version}); the "
                f"first step consumer mesh ({self.mesh}) can still read is step {readable}: "
                "resume from a later checkpoint, or, for a run that does not need the "
                "reclaimed steps, "
                + (
                    f"load this consumer's state_dict() with its step set to {readable}"
                    if anchored
                    else f"start past them with Consumer(start_step={readable})"
                )
            )

    # -- reading -----------------------------------------------------------------------------

    def _schedule(self, step: int, *, submit: bool = True) -> None:
        assert self._manifest is not None
        assert self._projection is not None
        self._check_not_closed(f"scheduling step {step}")  # close() came from another thread
        location = self._projection.locate(step, self.dp_rank, self.cp_rank)
        job = None
        if submit:
            job = Job(functools.partial(self._fetch_step, step, location, self._manifest))
            try:
                self._pool.submit(job)
            except RuntimeError:  # closed by another thread since the check above
                self._check_not_closed(f"scheduling step {step}")
                raise
        self._window.append(_Pending(step, location, self._manifest, job))

    def _drop_window(self) -> None:
        while self._window:
            job = self._window.popleft().job
            if job is not None:
                job.cancel()

    def _fetch_step(self, step: int, loc: SliceLocation, manifest: Manifest) -> tuple[Any, int]:
        """Read and decode this rank's slices of ``step``; return ``(data, stored bytes)``."""
        started = self._clock()
        cpu_started = self._cpu_started()
        budget = _Budget(self.retry_budget)
        what = f"step {step} (TGB step {loc.tgb_step})"
        try:
            desc = self._retrying(budget, what, self._descriptor, what, manifest, loc.tgb_step)
        except StepReclaimed as exc:
            raise StepReclaimed(f"step {step}: {exc}") from exc
        data: Any
        if len(loc.slices) == 1:  # the common case: nothing to group by object or into runs
            index = loc.slices[0]
            data, nbytes = self._read_slice(what, _object_holding(desc, index, what), index, budget)
            one_object = True
        else:
            groups = _group_by_object(desc, loc, what)
            one_object = len(groups) == 1
            if one_object:  # one object holds the rank's slices: no jobs to gather
                data, nbytes = self._read_object_slices(what, *groups[0], budget)
            else:
                results = gather(
                    self._pool,
                    [
                        functools.partial(self._read_object_slices, what, ref, idx, budget)
                        for ref, idx in groups
                    ],
                )
                data = [value for values, _ in results for value in values]
                nbytes = sum(n for _, n in results)
        took = self._clock() - started
        # Several objects are read by pool threads: this thread's CPU is not the step's.
        if cpu_started is None or not one_object:
            self._counters.read_took(took, measurable=one_object)
        else:
            self._counters.read_took(took, self._cpu_clock() - cpu_started)
        return data, nbytes

    def _descriptor(self, what: str, manifest: Manifest, tgb_step: int) -> TgbDescriptor:
        """The TGB at ``tgb_step``: from ``manifest``, or from the latest version if the segment
        ``manifest`` lists it in is gone because a merge replaced it (a consumer reading far
        behind the head holds an old version). The latest version read then is adopted, as a
        refresh would, so the steps scheduled after it read through it; a step scheduled before
        (read ahead) first tries the version adopted since, which costs no manifest request. A
        segment the latest version lists is missing: the namespace is damaged, and the error
        names the segment."""
        try:
            return self._log.descriptor(manifest, tgb_step)
        except ObjectNotFound as exc:
            missing = exc
        ref = find_segment(manifest.segments, tgb_step)
        held = self._manifest  # newer than ``manifest`` if adopted since this step was scheduled
        if held is not None and held.version > manifest.version and ref not in held.segments:
            try:
                return self._log.descriptor(held, tgb_step)  # StepReclaimed if reclaimed
            except ObjectNotFound as exc:
                missing = exc  # merged away under ``held`` too: ask for the latest after it
            manifest, ref = held, find_segment(held.segments, tgb_step)
        self._counters.add(manifest_refreshes=1)
        self._last_refresh = self._clock()
        latest = self._log.latest(manifest)
        held = self._manifest
        if held is not None and latest.version > held.version:  # never step back (pool threads)
            self._manifest = latest
            self._poll_delay = self.poll_interval
        if ref not in latest.segments:
            try:
                return self._log.descriptor(latest, tgb_step)  # StepReclaimed if reclaimed
            except ObjectNotFound as exc:
                missing = exc
            ref = find_segment(latest.segments, tgb_step)
        raise ConsumerError(f"{what}: {self._log.missing_segment(latest, ref)}") from missing

    def _cpu_started(self) -> float | None:
        """This thread's CPU time now if this step's CPU share is to be measured, else None.

        The share decides something only while ``read_latency >= prefetch_min_latency``, and a
        CPU clock read is a system call (as much as 1 us, against 30 us for a whole inline
        100 KB page-cache step), so steps are not measured while the moving average is below
        half of that threshold: fast inline reads pay nothing. From half of it up they are,
        so the share is current by the time the average reaches the threshold. (One step of
        more than 3x the threshold can jump it there from below half; an unmeasured step
        forgets the share, so the step after it is read inline and measured before any read
        ahead: see :meth:`_read_ahead`.)
        """
        start = self._measure_cpu_from
        if start is None:
            return None
        latency = self._counters.read_latency
        if latency is not None and latency < start:
            return None
        return self._cpu_clock()

    def _read_slice(
        self, step_what: str, ref: TgbObjectRef, index: int, budget: _Budget
    ) -> tuple[Any, int]:
        """Slice ``index`` (numbered within the TGB) of ``ref``'s object, decoded, and its stored
        bytes: :meth:`_read_object_slices` for one slice, without building runs of slices."""
        key = self._log.key(ref.key)
        what = f"{step_what}, object {key!r}"
        entry: SliceEntry | SliceSpan
        if ref.slices is not None:
            layout: SliceTable | TgbFooter = ref.slices
            entry = ref.slices.span(index - ref.first_slice)
        else:
            layout = self._layout(key, ref, what, budget)
            entry = layout.slices[index - ref.first_slice]
        where = f"{what}, slice {index}"
        buf = self._read_range(key, entry.offset, entry.offset + entry.length, where, budget)
        # Checksums and raw decoding take bytes without a copy.
        raw = buf if isinstance(buf, bytes) else memoryview(buf)
        return decode_entry(raw, entry, layout, where=where), entry.length

    def _read_object_slices(
        self, step_what: str, ref: TgbObjectRef, indices: list[int], budget: _Budget
    ) -> tuple[list[Any], int]:
        key = self._log.key(ref.key)
        what = f"{step_what}, object {key!r}"
        layout = ref.slices if ref.slices is not None else self._layout(key, ref, what, budget)
        values: list[Any] = []
        nbytes = 0
        for run in _runs(layout, ref.first_slice, indices):
            (first_index, first), (_, last) = run[0], run[-1]
            start, end = first.offset, last.offset + last.length
            if len(run) == 1:
                where = f"{what}, slice {first_index}"
            else:
                where = f"{what}, slices {', '.join(str(i) for i, _ in run)}"
            buf = self._read_range(key, start, end, where, budget)
            if isinstance(buf, bytes) and len(run) == 1:
                # Checksums and raw decoding take bytes without a copy.
                values.append(decode_entry(buf, first, layout, where=where))
            else:
                view = memoryview(buf)
                for i, entry in run:
                    raw = view[entry.offset - start : entry.offset - start + entry.length]
                    values.append(decode_entry(raw, entry, layout, where=f"{what}, slice {i}"))
            nbytes += end - start
        return values, nbytes

    def _layout(self, key: str, ref: TgbObjectRef, what: str, budget: _Budget) -> TgbFooter:
        """The footer of ``ref``'s object, from the cache or fetched (the manifest has no table)."""
        try:
            footer, hit = self._footers.get(
                key,
                lambda: self._retrying(budget, f"{what}, footer", self._footer, key, ref),
            )
        except FormatError as exc:
            raise type(exc)(f"{what}, footer: {exc}") from exc
        self._counters.add(footer_cache_hits=1 if hit else 0)
        if len(footer.slices) != ref.slice_count:
            raise FormatError(
                f"{what}: the manifest records {ref.slice_count} slices in the object, its footer "
                f"{len(footer.slices)}; the object was replaced after it was committed: {_RESTORE}"
            )
        return footer

    def _footer(self, key: str, ref: TgbObjectRef) -> TgbFooter:
        """Fetch ``ref``'s footer and trailer with one exact range read and verify both."""
        want = ref.footer_length + TRAILER_SIZE
        buf = self._get(key, ref.footer_offset, ref.footer_offset + want)
        self._counters.add(footer_reads=1)
        if len(buf) != want:
            raise FormatError(
                f"object {key!r} is truncated: expected footer and trailer at bytes "
                f"[{ref.footer_offset}, {ref.footer_offset + want}), got {len(buf)} bytes; "
                f"{_RESTORE}"
            )
        footer = parse_footer(buf, key=key)  # verifies the trailer's checksum over the footer
        (footer_length,) = _U64.unpack_from(buf, len(buf) - TRAILER_SIZE)
        if footer_length != ref.footer_length or footer.payload_length != ref.footer_offset:
            raise FormatError(
                f"object {key!r}: the manifest locates its footer at [{ref.footer_offset}, "
                f"+{ref.footer_length}), the object at [{footer.payload_length}, "
                f"+{footer_length}); the object was replaced after it was committed: {_RESTORE}"
            )
        computed = checksum(buf[: ref.footer_length], footer.checksum_algo)
        if computed != ref.footer_checksum:
            raise ChecksumMismatch(
                f"object {key!r}: its footer's {footer.checksum_algo} checksum is {computed:#x}, "
                f"the manifest recorded {ref.footer_checksum:#x}; the object was replaced or "
                f"damaged after it was committed: {_RESTORE}"
            )
        return footer

    def _read_range(
        self, key: str, start: int, end: int, where: str, budget: _Budget
    ) -> bytes | bytearray | memoryview:
        """Bytes ``[start, end)`` of ``key``: mapped, one range read, or parallel parts.

        ``where`` names the slices read in errors: a format error (a truncated object) is
        raised again with it in front.
        """
        length = end - start
        if length == 0:
            return b""
        try:
            if length >= self.map_threshold:
                mapped = self._retrying(budget, where, self._map, key, start, end)
                if mapped is not None:
                    return mapped
            if length < self.split_threshold or length <= self.part_size:
                data = self._retrying(budget, where, self._get, key, start, end)
                if len(data) != length:
                    raise _truncated(key, start, end, len(data))
                return data
            buf = bytearray(length)
            view = memoryview(buf)

            def part(lo: int, hi: int) -> None:
                target = view[lo - start : hi - start]
                self._retrying(budget, where, self._get_into, key, lo, target)

            bounds = range(start, end, self.part_size)
            gather(
                self._pool,
                [functools.partial(part, a, min(a + self.part_size, end)) for a in bounds],
            )
            return buf
        except FormatError as exc:
            raise type(exc)(f"{where}: {exc}") from exc

    def _map(self, key: str, start: int, end: int) -> memoryview | None:
        view = self._store.map_range(key, start, end)
        if view is not None:
            self._counters.read_returned(len(view))
            if len(view) != end - start:
                raise _truncated(key, start, end, len(view))
        return view

    def _get_into(self, key: str, start: int, target: memoryview) -> None:
        try:
            n = self._store.get_range_into(key, start, target)
        except BaseException:
            self._counters.read_failed()
            raise
        self._counters.read_returned(n)
        if n != len(target):
            raise _truncated(key, start, start + len(target), n)

    def _get(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key`` with one range read (fewer at the object's end)."""
        try:
            data = self._store.get_range(key, Bounded(start, end))
        except BaseException:
            self._counters.read_failed()
            raise
        self._counters.read_returned(len(data))
        return data

    def _retrying(self, budget: _Budget, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, retried on transient store errors within ``budget`` and through
        outages; ``what`` names the read in errors and logs."""
        attempt = 0
        while True:
            try:
                result = fn(*args)
                self._outage.recovered()
                return result
            except StoreUnavailable as exc:
                # An outage does not spend the step's budget: the read is retried until the
                # store is back (``docs/guarantees.md``, "Outages").
                self._outage.failed(f"reading {what}", exc)
            except _RETRYABLE as exc:
                if no_answer(exc):  # a hung store: warn (once per outage), as when unreachable
                    self._outage.failed(f"reading {what}", exc)
                used = budget.spend()
                if used is None:
                    raise ConsumerError(
                        f"{what}: read failed and the step's retry budget ({budget.limit}) is "
                        f"spent (next() retries the step from scratch; a flaky store may need "
                        f"a larger retry_budget); last error: {exc}"
                    ) from exc
                _log.debug("%s: %s; retry %d", what, exc, used)
            except ObjectNotFound as exc:
                raise ConsumerError(
                    f"{what}: the object is gone: it was reclaimed (this consumer fell behind "
                    "the checkpoint watermarks) or deleted by hand; resume from a later checkpoint"
                ) from exc
            # Also stops a read-ahead job of a closed consumer that waits out an outage.
            self._check_not_closed(f"retrying {what}")
            self._counters.add(retries=1)
            # The exponent is capped: an outage can last thousands of retries, and 2.0**1024
            # overflows a float.
            self._sleep(min(self.max_retry_backoff, self.retry_backoff * 2.0 ** min(attempt, 30)))
            attempt += 1


def _truncated(key: str, start: int, end: int, got: int) -> FormatError:
    return FormatError(
        f"object {key!r} is truncated: bytes [{start}, {end}) requested, {got} returned; {_RESTORE}"
    )


def _object_holding(desc: TgbDescriptor, index: int, what: str) -> TgbObjectRef:
    """The object of ``desc`` holding slice ``index`` (numbered within the TGB)."""
    for ref in desc.objects:
        if ref.first_slice <= index < ref.first_slice + ref.slice_count:
            return ref
    raise FormatError(f"{what}: no object of the TGB holds slice {index}")


def _group_by_object(
    desc: TgbDescriptor, loc: SliceLocation, what: str
) -> list[tuple[TgbObjectRef, list[int]]]:
    """Split ``loc.slices`` by the object holding each, keeping their order."""
    groups: list[tuple[TgbObjectRef, list[int]]] = []
    for index in loc.slices:
        ref = _object_holding(desc, index, what)
        if groups and groups[-1][0] is ref:
            groups[-1][1].append(index)
        else:
            groups.append((ref, [index]))
    return groups


def _runs(
    layout: SliceTable | TgbFooter, first_slice: int, indices: list[int]
) -> list[list[tuple[int, SliceEntry | SliceSpan]]]:
    """Slices ``indices`` (numbered within the TGB) of an object with their entries in its
    layout, in runs of slices stored back to back: one range read per run."""
    entry: Callable[[int], SliceEntry | SliceSpan] = (
        layout.slices.__getitem__ if isinstance(layout, TgbFooter) else layout.span
    )
    runs: list[list[tuple[int, SliceEntry | SliceSpan]]] = []
    run_end = -1  # where the last run's bytes end; no slice starts at -1
    for index in indices:
        cur = entry(index - first_slice)
        if cur.offset == run_end:
            runs[-1].append((index, cur))
        else:
            runs.append([(index, cur)])
        run_end = cur.offset + cur.length
    return runs


_COUNTS: Final = {
    "start_step": 0,
    "stride": 1,
    "prefetch": 0,
    "ramp_every": 1,
    "max_process_reads": 1,
    "max_workers": 1,
    "footer_cache": 1,
    "retry_budget": 0,
}
"""The :class:`Consumer` options that are counts, with their smallest value."""
_SIZES: Final = ("map_threshold", "split_threshold", "part_size")
"""The :class:`Consumer` options that are sizes in bytes (at least 1; ``16e6`` is taken)."""
_SECONDS: Final = ("poll_interval", "max_poll_interval", "retry_backoff", "max_retry_backoff")
"""The :class:`Consumer` options that are finite numbers of seconds, slept between reads."""


def _check_options(**options: Any) -> dict[str, Any]:
    """:class:`Consumer` keyword arguments with every count, size, number of seconds and share
    checked and made a plain ``int`` or ``float``; the others are returned as given.

    ``TypeError`` for the wrong type (``part_size=16e6``, ``timeout="5"``), ``ValueError`` for a
    value out of range, naming the option. Pairs are checked against the consumer's defaults
    for the options not given, so :class:`~batchweave.torch.WeaveDataset` checks its consumer
    options with this when it is made, not in a DataLoader worker.
    """
    checked = dict(options)
    for name, minimum in _COUNTS.items():
        if name in checked:
            checked[name] = as_count(name, checked[name], minimum)
    for name in _SIZES:
        if name in checked:
            checked[name] = as_size(name, checked[name], 1)
    for name in _SECONDS:
        if name in checked:  # slept: infinity would make time.sleep raise
            checked[name] = as_seconds(name, checked[name], finite=True)
    if "prefetch_min_latency" in checked:  # a threshold: infinity never reads ahead
        checked["prefetch_min_latency"] = as_seconds(
            "prefetch_min_latency", checked["prefetch_min_latency"]
        )
    if checked.get("timeout") is not None:  # infinity waits for ever, as None does
        checked["timeout"] = as_seconds("timeout", checked["timeout"])
    if "prefetch_max_cpu_share" in checked:
        checked["prefetch_max_cpu_share"] = as_fraction(
            "prefetch_max_cpu_share", checked["prefetch_max_cpu_share"]
        )
    both = {**_DEFAULTS, **checked}
    if not 0 < both["poll_interval"] <= both["max_poll_interval"]:
        raise ValueError(
            f"need 0 < poll_interval <= max_poll_interval, got {both['poll_interval']} and "
            f"{both['max_poll_interval']}"
        )
    if both["max_retry_backoff"] < both["retry_backoff"]:
        raise ValueError(
            f"need 0 <= retry_backoff <= max_retry_backoff, got {both['retry_backoff']} and "
            f"{both['max_retry_backoff']}"
        )
    return checked


_DEFAULTS: Final = {
    name: parameter.default
    for name, parameter in inspect.signature(Consumer).parameters.items()
    if name in ("poll_interval", "max_poll_interval", "retry_backoff", "max_retry_backoff")
}


def _resolve_coordinates(
    mesh: Mesh,
    dp_rank: int | None,
    cp_rank: int | None,
    *,
    tp: int,
    pp: int,
    order: str,
    environ: Mapping[str, str] | None,
) -> tuple[int, int]:
    """The rank's ``(dp_rank, cp_rank)``: given, or derived from the environment.

    ``tp``, ``pp`` and ``order`` are checked either way: a job's degrees that cannot be right
    are a mistake even when explicit coordinates make them unused.
    """
    check_mesh(mesh)
    tp, pp = as_count("tp", tp, 1), as_count("pp", pp, 1)
    if not isinstance(order, str):
        raise TypeError(
            f"rank_order must be a str, got the {type(order).__name__} {order!r}; e.g. "
            f"rank_order={DEFAULT_RANK_ORDER!r}"
        )
    _parse_order(order)
    dp_rank = None if dp_rank is None else as_int("dp_rank", dp_rank)
    cp_rank = None if cp_rank is None else as_int("cp_rank", cp_rank)
    if dp_rank is None and cp_rank is None:
        coords = coordinates_from_env(mesh, tp=tp, pp=pp, order=order, environ=environ)
        return coords.dp_rank, coords.cp_rank
    if cp_rank is None and mesh.cp == 1:
        cp_rank = 0
    if dp_rank is None or cp_rank is None:
        raise ValueError(
            f"give both dp_rank and cp_rank for mesh ({mesh}), or neither to derive them from "
            "RANK and WORLD_SIZE"
        )
    mesh.slice_index(dp_rank, cp_rank)  # range check with a clear message
    return dp_rank, cp_rank


_STATE_INTS: Final = (
    "format",
    "step",
    "dp",
    "cp",
    "dp_rank",
    "cp_rank",
    "anchor_step",
    "anchor_replica",
)


def _state_int(name: str, value: Any) -> int:
    """A state value as an int: what :func:`as_int` takes, or a float or string holding one
    exactly. ``int()`` alone would resume a state whose step is ``2.5`` at step 2."""
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{name} is {value!r}, not an integer")
        return int(value)
    if isinstance(value, str):
        return int(value)
    return as_int(name, value)


def _parse_state(state: Mapping[str, Any]) -> dict[str, Any]:
    try:
        parsed: dict[str, Any] = {name: _state_int(name, state[name]) for name in _STATE_INTS}
        parsed["namespace"] = str(state.get("namespace", ""))
        parsed["namespace_id"] = str(state["namespace_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConsumerError(
            f"not a BatchWeave consumer state ({exc!r}); pass what Consumer.state_dict() returned"
        ) from exc
    if parsed["format"] != STATE_FORMAT:
        raise ConsumerError(
            f"consumer state format {parsed['format']} is not {STATE_FORMAT}; it was written by "
            "another BatchWeave version"
        )
    problems = [
        f"{name} {parsed[name]} is negative"
        for name in ("step", "anchor_step", "anchor_replica")
        if parsed[name] < 0
    ]
    if parsed["step"] < parsed["anchor_step"]:
        problems.append(f"step {parsed['step']} precedes anchor_step {parsed['anchor_step']}")
    try:
        Mesh(dp=parsed["dp"], cp=parsed["cp"])
    except ValueError:
        problems.append(f"dp={parsed['dp']}, cp={parsed['cp']} is not a mesh")
    if problems:
        raise ConsumerError(
            f"consumer state is inconsistent ({'; '.join(problems)}): {dict(state)!r}; pass "
            "what Consumer.state_dict() returned, unmodified"
        )
    return parsed

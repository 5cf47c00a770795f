"""The per-rank consumer: each training rank reads exactly its own slice of every step.

A :class:`Consumer` follows a namespace's manifest, projects every logical step onto the TGB
slices its rank owns (:mod:`batchweave._projection`), fetches them with one range read per object
(after one cached footer read per TGB object, :mod:`batchweave._consumer._reader`) and yields
``(step, data)`` strictly in step order while a bounded window of later steps is already being
read. See ``docs/consumer.md``.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any, ClassVar, Final

from batchweave._checks import check_namespace, check_store
from batchweave._consumer._options import (
    DEFAULT_MAX_POLL_INTERVAL,
    DEFAULT_MAX_RETRY_BACKOFF,
    DEFAULT_POLL_INTERVAL,
    DEFAULT_RETRY_BACKOFF,
    check_options,
    resolve_coordinates,
)
from batchweave._consumer._prefetch import Job, Workers
from batchweave._consumer._reader import (
    READ_RETRYABLE,
    Budget,
    ObjectGone,
    ReadOptions,
    SliceReader,
    closed_error,
)
from batchweave._consumer._registry import OPEN_CONSUMERS
from batchweave._consumer._state import STATE_FORMAT, check_state_namespace, parse_state
from batchweave._consumer._stats import ConsumerStats, Counters
from batchweave._errors import (
    ConsumerError,
    ConsumerTimeout,
    FormatError,
    NamespaceMismatch,
    NamespaceNotFound,
    ObjectNotFound,
    StepReclaimed,
)
from batchweave._fork import current_pid
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import Manifest, TgbDescriptor
from batchweave._manifest._segments import find_segment
from batchweave._mesh import Mesh
from batchweave._outage import OutageLog, is_outage
from batchweave._projection import (
    DEFAULT_RANK_ORDER,
    Projection,
    SliceLocation,
    resume_anchor,
)
from batchweave._store._base import ObjectStore

__all__ = ["Consumer"]

_log = logging.getLogger("batchweave.consumer")

_MIB: Final = 1 << 20

_UNREACHABLE: Final = (
    "The object store was unreachable or did not answer at the last attempt (see the warnings "
    "logged): check its endpoint and the network."
)
"""Why a wait timed out when the store, not the producers, was the problem."""

_OVERRUN: Final = 1.0
"""Seconds past ``timeout`` from which a timeout error says how long the wait really took."""


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

    _takes_consumer_states: ClassVar[bool] = True
    """``checkpoint_hook`` checks a ``state`` given with it on every rank (its states are
    consumer states)."""

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
        poll_interval: float = DEFAULT_POLL_INTERVAL,
        max_poll_interval: float = DEFAULT_MAX_POLL_INTERVAL,
        timeout: float | None = None,
        retry_budget: int = 8,
        retry_backoff: float = DEFAULT_RETRY_BACKOFF,
        max_retry_backoff: float = DEFAULT_MAX_RETRY_BACKOFF,
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
        options = check_options(
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
            clock=clock,
            sleep=sleep,
            cpu_clock=cpu_clock,
        )
        self.mesh = mesh
        self.dp_rank, self.cp_rank = resolve_coordinates(
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
        self.poll_interval: float = options["poll_interval"]
        self.max_poll_interval: float = options["max_poll_interval"]
        self.timeout: float | None = options["timeout"]
        self.retry_budget: int = options["retry_budget"]
        self._clock = clock
        self._sleep = sleep
        self._cpu_clock = cpu_clock
        # CPU time is measured only from this read latency on (None: never); see _cpu_started.
        self._measure_cpu_from: float | None = (
            self.prefetch_min_latency / 2
            if self.prefetch_min_latency > 0 and self.prefetch_max_cpu_share < 1
            else None
        )
        self._counters = Counters(clock)
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
        self._reader = SliceReader(
            store,
            self._log,
            counters=self._counters,
            outage=self._outage,
            pool=self._pool,
            footer_cache=options["footer_cache"],
            options=ReadOptions(
                map_threshold=options["map_threshold"],
                split_threshold=options["split_threshold"],
                part_size=options["part_size"],
                retry_backoff=options["retry_backoff"],
                max_retry_backoff=options["max_retry_backoff"],
            ),
            sleep=sleep,
        )
        # Held by next(): close() from another thread leaves the read window to it.
        self._reading = threading.Lock()
        self._depth: int = min(1, self.prefetch)
        self._delivered_since_ramp = 0
        self._delivered_any = False
        self._warned_partial_step = False
        self._poll_delay = self.poll_interval
        self._last_refresh = -math.inf
        self._closed = False
        # Counted open until closed, or until collected unclosed.
        self._unregister = weakref.finalize(self, OPEN_CONSUMERS.closed, OPEN_CONSUMERS.opened())

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

    # Read-only: the slice reader reads with these, fixed when it was made.

    @property
    def map_threshold(self) -> int:
        """Reads of at least this many bytes are mapped instead of copied (stores that can map)."""
        return self._reader.options.map_threshold

    @property
    def split_threshold(self) -> int:
        """Reads of at least this many bytes are split into ``part_size`` range reads."""
        return self._reader.options.split_threshold

    @property
    def part_size(self) -> int:
        """Size of each range read of a split read, in bytes."""
        return self._reader.options.part_size

    @property
    def retry_backoff(self) -> float:
        """Seconds slept before the first retry of a failed read; doubled per retry."""
        return self._reader.options.retry_backoff

    @property
    def max_retry_backoff(self) -> float:
        """The longest sleep before retrying a failed read, in seconds."""
        return self._reader.options.max_retry_backoff

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
        parsed = None if state is None else parse_state(state)  # garbage is refused, always
        if parsed is not None:
            self._check_state_namespace(parsed)  # its name, also where there is no namespace
        if self._manifest is None:
            try:
                self._ensure_open(wait=False)
            except NamespaceNotFound:
                return 0
        assert self._manifest is not None
        if parsed is None:
            assert self._projection is not None
            return self._projection.first_tgb_step(self._next_step)
        self._check_state_namespace(parsed)  # its id too, now the namespace is open
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
                stall_seconds=c.stall_now(),
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
        self._refuse_if_closed("next()")
        # Counted as stall from now on, also while still blocked (stats shows it growing).
        waiting = self._counters.wait_began()
        try:
            with self._reading:
                try:
                    step, data, nbytes = self._next()
                finally:
                    if self._closed:  # by another thread, during this call: drop what it read
                        self._drop_window()
        except BaseException:
            self._counters.stalled(waiting)
            raise
        self._counters.delivered(waiting, nbytes, self._created_at)
        self._delivered_any = True
        return step, data

    def open(self, *, wait: bool = True) -> None:
        """Open the namespace now rather than at the first ``next()``.

        With ``wait`` it waits for the namespace to be created like ``next()`` does (``timeout``
        applies); without, a missing namespace raises :class:`NamespaceNotFound` at once. A
        consumer ``cp`` that does not fit the stored mesh raises :class:`NamespaceMismatch`.
        Idempotent; costs one manifest read the first time. A closed consumer refuses it
        (:class:`ConsumerError`), as it refuses ``next()``.
        """
        self._check_process("open()")
        self._refuse_if_closed("open()")
        self._ensure_open(wait=wait)

    def close(self) -> None:
        """Stop prefetching, release the read threads and the cached segments and footers.
        Idempotent.

        May be called from another thread: a ``next()`` reading a step, or waiting for
        producers, for the namespace or for the end of an outage, then raises
        :class:`ConsumerError` once its current sleep (at most ``max_poll_interval`` or
        ``max_retry_backoff``) or store request ends. A request is not cut short: to a store
        that accepts connections but does not answer, it ends after the store's
        ``read_timeout`` x its attempts (300 s with the defaults).
        """
        # The reader first: no retry starts once this consumer says it is closed.
        self._reader.close(repr(self))
        self._closed = True
        self._unregister()  # runs once, however often close() is called
        # A closed consumer that stays referenced (a variable, a traceback) would keep up to
        # max_segment_tgbs decoded descriptors (65 MB at dp=2).
        self._log.stop_caching_segments()
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

        The namespace is opened (one manifest read; an open consumer reads the latest version,
        one GET when it holds it) to check the state belongs to it (:class:`NamespaceMismatch`
        otherwise) and that the step was not reclaimed (:class:`StepReclaimed`). A state saved
        with another data-parallel degree is re-anchored so the data continues exactly where it
        stopped (see ``docs/consumer.md``); prefetched steps are discarded.

        Call it before iterating or between steps, from the thread that iterates: while a
        ``next()`` runs on another thread it is refused (:class:`ConsumerError`), since that
        ``next()`` would deliver a step of neither position. A closed consumer refuses it
        (:class:`ConsumerError`): load the state into a new consumer.
        """
        self._check_process("load_state_dict()")
        parsed = parse_state(state)
        self._refuse_if_closed("load_state_dict()", "the state")
        self._check_state_namespace(parsed)  # the name; the id once the namespace is open
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
        """:meth:`load_state_dict` of a parsed state, holding the read lock.

        An open consumer first looks for a newer manifest version (one GET when it holds the
        latest): the version it holds may be long stale (a :class:`WeaveLoader`'s checking
        consumer is opened once per run), and a state whose step was reclaimed since would be
        accepted, every ``next()`` then failing on a deleted object. If that lookup fails (a
        transient error or an outage), the version held is checked: a reclaimed step is then
        refused by the ``next()`` that reads it.
        """
        step, old_dp = parsed["step"], parsed["dp"]
        if self._manifest is not None:
            try:
                latest = self._latest(self._manifest)
            except READ_RETRYABLE as exc:
                _log.debug("%s: manifest refresh on load_state_dict() failed: %s", self._where, exc)
            else:
                if latest.version > self._manifest.version:
                    self._adopt(latest)
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
                self._check_not_reclaimed(step, loaded=parsed)
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

    def _refuse_if_closed(self, call: str, load: str = "this one's state_dict()") -> None:
        """Refuse ``call`` (``"next()"``, ...) once :meth:`close` was called: a closed consumer
        reads nothing more (:meth:`state_dict` still works, to continue in a new one, into
        which the advice says to load ``load``)."""
        if self._closed:
            raise ConsumerError(
                f"{self!r} is closed; to continue, create a new Consumer and load {load} into it "
                f"({call} on a closed consumer reads nothing)"
            )

    def _check_state_namespace(self, parsed: Mapping[str, Any]) -> None:
        """:func:`check_state_namespace` against this consumer's namespace: its name always,
        without a store request, and its id once the namespace is open."""
        check_state_namespace(
            parsed, reader=repr(self), namespace=self.namespace, namespace_id=self.namespace_id
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
        self._check_not_reclaimed(step, refresh=True)
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
        process_share = self.max_process_reads // max(1, OPEN_CONSUMERS.count) - 1
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
            except READ_RETRYABLE as exc:
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
            except READ_RETRYABLE as exc:
                if is_outage(exc):
                    # An outage (also a store that stopped answering) is waited out, bounded
                    # only by ``timeout``, polling ever slower.
                    self._counters.add(retries=1)
                    self._outage.failed(f"waiting for step {step}", exc)
                    self._poll_slower()
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
            raise closed_error(repr(self), doing)

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
        latest = self._latest(self._manifest)
        if latest.version != self._manifest.version:
            self._adopt(latest)
        else:
            self._poll_slower()

    def _latest(self, since: Manifest) -> Manifest:
        """The latest manifest version from ``since`` on (one GET when up to date): a refresh."""
        self._counters.add(manifest_refreshes=1)
        self._last_refresh = self._clock()
        return self._log.latest(since)

    def _adopt(self, manifest: Manifest) -> None:
        """Follow ``manifest``, newer than the version held, and poll again soon."""
        self._manifest = manifest
        self._poll_delay = self.poll_interval

    def _poll_slower(self) -> None:
        """Double the delay before the next manifest poll, up to ``max_poll_interval``."""
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
            except READ_RETRYABLE as exc:
                failed = exc
                if is_outage(exc):
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
            self._poll_slower()
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

    def _check_not_reclaimed(
        self, step: int, loaded: Mapping[str, Any] | None = None, *, refresh: bool = False
    ) -> None:
        """Refuse ``step`` if it needs a reclaimed TGB step; ``loaded``: the parsed state that
        :meth:`load_state_dict` is loading, whose step the error's advice is then given in.

        With ``refresh`` (the version held may be old: an open consumer's), a step found
        reclaimed first looks for a newer version, which is adopted, and the advice is given
        from its base step: the held one's may have been passed since, and the step it names
        reclaimed too.
        """
        assert self._manifest is not None
        assert self._projection is not None
        first = self._projection.first_tgb_step(step)
        if first < self._manifest.base_step:
            manifest = (
                self._newest_manifest(f"step {step} was found reclaimed") if refresh else None
            )
            raise self._reclaimed_error(step, first, manifest or self._manifest, loaded=loaded)

    def _newest_manifest(self, why: str, *, confirm: bool = False) -> Manifest | None:
        """The latest manifest version (one GET when the one held is the latest), adopted if
        newer than the one held: for an error's advice, which must not come from a stale
        version. ``None`` if it cannot be read (``why`` says what asked, for the debug log): the
        error then stands on what is held. ``confirm``: the version held is read back too (a
        LIST and a GET, trusting no clock), and a history that went back (an older copy
        restored over the prefix) is raised, a :class:`FormatError`: an object missing that
        the held version lists is how a reader behind the head first meets a restore."""
        held = self._manifest
        if held is None:  # cannot happen: only an open consumer has steps to check
            return None
        try:
            if confirm:
                self._counters.add(manifest_refreshes=1)
                latest = self._log.latest_from(held)
            else:
                latest = self._latest(held)
        except Exception as exc:  # the error being raised stands without it, but a history
            if confirm and isinstance(exc, FormatError):  # gone back is what happened
                raise
            _log.debug("%s: reading the latest manifest after %s failed: %s", self._where, why, exc)
            return None
        current = self._manifest
        if current is not None and latest.version > current.version:  # never step back
            self._adopt(latest)
        return latest

    def _reclaimed_error(
        self,
        step: int,
        tgb_step: int,
        manifest: Manifest,
        gone: str = "",
        loaded: Mapping[str, Any] | None = None,
    ) -> StepReclaimed:
        """The error of ``step``, which needs ``tgb_step``, below ``manifest``'s base step;
        ``gone`` names the read that found its object deleted, if one did.

        The advice names the first step that can still be read, in the numbering of what the
        user would change: the consumer's own steps, or, for a state being loaded
        (``loaded``), that state's steps (a state from another ``dp`` is re-anchored on load,
        so the consumer's numbering is not the state's).
        """
        assert self._projection is not None
        base = manifest.base_step
        where = (
            f"{self._where}: step {step} needs TGB step {tgb_step}, but steps below {base} were "
            f"reclaimed (manifest version {manifest.version}"
            + (f"; reading {gone}: the object is gone" if gone else "")
            + ")"
        )
        as_saved = None if loaded is None else _saved_projection(manifest.mesh, loaded)
        if as_saved is not None:
            readable = as_saved.first_step_from(base)
            return StepReclaimed(
                f"{where}; the state was not loaded. Resume from a later checkpoint, or, for a "
                "run that does not need the reclaimed steps, set the step of the state you "
                f"loaded to {readable} (the first step it can still resume at) and load it again"
            )
        readable = self._projection.first_step_from(base)
        anchored = (self._projection.anchor_step, self._projection.anchor_replica) != (0, 0)
        return StepReclaimed(
            f"{where}; the first step consumer mesh ({self.mesh}) can still read is step "
            f"{readable}: resume from a later checkpoint, or, for a run that does not need the "
            "reclaimed steps, "
            + (
                f"load this consumer's state_dict() with its step set to {readable}"
                if anchored
                else f"start past them with Consumer(start_step={readable}) (a WeaveLoader: "
                f"load_state_dict() a state with step {readable})"
            )
        )

    def _object_gone(
        self, step: int, loc: SliceLocation, gone: ObjectGone
    ) -> ObjectGone | StepReclaimed:
        """The error of a read of ``step`` that found its object missing: :class:`StepReclaimed`
        if the namespace's base step has passed the step's TGB since the manifest this consumer
        holds (one GET of the latest version, which is adopted), else ``gone`` itself."""
        latest = self._newest_manifest(str(gone), confirm=True)
        if latest is None:  # the store's answer on the object stands alone
            return gone
        if loc.tgb_step < latest.base_step:
            return self._reclaimed_error(step, loc.tgb_step, latest, gone.what)
        return gone  # deleted by hand, or by a reclaimer as an orphan (docs/lifecycle.md)

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
        budget = Budget(self.retry_budget)
        what = f"step {step} (TGB step {loc.tgb_step})"
        try:
            desc = self._reader.retrying(
                budget, what, self._descriptor, what, manifest, loc.tgb_step
            )
        except StepReclaimed as exc:
            # The manifest log's message names the TGB step, not this consumer's, and no step
            # still readable: give the consumer's own, from the latest version (the one that
            # refused the step may be the stale one it was scheduled with), as next() does.
            latest = self._newest_manifest(f"{what} was found reclaimed") or self._manifest
            if latest is None or loc.tgb_step >= latest.base_step:  # cannot happen: base rises
                raise
            raise self._reclaimed_error(step, loc.tgb_step, latest) from exc
        try:
            data, nbytes, one_object = self._reader.read(what, desc, loc, budget)
        except ObjectGone as gone:
            error = self._object_gone(step, loc, gone)
            if error is gone:
                raise
            raise error from gone.__cause__
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
        latest = self._latest(manifest)
        held = self._manifest
        if held is not None and latest.version > held.version:  # never step back (pool threads)
            self._adopt(latest)
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


def _saved_projection(stored: Mesh, state: Mapping[str, Any]) -> Projection | None:
    """The projection of the consumer that saved the parsed ``state`` (None: not one that can
    read a namespace of mesh ``stored``, which a state from ``state_dict()`` always is)."""
    try:
        return Projection(
            stored=stored,
            consumer=Mesh(dp=state["dp"], cp=state["cp"]),
            anchor_step=state["anchor_step"],
            anchor_replica=state["anchor_replica"],
        )
    except ValueError:
        return None

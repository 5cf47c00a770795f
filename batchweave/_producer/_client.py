"""The producer client: upload TGBs in the background, commit them, resume exactly once.

A :class:`Producer` owns one ``producer_id`` in one namespace. Starting it commits a bumped
``epoch`` for that id, which fences every older incarnation, and reads the id's committed offset
so a restarted process resumes exactly where the committed history ends (``resume_offset``).

Data path: :meth:`Producer.append` encodes a TGB and hands it to a pool of upload threads
(bounded bytes in flight). Uploaded TGBs become *pending* in offset order; a commit-loop thread
publishes the contiguous uploaded prefix with one conditional manifest write per attempt, paced by
a :class:`~batchweave._policy.CommitPolicy`. On a conflict it rebases onto the winner: TGBs the
winner already holds for this producer (an ambiguous write that did land) are dropped, and a
higher epoch for this id raises :class:`~batchweave.ProducerFenced`.

Threads never raise into the void: an error in the commit loop or an upload is re-raised in the
caller's thread at the next ``append``, ``flush``, ``seal`` or ``close``.

This module is the producer's centre: its public API, uploads and commit loop. Beside it:
checking its arguments (``_options``), starting (``_start``), encoding and describing TGBs
(``_tgbs``), the ``max_lag`` wait (``_lag``), retried store failures (``_retry``), what it
reports (``_stats``) and the registry that closes producers left open at interpreter exit
(``_lifetime``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import random
import secrets
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any, Literal, NoReturn

from batchweave._checks import as_count, as_seconds, as_size
from batchweave._errors import (
    FormatError,
    NamespaceError,
    NamespaceSealed,
    OffsetOrderError,
    ProducerError,
    ProducerFenced,
    ProducerRetired,
    StoreError,
)
from batchweave._fork import current_pid
from batchweave._format._checksum import DEFAULT_CHECKSUM_ALGO, ChecksumAlgo
from batchweave._format._tgb import EncodedTgb
from batchweave._format._tgb_write import TgbBuilder
from batchweave._manifest._log import (
    DEFAULT_TAIL_BYTES_LIMIT,
    DEFAULT_TAIL_LIMIT,
    CommitResult,
    Committed,
    Conflict,
    ManifestLog,
    active_producer_ids,
    manifest_key,
)
from batchweave._manifest._models import Manifest, ProducerState, TgbDescriptor
from batchweave._mesh import Mesh
from batchweave._outage import OutageLog, is_outage, no_answer
from batchweave._policy import (
    AttemptOutcome,
    CommitPolicy,
    DacPolicy,
    PolicyWrapper,
    checked_wait,
    measured_duration,
    resolve_policy,
)
from batchweave._producer import _lifetime
from batchweave._producer._lag import LagGate
from batchweave._producer._options import as_offset, check_functions, check_identity
from batchweave._producer._retry import RETRYABLE, Retries, default_backoff
from batchweave._producer._start import start_epoch
from batchweave._producer._stats import CommitPuts, ProducerStats
from batchweave._producer._tgbs import DEFAULT_SLICE_TABLE_LIMIT, Entry, TgbEncoder, describe
from batchweave._producer._uploads import UploadThreads
from batchweave._store._base import ObjectStore
from batchweave._watermarks import Watermarks

__all__ = ["Producer"]

_LOG = logging.getLogger("batchweave.producer")

_MIB = 1 << 20

_TIME_WAIT_CHUNK = 0.25
"""Longest single sleep of the commit loop, so ``abort()`` is never delayed by a long gap."""
_EVENT_WAIT = 0.5
"""Longest wait for an event (upload done, flush, close) before re-checking the state."""
_FORCED_POLL = 0.02
"""Longest sleep of a regular wait while this producer's forced slot is open (see _next_work):
only for a policy that takes turns on a grid, whose slot closes again."""


def _event_wait(deadline: float | None, timed_out: Callable[[], BaseException]) -> float:
    """How long a wait for the producer's next event may last: at most ``_EVENT_WAIT``, and not
    past ``deadline`` (a ``time.monotonic()`` value); ``timed_out()`` is raised once it passed."""
    if deadline is None:
        return _EVENT_WAIT
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise timed_out()
    return min(_EVENT_WAIT, remaining)


class _Wait:
    """What ``_next_work`` returns, holding the producer's lock, when the commit loop must wait:
    its thread waits holding no reference to the producer (``_commit_thread``), so that one
    dropped without ``close()`` reaches ``Producer.__del__`` whatever its policy waits for.
    ``sleep`` given: release the lock and sleep ``seconds`` with it; else wait on the condition
    for at most ``seconds`` (woken by an upload, ``flush()``, ``close()``, ``__del__``)."""

    __slots__ = ("seconds", "sleep")

    def __init__(self, seconds: float, sleep: Callable[[float], object] | None = None) -> None:
        self.seconds = seconds
        self.sleep = sleep

    def run(self, cond: threading.Condition) -> None:
        """Wait as said, then release ``cond``'s lock (held on entry)."""
        if self.sleep is None:
            try:
                cond.wait(self.seconds)
            finally:
                cond.release()
        else:
            cond.release()
            self.sleep(self.seconds)


_IDLE = _Wait(_EVENT_WAIT)


class _Pace:
    """The commit loop's waits toward its next attempt, kept across the turns that wait for it
    (see ``Producer._next_work_locked``)."""

    __slots__ = ("forced_left", "gap_waited", "regular_left", "slept", "slept_gap", "wait_began")

    def __init__(self) -> None:
        # Set once the whole remaining gap was slept: a clock too coarse to show it (or a fake
        # one advancing by less than float resolution) must not keep the loop waiting forever.
        self.gap_waited = False
        # What is left of the first forced and regular (slot) waits computed, counting the time
        # slept against them: a wall clock that stands still or has 1 s resolution gives the
        # same wait at every check (the slot never opens on it), so once the wait first computed
        # has been slept, the attempt goes ahead (out of its slot, as with random phases).
        self.forced_left = math.inf
        self.regular_left = math.inf
        self.wait_began: float | None = None
        """``time.monotonic()`` when the last turn began waiting on the condition."""
        self.slept = 0.0
        """Seconds the last turn slept (an injected sleep), whether that was the whole gap."""
        self.slept_gap = False


def _check_horizon(policy: CommitPolicy, active_horizon: float) -> None:
    """Refuse a DAC ``max_gap`` longer than half of ``active_horizon`` (``docs/dac.md``).

    DAC's ``N`` counts the producers whose last commit lies within ``active_horizon``; one that
    waits up to ``max_gap`` between attempts, and another gap after a lost one, would drop out
    of the others' count between its own commits, and DAC would undercount ``N`` and overrun
    its conflict budget. Half leaves room for one lost attempt.
    """
    inner = policy
    while isinstance(inner, PolicyWrapper):
        inner = inner.inner
    if isinstance(inner, DacPolicy) and not inner.max_gap <= active_horizon / 2:
        raise ValueError(
            f"the DAC policy's max_gap ({inner.max_gap!r} s) must be at most half of the "
            f"Producer's active_horizon ({active_horizon!r} s): a producer that waits max_gap "
            "between commits would drop out of the other producers' active count N, and DAC "
            "would exceed its conflict budget; pass active_horizon >= 2 * max_gap "
            "(active_horizon=math.inf with max_gap=math.inf) or a smaller max_gap"
        )


class Producer:
    """Publishes TGBs into a namespace with exactly-once, all-or-nothing visibility.

    Typical use::

        with bw.Producer(store, "run-1", producer_id="prep-0", mesh=mesh) as p:
            for offset, slices in source.iter_from(p.resume_offset):
                p.append(slices, offset=offset)

    Construction joins (or creates) the namespace and commits a new epoch for ``producer_id``;
    an older process with the same id is fenced from then on. Source offsets must strictly
    increase; ``resume_offset`` is the first offset not yet committed by this id.

    Parameters beyond the obvious ones:

    - ``source``: an opaque identity of what the offsets mean, such as
      :attr:`batchweave.lance.LanceSource.source_id` (1 to 1024 printable characters). The
      epoch commit records it for ``producer_id``; a later start with another ``source`` raises
      :class:`~batchweave.SourceMismatch` before committing anything, since its resumed offsets
      would publish other data. ``None`` checks nothing and keeps what is committed
      (:attr:`committed_source`). Manifests carrying a source are format 4, which needs readers
      of this version or newer (``docs/producer.md``).
    - ``codec`` / ``compression`` / ``checksum_algo``: how ``append`` encodes slices it is given
      as payloads (TGBs given ready-built keep their own). ``checksum_algo`` is ``"crc32c"``
      (default: every BatchWeave reads it), ``"xxhash64"`` or ``"xxh3"`` (XXH3-64: about 4x
      cheaper to verify than CRC-32C, for readers whose reads are CPU-bound such as ``file://``
      on the page cache or local NVMe; 4 more manifest bytes per slice; only BatchWeave
      versions with xxh3 support read it, so upgrade every reader first; ``docs/producer.md``).
    - ``policy``: a commit policy name (``"dac"``, ``"naive"``, ``"fixed10"``, ``"fixed100"``,
      ``"incr"``, ``"aimd"``) or a :class:`CommitPolicy` instance.
    - ``max_lag``: block ``append`` while the visible steps exceed the reclamation boundary by
      more than this many steps (``None``: never block).
    - ``upload_threads`` / ``max_inflight_bytes``: upload parallelism and the bound on encoded
      bytes waiting for upload (``append`` blocks above it; a single larger TGB still goes).
    - ``clock`` (monotonic seconds), ``wall_clock`` (epoch seconds, stored in manifests) and
      ``sleep``: injectable for tests; every timed wait of the producer goes through them.
    - ``boundary``: returns the reclamation boundary step for ``max_lag`` (default:
      ``Watermarks(store, namespace).boundary``, 0 when there are no watermarks).
    - ``refresh_age``: before an attempt, a base manifest read longer ago than this is re-read
      (0, the default, probes for a newer version before every attempt: one small GET that
      spares a conditional PUT doomed by a stale base). Keep it below half the
      :class:`~batchweave.Reclaimer`'s ``grace`` so a stale base is never written on top of
      (see ``docs/lifecycle.md``).
    - ``max_retries``: transient store failures tolerated per upload and while starting, with
      ``backoff(attempt)`` seconds between tries; commits retry transient failures
      indefinitely (nothing pending is ever dropped), logging each one. An unreachable store
      (:class:`~batchweave.StoreUnavailable`, an outage) or one that accepts connections but
      does not answer (:class:`~batchweave.StoreTimeout` or a timed-out write, a hung server) is
      waited out however long it lasts, spending none of ``max_retries``: pending TGBs are
      kept, ``append`` blocks once ``max_inflight_bytes`` wait for upload, and one log line
      says when the outage started and one when the store is back.
    - ``active_horizon``: producers whose last commit is older than this many seconds do not
      count as active for the DAC policy. It must be at least twice a DAC policy's ``max_gap``
      (``ValueError`` otherwise): a producer waiting ``max_gap`` between its commits would drop
      out of the others' count. ``max_gap=math.inf`` needs ``active_horizon=math.inf``.
    - ``tail_limit``: TGB descriptors kept inline in the manifest before a commit rolls them
      into a segment object (``docs/protocol.md``); larger means fewer segment writes and a
      larger manifest per commit. Every producer of a namespace should use the same value.
    - ``tail_bytes_limit``: the tail also rolls once its descriptors' JSON reaches this many
      bytes (default 64 KiB; ``None``: count only), so that descriptors carrying slice tables
      do not make every commit's manifest, and so every fragile window, 100-250 KB long.
    - ``slice_table_limit``: a TGB of at most this many slices carries its slice table
      (offsets, lengths, checksums) in its manifest descriptor, so a consumer reads its slice
      with one request instead of fetching the footer first; each slice adds about 6 bytes to
      the descriptor (its checksum; lengths and sample counts too if they differ between
      slices). Larger meshes keep only the footer's location. 0 never copies the table.
    """

    def __init__(
        self,
        store: ObjectStore,
        namespace: str,
        *,
        producer_id: str,
        mesh: Mesh,
        source: str | None = None,
        policy: str | CommitPolicy = "dac",
        max_lag: int | None = None,
        codec: str = "raw",
        compression: str | None = None,
        checksum_algo: ChecksumAlgo = DEFAULT_CHECKSUM_ALGO,
        upload_threads: int = 4,
        max_inflight_bytes: int = 256 * _MIB,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        boundary: Callable[[], int] | None = None,
        refresh_age: float = 0.0,
        active_horizon: float = 60.0,
        max_retries: int = 8,
        backoff: Callable[[int], float] = default_backoff,
        lag_log_interval: float = 5.0,
        tail_limit: int = DEFAULT_TAIL_LIMIT,
        tail_bytes_limit: int | None = DEFAULT_TAIL_BYTES_LIMIT,
        slice_table_limit: int = DEFAULT_SLICE_TABLE_LIMIT,
    ) -> None:
        # Every argument is checked before the namespace is created or the epoch committed
        # (the length limits of a new namespace or id in start_epoch, where they are created).
        check_identity(namespace, producer_id, mesh, source)
        # Counts and seconds as plain numbers here: "4" or 2.5 would otherwise be taken and fail
        # later, deep inside (a str in a comparison, a float where a count is needed).
        max_lag = None if max_lag is None else as_count("max_lag", max_lag, 0)
        upload_threads = as_count("upload_threads", upload_threads, 1)
        max_inflight_bytes = as_size("max_inflight_bytes", max_inflight_bytes, 1)
        max_retries = as_count("max_retries", max_retries, 0)
        slice_table_limit = as_count("slice_table_limit", slice_table_limit, 0)
        tail_limit = as_count("tail_limit", tail_limit, 1)
        if tail_bytes_limit is not None:
            tail_bytes_limit = as_size("tail_bytes_limit", tail_bytes_limit, 1)
        refresh_age = as_seconds("refresh_age", refresh_age)
        active_horizon = as_seconds("active_horizon", active_horizon)
        lag_log_interval = as_seconds("lag_log_interval", lag_log_interval)
        check_functions(
            clock=clock, wall_clock=wall_clock, sleep=sleep, backoff=backoff, boundary=boundary
        )
        resolved_policy = resolve_policy(policy)
        _check_horizon(resolved_policy, active_horizon)
        encoder = TgbEncoder(
            producer_id,
            namespace,
            mesh,
            codec=codec,
            compression=compression,
            checksum_algo=checksum_algo,
        )
        self._pid = current_pid()
        """The process that created this producer: the only one its threads run in."""
        self._store = store
        self._namespace = namespace
        self._producer_id = producer_id
        self._mesh = mesh
        self._policy = resolved_policy
        self._max_lag = max_lag
        self._encoder = encoder
        self._slice_table_limit = slice_table_limit
        self._max_inflight = max_inflight_bytes
        self._clock = clock
        self._wall_clock = wall_clock
        self._sleep = sleep
        self._lock = threading.RLock()
        """Guards the producer's state. ``with self._lock``, not ``with self._cond``: a C lock's
        enter and exit, where a Ctrl-C cannot land between acquiring and releasing (it can in
        ``Condition.__exit__``, a Python function, and would leave the lock held for ever)."""
        self._cond = threading.Condition(self._lock)
        self._outage = OutageLog(_LOG, f"producer {producer_id!r}", clock=clock)
        self._retries = Retries(producer_id, self._lock, self._outage, backoff=backoff, sleep=sleep)
        self._lag = LagGate(
            producer_id,
            self._lock,
            self._cond,
            self._retries,
            boundary=Watermarks(store, namespace, sleep=sleep) if boundary is None else boundary,
            clock=clock,
            wall_clock=wall_clock,
            log_interval=lag_log_interval,
        )
        self._refresh_age = refresh_age
        self._active_horizon = active_horizon
        self._max_retries = max_retries
        self._rng = random.Random()
        self._unknown_conflicts = 0
        """Consecutive conflicts whose winner could not be read (409s, transient failures)."""

        self._commit_puts = CommitPuts(store)
        self._log = ManifestLog(
            self._commit_puts,
            namespace,
            clock=wall_clock,
            monotonic=clock,
            tail_limit=tail_limit,
            tail_bytes_limit=tail_bytes_limit,
            deferred_merges=True,  # level merges are written after a commit, not inside it
        )
        self._entries: deque[Entry] = deque()
        self._inflight_bytes = 0
        self._last_appended: int | None = None
        self._error: BaseException | None = None
        self._error_tb: TracebackType | None = None
        """``_error``'s traceback when it was stored: each re-raise starts from it again."""
        self._transient_attempt = 0
        """Consecutive commit turns that failed transiently (the commit loop's backoff)."""
        self._aborted = False
        self._closing = False
        self._closed = False
        self._stopping: Literal["close", "abort"] | None = None
        """How ``_shutdown`` stops the threads (once each way: an abort after a close)."""
        self._exit_failure: ProducerError | None = None
        """What the exit hook could not commit, for a ``close()`` after it (an atexit one)."""
        self._flush_waiters = 0
        self._seal_requests = 0
        """seal() calls waiting for the sealed flag: the commit loop commits it while any does.
        One that times out or is interrupted withdraws its request (appends are taken again)."""
        self._seal_sent = False
        """Whether a commit carrying the sealed flag was sent (it may land after its seal()
        gave up): a sealed manifest is then this producer's own doing."""
        self._sealed = False
        self._pace: _Pace | None = None
        """The commit loop's waits toward its next attempt, while it waits for it."""
        self._dropped = False
        """Set by ``__del__``: dropped without ``close()`` holding TGBs, this producer is kept
        alive, and its commit attempts are forced (as by ``flush()``) until it committed them."""
        self._last_attempt_end = -math.inf
        self._waited = 0.0
        """Seconds the commit loop waited since ``_last_attempt_end`` (set with it): a lower
        bound on the time since, for a clock that stands still or steps backwards."""
        self._stats: dict[str, int] = dict.fromkeys(
            (
                "attempts",
                "commits",
                "conflicts",
                "ambiguous",
                "tgbs_published",
                "bytes_published",
            ),
            0,
        )
        self._last_window = 0.0
        self._policy_started = False
        """Set once the commit loop had its first work and called ``policy.start``."""
        self._rank: int | None = None
        """This producer's position among the active ids of the newest manifest read."""
        self._forced_attempt = False
        """Whether the attempt about to start was started by flush()/close()/seal()."""
        self._first_upload: float | None = None
        """Seconds the first successful upload PUT took: the first request under data load."""
        self._base, self._epoch, self._start_window = start_epoch(
            self._log,
            namespace=namespace,
            producer_id=producer_id,
            mesh=mesh,
            source=source,
            retries=self._retries,
            max_retries=max_retries,
            rng=self._rng,
            clock=clock,
            wall_clock=wall_clock,
        )
        """The epoch commit's manifest, this incarnation's epoch, and how long that commit took."""
        self._base_read_at = self._clock()
        self._attempt_ended(self._base_read_at)
        state = self._base.producers[producer_id]
        self._committed_offset: int | None = state.offset
        self._committed_source = state.source
        self._resume_offset = 0 if state.offset is None else state.offset + 1

        self._uploads = UploadThreads(upload_threads, name=f"bw-upload-{producer_id}")
        # The thread holds this producer only during its turns (see _commit_thread): one dropped
        # without close() holding TGBs is kept alive by __del__ until it committed them.
        self._link = _Link(self)
        self._committer = threading.Thread(
            target=_commit_thread,
            args=(self._link,),
            name=f"bw-commit-{producer_id}",
            daemon=True,
        )
        self._committer.start()
        self._started = True
        _lifetime.add_unclosed(self)

    # ------------------------------------------------------------------------------------------
    # public surface

    @property
    def producer_id(self) -> str:
        """This producer's stable id."""
        return self._producer_id

    @property
    def namespace(self) -> str:
        """The namespace this producer publishes into."""
        return self._namespace

    @property
    def mesh(self) -> Mesh:
        """The namespace's mesh; every TGB holds ``mesh.slices`` slices."""
        return self._mesh

    @property
    def epoch(self) -> int:
        """This incarnation's epoch (committed at start; higher than every earlier one)."""
        return self._epoch

    @property
    def resume_offset(self) -> int:
        """First source offset not committed by this producer id when this incarnation started.

        Every offset below it is in the committed history exactly once; feed the source from
        here (``source.iter_from(p.resume_offset)``) for exactly-once publication.
        """
        return self._resume_offset

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` or :meth:`abort` stopped this producer: it publishes no more."""
        return self._closed

    @property
    def failed(self) -> bool:
        """Whether a background failure (an upload or commit that retrying cannot cure) stopped
        this producer: it publishes nothing more, and every call but :meth:`abort` raises it."""
        return self._error is not None

    @property
    def committed_source(self) -> str | None:
        """The source identity committed for this producer id: ``source=`` as given, or, with
        ``source=None``, the one an earlier incarnation committed (``None``: none)."""
        return self._committed_source

    @property
    def committed_offset(self) -> int | None:
        """Highest offset of this producer id known to be committed (``None``: none yet)."""
        self._check_process()
        with self._lock:
            return self._committed_offset

    def append(
        self,
        slices: Iterable[Any] | EncodedTgb | TgbBuilder,
        *,
        offset: int,
        sample_counts: Iterable[int | None] | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> None:
        """Encode and upload one TGB for source ``offset``; it is committed in the background.

        ``slices`` holds ``dp * cp`` payloads in ``(d, c)`` order (encoded with the producer's
        codec, compression and checksum algorithm), or an already built :class:`EncodedTgb` /
        :class:`TgbBuilder`, which is published as built: its own codec, compression and
        checksum algorithm are kept, whatever the producer's.
        Blocks while ``max_inflight_bytes`` are waiting for upload, and while ``max_lag`` is
        exceeded. Raises :class:`OffsetOrderError` if ``offset`` is not greater than both the
        last appended and the committed offset, and re-raises any background failure.
        """
        self._check_process()
        offset = as_offset(offset)
        with self._lock:
            self._check_usable_locked()
            self._check_offset_locked(offset)
        self._wait_for_lag()
        encoded = self._encoder.encode(slices, offset, sample_counts, metadata)
        key = f"data/{self._producer_id}/{self._epoch}/{offset:020d}-{secrets.token_hex(16)}.tgb"
        entry = Entry(offset=offset, key=key, size=encoded.size)
        # A TGB encoded here from payloads, with settings checked at start, is valid by
        # construction: the upload thread builds its descriptor without validating it again.
        # One the caller built is described and validated here, before it is registered, so
        # one a manifest cannot record is refused by this call (FormatError), not by the upload
        # thread (which would stop the producer after uploading it).
        descriptor = (
            self._descriptor(entry, encoded, validate=True)
            if isinstance(slices, EncodedTgb | TgbBuilder)
            else None
        )
        # Registering the TGB and submitting its upload are one region for a Ctrl-C, which
        # can land at any call in it: an interrupted append either leaves the TGB appended, its
        # upload under way (and then committed like the others), or takes it back entirely
        # (_withdraw), so the offset can be appended again. Never half: a TGB registered
        # without an upload would make flush() and close() wait for ever.
        previous: int | None = None
        submitting = False
        try:
            with self._lock:
                while (
                    self._inflight_bytes > 0
                    and self._inflight_bytes + entry.size > self._max_inflight
                ):
                    self._check_usable_locked()
                    self._cond.wait(_EVENT_WAIT)
                self._check_usable_locked()
                # Re-checked: another thread may have appended while this one encoded.
                self._check_offset_locked(offset)
                # Plain assignments up to the one call that ends them: an interrupt lands
                # before this registration or after all of it, and _withdraw undoes each part.
                previous = self._last_appended
                entry.state = "queued"
                entry.charged = True
                self._inflight_bytes += entry.size
                self._last_appended = offset
                self._entries.append(entry)
            submitting = True
            self._uploads.submit(self._upload, entry, encoded, descriptor)
        except BaseException as exc:
            # Refused, interrupted (Ctrl-C), or not submitted (the upload threads stopped by a
            # concurrent abort): take the TGB back unless an upload thread already took it.
            self._withdraw(entry, previous)
            if submitting and isinstance(exc, RuntimeError):
                raise ProducerError(
                    f"producer {self._producer_id!r} was stopped while appending offset {offset}"
                ) from exc
            raise

    def _withdraw(self, entry: Entry, previous: int | None) -> None:
        """Take back ``entry`` (appended after ``previous``) if no upload thread took it yet.

        Its upload, if one was queued after all (a Ctrl-C inside ``submit``), finds it withdrawn
        and does nothing: neither uploads it nor releases its bytes a second time.
        """
        with self._lock:
            if entry.state != "queued":
                return  # never registered, or its upload runs: then it stays appended
            entry.state = "withdrawn"
            self._release_locked(entry)
            for i, queued in enumerate(self._entries):
                if queued is entry:
                    del self._entries[i]
                    break
            if self._last_appended == entry.offset:
                self._last_appended = previous
            self._cond.notify_all()

    def _release_locked(self, entry: Entry) -> None:
        """Stop counting the bytes of ``entry`` as in flight, once only."""
        if entry.charged:
            entry.charged = False
            self._inflight_bytes -= entry.size
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every TGB appended so far is committed (visible to consumers).

        Forces commits regardless of the policy's TGB-count condition; the policy's forced wait
        still applies (:meth:`~batchweave.CommitPolicy.forced_wait`: for DAC, this producer's
        turn on the flush grid, at most a fraction of a second on a fast store). ``timeout`` is
        in seconds of real time; raises ``TimeoutError`` when it passes. Re-raises any
        background failure.
        """
        self._check_process()
        if timeout is not None:
            timeout = as_seconds("timeout", timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._raise_if_failed_locked()
            target = self._last_appended
            if target is None:
                return
            self._flush_waiters += 1
            self._cond.notify_all()
            try:
                while self._entries and self._entries[0].offset <= target:
                    self._raise_if_failed_locked()
                    if self._aborted:
                        raise ProducerError(
                            f"producer {self._producer_id!r} was aborted; offsets up to "
                            f"{target} are not all committed"
                        )
                    self._cond.wait(
                        _event_wait(
                            deadline,
                            lambda: TimeoutError(
                                f"producer {self._producer_id!r}: flush timed out after "
                                f"{timeout:g} s with {len(self._entries)} TGBs not committed "
                                f"(offsets {self._entries[0].offset}.."
                                f"{self._entries[-1].offset})"
                            ),
                        )
                    )
            finally:
                self._flush_waiters -= 1
            self._raise_if_failed_locked()

    def seal(self, timeout: float | None = None) -> None:
        """Flush, then commit the sealed flag: consumers stop cleanly after the last step.

        No producer can append to a sealed namespace. ``timeout`` applies to the flush and to the
        seal commit each. A seal that times out (``TimeoutError``) or is interrupted withdraws its
        request: appends are taken again and ``close()`` does not wait for it (the namespace is
        sealed only if the seal commit already sent lands).
        """
        self._check_process()
        if timeout is not None:
            timeout = as_seconds("timeout", timeout)
        self.flush(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._raise_if_failed_locked()
            if self._aborted:
                raise ProducerError(f"producer {self._producer_id!r} was aborted")
            if self._closed or self._closing:
                # Its commit thread is stopped (or stopping): nothing would commit the flag.
                raise ProducerError(
                    f"producer {self._producer_id!r} is closed (or closing), so it cannot seal "
                    f"namespace {self._namespace!r}: call seal() before close(), or seal with "
                    "`batchweave seal STORE NAMESPACE`"
                )
            self._seal_requests += 1
            self._cond.notify_all()
            try:
                while not self._sealed:
                    self._raise_if_failed_locked()
                    if self._aborted:
                        raise ProducerError(f"producer {self._producer_id!r} was aborted")
                    if not self._committer.is_alive():
                        raise ProducerError(
                            f"producer {self._producer_id!r} is closed: its commit thread "
                            f"stopped before sealing namespace {self._namespace!r}; seal with "
                            "`batchweave seal STORE NAMESPACE`"
                        )
                    self._cond.wait(
                        _event_wait(
                            deadline,
                            lambda: TimeoutError(
                                f"producer {self._producer_id!r}: sealing timed out after "
                                f"{timeout:g} s; the request is withdrawn, so namespace "
                                f"{self._namespace!r} is not sealed (unless the seal commit "
                                "already sent lands), appends are taken again and close() does "
                                "not wait for the seal: call seal() again to seal"
                            ),
                        )
                    )
            finally:
                # Given up (timed out, interrupted, failed) or done: once sealed, _sealed rules.
                # A request left behind would keep the commit loop (and so close()) retrying a
                # seal nobody waits for, and refuse appends to a namespace that is not sealed.
                self._seal_requests -= 1

    def close(self) -> None:
        """Commit everything appended (like :meth:`flush`), then stop the background threads.

        Idempotent. If a background failure happened, threads are stopped and it is raised.
        An ``append`` from another thread once ``close()`` began raises :class:`ProducerError`
        (nothing it was given is published). A producer never closed is closed as the
        interpreter exits, for at most ``EXIT_CLOSE_TIMEOUT`` seconds (``docs/producer.md``).
        """
        self._check_process()
        if self._closed:
            failure, self._exit_failure = self._exit_failure, None
            if failure is not None:  # closed by the exit hook, which could not commit it all
                raise failure
            return
        try:
            with self._lock:
                self._closing = True
                self._cond.notify_all()
            self.flush()
            # The join too: the commit loop may still be committing a seal() another thread
            # waits for, through an outage, as long as it lasts.
            self._shutdown(abort=self._error is not None)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: stop now. Waiting for the commit thread here would
            # hang for as long as the store keeps refusing commits.
            self._shutdown(abort=True)
            raise

    def abort(self) -> None:
        """Stop the background threads now, without committing what is pending.

        Uncommitted TGBs are simply not published (their objects become orphans for the
        reclaimer); a restarted producer re-produces them from ``resume_offset``. An attempt
        already in flight completes or fails on its own.
        """
        self._check_process()
        with self._lock:
            self._aborted = True
            self._cond.notify_all()
        self._shutdown(abort=True)

    def stats(self) -> ProducerStats:
        """A consistent snapshot of this producer's counters."""
        self._check_process()
        with self._lock:
            return ProducerStats(
                producer_id=self._producer_id,
                epoch=self._epoch,
                attempts=self._stats["attempts"],
                commits=self._stats["commits"],
                conflicts=self._stats["conflicts"],
                ambiguous=self._stats["ambiguous"],
                transient_errors=self._retries.count,
                tgbs_published=self._stats["tgbs_published"],
                bytes_published=self._stats["bytes_published"],
                pending=len(self._entries),
                inflight_bytes=self._inflight_bytes,
                last_fragile_window=self._last_window,
                gap=self._policy.gap,
                lag_blocked_seconds=self._lag.blocked_seconds,
                lag_blocked=self._lag.blocked > 0,
                committed_offset=self._committed_offset,
            )

    def _progress(self) -> tuple[int | None, int]:
        """What changes while this producer is in use (the last offset appended, the TGBs
        published): the exit hook waits for a ``with`` thread only while it does."""
        with self._lock:
            return self._last_appended, self._stats["tgbs_published"]

    def __enter__(self) -> Producer:
        # The thread running the block owns this producer until it leaves it: the exit hook
        # waits for a live non-daemon one rather than closing the producer under it.
        _lifetime.enter_with(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None:
                self.close()
            else:
                with self._lock:
                    # A close() begun elsewhere (another thread, the exit hook) drains what was
                    # appended; the body failed because of it ("is closing"): let it finish.
                    closing = self._closing
                if not closing:
                    # The body failed: stop without committing more and without sealing; the
                    # caller's exception propagates.
                    self.abort()
        finally:
            # Only now, closed or aborted: the exit hook must not close it during close().
            _lifetime.leave_with(self)

    def __repr__(self) -> str:
        return (
            f"Producer(namespace={self._namespace!r}, producer_id={self._producer_id!r}, "
            f"epoch={self._epoch}, store={self._store.url!r})"
        )

    def __del__(self) -> None:
        # Dropped without close() or abort(). Holding TGBs it can still commit, it stays alive
        # (resurrected) and commits them, forced as by flush(); its commit thread frees it after
        # that (_let_go). Otherwise it is freed now: its idle threads stop.
        try:
            if not self.__dict__.get("_started") or self._pid != current_pid():
                return
            link = self._link
            with link.lock:  # one section: the commit thread sees finalized and kept together
                link.finalized = True
                link.changed.notify_all()
                if self._closed:
                    return
                holding = self._error is None and not self._aborted and bool(self._entries)
                if holding and self._keep_committing():
                    return
            self._let_go()
        except Exception:
            pass  # interpreter teardown (modules half gone): never raise from __del__

    def _keep_committing(self) -> bool:
        """From ``__del__``, holding ``self._link.lock``: keep this dropped producer alive,
        committing what it holds, until its commit thread ends; ``False`` if that thread already
        ended (nothing would commit).

        Never blocks on the producer's lock (a finalizer runs wherever the collector does): a
        missed wake-up only delays the next forced attempt by one wait of the loop.
        """
        link = self._link
        if link.ended:
            return False
        self._dropped = True
        # The commit thread reaches it through the link even if the cycle collector cleared its
        # weak references before calling __del__ (and _UNCLOSED's with them).
        link.kept = self
        # Under the link's lock: the thread's _let_go (after it set ``ended``) comes later.
        _lifetime.add_busy(self)
        _lifetime.add_unclosed(self)
        if self._lock.acquire(blocking=False):
            try:
                self._cond.notify_all()
            finally:
                self._lock.release()
        return True

    def _let_go(self) -> None:
        """Free a producer dropped without ``close()``: stop its upload threads and say so
        (``ResourceWarning``). From ``__del__``, or from the commit thread once a dropped
        producer committed what it held (or failed)."""
        if self._closed:
            _lifetime.discard_busy(self)
            return  # the exit hook closed it while it was committing
        self._aborted = True  # the commit thread also ends on its own: it sees no producer
        _lifetime.discard_unclosed(self)
        self._uploads.shutdown(wait=False, cancel=True)
        left = f"; {self._pending_locked()} were not committed" if self._entries else ""
        try:
            warnings.warn(
                f"unclosed producer {self._producer_id!r} of namespace {self._namespace!r}: "
                f"call close(), or use `with bw.Producer(...) as p:`, to commit what it "
                f"appended and stop its threads{left}",
                ResourceWarning,
                stacklevel=2,
                source=self,
            )
        finally:  # a warning filter may raise it (-W error)
            _lifetime.discard_busy(self)  # last: once out of it, it was let go of

    def _check_process(self) -> None:
        """Refuse use in a fork()ed child: the threads that upload and commit are the parent's."""
        if current_pid() != self._pid:
            raise ProducerError(
                f"producer {self._producer_id!r} was created in process {self._pid} and cannot be "
                f"used in process {current_pid()}, a fork()ed child: its upload and commit threads "
                "run only in the parent, so nothing appended here would ever be committed. Create "
                "the Producer in the child process, after forking (or start workers with the "
                "'spawn' or 'forkserver' method)"
            )

    def _close_at_exit(self, deadline: float) -> BaseException | None:
        """Close this unclosed producer as the interpreter exits, by ``deadline`` (monotonic).

        Says at WARNING what it commits, and at ERROR what stays uncommitted if that fails or
        times out (the producer is then aborted). Returns the failure, if any.
        """
        if self._pid != current_pid():
            return None  # a fork()ed copy: the parent's exit closes the producer
        with self._lock:
            if self._closed:
                return None
            pending = len(self._entries)
            offsets = self._pending_locked()
            failed = self._error is not None  # what it holds cannot be committed: said below
        if pending and not failed:
            _LOG.warning(
                "producer %r of namespace %r was not closed when the interpreter began to "
                "exit: committing its %d appended but uncommitted TGBs (%s) now, for at most "
                "%g s (EXIT_CLOSE_TIMEOUT); close it before the main thread ends (use `with "
                "bw.Producer(...) as p:`; an atexit function runs too late) to see its errors",
                self._producer_id,
                self._namespace,
                pending,
                offsets,
                _lifetime.EXIT_CLOSE_TIMEOUT,
            )
        try:
            with self._lock:
                self._closing = True
                self._cond.notify_all()
            self.flush(max(0.0, deadline - time.monotonic()))
        except BaseException as exc:
            # Not waited for: a commit in flight lands or not, exactly once either way.
            self._shutdown(abort=True, join_timeout=0.0)
            with self._lock:
                left = len(self._entries)
                offsets = self._pending_locked()
                committed = self._committed_offset
            if left:
                advice = self._exit_advice(exc, 0 if committed is None else committed + 1)
                _LOG.error(
                    "producer %r of namespace %r was not closed, and committing what it had "
                    "appended failed as the interpreter exited (%s: %s): %d TGBs (%s) are NOT "
                    "committed. %s",
                    self._producer_id,
                    self._namespace,
                    type(exc).__name__,
                    exc,
                    left,
                    offsets,
                    advice,
                )
                self._exit_failure = ProducerError(
                    f"producer {self._producer_id!r} was closed as the interpreter exited, and "
                    f"{left} TGBs ({offsets}) are NOT committed. {advice}"
                )
                self._exit_failure.__cause__ = exc
            return exc
        self._shutdown(
            abort=self._error is not None, join_timeout=max(0.0, deadline - time.monotonic())
        )
        return None

    def _exit_advice(self, failure: BaseException, resume_offset: int) -> str:
        """What publishes the TGBs an unclosed producer could not commit at exit, given why."""
        if isinstance(failure, NamespaceSealed):
            return (
                f"Namespace {self._namespace!r} is sealed: no producer can publish them there; "
                "publish them in a new namespace"
            )
        if isinstance(failure, ProducerRetired):
            return (
                f"producer_id {self._producer_id!r} was retired: a producer started with it "
                "begins a new stream (resume_offset 0), so append them there again, or under "
                "another producer_id"
            )
        if isinstance(failure, ProducerFenced):
            return (
                f"A newer incarnation of producer_id {self._producer_id!r} runs: it resumes from "
                "its own resume_offset and publishes them"
            )
        return (
            f"A producer restarted with producer_id {self._producer_id!r} resumes from its "
            f"resume_offset ({resume_offset}) and publishes them"
        )

    # ------------------------------------------------------------------------------------------
    # append helpers

    def _check_usable_locked(self) -> None:
        self._raise_if_failed_locked()
        if self._closed or self._aborted:
            raise ProducerError(f"producer {self._producer_id!r} is closed")
        if self._closing:
            # close() commits what was appended when it began; a TGB appended during its drain
            # could land after the commit thread ended, and would be silently lost.
            raise ProducerError(
                f"producer {self._producer_id!r} is closing; append before close() to publish"
            )
        if self._seal_requests or self._sealed:
            raise ProducerError(
                f"producer {self._producer_id!r} sealed namespace {self._namespace!r}; "
                "no more TGBs can be appended"
            )

    def _check_offset_locked(self, offset: int) -> None:
        if self._last_appended is not None and offset <= self._last_appended:
            raise OffsetOrderError(
                f"producer {self._producer_id!r}: offset {offset} is not greater than the last "
                f"appended offset {self._last_appended}; offsets must strictly increase"
            )
        if self._committed_offset is not None and offset <= self._committed_offset:
            raise OffsetOrderError(
                f"producer {self._producer_id!r}: offset {offset} is not greater than the "
                f"committed offset {self._committed_offset}; resume from resume_offset "
                f"({self._resume_offset}) to publish each offset exactly once"
            )

    def _raise_if_failed_locked(self) -> None:
        if self._error is not None:
            # From its stored traceback each time: re-raising the object as it is would add
            # this call's frames to those of every earlier one.
            raise self._error.with_traceback(self._error_tb)

    def _store_error_locked(self, exc: BaseException) -> None:
        """Keep the first background failure (and its traceback) for the caller's next call."""
        if self._error is None:
            self._error = exc
            self._error_tb = exc.__traceback__

    def _descriptor(
        self, entry: Entry, encoded: EncodedTgb, *, validate: bool = True
    ) -> TgbDescriptor:
        """The descriptor of ``encoded``, uploaded as ``entry`` (see :func:`describe`)."""
        return describe(
            entry,
            encoded,
            producer_id=self._producer_id,
            epoch=self._epoch,
            slice_table_limit=self._slice_table_limit,
            validate=validate,
        )

    def _store_key(self, relative: str) -> str:
        return self._log.key(relative)

    # ------------------------------------------------------------------------------------------
    # uploads (pool threads)

    def _upload(
        self, entry: Entry, encoded: EncodedTgb, descriptor: TgbDescriptor | None = None
    ) -> None:
        """Upload ``entry``; ``descriptor``: validated by ``append``, else built here unchecked."""
        with self._lock:
            if entry.state != "queued":
                return  # taken back by an interrupted append(): it was never appended
            entry.state = "uploading"
        key = self._store_key(entry.key)
        attempt = failures = 0
        released = False
        try:
            while True:
                if self._aborted:
                    return
                try:
                    began = self._clock()
                    self._store.put_parts(key, encoded.parts)
                    took = measured_duration(began, self._clock())
                    self._outage.recovered()
                    break
                except RETRYABLE as exc:
                    attempt += 1
                    # An unreachable or hung store is an outage: waited out however long it
                    # lasts, keeping the TGB (append blocks on max_inflight_bytes meanwhile:
                    # memory stays bounded). A PUT that got no answer is asked about with a
                    # HEAD: landed after all, it is done; not there from a store that answers,
                    # it failed on its own (an object too large for read_timeout would time out
                    # for ever): it spends max_retries, and its lines name the key.
                    outage = is_outage(exc)
                    if outage and no_answer(exc):
                        after = self._after_no_answer(key, encoded.size)
                        if after == "landed":
                            took = measured_duration(began, self._clock())
                            self._outage.recovered()
                            break
                        outage = after == "silent"
                    failures += not outage
                    if failures > self._max_retries:
                        raise self._upload_failure(key, entry, failures, exc) from exc
                    self._retries.note(f"uploading {key!r}", exc, attempt, outage=outage)
            if descriptor is None:
                descriptor = self._descriptor(entry, encoded, validate=False)
            # One lock round and one wake-up for everything a finished upload changes.
            with self._lock:
                if self._first_upload is None:
                    self._first_upload = took
                self._policy.observe_put(took, encoded.size)
                entry.descriptor = descriptor
                self._release_locked(entry)
                released = True
                self._cond.notify_all()
        except BaseException as exc:
            if not isinstance(exc, ProducerError):
                wrapped = ProducerError(
                    f"producer {self._producer_id!r}: upload of {key!r} (offset {entry.offset}) "
                    f"failed: {exc}"
                )
                wrapped.__cause__ = exc
                exc = wrapped
            self._fail(exc)
        finally:
            if not released:
                with self._lock:
                    self._release_locked(entry)

    def _after_no_answer(self, key: str, size: int) -> str:
        """What a HEAD of ``key`` says after its PUT of ``size`` bytes got no answer (one small
        request per such retry): ``"landed"`` (the object is there, whole: a PUT is atomic, and
        only these bytes are ever written to this key), ``"failed"`` (the store answers: the
        PUT failed on its own) or ``"silent"`` (no answer either: the outage it looked like)."""
        try:
            meta = self._store.head(key)
        except RETRYABLE:
            return "silent"
        except StoreError:
            return "failed"  # not found, access denied...: an answer
        return "landed" if meta.size == size else "failed"

    def _upload_failure(
        self, key: str, entry: Entry, failures: int, exc: BaseException
    ) -> ProducerError:
        """The error an upload that failed more than ``max_retries`` times stops the producer
        with: what failed, what is left uncommitted and how to publish it."""
        with self._lock:
            pending = self._pending_locked()
            committed = self._committed_offset
        resume = 0 if committed is None else committed + 1
        return ProducerError(
            f"producer {self._producer_id!r}: upload of {key!r} (offset {entry.offset}) failed "
            f"{failures} times (max_retries={self._max_retries}); last error: "
            f"{type(exc).__name__}: {exc}. The producer stopped; uncommitted: {pending}. An "
            "upload is only ever rewritten whole, so nothing needs reading back: remove the "
            f"cause, then restart a producer with producer_id {self._producer_id!r}: it resumes "
            f"from resume_offset ({resume}) and uploads them again"
        )

    def _pause(self, seconds: float) -> None:
        """The commit loop's backoff: ``seconds`` slept in pieces, ended early by a failure or
        ``abort()`` (which joins this thread: a Ctrl-C in ``close()`` must not wait out 5 s)."""
        remaining = seconds
        while remaining > 0:
            if self._error is not None or self._aborted:
                return
            chunk = min(remaining, _TIME_WAIT_CHUNK)
            self._sleep(chunk)
            remaining -= chunk

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            self._store_error_locked(exc)
            # Nothing can commit its entries now: once dropped it is freed (its commit thread
            # ends, and frees one dropped earlier: _let_go). While it is alive, the exit hook
            # still names what it did not commit (it is in _lifetime's unclosed producers until
            # closed, aborted or freed).
            self._cond.notify_all()
        # Formatted here: a handler that keeps records (a buffer, pytest's capture) would keep
        # the exception, its traceback's frames and so this producer alive through the args.
        if isinstance(exc, ProducerFenced):
            _LOG.error("%s", str(exc))
        else:
            _LOG.error("producer %r stopped: %s", self._producer_id, str(exc))

    # ------------------------------------------------------------------------------------------
    # commit loop (one thread)

    def _commit_turn(self) -> bool | _Wait:
        """One turn of the commit loop (see ``_commit_thread``): ``False`` once it must stop,
        ``True`` after an attempt, or the ``_Wait`` to run before the next turn, returned
        holding ``self._cond``."""
        try:
            seal = self._next_work()
            if isinstance(seal, _Wait):
                return seal
            if seal is None:
                return False
            try:
                if not self._policy_started:
                    self._begin()
                    return True
                self._attempt(seal)
                self._transient_attempt = 0
                self._outage.recovered()
            except RETRYABLE as exc:
                self._transient_attempt += 1
                self._base_read_at = -math.inf  # re-read the base before retrying
                self._retries.note("committing", exc, self._transient_attempt, sleep=self._pause)
            return True
        except BaseException as exc:
            self._fail(self._commit_failure(exc))
            return False

    def _commit_failure(self, exc: BaseException) -> BaseException:
        """What a failure of the commit loop that retrying does not cure is raised as.

        A ``ProducerError`` (fenced, retired, ...), a ``NamespaceError`` (sealed, a manifest
        too large, ...), a ``FormatError`` (a damaged or rewritten manifest history) or a
        ``ValueError``/``TypeError`` (a ``backoff=`` or policy answer refused, naming it)
        already says what happened and what to do, and stays as it is. Anything else
        (``AccessDenied``, a full disk, a bug) becomes a ``ProducerError`` naming what is left
        uncommitted and how to publish it, chained to the error, like a failed upload.
        """
        if not isinstance(exc, Exception) or isinstance(
            exc, ProducerError | NamespaceError | FormatError | ValueError | TypeError
        ):
            return exc
        with self._lock:
            pending = self._pending_locked()
            committed = self._committed_offset
        resume = 0 if committed is None else committed + 1
        wrapped = ProducerError(
            f"producer {self._producer_id!r} of namespace {self._namespace!r} stopped: its "
            f"commit loop failed ({type(exc).__name__}: {exc}), which retrying does not cure; "
            f"uncommitted: {pending}. Remove the cause, then restart a producer with "
            f"producer_id {self._producer_id!r}: it resumes from resume_offset ({resume}) and "
            "publishes them"
        )
        wrapped.__cause__ = exc  # as `raise wrapped from exc` would
        return wrapped

    def _committable_locked(self, limit: int | None = None) -> list[Entry]:
        """The uploaded prefix of the pending TGBs, at most ``limit`` of them."""
        batch: list[Entry] = []
        for entry in self._entries:
            if entry.descriptor is None or (limit is not None and len(batch) >= limit):
                break
            batch.append(entry)
        return batch

    def _next_work(self) -> bool | _Wait | None:
        """Block until an attempt should start; return whether it seals, or None to stop.

        With nothing to do yet, return a ``_Wait`` still holding ``self._cond``, for the caller
        to run (without a missed wake-up) after dropping its reference to this producer, then
        call again.
        """
        self._cond.acquire()
        try:
            work = self._next_work_locked()
        except BaseException:
            self._cond.release()
            raise
        if not isinstance(work, _Wait):
            self._cond.release()
        return work

    def _next_work_locked(self) -> bool | _Wait | None:
        # What the last turn waited toward this attempt, counted first.
        pace, self._pace = self._pace or _Pace(), None
        if pace.wait_began is not None:
            waited = measured_duration(pace.wait_began, time.monotonic())
            self._waited += waited
            pace.forced_left -= waited
            pace.regular_left -= waited
            pace.wait_began = None
        elif pace.slept:
            self._waited += pace.slept
            pace.gap_waited = pace.slept_gap
            pace.forced_left -= pace.slept  # exactly 0 after the last chunk of a wait
            pace.regular_left -= pace.slept
            pace.slept = 0.0
        if self._error is not None or self._aborted:
            return None
        n = len(self._committable_locked())
        seal_now = self._seal_requests > 0 and not self._sealed and not self._entries
        if n == 0 and not seal_now:
            if (self._closing or self._dropped) and not self._entries:
                return None  # one dropped committed what it held: its thread frees it
            return _IDLE
        if not self._policy_started:
            return seal_now  # the first work: _begin() starts the policy's pacing
        # A producer dropped holding TGBs commits them as flush() would: a count-paced policy
        # waiting for more would otherwise keep them (and it) for ever.
        forced = seal_now or self._flush_waiters > 0 or self._closing or self._dropped
        gap = checked_wait(self._policy, "gap", self._policy.gap)
        # The time this loop waited is a lower bound: a clock that stands still (or one
        # stepped back, as an NTP step moves clock=time.time) must not hold attempts back.
        since = max(self._clock() - self._last_attempt_end, self._waited)
        if pace.gap_waited:
            since = max(since, gap)
        # flush()/close() end a stream: they wait only the policy's forced wait (for
        # DAC, this producer's slot, which a regular attempt would not respect).
        until_forced = checked_wait(
            self._policy,
            "forced_wait",
            self._policy.forced_wait(since, self._wall_clock(), self._rank),
        )
        self._forced_attempt = forced
        if not forced:
            pace.forced_left = math.inf  # a later flush() counts its own wait
        until_regular = None
        if not forced:
            regular = self._policy.regular_wait(since, self._wall_clock(), self._rank)
            if regular is not None:
                until_regular = checked_wait(self._policy, "regular_wait", regular)
        if forced:
            pace.forced_left = min(pace.forced_left, until_forced)
            if pace.forced_left <= 0:
                return seal_now
            remaining = pace.forced_left
        elif until_regular is not None:
            # The policy paces regular attempts itself (DAC's slots), not with ready().
            pace.regular_left = min(pace.regular_left, until_regular)
            if pace.regular_left <= 0:
                return seal_now
            remaining = pace.regular_left
        else:
            # An append blocked by max_lag counts these TGBs as visible: publish them
            # after the gap even if a count-paced policy wants more (nobody could read,
            # checkpoint past and unblock TGBs that are never committed).
            if n > 0 and (self._policy.ready(n, since) or (self._lag.blocked > 0 and since >= gap)):
                return seal_now
            remaining = gap - since
        # Waits are the caller's (see _Wait), which calls again after them, this pace kept.
        self._pace = pace
        if remaining <= 0:
            return _IDLE
        chunk = min(remaining, _TIME_WAIT_CHUNK)
        open_now = not forced and until_forced <= 0 and until_regular is None
        if open_now and self._sleep is time.sleep:
            # A flush()/close() may attempt at once whenever it comes (a lone producer, or a
            # policy without turns: no slot to catch, so nothing to poll for). On real time,
            # wait on the condition, which flush() and close() notify; an injected sleep
            # (which they cannot cut short) sleeps the chunk below.
            pace.wait_began = time.monotonic()
            return _Wait(chunk)
        if not forced and not open_now:
            # A flush()/close() arriving during this sleep (which it cannot cut short) must
            # not miss this producer's next forced slot: wake for every one and re-check, and
            # poll while inside one. A closer that slept through its slot waited up to a whole
            # regular chunk more.
            chunk = min(chunk, until_forced if until_forced > 0 else _FORCED_POLL)
        pace.slept = chunk
        pace.slept_gap = chunk == gap - since
        return _Wait(chunk, self._sleep)

    def _begin(self) -> None:
        """Start the policy's pacing when there is first something to commit.

        Start-up (the epoch commit) can precede the first data by far longer than a gap, and
        producers of one job start together: pacing from start-up would let every first gap
        expire before the first upload, and the first uploads (which finish at about the same
        time everywhere) would then trigger attempts in lock step. So the first gap counts from
        here, with ``N`` and this producer's rank among the active ids read now, when producers
        started together have all joined.
        """
        if self._base_is_old(self._clock()):
            latest = self._log.latest(self._base)
            with self._lock:
                self._adopt_locked(latest)
            self._base_read_at = self._clock()
        active = self._note_active()
        with self._lock:
            first_upload = self._first_upload or 0.0
        # The epoch commit ran before the data load began (when producers start together, the
        # store was idle), so it can underestimate W under load many times over; the first
        # upload is a PUT made under that load, a conservative seed while W is still unknown.
        self._policy.start(self._start_window, active, self._rank, loaded_window=first_upload)
        with self._lock:
            self._policy_started = True
            self._attempt_ended(self._clock())

    def _attempt_ended(self, now: float) -> None:
        """Count the gap from ``now`` (holding ``self._cond``, or before the threads start)."""
        self._last_attempt_end = now
        self._waited = 0.0

    def _base_is_old(self, now: float) -> bool:
        """Whether the base manifest was read ``refresh_age`` or longer ago (or the clock went
        back since: then its age is unknown, and it is read again)."""
        return not 0 <= now - self._base_read_at < self._refresh_age

    def _note_active(self) -> int:
        """``N`` from the newest manifest read, noting this producer's rank among those ids."""
        with self._lock:
            base = self._base
        ids = active_producer_ids(base, self._wall_clock(), self._active_horizon)
        rank = ids.index(self._producer_id) if self._producer_id in ids else None
        with self._lock:
            self._rank = rank
        return max(1, len(ids))

    def _attempt(self, seal: bool) -> None:
        # Before the window: a merge prepared long ago is written again rather than dropped.
        self._write_merge(self._log.refresh_prepared_merge, "before the next commit")
        start = self._clock()
        base = self._base
        if self._base_is_old(start):
            base = self._log.latest(base)
            self._base_read_at = self._clock()
        with self._lock:
            self._adopt_locked(base)
            base = self._base
            # At most one full segment per commit: a backlog (an outage, a slow store) drains
            # over several commits, and no roll (rewritten on every retry) grows with it.
            batch = self._committable_locked(self._log.max_segment_tgbs)
            # A seal() that gave up since _next_work withdrew its request: do not send it.
            seal = seal and self._seal_requests > 0 and not self._sealed
            if seal:
                self._seal_sent = True
        if not batch and not seal:
            return
        new_offset = batch[-1].offset if batch else self._committed_offset
        state = ProducerState(
            epoch=self._epoch,
            offset=new_offset,
            last_version=base.version + 1,
            last_commit_at=self._wall_clock(),
            source=self._committed_source,
        )
        descriptors = [e.descriptor for e in batch if e.descriptor is not None]
        result: CommitResult | None = None
        self._commit_puts.begin(self._log.key(manifest_key(base.version + 1)))
        try:
            result = self._log.commit(
                base, append=descriptors, producers={self._producer_id: state}, seal=seal
            )
        finally:
            self._commit_puts.end()
            # An attempt once its conditional PUT reached the store (not one that failed
            # writing segments or reading its base first), or lost to a reclaimed base (the PUT
            # could only have lost): ambiguous and conflicts stay within attempts.
            lost = isinstance(result, Conflict) and result.failure is None
            with self._lock:
                self._stats["attempts"] += int(self._commit_puts.reached or lost)
                self._stats["ambiguous"] += int(self._commit_puts.ambiguous)
        if isinstance(result, Conflict) and result.failure is not None:
            # The store failed the attempt (a 503, throttling): no race was lost, so it is not
            # a conflict for the stats nor for the policy (DAC would widen its gap or its slots
            # for it). _commit_turn counts it as a retried failure and backs off.
            raise result.failure
        end = self._clock()
        window = measured_duration(start, end)
        if isinstance(result, Committed):
            self._unknown_conflicts = 0
            manifest = result.manifest
            with self._lock:
                for entry in batch:
                    # A concurrent rebase (max_lag refresh) may already have dropped it.
                    if self._entries and self._entries[0] is entry:
                        self._entries.popleft()
                        self._stats["tgbs_published"] += 1
                        self._stats["bytes_published"] += entry.size
                if self._committed_offset is None or (
                    new_offset is not None and new_offset > self._committed_offset
                ):
                    self._committed_offset = new_offset
                self._stats["commits"] += 1
                if manifest.version > self._base.version:
                    self._base = manifest
                if seal:
                    self._sealed = True
                # Decided with the commit, before flush() can return and close() begin: a
                # merge is swapped in by this producer's next commit, and a closing producer
                # with nothing left has none (writing it would only delay close()).
                merge = not (self._closing and not self._entries)
                self._cond.notify_all()
            self._base_read_at = end
            committed = True
        else:
            if result.winner is None:
                # A 409, a 412 whose winner could not be read or a reclaimed base: back off
                # (jittered) so a zero-gap policy cannot spin, then rebase on the latest.
                self._unknown_conflicts += 1
                self._pause(self._rng.uniform(0.0, self._retries.backoff(self._unknown_conflicts)))
                winner = self._log.latest(base)
            else:
                self._unknown_conflicts = 0
                winner = result.winner
            self._base_read_at = self._clock()
            with self._lock:
                self._stats["conflicts"] += 1
                self._adopt_locked(winner)
            committed = merge = False
        active = self._note_active()
        self._policy.record(
            AttemptOutcome(
                committed=committed,
                fragile_window=window,
                active_producers=active,
                tgbs=len(batch),
                forced=self._forced_attempt,
                bytes_written=self._log.last_commit_bytes,
            )
        )
        with self._lock:
            self._last_window = window
            self._attempt_ended(self._clock())
        if isinstance(result, Committed) and merge:
            self._prepare_merge(result.manifest)

    def _prepare_merge(self, committed: Manifest) -> None:
        """After a commit, outside its fragile window: write the segment merge it calls for.

        An optimization only: a failure is logged, and the merge is retried after a later roll.
        """
        self._write_merge(
            functools.partial(self._log.prepare_merge, committed),
            f"after version {committed.version}",
        )

    def _write_merge(self, write: Callable[[], int], when: str) -> None:
        """Run ``write`` (a segment merge, an optimization): a store failure is only logged."""
        try:
            write()
        except RETRYABLE as exc:
            _LOG.warning(
                "producer %r: writing a segment merge %s failed (%s: %s); the segments stay "
                "unmerged until a later commit",
                self._producer_id,
                when,
                type(exc).__name__,
                exc,
            )

    def _pending_locked(self) -> str:
        """The offsets appended but not committed, for error messages."""
        if not self._entries:
            return "nothing"
        return f"offsets {self._entries[0].offset}..{self._entries[-1].offset}"

    def _raise_retired(self, manifest: Manifest) -> NoReturn:
        """Our id is gone from a manifest after our epoch commit: only retirement removes ids."""
        resume = (
            f"it had committed offsets up to {self._committed_offset}, so resume the source "
            f"after {self._committed_offset}"
            if self._committed_offset is not None
            else "it had committed nothing"
        )
        raise ProducerRetired(
            f"producer {self._producer_id!r} (epoch {self._epoch}) in namespace "
            f"{self._namespace!r} was retired: manifest version {manifest.version} no longer "
            f"lists it (retire_producers / `batchweave retire` removes ids idle for long). Stop "
            f"this process (uncommitted: {self._pending_locked()}). A new producer with this id "
            f"starts a new stream with no resume offset; {resume}"
        )

    def _adopt_locked(self, manifest: Manifest) -> None:
        """Rebase onto ``manifest``: fence, drop what it already holds for us, keep the newest."""
        state = manifest.producers.get(self._producer_id)
        if state is None:
            self._raise_retired(manifest)
        if state.epoch > self._epoch:
            raise ProducerFenced(
                f"producer {self._producer_id!r} in namespace {self._namespace!r} was fenced: "
                f"manifest version {manifest.version} records epoch {state.epoch} for it, this "
                f"incarnation has epoch {self._epoch}. A newer process with the same "
                f"producer_id has started; stop this one (uncommitted: "
                f"{self._pending_locked()}; the new incarnation resumes from its resume_offset)"
            )
        if state.offset is not None:
            dropped = 0
            dropped_bytes = 0
            while self._entries and self._entries[0].offset <= state.offset:
                entry = self._entries.popleft()
                dropped += 1
                dropped_bytes += entry.size
            if dropped:
                # An earlier attempt whose outcome looked lost did land: those TGBs are visible.
                self._stats["tgbs_published"] += dropped
                self._stats["bytes_published"] += dropped_bytes
            if self._committed_offset is None or state.offset > self._committed_offset:
                self._committed_offset = state.offset
            self._cond.notify_all()
        if manifest.version > self._base.version:
            self._base = manifest
        if manifest.sealed and not self._sealed:
            if (self._seal_requests or self._seal_sent) and not self._entries:
                self._sealed = True
                self._cond.notify_all()
            else:
                by = (
                    "perhaps by a seal() of this producer that gave up before its commit landed"
                    if self._seal_sent
                    else "by another producer, or with `batchweave seal`"
                )
                raise NamespaceSealed(
                    f"namespace {self._namespace!r} was sealed at manifest version "
                    f"{manifest.version} ({by}); "
                    f"producer {self._producer_id!r} still had {len(self._entries)} uncommitted "
                    "TGBs, which a sealed namespace cannot take: stop this producer"
                )

    # ------------------------------------------------------------------------------------------
    # max_lag (the wait itself is the LagGate's)

    def _wait_for_lag(self) -> None:
        if self._max_lag is not None:
            self._lag.wait(self._max_lag, self._visible_steps, self._rebase_on_latest)

    def _visible_steps(self) -> int:
        """Steps visible to readers once what is appended is committed; raises if unusable."""
        with self._lock:
            self._check_usable_locked()
            # Own uploads not yet committed count too: they become visible (and stored)
            # without another max_lag check.
            return self._base.next_step + len(self._entries)

    def _rebase_on_latest(self) -> None:
        """Adopt the newest manifest; what forbids adopting it is this producer's failure."""
        latest = self._log.latest(self._base)
        with self._lock:
            try:
                self._adopt_locked(latest)
            except ProducerError as exc:
                self._store_error_locked(exc)
                raise

    # ------------------------------------------------------------------------------------------
    # shutdown

    def _shutdown(self, *, abort: bool, join_timeout: float | None = None) -> None:
        """Stop the threads; ``join_timeout`` (at exit): wait at most that long for them."""
        with self._lock:
            if self._stopping == "abort" or (self._stopping == "close" and not abort):
                return
            # A close() interrupted while it joins the threads stops them again, as abort().
            self._stopping = "abort" if abort else "close"
            self._closed = True
            if abort:
                self._aborted = True
            self._closing = True
            self._cond.notify_all()
        _lifetime.discard_unclosed(self)
        _lifetime.discard_busy(self)
        if abort:
            with self._lock:
                # Uploads not started are cancelled: one a thread takes from now on does nothing.
                for entry in self._entries:
                    if entry.state == "queued":
                        entry.state = "withdrawn"
                        self._release_locked(entry)
        if threading.current_thread() is not self._committer:
            self._committer.join(join_timeout)
        self._uploads.shutdown(wait=not abort and join_timeout is None, cancel=abort)


class _Link:
    """What a commit thread holds of its producer: a weak reference, and, once ``__del__``
    kept the producer dropped holding TGBs alive, the producer itself (``kept``), until the
    thread ends (``ended``). ``finalized``: its ``__del__`` ran. All guarded by ``lock``."""

    __slots__ = ("changed", "ended", "finalized", "kept", "lock", "ref")

    def __init__(self, producer: Producer) -> None:
        self.ref = weakref.ref(producer)
        self.kept: Producer | None = None
        self.ended = False
        self.finalized = False
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        """Notified when ``__del__`` ran."""

    def get(self) -> Producer | None:
        """The producer, or ``None`` once it was freed; call holding ``lock``.

        The cycle collector clears weak references before it calls ``__del__``, which may yet
        keep the producer: until then, wait for it.
        """
        while (producer := self.kept or self.ref()) is None and not self.finalized:
            self.changed.wait()
        return producer


def _commit_thread(link: _Link) -> None:
    """The commit loop: a producer's turns, holding it only during a turn.

    Between turns it waits (``_Wait``: for an event, or for its policy's pacing) holding no
    reference to the producer, so one dropped without ``close()`` reaches ``Producer.__del__``:
    with nothing to commit it is freed, and the loop ends at its next wake-up; holding TGBs it
    is kept alive (``link.kept``) and commits them, forced, and the loop then ends and frees it
    (``Producer._let_go``).
    """
    try:
        while True:
            with link.lock:
                producer = link.get()
                if producer is None:
                    link.ended = True
                    return
            turn = producer._commit_turn()
            if isinstance(turn, _Wait):  # returned holding the condition's lock
                cond = producer._cond
                del producer
                try:
                    turn.run(cond)
                except BaseException as exc:  # an injected sleep failed: as in a turn
                    with link.lock:
                        producer = link.get()
                    if producer is not None:
                        producer._fail(producer._commit_failure(exc))
                    return
                continue
            del producer
            if not turn:
                return
    finally:
        with link.lock:
            link.ended = True
            kept, link.kept = link.kept, None
        if kept is not None:
            with contextlib.suppress(Exception):  # a ResourceWarning made an error: as __del__
                kept._let_go()

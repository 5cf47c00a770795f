"""Checkpoint-aligned lifecycle: the checkpoint hook and the reclaimer.

Data must stay until no live checkpoint can need it, and go once none can. The training loop
records a watermark after each durable checkpoint (:func:`checkpoint_hook`); the
:class:`Reclaimer` raises the manifest's ``base_step`` to the minimum watermark step through the
normal commit protocol and deletes what nothing can read any more. Every decision is a function of
what the store holds and of the clock, so a reclaimer killed at any point and started again
finishes the job; see ``docs/lifecycle.md`` for the algorithm and the safety argument.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from batchweave._checks import as_count, as_int, as_seconds, check_namespace, check_store
from batchweave._errors import (
    NamespaceNotFound,
    ObjectNotFound,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
)
from batchweave._manifest._log import (
    MANIFESTS_DIR,
    PROBE_TRUST_SECONDS,
    CommitResult,
    ManifestLog,
    commit_until,
    manifest_key,
)
from batchweave._manifest._models import Manifest, SegmentRef
from batchweave._manifest._segments import SEGMENTS_DIR, find_segment
from batchweave._store._base import ObjectMeta, ObjectStore
from batchweave._watermarks import (
    Watermark,
    Watermarks,
    validate_checkpoint_id,
)

__all__ = [
    "DATA_DIR",
    "ReclaimProgress",
    "ReclaimReport",
    "Reclaimer",
    "Resumable",
    "checkpoint_hook",
]

_log = logging.getLogger("batchweave.lifecycle")

DATA_DIR = "data"

METADATA_MIN_GRACE = 2 * PROBE_TRUST_SECONDS
"""The least time manifest versions and segments are kept after they stop being needed,
whatever the reclaimer's ``grace``.

Readers rely on it: ``ManifestLog.latest(known)`` trusts a missing ``known.version + 1`` for a
``known`` younger than ``PROBE_TRUST_SECONDS``, and a producer may swap in a merge prepared up
to ``PREPARED_MERGE_MAX_AGE`` earlier. Both hold only while such metadata outlives them. It is
kilobytes, so a short ``grace`` (seconds, to recycle data quickly in tests and demos) applies to
data objects alone and cannot make readers miss versions.
"""

_PROGRESS_EVERY = 1000
"""Listed keys between two progress reports (one LIST page of S3)."""

_OWN_KEYS = re.compile(
    rf"{DATA_DIR}/[^/]+/\d+/\d{{20}}-[0-9a-f]{{32}}\.tgb|{SEGMENTS_DIR}/\d{{20}}-[0-9a-f]{{32}}\.seg"
)
"""Names of the data and segment objects BatchWeave writes. Unreferenced objects are deleted
only if they match: another tool's files under the namespace are never touched."""


class Resumable(Protocol):
    """What :func:`checkpoint_hook` needs: a :class:`~batchweave.Consumer` or a
    ``batchweave.torch.WeaveLoader``."""

    def resume_tgb_step(self, state: Mapping[str, Any] | None = None) -> int:
        """The first TGB step resuming from ``state`` (default: the current state) reads."""
        ...

    @property
    def manifest_version(self) -> int | None:
        """The newest manifest version read, or ``None`` (the latest is recorded then)."""
        ...


def checkpoint_hook(
    consumer: Resumable,
    watermarks: Watermarks,
    checkpoint_id: str,
    *,
    state: Mapping[str, Any] | None = None,
    rank: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Watermark | None:
    """Record the watermark of a checkpoint that was just written successfully.

    Call it once per checkpoint on every rank, after the checkpoint is durable; only rank 0
    (``rank``, an int, else the ``RANK`` environment variable, else 0) writes, the others return
    ``None``; a ``rank`` that is no integer (``"0"`` read from the environment) is a
    ``TypeError`` rather than a rank that never writes. The watermark's step is the manifest
    step that resuming from the consumer's state reads first: pass the ``state`` that went into
    the checkpoint if the loop may have advanced the consumer since (asynchronous
    checkpointing); by default the consumer's current state is used. ``consumer`` may also be a
    ``batchweave.torch.WeaveLoader`` (anything with ``resume_tgb_step`` and
    ``manifest_version``). Returns the recorded :class:`Watermark` on rank 0.

    Call it again right after restoring a checkpoint (``consumer.load_state_dict(state)``, then
    this hook with that ``state``): a process killed between writing the checkpoint and this
    call left that checkpoint without a watermark, and producers with a ``max_lag`` below two
    checkpoint intervals would block until the next checkpoint, which needs the steps they
    hold back. For a checkpoint whose watermark was recorded, the call writes the same one again.

    A consumer of another namespace than ``watermarks`` is a ``ValueError`` on every rank: its
    step and version mean nothing there, and such a watermark would hold (or free) the wrong data.
    So is a ``checkpoint_id`` that is no safe key segment (a ``TypeError`` if it is no ``str``).
    """
    # On every rank, like the checks below: rank 0 alone raising would leave the others waiting
    # for it at the next collective.
    validate_checkpoint_id(checkpoint_id)
    namespace = getattr(consumer, "namespace", None)
    if namespace is not None and namespace != watermarks.namespace:
        raise ValueError(
            f"checkpoint_hook: the consumer reads namespace {namespace!r} but the watermarks are "
            f"for {watermarks.namespace!r}; pass Watermarks(store, {namespace!r})"
        )
    if rank is None:
        env = os.environ if environ is None else environ
        raw = env.get("RANK", "0")
        try:
            rank = int(raw)
        except ValueError:
            raise ValueError(f"RANK={raw!r} is not an integer; pass rank= explicitly") from None
    else:
        # A string (os.environ["RANK"] passed on) is refused: "0" != 0, so rank 0 would
        # silently record nothing and reclamation would never see this checkpoint.
        rank = as_int("rank", rank)
    if rank != 0:
        return None
    step = consumer.resume_tgb_step(state)
    return watermarks.record(checkpoint_id, step, version=consumer.manifest_version)


@dataclass(frozen=True)
class ReclaimReport:
    """What one :meth:`Reclaimer.run_once` pass did."""

    boundary: int
    """Minimum step over live watermarks (0: none, nothing reclaimable)."""
    watermarks: int
    """Live watermarks seen."""
    base_step_before: int
    base_step_after: int
    latest_version: int
    """Newest manifest version after the pass (-1 when the namespace does not exist)."""
    tgbs_deleted: int = 0
    """TGB objects of steps below ``base_step_after`` deleted."""
    tgb_bytes_deleted: int = 0
    orphans_deleted: int = 0
    """Data objects no manifest references, older than the grace period (crashed producers)."""
    orphan_bytes_deleted: int = 0
    segments_deleted: int = 0
    segment_bytes_deleted: int = 0
    manifests_deleted: int = 0
    manifest_bytes_deleted: int = 0
    commit_conflicts: int = 0
    """Lost races while committing the new ``base_step`` (retried)."""
    seconds: float = 0.0
    keys_listed: int = 0
    """Keys the pass listed (manifests, data and segments): most of a large pass's time."""

    @property
    def objects_deleted(self) -> int:
        """Every object deleted by the pass."""
        return (
            self.tgbs_deleted
            + self.orphans_deleted
            + self.segments_deleted
            + self.manifests_deleted
        )

    @property
    def bytes_deleted(self) -> int:
        """Bytes of every object deleted by the pass."""
        return (
            self.tgb_bytes_deleted
            + self.orphan_bytes_deleted
            + self.segment_bytes_deleted
            + self.manifest_bytes_deleted
        )


@dataclass(frozen=True)
class ReclaimProgress:
    """A snapshot of a running :meth:`Reclaimer.run_once` pass, for progress displays.

    A pass on a large namespace is mostly LIST requests and 1,000-key batch deletes and can
    take minutes; the reclaimer's ``progress`` callback receives one of these when a phase
    begins, every 1,000 keys listed, after every delete request and when the pass ends.
    """

    phase: str
    """What the pass is doing: ``"reading watermarks"``, ``"committing base_step"``,
    ``"listing _manifests/"``, ``"reading manifests"``, ``"listing data/"``,
    ``"deleting TGBs"``, ``"deleting orphans"``, ``"listing _segments/"``,
    ``"deleting segments"``, ``"deleting manifests"``, then ``"done"``."""
    keys_listed: int
    """Keys listed so far in this pass (every prefix)."""
    objects_deleted: int
    """Objects deleted so far in this pass (every kind)."""
    bytes_deleted: int
    """Bytes of the objects deleted so far."""
    phase_done: int = 0
    """Objects of a deleting phase handled so far (deleted, or refused by the store)."""
    phase_total: int | None = None
    """Objects a deleting phase will handle (``None`` while listing or reading: unknown)."""
    seconds: float = 0.0
    """Time since the pass began, by the reclaimer's clock."""


class _Pass:
    """The counts of one pass, and the progress reports made from them."""

    def __init__(
        self, clock: Callable[[], float], callback: Callable[[ReclaimProgress], None] | None
    ) -> None:
        self.counts: dict[str, int] = {}
        self.listed = 0
        self.objects = 0
        self.bytes = 0
        self.phase = "reading watermarks"
        self.phase_done = 0
        self.phase_total: int | None = None
        self._clock = clock
        self._callback = callback
        self.started = clock()

    def seconds(self) -> float:
        return self._clock() - self.started

    def begin(self, phase: str, total: int | None = None) -> None:
        self.phase, self.phase_done, self.phase_total = phase, 0, total
        self.report()

    def listed_one(self) -> None:
        self.listed += 1
        if self.listed % _PROGRESS_EVERY == 0:
            self.report()

    def handled(self, kind: str, deleted: Iterable[ObjectMeta], count: int) -> None:
        """``count`` objects of the current phase were handled; ``deleted`` of them went."""
        for meta in deleted:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.counts[f"{kind}_bytes"] = self.counts.get(f"{kind}_bytes", 0) + meta.size
            self.objects += 1
            self.bytes += meta.size
        self.phase_done += count
        self.report()

    def report(self) -> None:
        if self._callback is not None:
            self._callback(
                ReclaimProgress(
                    phase=self.phase,
                    keys_listed=self.listed,
                    objects_deleted=self.objects,
                    bytes_deleted=self.bytes,
                    phase_done=self.phase_done,
                    phase_total=self.phase_total,
                    seconds=self.seconds(),
                )
            )


class Reclaimer:
    """Deletes what no live checkpoint can need; run it on rank 0 or as ``batchweave reclaim``.

    One :meth:`run_once` pass:

    1. reads the watermarks; the boundary ``b`` is their minimum step (0 without any);
    2. commits a manifest with ``base_step = b`` through the normal commit protocol (a lost race
       is retried on the winner), so consumers and producers see the cut;
    3. deletes the TGB objects of steps below ``base_step`` (found in the manifest version the
       cut was committed on, or after a crash in the newest surviving version below the cut);
    4. deletes *orphans*: data objects the latest manifest does not reference, last modified more
       than ``grace`` seconds ago (uploads of crashed producers, leftovers of a crashed pass);
       objects not named the way BatchWeave names its own (another tool's files) are left alone;
    5. deletes segment objects referenced neither by the latest manifest nor by the version that
       was latest ``metadata_grace`` seconds ago, and older than ``2 * metadata_grace``;
    6. deletes manifest versions, oldest first, that were superseded more than
       ``metadata_grace`` seconds ago and lie below the oldest live watermark's version; never
       the latest.

    ``grace`` must exceed the longest time a producer may take from uploading a TGB to
    committing it. Manifest versions and segments (kilobytes) are kept ``metadata_grace``:
    ``grace``, but at least ``METADATA_MIN_GRACE`` (120 s), which readers and producers rely on,
    so a short ``grace`` recycles data quickly without making anyone miss versions; it must be
    more than twice the producers' ``refresh_age`` (see ``docs/lifecycle.md``). ``clock`` must
    be comparable with the store's ``last_modified`` (wall-clock seconds); ``sleep`` paces
    commit retries and watermark listings retaken after a release. ``delete_batch`` bounds the
    keys per delete request (SeaweedFS refuses more than 1,000). ``progress``, if given,
    receives a :class:`ReclaimProgress` as each pass goes (on the pass's thread; an exception it
    raises stops the pass, which is safe: a pass may stop anywhere and the next one finishes the
    job).
    """

    def __init__(
        self,
        store: ObjectStore,
        namespace: str,
        *,
        grace: float = 600.0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        max_commit_attempts: int = 50,
        delete_batch: int = 1000,
        log: ManifestLog | None = None,
        progress: Callable[[ReclaimProgress], None] | None = None,
    ) -> None:
        # Every argument is checked here, before any request: delete_batch=2.5 failed only at
        # the pass's first delete, after the pass had committed its cut.
        check_store(store)
        check_namespace(namespace)
        grace = as_seconds("grace", grace)
        max_commit_attempts = as_count("max_commit_attempts", max_commit_attempts, 1)
        delete_batch = as_count("delete_batch", delete_batch, 1)
        if progress is not None and not callable(progress):
            raise TypeError(
                f"progress must be a callable taking a ReclaimProgress, or None, got the "
                f"{type(progress).__name__} {progress!r}"
            )
        if grace < METADATA_MIN_GRACE:
            _log.warning(
                "Reclaimer grace %.0f s is below %.0f s: a TGB a producer holds longer than that "
                "between its upload and its commit (through a store outage, say) is deleted as "
                "an orphan, and its step cannot be read; use a longer grace outside tests",
                grace,
                METADATA_MIN_GRACE,
            )
        self.store = store
        self.namespace = namespace
        self.grace = grace
        self.metadata_grace = max(grace, METADATA_MIN_GRACE)
        """The grace for manifest versions and segments: ``grace``, but never below
        ``METADATA_MIN_GRACE``."""
        self._clock = clock
        self._sleep = sleep
        self._max_commit_attempts = max_commit_attempts
        self._delete_batch = delete_batch
        self._log = log if log is not None else ManifestLog(store, namespace, clock=clock)
        self._watermarks = Watermarks(store, namespace, clock=clock, sleep=sleep)
        self.progress = progress
        """Called with a :class:`ReclaimProgress` as each pass goes (``None``: not reported)."""
        self._rng = random.Random()
        self._swept_below: int | None = None
        """A base_step whose lower steps this instance already deleted (skip finding them)."""
        self._known: Manifest | None = None
        """The latest manifest of the previous pass: the next pass lists only the versions after
        it (``_find_latest``) instead of every retained version twice."""
        self._segment_keys: dict[str, tuple[SegmentRef, int, tuple[tuple[str, ...], ...]]] = {}
        """The data keys of each step of the segments the latest manifest lists, by segment key:
        (the reference they were read through, the first step kept, each step's keys from it).
        A segment is immutable, so a pass reads only the segments added since the previous one
        (the log's cache of decoded segments is bounded, and a long retained window exceeds
        it). Keys are a few short strings per step, a small part of a decoded descriptor
        (about 4 KB at ``dp=2``); segments the latest no longer lists are forgotten."""
        self._refused: list[StoreError] = []
        """Deletions the store refused during the current pass (raised at its end)."""
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.last_report: ReclaimReport | None = None
        self.last_error: BaseException | None = None

    def __repr__(self) -> str:
        return f"Reclaimer({self.store.url!r}, {self.namespace!r}, grace={self.grace})"

    # -- background thread ---------------------------------------------------------------------

    def start(self, interval: float) -> None:
        """Run :meth:`run_once` every ``interval`` seconds in a daemon thread until :meth:`stop`.

        A failing pass is logged and kept in ``last_error``; the next pass retries (reclamation
        is off the critical path: a failure delays it, never affects training).
        """
        # A string, NaN (a loop without pauses) or inf (OverflowError in the thread) is refused
        # here, not found by the thread after its first pass.
        interval = as_seconds("interval", interval)
        if not 0 < interval <= threading.TIMEOUT_MAX:
            raise ValueError(
                f"interval must be > 0 and at most {threading.TIMEOUT_MAX:.0f} seconds, "
                f"got {interval}"
            )
        if self._thread is not None:
            raise RuntimeError(f"{self!r} is already running")
        # A fresh event per thread: a loop whose stop() timed out mid-pass must still end after
        # that pass, even when start() is called again meanwhile.
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._loop, args=(interval, self._stop), name="batchweave-reclaimer", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop the background thread after its current pass. Idempotent.

        ``timeout``: seconds to wait for that pass to end (``None``: until it ends).
        """
        if timeout is not None:
            # Checked before the thread is told to stop: join() would refuse it only after.
            timeout = as_seconds("timeout", timeout)
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def __enter__(self) -> Reclaimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _loop(self, interval: float, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                self.run_once()
                self.last_error = None
            except Exception as exc:
                self.last_error = exc
                _log.warning("%r: pass failed, retrying in %.1f s: %s", self, interval, exc)
            stop.wait(interval)

    # -- one pass ------------------------------------------------------------------------------

    def run_once(self) -> ReclaimReport:
        """Reclaim everything no live checkpoint can need; see the class docstring."""
        with self._lock:
            return self._run_once()

    def _run_once(self) -> ReclaimReport:
        self._refused = []
        tally = _Pass(self._clock, self.progress)
        tally.report()
        marks = self._watermarks.live()
        boundary = marks[0].step if marks else 0
        try:
            latest = self._find_latest()
        except NamespaceNotFound:
            return self._no_namespace(boundary, marks, tally)
        before = latest.base_step
        tally.begin("committing base_step")
        latest, cut_from, conflicts = self._commit_boundary(latest, boundary)
        self._known = latest
        now = self._clock()
        versions = self._list(f"{MANIFESTS_DIR}/", tally)
        numbered = sorted((v, meta) for meta in versions if (v := _version_of(meta)) is not None)
        if not numbered:
            # The latest version is never deleted, so a namespace has at least one: the prefix
            # was deleted since ``_find_latest`` found the latest. Nothing is deleted on such a
            # view.
            self._known = None
            return self._no_namespace(boundary, marks, tally)
        self._delete_data(latest, cut_from, numbered, now, tally)
        settled = self._settled_version(numbered, now)
        self._delete_segments(latest, settled, now, tally)
        if marks:
            floor = min(min(m.version for m in marks), latest.version)
            if settled is not None:
                self._delete_manifests(numbered, min(floor, settled.version), tally)
        c = tally.counts
        report = ReclaimReport(
            boundary=boundary,
            watermarks=len(marks),
            base_step_before=before,
            base_step_after=latest.base_step,
            latest_version=latest.version,
            tgbs_deleted=c.get("tgb", 0),
            tgb_bytes_deleted=c.get("tgb_bytes", 0),
            orphans_deleted=c.get("orphan", 0),
            orphan_bytes_deleted=c.get("orphan_bytes", 0),
            segments_deleted=c.get("segment", 0),
            segment_bytes_deleted=c.get("segment_bytes", 0),
            manifests_deleted=c.get("manifest", 0),
            manifest_bytes_deleted=c.get("manifest_bytes", 0),
            commit_conflicts=conflicts,
            seconds=tally.seconds(),
            keys_listed=tally.listed,
        )
        self.last_report = report
        try:
            tally.begin("done")
        finally:
            # Keys the store refused are what the operator must act on: that error wins over
            # one raised by the progress callback.
            if self._refused:
                first = self._refused[0]
                raise type(first)(
                    f"{self.store.url}/{self.namespace}: the store refused to delete "
                    f"{len(self._refused)} objects (first: {first}); the rest of the pass went "
                    f"on ({report.objects_deleted} objects deleted, base_step "
                    f"{latest.base_step}). Fix the permissions (or object lock) on those keys; "
                    "the next pass retries them"
                ) from first
        # A pass that changed nothing is routine for a background reclaimer: not worth INFO.
        changed = report.objects_deleted or before != latest.base_step
        _log.log(
            logging.INFO if changed else logging.DEBUG,
            "%s/%s: reclaim pass done in %.1f s: base_step %d -> %d (boundary %d, %d "
            "watermarks); listed %d keys; deleted %d TGB objects, %d orphans, %d segments, "
            "%d manifests (%d bytes)",
            self.store.url,
            self.namespace,
            report.seconds,
            before,
            latest.base_step,
            boundary,
            report.watermarks,
            report.keys_listed,
            report.tgbs_deleted,
            report.orphans_deleted,
            report.segments_deleted,
            report.manifests_deleted,
            report.bytes_deleted,
        )
        return report

    def _find_latest(self) -> Manifest:
        """The newest manifest version, for the cut.

        The first pass finds it with a LIST of ``_manifests/``; later ones start from the
        previous pass's latest (``ManifestLog.latest_from``): a LIST of the versions after it and
        one GET, of the newest listed or, when none is, of that version itself to confirm it is
        still there as the same commit. So a pass lists every retained version once (after the
        cut, below), not twice, trusts no clock, and never goes on with a manifest that is gone:
        a prefix deleted and re-created meanwhile is ``NamespaceMismatch`` (re-created) or
        ``NamespaceNotFound`` (deleted) before anything is committed or deleted.
        """
        try:
            return self._log.latest_from(self._known)
        except NamespaceNotFound:
            self._known = None
            raise

    def _no_namespace(self, boundary: int, marks: list[Watermark], tally: _Pass) -> ReclaimReport:
        """End a pass that found no manifest version (the namespace does not exist)."""
        self.last_report = ReclaimReport(
            boundary=boundary,
            watermarks=len(marks),
            base_step_before=0,
            base_step_after=0,
            latest_version=-1,
            seconds=tally.seconds(),
            keys_listed=tally.listed,
        )
        tally.begin("done")
        return self.last_report

    def _commit_boundary(
        self, latest: Manifest, boundary: int
    ) -> tuple[Manifest, Manifest | None, int]:
        """Commit ``base_step = boundary`` (capped at the committed steps); retry lost races.

        Returns the newest manifest, the version the cut was committed on (``None`` if no commit
        was needed) and the number of conflicts.
        """

        def cut(manifest: Manifest) -> CommitResult | None:
            target = min(boundary, manifest.next_step)
            if target <= manifest.base_step:
                return None
            return self._log.commit(manifest, base_step=target)

        settled = commit_until(
            self._log,
            latest,
            cut,
            what=f"base_step {boundary}",
            attempts=self._max_commit_attempts,
            sleep=self._sleep,
            rng=self._rng,
        )
        if settled.parent is not None:
            _log.debug(
                "committed base_step %d as version %d",
                settled.manifest.base_step,
                settled.manifest.version,
            )
        return settled.manifest, settled.parent, settled.conflicts

    # -- data ----------------------------------------------------------------------------------

    def _delete_data(
        self,
        latest: Manifest,
        cut_from: Manifest | None,
        numbered: list[tuple[int, ObjectMeta]],
        now: float,
        tally: _Pass,
    ) -> None:
        tally.begin("reading manifests")
        live = self._live_keys(latest)
        below: set[str] = set()
        if self._swept_below != latest.base_step:
            source = cut_from or self._newest_below(numbered, latest)
            if source is not None:
                below = self._keys_below(source, latest.base_step)
        listed = {ref.key for ref in latest.segments if ref.end_step > latest.base_step}
        self._segment_keys = {k: v for k, v in self._segment_keys.items() if k in listed}
        reclaimed: list[ObjectMeta] = []
        orphans: list[ObjectMeta] = []
        cutoff = now - self.grace
        for meta in self._list(f"{DATA_DIR}/", tally):
            rel = self._relative(meta.key)
            if rel in live:
                continue
            if rel in below:
                reclaimed.append(meta)
            elif meta.last_modified <= cutoff and _OWN_KEYS.fullmatch(rel):
                orphans.append(meta)
        refused = len(self._refused)
        tally.begin("deleting TGBs", len(reclaimed))
        self._delete(reclaimed, "tgb", tally)
        tally.begin("deleting orphans", len(orphans))
        orphans = self._delete(orphans, "orphan", tally)
        for meta in orphans:
            _log.info("deleted orphan %r (%d bytes, unreferenced)", meta.key, meta.size)
        if len(self._refused) == refused:
            self._swept_below = latest.base_step

    def _live_keys(self, latest: Manifest) -> set[str]:
        """Data keys of ``latest``'s steps; a segment it lists that is missing stops the pass
        (nothing is deleted without knowing what is live) with an error naming it."""
        live: set[str] = set()
        unread = latest.base_step
        try:
            for step, keys in self._step_keys(latest, latest.base_step, latest.next_step):
                live.update(keys)
                unread = step + 1
        except ObjectNotFound as exc:
            ref = find_segment(latest.segments, unread)
            raise ObjectNotFound(
                f"namespace {self.namespace!r} in {self.store.url}: "
                f"{self._log.missing_segment(latest, ref)}. This pass deletes nothing"
            ) from exc
        return live

    def _step_keys(
        self, manifest: Manifest, start: int, stop: int
    ) -> Iterator[tuple[int, tuple[str, ...]]]:
        """``(step, data keys of its TGB)`` for steps ``start .. stop-1`` of ``manifest``; a
        segment whose keys ``_segment_keys`` holds (read through an equal reference) is not
        read again."""
        step = start
        while step < stop:
            if step >= manifest.tail_start:
                for s, desc in self._log.descriptors(manifest, step, stop):
                    yield s, tuple(ref.key for ref in desc.objects)
                return
            ref = find_segment(manifest.segments, step)
            cached = self._segment_keys.get(ref.key)
            if cached is None or cached[0] != ref or cached[1] > step:
                # The whole segment is downloaded either way: keep the keys of all its steps.
                keys = tuple(
                    tuple(obj.key for obj in desc.objects)
                    for _, desc in self._log.descriptors(manifest, step, ref.end_step)
                )
                cached = self._segment_keys[ref.key] = (ref, step, keys)
            _, first, keys = cached
            end = min(stop, ref.end_step)
            for s in range(step, end):
                yield s, keys[s - first]
            step = end

    def _newest_below(
        self, numbered: list[tuple[int, ObjectMeta]], latest: Manifest
    ) -> Manifest | None:
        """The newest surviving version with a lower ``base_step`` than ``latest`` (a crashed
        pass's cut was committed on it). ``base_step`` never decreases with the version, so a
        binary search costs O(log versions) reads."""
        versions = [v for v, _ in numbered if v < latest.version]
        found: Manifest | None = None
        lo, hi = 0, len(versions)
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                manifest = self._log.read(versions[mid])
            except ObjectNotFound:
                return found  # reclaimed meanwhile: the orphan rule covers what is left
            if manifest.base_step < latest.base_step:
                found, lo = manifest, mid + 1
            else:
                hi = mid
        return found

    def _keys_below(self, source: Manifest, base_step: int) -> set[str]:
        """Data keys of ``source``'s steps below ``base_step`` (best effort: a segment reclaimed
        by an earlier pass leaves its objects to the orphan rule)."""
        keys: set[str] = set()
        stop = min(base_step, source.next_step)
        try:
            for _, step_keys in self._step_keys(source, source.base_step, stop):
                keys.update(step_keys)
        except ObjectNotFound as exc:
            _log.info(
                "cannot list steps below %d in version %d: %s", base_step, source.version, exc
            )
        return keys

    # -- segments and manifests ----------------------------------------------------------------

    def _settled_version(
        self, numbered: list[tuple[int, ObjectMeta]], now: float
    ) -> Manifest | None:
        """The version that was latest ``metadata_grace`` seconds ago (newest written before
        then)."""
        cutoff = now - self.metadata_grace
        old = [v for v, meta in numbered if meta.last_modified <= cutoff]
        version = max(old) if old else None
        if version is None:
            return None
        try:
            return self._log.read(version)
        except ObjectNotFound:
            return None

    def _delete_segments(
        self, latest: Manifest, settled: Manifest | None, now: float, tally: _Pass
    ) -> None:
        if settled is None:
            return  # no version is old enough to tell what readers may still hold
        keep = {ref.key for ref in latest.segments} | {ref.key for ref in settled.segments}
        cutoff = now - 2 * self.metadata_grace
        doomed = [
            meta
            for meta in self._list(f"{SEGMENTS_DIR}/", tally)
            if self._relative(meta.key) not in keep
            and meta.last_modified <= cutoff
            and _OWN_KEYS.fullmatch(self._relative(meta.key))
        ]
        tally.begin("deleting segments", len(doomed))
        self._delete(doomed, "segment", tally)

    def _delete_manifests(
        self, numbered: list[tuple[int, ObjectMeta]], below: int, tally: _Pass
    ) -> None:
        """Delete versions below ``below`` one at a time, oldest first: the survivors always
        form a suffix of history, so a writer whose base survives also finds its successor."""
        doomed = [meta for version, meta in numbered if version < below]
        tally.begin("deleting manifests", len(doomed))
        for meta in doomed:
            if not self._delete([meta], "manifest", tally):
                break  # never delete a newer version while an older one survives

    # -- helpers -------------------------------------------------------------------------------

    def _list(self, relative_prefix: str, tally: _Pass) -> list[ObjectMeta]:
        tally.begin(f"listing {relative_prefix}")
        metas: list[ObjectMeta] = []
        for meta in self.store.list(f"{self.namespace}/{relative_prefix}"):
            metas.append(meta)
            tally.listed_one()
        tally.report()
        return metas

    def _relative(self, key: str) -> str:
        return key[len(self.namespace) + 1 :]

    def _delete(self, metas: list[ObjectMeta], kind: str, tally: _Pass) -> list[ObjectMeta]:
        """Delete ``metas`` in batches, count them in ``tally`` as ``kind`` and return those
        deleted.

        A batch the store refuses (permission denied on some keys, an object lock) is retried
        key by key, and the keys still refused are skipped and recorded, so one undeletable
        object does not stop the whole pass; the pass raises at its end. An unreachable or
        failing store (``StoreUnavailable``, ``TransientStoreError``) stops the pass at once.
        """
        deleted: list[ObjectMeta] = []
        for i in range(0, len(metas), self._delete_batch):
            chunk = metas[i : i + self._delete_batch]
            try:
                self.store.delete_many([m.key for m in chunk])
            except (StoreUnavailable, TransientStoreError):
                raise
            except StoreError:
                for meta in chunk:
                    try:
                        self.store.delete_many([meta.key])
                    except (StoreUnavailable, TransientStoreError):
                        raise
                    except StoreError as exc:
                        level = logging.WARNING if not self._refused else logging.DEBUG
                        _log.log(level, "cannot delete %r, skipping it: %s", meta.key, exc)
                        self._refused.append(exc)
                        tally.handled(kind, (), 1)
                    else:
                        deleted.append(meta)
                        tally.handled(kind, (meta,), 1)
            else:
                deleted.extend(chunk)
                tally.handled(kind, chunk, len(chunk))
        return deleted


def _version_of(meta: ObjectMeta) -> int | None:
    name = meta.key.rsplit("/", 1)[-1]
    digits = name[:20]
    if digits.isdigit() and meta.key.endswith(manifest_key(int(digits))):
        return int(digits)
    return None

"""The reclaimer: raises ``base_step`` to the minimum watermark step, deletes what no live
checkpoint can need.

The :class:`Reclaimer` decides what goes, from the data keys the manifests reference
(``StepKeys``, ``_keys.py``); a ``Sweep`` (``_sweep.py``) lists, deletes and reports progress.
Every decision is a function of what the store holds and of the clock, so a reclaimer killed at
any point and started again finishes the job; see ``docs/lifecycle.md`` for the algorithm and
the safety argument.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from batchweave._checks import as_count, as_seconds, check_callable, check_namespace, check_store
from batchweave._errors import (
    FormatError,
    NamespaceNotFound,
    ObjectNotFound,
    UnsupportedFormatVersion,
)
from batchweave._lifecycle._keys import StepKeys
from batchweave._lifecycle._sweep import ReclaimProgress, Sweep
from batchweave._manifest._log import (
    MANIFESTS_DIR,
    PROBE_TRUST_SECONDS,
    CommitResult,
    ManifestLog,
    commit_until,
    manifest_key,
)
from batchweave._manifest._models import Manifest
from batchweave._manifest._segments import SEGMENTS_DIR
from batchweave._store._base import ObjectMeta, ObjectStore
from batchweave._watermarks import Watermark, Watermarks

__all__ = ["DATA_DIR", "METADATA_MIN_GRACE", "ReclaimReport", "Reclaimer"]

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

_OWN_KEYS = re.compile(
    rf"{DATA_DIR}/[^/]+/\d+/\d{{20}}-[0-9a-f]{{32}}\.tgb|{SEGMENTS_DIR}/\d{{20}}-[0-9a-f]{{32}}\.seg"
)
"""Names of the data and segment objects BatchWeave writes. Unreferenced objects are deleted
only if they match: another tool's files under the namespace are never touched."""


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
    damaged_versions: int = 0
    """Old manifest versions the pass had to read but could not decode (bit rot, a partial
    restore), skipped with a WARNING naming each: run ``batchweave verify``."""
    damaged_segments: int = 0
    """Segments of steps below the cut the pass had to read but could not decode (bit rot, a
    partial restore), skipped with a WARNING naming each (the objects of their steps are
    deleted as orphans once older than ``grace``): run ``batchweave verify``."""

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


class Reclaimer:
    """Deletes what no live checkpoint can need; run it on rank 0 or as ``batchweave reclaim``.

    One :meth:`run_once` pass:

    1. reads the watermarks; the boundary ``b`` is their minimum step (0 without any); a
       watermark past the namespace's newest version (a history that went back: an older
       backup of ``_manifests/`` restored) stops the pass, a :class:`FormatError`;
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
        check_callable("clock", clock, "time.time")
        check_callable("sleep", sleep, "time.sleep")
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
        self._keys = StepKeys(self._log, f"namespace {namespace!r} in {store.url}")
        self._watermarks = Watermarks(store, namespace, clock=clock, sleep=sleep)
        self.progress = progress
        """Called with a :class:`ReclaimProgress` as each pass goes (``None``: not reported)."""
        self._rng = random.Random()
        self._swept_below: int | None = None
        """A base_step whose lower steps this instance already deleted (skip finding them)."""
        self._known: Manifest | None = None
        """The latest manifest of the previous pass: the next pass lists only the versions after
        it (``_find_latest``) instead of every retained version twice."""
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
        interval = as_seconds("interval", interval, positive=True)
        if interval > threading.TIMEOUT_MAX:
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
        sweep = Sweep(self.store, self.namespace, self._delete_batch, self.progress)
        sweep.begin("reading watermarks")
        marks = self._watermarks.live()
        boundary = marks[0].step if marks else 0
        try:
            latest = self._find_latest()
        except NamespaceNotFound:
            return self._no_namespace(boundary, marks, sweep)
        latest = self._refuse_marks_from_lost_history(marks, latest)
        before = latest.base_step
        sweep.begin("committing base_step")
        latest, cut_from, conflicts = self._commit_boundary(latest, boundary)
        self._known = latest
        now = self._clock()
        versions = sweep.list_prefix(f"{MANIFESTS_DIR}/")
        numbered = sorted(
            ((v, meta) for meta in versions if (v := self._version_of(meta)) is not None),
            key=lambda item: item[0],  # one key per version: never compare the ObjectMetas
        )
        if not numbered:
            # The latest version is never deleted, so a namespace has at least one: the prefix
            # was deleted since ``_find_latest`` found the latest. Nothing is deleted on such a
            # view.
            self._known = None
            return self._no_namespace(boundary, marks, sweep)
        damaged: list[str] = []
        damaged_segments: list[str] = []

        def what_it_did() -> ReclaimReport:
            c = sweep.counts
            return ReclaimReport(
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
                seconds=sweep.seconds(),
                keys_listed=sweep.listed,
                damaged_versions=len(damaged),
                damaged_segments=len(damaged_segments),
            )

        try:
            self._delete_data(latest, cut_from, numbered, now, sweep, damaged, damaged_segments)
            settled_version, settled = self._settled_version(numbered, now, damaged)
            if settled is not None:
                self._delete_segments(latest, settled, now, sweep)
            if marks:
                floor = min(min(m.version for m in marks), latest.version)
                if settled_version is not None:
                    self._delete_manifests(numbered, min(floor, settled_version), sweep)
        except BaseException:
            # A pass stopped part-way (a store error, an exception from ``progress``, Ctrl-C)
            # may have deleted objects already: ``last_report`` says what (``track_metrics``
            # counts them from it). A later pass lists only what is left, so no deletion is
            # counted twice.
            if sweep.objects:
                self.last_report = what_it_did()
            raise
        report = what_it_did()
        self.last_report = report
        try:
            sweep.begin("done")
        finally:
            # Keys the store refused are what the operator must act on: that error wins over
            # one raised by the progress callback.
            if sweep.refused:
                first = sweep.refused[0]
                raise type(first)(
                    f"{self.store.url}/{self.namespace}: the store refused to delete "
                    f"{len(sweep.refused)} objects (first: {first}); the rest of the pass went "
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
        except UnsupportedFormatVersion:
            raise  # no damage: "upgrade batchweave" says what to do
        except FormatError as exc:
            # Unlike an old version (skipped), the newest one is what the cut and every reader
            # build on: nothing is committed or deleted until it is readable again.
            raise type(exc)(
                f"{self.store.url}/{self.namespace}: the newest manifest version cannot be read "
                f"({exc}); nothing is committed or deleted until it is. Run `batchweave verify "
                f"{self.store.url} {self.namespace}` and restore that object from a backup"
            ) from exc

    def _refuse_marks_from_lost_history(self, marks: list[Watermark], latest: Manifest) -> Manifest:
        """``latest``, once no live watermark lies past it; else a :class:`FormatError`.

        A watermark records a version its reader held, and versions are never deleted from
        the top, so one whose version is above the newest stored comes from a history that is
        gone: an older copy of ``_manifests/`` was restored over the prefix (the watermarks left
        in place). Capping the cut at ``next_step`` would let it move ``base_step`` to that
        watermark once producers re-grow the history, deleting steps nobody read. A version
        above the newest one listed is read first: there, the listing lagged behind the writes,
        and the pass goes on from it. A *step* above ``next_step`` alone is no such sign (a
        consumer started ahead with ``start_step`` checkpoints the step it waits for): the cut
        is capped at the committed steps for it, as always.
        """
        newest_marked = max((m.version for m in marks), default=-1)
        if newest_marked > latest.version:
            try:
                found = self._log.read(newest_marked)
            except ObjectNotFound:
                pass  # gone, or never written in this history: refused below
            else:
                latest = self._log.latest_from(found)
        for mark in marks:
            if mark.version > latest.version:
                raise FormatError(
                    f"{self.store.url}/{self.namespace}: watermark {mark.checkpoint_id!r} holds "
                    f"step {mark.step} (manifest version {mark.version}), but the namespace "
                    f"has only steps below {latest.next_step} and its newest version is "
                    f"{latest.version}: no reader can have read past them, so the watermark "
                    "comes from a history that is gone. The namespace's history went back "
                    "(an older backup of _manifests/ restored over the prefix?). Nothing is "
                    "committed or deleted. If that checkpoint belongs to the lost history, "
                    f"release it (Watermarks(store, {self.namespace!r})"
                    f".release({mark.checkpoint_id!r})); otherwise restore the newer manifest "
                    "versions from the backup that holds them"
                )
        return latest

    def _no_namespace(self, boundary: int, marks: list[Watermark], sweep: Sweep) -> ReclaimReport:
        """End a pass that found no manifest version (the namespace does not exist)."""
        self.last_report = ReclaimReport(
            boundary=boundary,
            watermarks=len(marks),
            base_step_before=0,
            base_step_after=0,
            latest_version=-1,
            seconds=sweep.seconds(),
            keys_listed=sweep.listed,
        )
        sweep.begin("done")
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
        sweep: Sweep,
        damaged: list[str],
        damaged_segments: list[str],
    ) -> None:
        sweep.begin("reading manifests")
        live = self._keys.live(latest)
        below: set[str] = set()
        if self._swept_below != latest.base_step:
            source = cut_from or self._newest_below(numbered, latest, damaged)
            if source is not None:
                below = self._keys.below(source, latest.base_step, damaged_segments)
        self._keys.forget_unlisted(latest)
        reclaimed: list[ObjectMeta] = []
        orphans: list[ObjectMeta] = []
        cutoff = now - self.grace
        for meta in sweep.list_prefix(f"{DATA_DIR}/"):
            rel = self._relative(meta.key)
            if rel in live:
                continue
            if rel in below:
                reclaimed.append(meta)
            elif meta.last_modified <= cutoff and _OWN_KEYS.fullmatch(rel):
                orphans.append(meta)
        refused = len(sweep.refused)
        sweep.begin("deleting TGBs", len(reclaimed))
        sweep.delete(reclaimed, "tgb")
        sweep.begin("deleting orphans", len(orphans))
        orphans = sweep.delete(orphans, "orphan")
        for meta in orphans:
            _log.info("deleted orphan %r (%d bytes, unreferenced)", meta.key, meta.size)
        if len(sweep.refused) == refused:
            self._swept_below = latest.base_step

    def _newest_below(
        self, numbered: list[tuple[int, ObjectMeta]], latest: Manifest, damaged: list[str]
    ) -> Manifest | None:
        """The newest surviving version with a lower ``base_step`` than ``latest`` (a crashed
        pass's cut was committed on it). ``base_step`` never decreases with the version, so a
        binary search costs O(log versions) reads.

        A version that cannot be decoded is left out of the search (and added to ``damaged``):
        the search goes on among the others, which are still ordered by ``base_step``. Safe,
        since only the TGBs of steps below ``latest.base_step`` that ``latest`` does not reference
        are deleted from whichever version is found: the cut is committed, so no readable version
        (``latest`` and everything after it) needs them, and a version found lower (or none)
        only leaves some of them to the orphan rule.
        """
        versions = [v for v, _ in numbered if v < latest.version]
        found: Manifest | None = None
        lo, hi = 0, len(versions)
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                manifest = self._read_old(versions[mid], damaged)
            except ObjectNotFound:
                return found  # reclaimed meanwhile: the orphan rule covers what is left
            if manifest is None:
                del versions[mid]
                hi -= 1
                continue
            if manifest.base_step < latest.base_step:
                found, lo = manifest, mid + 1
            else:
                hi = mid
        return found

    # -- segments and manifests ----------------------------------------------------------------

    def _settled_version(
        self, numbered: list[tuple[int, ObjectMeta]], now: float, damaged: list[str]
    ) -> tuple[int | None, Manifest | None]:
        """The version that was latest ``metadata_grace`` seconds ago (newest written before
        then): its number and its manifest, both ``None`` when no version is that old or it is
        gone.

        A damaged one (it cannot be decoded; added to ``damaged``) has its number and no
        manifest: the versions below it may still go (they were superseded before it was
        written, and the number comes from the listing), but no segment does, as what readers
        that hold it may read is unknown. Once a newer version settles, it goes too.
        """
        cutoff = now - self.metadata_grace
        old = [v for v, meta in numbered if meta.last_modified <= cutoff]
        version = max(old) if old else None
        if version is None:
            return None, None
        try:
            return version, self._read_old(version, damaged)
        except ObjectNotFound:
            return None, None

    def _read_old(self, version: int, damaged: list[str]) -> Manifest | None:
        """Old manifest ``version``, or ``None`` if it cannot be decoded (then added to
        ``damaged``). ``ObjectNotFound`` if it is gone; a version written by a newer BatchWeave
        is no damage and not ours to skip: its ``UnsupportedFormatVersion`` is raised."""
        try:
            return self._log.read(version)
        except UnsupportedFormatVersion:
            raise
        except FormatError as exc:
            self._damaged(version, exc, damaged)
            return None

    def _damaged(self, version: int, exc: FormatError, damaged: list[str]) -> None:
        """Add old manifest ``version``, which cannot be decoded, to the pass's ``damaged``
        keys, logging a WARNING the first time the pass meets it."""
        key = f"{self.namespace}/{manifest_key(version)}"
        if key in damaged:
            return
        damaged.append(key)
        _log.warning(
            "%s/%s: old manifest version %d cannot be read (%s); the pass skips it (what it "
            "deletes is decided from the latest version and readable older ones). Run "
            "`batchweave verify %s %s` to check the rest of the namespace; the damaged object "
            "%r is deleted like any old version (once superseded for the grace and below every "
            "watermark's version), or delete it by hand",
            self.store.url,
            self.namespace,
            version,
            exc,
            self.store.url,
            self.namespace,
            key,
        )

    def _delete_segments(
        self, latest: Manifest, settled: Manifest | None, now: float, sweep: Sweep
    ) -> None:
        if settled is None:
            return  # no version is old enough to tell what readers may still hold
        keep = {ref.key for ref in latest.segments} | {ref.key for ref in settled.segments}
        cutoff = now - 2 * self.metadata_grace
        doomed = [
            meta
            for meta in sweep.list_prefix(f"{SEGMENTS_DIR}/")
            if self._relative(meta.key) not in keep
            and meta.last_modified <= cutoff
            and _OWN_KEYS.fullmatch(self._relative(meta.key))
        ]
        sweep.begin("deleting segments", len(doomed))
        sweep.delete(doomed, "segment")

    def _delete_manifests(
        self, numbered: list[tuple[int, ObjectMeta]], below: int, sweep: Sweep
    ) -> None:
        """Delete versions below ``below`` one at a time, oldest first: the survivors always
        form a suffix of history, so a writer whose base survives also finds its successor."""
        doomed = [meta for version, meta in numbered if version < below]
        sweep.begin("deleting manifests", len(doomed))
        for meta in doomed:
            if not sweep.delete([meta], "manifest"):
                break  # never delete a newer version while an older one survives

    # -- helpers -------------------------------------------------------------------------------

    def _relative(self, key: str) -> str:
        return key[len(self.namespace) + 1 :]

    def _version_of(self, meta: ObjectMeta) -> int | None:
        """The version ``meta`` holds, if its key is exactly ``{namespace}/`` followed by
        ``manifest_key(version)``; ``None`` for anything else under ``_manifests/``.

        An exact match, not a suffix: a namespace nested there (``{namespace}/_manifests``,
        whose versions are ``{namespace}/_manifests/_manifests/...``) is not this one's, and a
        suffix match once counted its versions as ours (then deleted them, or crashed sorting
        two objects of one version).
        """
        relative = self._relative(meta.key)
        digits = relative[len(MANIFESTS_DIR) + 1 :][:20]
        if digits.isascii() and digits.isdigit() and relative == manifest_key(int(digits)):
            return int(digits)
        return None

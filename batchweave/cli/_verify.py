"""``batchweave verify``: is everything the newest manifest references readable and consistent?

Checks, collecting every problem rather than stopping at the first:

- every surviving manifest version decodes, belongs to the namespace, names its parent, and
  never moves ``base_step`` or ``next_step`` backwards;
- the live steps ``base_step .. next_step - 1`` are dense (segments plus tail, in order);
- exactly-once per stream of a producer id: no offset twice, offsets strictly increasing in
  step order, the current stream's never above the id's committed offset, epochs never above its
  committed one (see :class:`_Streams` for how steps are told apart into streams: an id retired
  and started again begins a new stream at offset 0);
- every referenced object exists, its footer matches the manifest (size, checksum, slice count,
  the namespace's mesh when the object holds the whole TGB, and the slice table when the
  manifest carries one), the objects of a TGB stored as several tile its slices, its sample ids
  (when recorded) are what ``export`` can read and, unless ``slices=False``, every slice's bytes
  match their checksum and decode.

Segments are read one at a time: a missing or damaged one is a problem naming its key and the
steps it lists (which then cannot be checked), and the check goes on with the next segment and
the tail. A segment or object written by a newer BatchWeave is no damage: it is listed in
``unchecked`` (upgrade batchweave), and its steps count in ``steps_unchecked``. A newest
manifest version written by a newer BatchWeave stops the check with
:class:`~batchweave.UnsupportedFormatVersion` (nothing can be checked against it).

A reclamation pass may run during the check (reclaimers run at any time): an object missing
because its step fell below the ``base_step`` of a manifest committed since is not a problem;
those steps are counted in ``steps_reclaimed``. Steps whose stream cannot be told, because the
manifest versions that would show a retirement were reclaimed, are no problem either: they are
named in ``notes`` and their exactly-once check is skipped.
"""

from __future__ import annotations

import bisect
import enum
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from batchweave._errors import (
    FormatError,
    NamespaceMismatch,
    ObjectNotFound,
    UnsupportedFormatVersion,
)
from batchweave._format._tgb_read import decode_slice, slice_range
from batchweave._history import _sample_ids, base_step_now, read_object_footer
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import Manifest, SegmentRef, SliceTable, TgbDescriptor
from batchweave._store._base import ObjectStore

__all__ = ["VerifyReport", "verify_namespace"]


@dataclass
class VerifyReport:
    """What :func:`verify_namespace` checked and found."""

    latest_version: int = -1
    versions: int = 0
    base_step: int = 0
    next_step: int = 0
    steps: int = 0
    """Live steps checked: their descriptors read, every object checked (found sound or not)."""
    steps_unchecked: int = 0
    """Live steps that could not be checked: their segment is missing, damaged or written by a
    newer BatchWeave, or one of their objects was written by a newer BatchWeave."""
    objects: int = 0
    slices: int = 0
    bytes_read: int = 0
    producers: dict[str, int] = field(default_factory=dict)
    """Live steps per producer."""
    retired: list[str] = field(default_factory=list)
    """Producers with live steps that the manifest no longer lists (retired ids)."""
    problems: list[str] = field(default_factory=list)
    """Damage: what consumers, ``export`` or a resume would trip over."""
    unchecked: list[str] = field(default_factory=list)
    """Segments and objects written by a newer BatchWeave: no damage, but this version cannot
    check them (upgrade batchweave); also the live steps of an unreadable newest manifest version
    (its damage is in ``problems``), none of which could be checked."""
    steps_reclaimed: int = 0
    """Steps a reclamation pass moved below ``base_step`` while the check ran, counted when
    one of their objects had gone missing (then not a problem)."""
    notes: list[str] = field(default_factory=list)
    """Checks skipped for a reason that is no damage: steps of an id whose offsets start over
    after a jump in epoch (a retirement and a new stream of the id) where the manifest versions
    that would show the retirement were reclaimed. They leave ``ok`` and ``complete`` alone."""

    @property
    def complete(self) -> bool:
        """True when every live step could be checked."""
        return not self.unchecked and self.steps_unchecked == 0

    @property
    def ok(self) -> bool:
        """True when everything was checked and no problem was found."""
        return not self.problems and self.complete


def _check_versions(log: ManifestLog, latest: Manifest, report: VerifyReport) -> _Streams:
    """Check the surviving versions; return which of them list which producer ids."""
    streams = _Streams()
    previous: Manifest | None = None
    for version in log.versions():
        if version > latest.version:
            continue  # committed while we were verifying
        report.versions += 1
        try:
            manifest = log.read(version)
        except ObjectNotFound:
            continue  # reclaimed while we were verifying
        except UnsupportedFormatVersion as exc:  # no damage: this version cannot read it
            report.unchecked.append(f"manifest version {version}: {exc}")
            continue
        except (FormatError, NamespaceMismatch) as exc:  # damaged, or another namespace's
            advice = (
                "the newest version: restore it from a backup, or continue in a new namespace"
                if version == latest.version
                else "an old version: readers and producers no longer need it and the "
                "reclaimer skips it; restore it from a backup to keep the full history, or "
                "leave it to be reclaimed"
            )
            report.problems.append(f"manifest version {version}: {exc} ({advice})")
            continue
        if previous is not None and previous.version == version - 1:
            if manifest.parent != previous.version:
                report.problems.append(
                    f"manifest version {version} names parent {manifest.parent}, expected "
                    f"{previous.version}"
                )
            if manifest.next_step < previous.next_step:
                report.problems.append(
                    f"manifest version {version} has {manifest.next_step} steps, fewer than "
                    f"version {previous.version} ({previous.next_step}): steps were lost"
                )
            if manifest.base_step < previous.base_step:
                report.problems.append(
                    f"manifest version {version} lowers base_step from {previous.base_step} to "
                    f"{manifest.base_step}"
                )
        streams.add(manifest)
        previous = manifest
    streams.add(latest)  # read before the listing: in it even if a LIST missed it
    return streams


class _Relation(enum.Enum):
    SAME = "same"
    """One stream: no retirement of the id between the two epochs."""
    NEW = "new"
    """A surviving version between them does not list the id: it was retired, then started."""
    UNKNOWN = "unknown"
    """Versions that would tell were reclaimed (or cannot be read)."""


class _Streams:
    """Which surviving manifest versions list which producer ids: tells an id's streams apart.

    Retirement removes an id from the producer map; a producer started later under it begins a
    new stream (no resume offset: its offsets start over) with the version of its epoch commit as
    its epoch; a restart within a stream takes the old epoch + 1. So an id's epochs increase
    across its streams, every epoch is at most the version of its epoch commit, and:

    - a version ``w`` that does not list the id, with ``e1 < w < e2``, separates the streams of
      epochs ``e1`` and ``e2`` (an epoch below ``w`` was committed before ``w``; after ``w`` the
      id starts over at an epoch above ``w``);
    - a TGB's epoch ``e1`` and a later epoch ``e2 <= e1 + 2`` are one stream (after the epoch
      commit of ``e1``, a version ``>= e1``, the TGB's commit, a retirement and a new epoch
      commit take three more versions), and so are ``e1`` and ``e2`` when every version
      ``e1 + 2 .. e2 - 1`` survives and lists the id (a retirement would leave one unlisted).

    Otherwise (reclaimed versions) the two cannot be told apart.
    """

    def __init__(self) -> None:
        self._versions: list[int] = []
        """Surviving readable versions, increasing."""
        self._firsts: dict[str, list[int]] = {}
        self._lasts: dict[str, list[int]] = {}
        """Per id, the first and last versions of each run of consecutive surviving versions
        that list it."""

    def add(self, manifest: Manifest) -> None:
        """Record ``manifest``; versions come in increasing order."""
        version = manifest.version
        if self._versions and version <= self._versions[-1]:
            return
        self._versions.append(version)
        for pid in manifest.producers:
            lasts = self._lasts.setdefault(pid, [])
            if lasts and lasts[-1] == version - 1:
                lasts[-1] = version
            else:
                self._firsts.setdefault(pid, []).append(version)
                lasts.append(version)

    def _run_end(self, pid: str, version: int) -> int | None:
        """The last version of the run listing ``pid`` that holds ``version``, if any."""
        i = bisect.bisect_right(self._firsts.get(pid, []), version) - 1
        if i < 0 or self._lasts[pid][i] < version:
            return None
        return self._lasts[pid][i]

    def _absent_between(self, pid: str, lo: int, hi: int) -> bool:
        """Does a surviving version ``lo < w < hi`` not list ``pid``?"""
        i = bisect.bisect_right(self._versions, lo)
        while i < len(self._versions) and self._versions[i] < hi:
            end = self._run_end(pid, self._versions[i])
            if end is None:
                return True
            i = bisect.bisect_right(self._versions, end)
        return False

    def relation(self, pid: str, earlier: int, later: int) -> _Relation:
        """Are epoch ``earlier`` (of a TGB of ``pid``) and a later-committed epoch ``later``
        one stream of ``pid``? An epoch that went down is damage: one stream (checked)."""
        if later <= earlier + 2:
            return _Relation.SAME
        if self._absent_between(pid, earlier, later):
            return _Relation.NEW
        end = self._run_end(pid, earlier + 2)
        if end is not None and end >= later - 1:
            return _Relation.SAME
        return _Relation.UNKNOWN


class _Offsets:
    """The set of the offsets of one stream's steps, for "appears twice". A stream's offsets
    increase, mostly by one: they are kept as runs of consecutive offsets (one run for a whole
    stream of consecutive offsets, not one entry per step), plus the offsets that came at or
    below an earlier one (each of them a problem)."""

    def __init__(self, first: int) -> None:
        self._starts = [first]
        self._ends = [first]
        """Runs ``starts[i] .. ends[i]`` of the increasing offsets, increasing."""
        self._out_of_order: set[int] = set()

    def __contains__(self, offset: int) -> bool:
        if offset in self._out_of_order:
            return True
        i = bisect.bisect_right(self._starts, offset) - 1
        return i >= 0 and offset <= self._ends[i]

    def add(self, offset: int) -> None:
        last = self._ends[-1]
        if offset == last + 1:
            self._ends[-1] = offset
        elif offset > last:
            self._starts.append(offset)
            self._ends.append(offset)
        elif offset not in self:
            self._out_of_order.add(offset)


class _Stream:
    """The steps of one stream of a producer id seen so far (in step order)."""

    def __init__(self, offset: int, epoch: int) -> None:
        self.last_offset = offset
        self.last_epoch = epoch
        self.seen = _Offsets(offset)


@dataclass
class _Unattributed:
    """The steps of an id whose exactly-once check was skipped (they come in step order)."""

    first: int
    last: int
    count: int = 1

    def add(self, step: int) -> None:
        if step != self.last:
            self.last = step
            self.count += 1


def _unattributed_note(pid: str, steps: _Unattributed) -> str:
    where = (
        f"step {steps.first}"
        if steps.count == 1
        else f"{steps.count} of its steps, from step {steps.first} to {steps.last},"
    )
    return (
        f"{pid}: the exactly-once check of {where} was skipped: their offsets start over (or "
        f"exceed the committed offset) after a jump in epoch, as when the id is retired and "
        f"started again (a new stream), but the manifest versions that would show whether it "
        f"was retired in between were reclaimed"
    )


def _check_object_set(step: int, desc: TgbDescriptor, slices: int) -> str | None:
    problem = desc.tiling_problem(slices)
    if problem is not None:
        return f"step {step}: {problem}"
    if desc.bytes != sum(ref.size for ref in desc.objects):
        return f"step {step}: descriptor says {desc.bytes} bytes, its objects sum to another size"
    return None


@dataclass
class _StepResult:
    """What checking one step's objects found."""

    problems: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    """Objects written by a newer BatchWeave (not damage; this version cannot check them)."""
    objects: int = 0
    slices: int = 0
    nread: int = 0
    missing: bool = False
    """An object was missing (the caller decides whether a concurrent reclamation explains it)."""


def _check_tgb(
    store: ObjectStore,
    log: ManifestLog,
    latest: Manifest,
    step: int,
    desc: TgbDescriptor,
    read_slices: bool,
) -> _StepResult:
    """Check one step's objects."""
    result = _StepResult()
    problems = result.problems
    objects = slices = nread = 0
    missing = False
    for ref in desc.objects:
        key = log.key(ref.key)
        where = f"step {step} ({desc.producer_id} offset {desc.offset})"
        try:
            footer = read_object_footer(store, key, ref)
            objects += 1
            nread += ref.size - ref.footer_offset  # the footer and its trailer
            # An object holding the whole TGB carries the namespace's mesh. One holding part of
            # it (a TGB in several objects) carries a mesh sizing its own slices only, whose
            # count read_object_footer checked, and the tiling is checked with the descriptor
            # (_check_object_set): the checks a consumer makes.
            if ref.slice_count == latest.mesh.slices and footer.mesh != latest.mesh:
                problems.append(
                    f"{where}: object {key!r} holds the whole TGB but was written for mesh "
                    f"({footer.mesh}), the namespace's is ({latest.mesh})"
                )
                continue
            if ref.slices is not None and ref.slices != SliceTable.from_footer(footer):
                problems.append(
                    f"{where}: the manifest's slice table for object {key!r} disagrees with the "
                    "object's footer; consumers would reject its slices"
                )
            _sample_ids(footer, key)  # malformed sample ids: a FormatError, as export raises
            if not read_slices:
                continue
            for j in range(len(footer.slices)):
                rng = slice_range(footer, j)
                raw = store.get_range(key, rng) if rng.end > rng.start else b""
                nread += len(raw)
                decode_slice(raw, footer, j, key=key)
                slices += 1
        except ObjectNotFound:
            missing = True
            problems.append(
                f"{where}: object {key!r} is missing (deleted outside BatchWeave, or reclaimed "
                "as an orphan because grace was shorter than an upload-to-commit); the step is "
                "lost: restore the object, or resume from a checkpoint past this step"
            )
        except UnsupportedFormatVersion as exc:  # no damage: upgrade to check it
            result.unchecked.append(f"{where}: {exc}")
        except FormatError as exc:
            problems.append(f"{where}: {exc}")
    result.objects, result.slices, result.nread, result.missing = objects, slices, nread, missing
    return result


@dataclass
class _SegmentFailure:
    """A segment the newest manifest lists whose descriptors could not be read."""

    ref: SegmentRef
    start: int
    stop: int
    """The live steps it lists: ``start .. stop - 1``."""
    error: FormatError | ObjectNotFound


def _segment_problem(log: ManifestLog, latest: Manifest, failure: _SegmentFailure) -> str:
    key = log.key(failure.ref.key)
    count = failure.stop - failure.start
    steps = f"steps {failure.start}..{failure.stop - 1} ({count} steps, not checked)"
    if isinstance(failure.error, ObjectNotFound):
        return (
            f"segment {key!r}, which manifest version {latest.version} (the latest) lists for "
            f"{steps}, is missing (a segment is never deleted while the latest version lists "
            "it; was it deleted by hand?): those steps are unreadable for every consumer; "
            "restore the segment object from a backup, or resume in a new namespace"
        )
    return (
        f"segment {key!r}, which manifest version {latest.version} (the latest) lists for "
        f"{steps}, is damaged: {failure.error}; those steps are unreadable for every consumer: "
        "restore the segment object from a backup, or resume in a new namespace"
    )


class _LiveSteps:
    """The live steps' descriptors in step order, read one segment at a time as they are
    iterated (only one segment's descriptors are held), the walk going on past an unreadable
    segment with the next segment and the tail. A segment written by a newer BatchWeave is noted
    in ``report`` as unchecked; one that cannot be read is a failure; both are skipped."""

    def __init__(self, log: ManifestLog, latest: Manifest, report: VerifyReport) -> None:
        self._log, self._latest, self._report = log, latest, report
        self.failures: list[_SegmentFailure] = []
        """The segments that could not be read, in step order."""
        self.skipped: deque[tuple[int, int]] = deque()
        """The steps ``(start, stop)`` of the segments not read, in step order, as far as the
        iteration got (consumed from the front by :func:`_past_skipped`)."""
        self.skipped_steps = 0
        """How many steps the segments not read so far list."""

    def __iter__(self) -> Iterator[tuple[int, TgbDescriptor]]:
        log, latest = self._log, self._latest
        for ref in latest.segments:
            start, stop = max(ref.first_step, latest.base_step), min(ref.end_step, latest.next_step)
            if stop <= start:
                continue
            try:
                rows = list(log.descriptors(latest, start, stop))
            except UnsupportedFormatVersion as exc:  # no damage: this version cannot read it
                self._report.unchecked.append(
                    f"steps {start}..{stop - 1} ({stop - start} steps): {exc}"
                )
                self._report.steps_unchecked += stop - start
            except (FormatError, ObjectNotFound) as exc:
                self.failures.append(_SegmentFailure(ref, start, stop, exc))
            else:
                yield from rows
                del rows
                continue
            self.skipped.append((start, stop))
            self.skipped_steps += stop - start
        start = max(latest.tail_start, latest.base_step)
        if start < latest.next_step:
            yield from log.descriptors(latest, start, latest.next_step)


def _past_skipped(step: int, skipped: deque[tuple[int, int]]) -> int:
    """The step the check expects next after ``step - 1``, past the steps of segments that
    could not be read (``skipped``, in step order, consumed from the front)."""
    while skipped and skipped[0][0] <= step:
        step = max(step, skipped.popleft()[1])
    return step


def _count_unreadable_latest(log: ManifestLog, stored: list[int], report: VerifyReport) -> None:
    """Record in ``report`` that no live step was checked, the newest version (in ``stored``,
    increasing) being unreadable: an ``unchecked`` entry (so ``complete`` is false even when no
    version can be read) and, as ``steps_unchecked``, the live steps of the newest version that
    can be read, the best count known (the unreadable version's own steps are unknown)."""
    older: Manifest | None = None
    for version in reversed(stored[:-1]):
        try:
            older = log.read(version)
        except (FormatError, ObjectNotFound, NamespaceMismatch, UnsupportedFormatVersion):
            continue  # reclaimed meanwhile, or unreadable too: try the one before
        break
    if older is None:
        known = "no older version can be read, so how many steps it lists is unknown"
    else:
        report.steps_unchecked = max(0, older.next_step - older.base_step)
        listed = (
            f"steps {older.base_step}..{older.next_step - 1}"
            if report.steps_unchecked
            else "no live step"
        )
        known = (
            f"the newest readable version, {older.version}, lists {listed} "
            f"({report.steps_unchecked} counted as not checked; the unreadable version may list "
            "more)"
        )
    report.unchecked.append(
        f"the live steps of manifest version {report.latest_version} (the newest, unreadable: "
        f"see problems) were not checked; {known}"
    )


def verify_namespace(
    store: ObjectStore,
    namespace: str,
    *,
    read_slices: bool = True,
    workers: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> VerifyReport:
    """Run every check on ``namespace``'s newest manifest; see the module docstring.

    ``progress(done, total)`` is called as steps are checked; ``total`` is the number of live
    steps, and the steps of a segment that cannot be read count as done when the check passes
    it. Store failures other than a missing object propagate (the verification could not
    complete: neither pass nor fail).

    Memory does not grow with the history: segments are read one at a time, at most ``4 *
    workers`` steps are checked ahead of the one whose result is taken next, and what is kept
    is per producer id and stream (offsets, epochs) and the report.
    """
    log = ManifestLog(store, namespace)
    try:
        latest = log.latest()
    except UnsupportedFormatVersion:
        # Written by a newer BatchWeave: no damage, and nothing can be checked against it. The
        # check cannot run (exit 2, "upgrade batchweave"), as every other command reports it.
        raise
    except FormatError as exc:
        # A damaged newest version is a finding, not a reason the check could not run.
        report = VerifyReport()
        report.problems.append(
            f"the newest manifest version cannot be read: {exc}; producers and consumers stop "
            "on it too. Restore the object from a backup, or resume in a new namespace"
        )
        stored = list(log.versions())
        report.versions = len(stored)
        report.latest_version = max(stored, default=-1)
        _count_unreadable_latest(log, stored, report)
        return report
    report = VerifyReport(
        latest_version=latest.version, base_step=latest.base_step, next_step=latest.next_step
    )
    streams = _check_versions(log, latest, report)

    # The live steps are read one segment at a time and their objects checked in a bounded
    # window (a history of 10^6 steps held in memory took gigabytes): what is kept is per id and
    # per stream, and the problems found. The descriptor checks' problems go to the report as
    # found (in step order); the objects' follow the segments' at the end, as before.
    live = _LiveSteps(log, latest, report)
    expected_step = latest.base_step
    current: dict[str, _Stream] = {}
    unattributed: dict[str, _Unattributed] = {}

    def unsure(pid: str, step: int) -> None:
        steps = unattributed.get(pid)
        if steps is None:
            unattributed[pid] = _Unattributed(step, step)
        else:
            steps.add(step)

    def check_descriptor(step: int, desc: TgbDescriptor) -> None:
        """The checks of one step's descriptor against the steps before it (in step order)."""
        nonlocal expected_step
        expected_step = _past_skipped(expected_step, live.skipped)
        if step != expected_step:
            report.problems.append(
                f"steps are not dense: found step {step} after {expected_step - 1}"
            )
        expected_step = step + 1
        pid = desc.producer_id
        report.producers[pid] = report.producers.get(pid, 0) + 1
        stream = current.get(pid)
        if stream is not None and desc.offset <= stream.last_offset:
            # Offsets start over: a new stream of the id (retired, then started), or damage.
            relation = streams.relation(pid, stream.last_epoch, desc.epoch)
            if relation is not _Relation.SAME:
                if relation is _Relation.UNKNOWN:
                    unsure(pid, step)
                stream = None
        if stream is None:
            stream = current[pid] = _Stream(desc.offset, desc.epoch)
        else:
            if desc.offset in stream.seen:
                report.problems.append(f"step {step}: {pid} offset {desc.offset} appears twice")
            if desc.offset <= stream.last_offset:
                report.problems.append(
                    f"step {step}: {pid} offset {desc.offset} does not follow offset "
                    f"{stream.last_offset} of an earlier step"
                )
            stream.last_offset = max(desc.offset, stream.last_offset)
            stream.last_epoch = desc.epoch
        stream.seen.add(desc.offset)
        state = latest.producers.get(pid)
        if state is not None:  # None: a retired id (see report.retired)
            if state.offset is None or desc.offset > state.offset:
                # Only the stream of the committed state is held to its offset.
                relation = streams.relation(pid, desc.epoch, state.epoch)
                if relation is _Relation.SAME:
                    report.problems.append(
                        f"step {step}: {pid} offset {desc.offset} is above its committed offset "
                        f"{state.offset}"
                    )
                elif relation is _Relation.UNKNOWN:
                    unsure(pid, step)
            if desc.epoch > state.epoch:
                report.problems.append(
                    f"step {step}: {pid} epoch {desc.epoch} is above its committed epoch "
                    f"{state.epoch}"
                )
        problem = _check_object_set(step, desc, latest.mesh.slices)
        if problem is not None:
            report.problems.append(problem)

    total = max(0, latest.next_step - latest.base_step)
    done = checked = 0
    step_results: list[tuple[int, _StepResult]] = []
    missing_steps: set[int] = set()
    any_missing = False

    def take(step: int, future: Future[_StepResult]) -> None:
        nonlocal done, checked, any_missing
        result = future.result()
        if result.problems or result.unchecked:
            step_results.append((step, result))
        if result.missing:
            any_missing = True
            missing_steps.add(step)
        report.objects += result.objects
        report.slices += result.slices
        report.bytes_read += result.nread
        checked += 1
        done = checked + live.skipped_steps  # the steps of a segment not read count as done
        if progress is not None:
            progress(done, total)

    window = max(1, workers) * 4  # steps submitted ahead of the one whose result is taken next
    pending: deque[tuple[int, Future[_StepResult]]] = deque()
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        try:
            for step, desc in live:
                check_descriptor(step, desc)
                pending.append(
                    (step, pool.submit(_check_tgb, store, log, latest, step, desc, read_slices))
                )
                if len(pending) >= window:
                    take(*pending.popleft())
            while pending:
                take(*pending.popleft())
        except BaseException:
            for _, future in pending:
                future.cancel()
            raise
    if progress is not None and checked + live.skipped_steps != done:
        progress(checked + live.skipped_steps, total)  # segments not read after the last step

    for pid, steps in sorted(unattributed.items()):
        report.notes.append(_unattributed_note(pid, steps))
    # Only retirement (retire_producers) removes an id's state; its steps stay.
    report.retired = sorted(pid for pid in report.producers if pid not in latest.producers)
    expected_step = _past_skipped(expected_step, live.skipped)
    if expected_step != latest.next_step:
        report.problems.append(
            f"steps end at {expected_step - 1}, the manifest says {latest.next_step - 1}"
        )

    failures = live.failures
    any_missing = any_missing or any(isinstance(f.error, ObjectNotFound) for f in failures)
    reclaimed_below = latest.base_step
    if any_missing:
        # A reclamation pass that ran meanwhile deletes the TGBs of the steps it moved below
        # base_step: those steps are no longer live, so their missing objects are no loss (as
        # _check_versions skips manifest versions reclaimed meanwhile).
        reclaimed_below = max(latest.base_step, base_step_now(log, default=latest.base_step))
    # A step whose object went missing because it was reclaimed meanwhile was not checked; one
    # reclaimed after its objects were checked was.
    report.steps_reclaimed = sum(1 for step in missing_steps if step < reclaimed_below)
    report.steps = checked - report.steps_reclaimed
    segment_problems: list[tuple[int, str]] = []
    for failure in failures:
        count = failure.stop - failure.start
        if isinstance(failure.error, ObjectNotFound) and failure.stop <= reclaimed_below:
            report.steps_reclaimed += count  # reclaimed with its steps meanwhile: no loss
        else:
            report.steps_unchecked += count
            segment_problems.append((failure.start, _segment_problem(log, latest, failure)))
    # In step order: segment problems first, then the steps' own.
    for _, problem in segment_problems:
        report.problems.append(problem)
    for step, result in step_results:
        if step < reclaimed_below:
            continue
        report.problems.extend(result.problems)
        report.unchecked.extend(result.unchecked)
        if result.unchecked:
            report.steps -= 1
            report.steps_unchecked += 1
    return report

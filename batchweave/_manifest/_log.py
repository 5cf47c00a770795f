"""The manifest log of one namespace: discovery, reading and one-attempt commits.

Versions are immutable objects ``{namespace}/_manifests/{version:020d}.manifest``; version
``v+1`` exists only if a conditional PUT (``If-None-Match: *``) created it, so the store itself
serializes history and there is no coordinator. :meth:`ManifestLog.commit` makes exactly one
attempt and reports who won; rebasing and pacing belong to the producer. See ``docs/protocol.md``.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Collection, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass

from batchweave._checks import check_namespace, check_store
from batchweave._errors import (
    AmbiguousWriteError,
    ChecksumMismatch,
    ConcurrentWriteConflict,
    FormatError,
    NamespaceError,
    NamespaceMismatch,
    NamespaceNotFound,
    NamespaceSealed,
    ObjectExists,
    ObjectNotFound,
    OffsetOrderError,
    ProducerFenced,
    StepReclaimed,
    TransientStoreError,
)
from batchweave._manifest import _codec
from batchweave._manifest._codec import decode_manifest, descriptors_json_bytes, encode_manifest
from batchweave._manifest._models import Manifest, ProducerState, SegmentRef, TgbDescriptor
from batchweave._manifest._segments import (
    DEFAULT_MERGE_FANOUT,
    SegmentFiles,
    cut_below,
    find_segment,
    is_full,
    most_per_level,
    swap_in,
)
from batchweave._mesh import Mesh
from batchweave._store._base import Bounded, ObjectStore
from batchweave._store._wrappers import LIST_PAGE_SIZE

__all__ = [
    "MANIFESTS_DIR",
    "NAMESPACE_DIRS",
    "PREPARED_MERGE_MAX_AGE",
    "LISTED_TRUST_SECONDS",
    "PROBE_TRUST_SECONDS",
    "DEFAULT_MERGE_FANOUT",
    "DEFAULT_TAIL_BYTES_LIMIT",
    "DEFAULT_TAIL_LIMIT",
    "CommitResult",
    "Committed",
    "Conflict",
    "ManifestLog",
    "active_producer_ids",
    "active_producers",
    "commit_until",
    "manifest_key",
]

_log = logging.getLogger("batchweave.manifest")

MANIFESTS_DIR = "_manifests"
NAMESPACE_DIRS = frozenset({MANIFESTS_DIR, "_segments", "_watermarks", "data"})
"""Top-level names BatchWeave creates under a namespace; anything else makes a prefix foreign."""

PROBE_TRUST_SECONDS = 60.0
"""``latest(known)`` trusts a missing ``known.version + 1`` only for a ``known`` committed this
recently (its ``created_at``) and first seen by this client this recently (its monotonic clock);
older ones are confirmed with a LIST, since the reclaimer may have deleted versions superseded
more than its grace period (default 600 s, which must stay well above this) ago."""

LISTED_TRUST_SECONDS = 1.0
"""A commit skips its parent check for a base a LIST showed as the newest this recently (see
``ManifestLog._listed_newest_lately``): about the time between that check and the PUT it guards."""

PREPARED_MERGE_MAX_AGE = PROBE_TRUST_SECONDS
"""Seconds after :meth:`ManifestLog.prepare_merge` during which a commit may swap its merge in,
on both of the log's clocks (see :class:`_Stamp`).

Until swapped in, a prepared merge is a segment no version references, and the reclaimer
deletes such segments once they are ``2 x grace`` old. A producer that commits nothing for
that long (a slow source, ``append`` blocked by ``max_lag``) must not then reference the
deleted object, so an older merge is dropped (an orphan) and a later roll merges again."""

DEFAULT_TAIL_LIMIT = 256
"""Descriptors kept inline in a manifest before a commit rolls them into a segment object."""

DEFAULT_TAIL_BYTES_LIMIT = 64 * 1024
"""JSON bytes of inline descriptors at which a commit rolls the tail, whatever their count.

Descriptors that carry slice tables are 0.3-1 KB each, so 256 of them made manifests of 100-250
KB; every commit reads, decodes, encodes and writes its manifest inside its fragile window, so
the manifest's size is part of every window. 64 KiB keeps that part to a few milliseconds of CPU
while a roll still moves dozens to hundreds of descriptors."""

_VERSION_RE = re.compile(r"([0-9]{20})\.manifest")
_NESTED_VERSION_RE = re.compile(rf"(.+)/{MANIFESTS_DIR}/[0-9]{{20}}\.manifest")
"""A manifest version of a namespace nested under another one's prefix (group 1: the rest
of its name)."""
_AMBIGUOUS_RESENDS = 3


def manifest_key(version: int) -> str:
    """Key of manifest ``version`` relative to the namespace."""
    return f"{MANIFESTS_DIR}/{version:020d}.manifest"


@dataclass(frozen=True)
class Committed:
    """Our attempt created the new version: its TGBs are visible from ``manifest`` on."""

    manifest: Manifest


@dataclass(frozen=True)
class Conflict:
    """Another attempt created the version we tried to write.

    ``winner`` is that version when it could be read back; ``None`` when the outcome is unknown
    (a 409, a transient error, or a reclaimed base): call :meth:`ManifestLog.latest` to rebase.
    """

    winner: Manifest | None
    failure: TransientStoreError | AmbiguousWriteError | None = dataclasses.field(
        default=None, compare=False
    )
    """Set when no race was lost: the store failed the attempt (a 5xx or throttling, a write
    whose outcome stayed unknown), and this is its error. Then nothing says another writer was
    there: a caller that paces itself by lost races (the producer) counts it as a retried
    failure instead. ``None`` for a lost race (a 412, a 409, a reclaimed base). Not compared:
    it is why the winner is unknown, not a different outcome."""


CommitResult = Committed | Conflict


def active_producers(manifest: Manifest, now: float, horizon: float) -> int:
    """Producers whose last commit lies within ``horizon`` seconds of ``now``; at least 1.

    This is the ``N`` of the DAC gap formula, read from committed state with no messages.
    """
    return max(1, len(active_producer_ids(manifest, now, horizon)))


def active_producer_ids(manifest: Manifest, now: float, horizon: float) -> list[str]:
    """The ids of the producers :func:`active_producers` counts, sorted (a producer's rank)."""
    cutoff = now - horizon
    return sorted(pid for pid, p in manifest.producers.items() if p.last_commit_at >= cutoff)


@dataclass(frozen=True)
class Settled:
    """What :func:`commit_until` did."""

    manifest: Manifest
    """The newest manifest: the version committed, or the one found to need no change."""
    parent: Manifest | None
    """The version the change was committed on; ``None`` when no commit was needed."""
    conflicts: int
    """Races lost on the way (another writer's version won), retried."""
    failures: int = 0
    """Attempts the store failed on the way (a 5xx or throttling, a write whose outcome stayed
    unknown: a :class:`Conflict` with a ``failure``), retried. Not lost races: nothing says
    another writer was there."""


def commit_until(
    log: ManifestLog,
    latest: Manifest,
    attempt: Callable[[Manifest], CommitResult | None],
    *,
    what: str,
    attempts: int = 50,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> Settled:
    """Commit a change on the newest version, rebasing on every lost race, until it lands.

    ``attempt(manifest)`` makes one :meth:`ManifestLog.commit` on ``manifest``, or returns
    ``None`` when ``manifest`` needs no change (someone else made it, or it no longer applies);
    it is called again on the newest version after every lost race or store failure, after a
    jittered backoff (up to 20 ms, doubling, at most 1 s). For operator changes (seal,
    reclamation boundary, retiring producer ids), which have no pacing of their own. Raises
    :class:`TransientStoreError` naming ``what`` after ``attempts`` attempts: all lost races,
    or, when the store failed any of them, how many it failed and its last error (chained as
    the cause), which is then what to look at, not another writer.
    """
    rng = rng or random.Random()
    conflicts = failures = 0
    failure: TransientStoreError | AmbiguousWriteError | None = None
    while True:
        result = attempt(latest)
        if result is None:
            return Settled(latest, None, conflicts, failures)
        if isinstance(result, Committed):
            return Settled(result.manifest, latest, conflicts, failures)
        if result.failure is None:
            conflicts += 1
        else:
            failures += 1
            failure = result.failure
        tried = conflicts + failures
        if tried >= attempts:
            where = f"{log.store.url}/{log.namespace}"
            if failure is None:
                raise TransientStoreError(
                    f"{where}: could not commit {what} after {conflicts} lost races (latest "
                    f"version {latest.version}); retry"
                )
            races = f", {conflicts} lost a race to another writer" if conflicts else ""
            raise TransientStoreError(
                f"{where}: could not commit {what} in {tried} attempts: the store failed "
                f"{failures} of them (last: {type(failure).__name__}: {failure}){races} (latest "
                f"version {latest.version}); check the store's health (errors, throttling) "
                "and retry"
            ) from failure
        sleep(rng.uniform(0.0, min(1.0, 0.01 * 2**tried)))
        latest = log.latest(result.winner or latest)


def _check_retire(
    retire: Collection[str], append: Sequence[TgbDescriptor], producers: Mapping[str, ProducerState]
) -> None:
    if isinstance(retire, str):
        raise TypeError(f"retire takes a collection of producer ids, not the string {retire!r}")
    touched = sorted(set(retire) & ({d.producer_id for d in append} | set(producers)))
    if touched:
        raise ValueError(
            f"cannot retire producer id(s) {touched} in the commit that appends or updates them"
        )


def check_tiling(desc: TgbDescriptor, manifest: Manifest, step: int, where: str) -> None:
    """Refuse ``desc``, the TGB at ``step`` of ``manifest`` (of ``where``), with a
    :class:`FormatError` unless its objects hold the mesh's slices in order."""
    problem = desc.tiling_problem(manifest.mesh.slices)
    if problem is not None:
        raise FormatError(
            f"{where}: step {step} (manifest version {manifest.version}): {problem}; it was not "
            "written by BatchWeave (or was edited), and reading it would give ranks the wrong "
            "slices. Run `batchweave verify`; restore the namespace from a backup"
        )


def _steps(manifest: Manifest) -> str:
    """The steps ``manifest`` holds, for messages."""
    if manifest.next_step <= manifest.base_step:
        return f"no steps, next step {manifest.next_step}"
    return f"steps {manifest.base_step}..{manifest.next_step - 1}"


def _tgb_identity(desc: TgbDescriptor) -> tuple[object, ...]:
    """What makes a descriptor the same TGB: its producer, epoch, offset and object keys (each
    with a random part, so a TGB written again has other keys)."""
    return (desc.producer_id, desc.epoch, desc.offset, tuple(o.key for o in desc.objects))


def _tgb_name(desc: TgbDescriptor) -> str:
    first = desc.objects[0].key if desc.objects else "no object"
    return f"the TGB of producer {desc.producer_id!r} offset {desc.offset} ({first})"


def _went_back(seen: Manifest, new: Manifest) -> str | None:
    """How ``new`` contradicts ``seen``, the newest version a client saw; ``None`` if it does not.

    Steps are never taken back (``next_step`` only grows), reclaimed steps never return
    (``base_step`` only grows), a version is written once, and a step never changes its TGB:
    the last step ``seen`` holds is compared when both hold it inline (O(1), no request). A
    history rewritten from an older version (a restored backup, then commits on it), or a
    version re-created over a gap in the version numbers, gives that step to another TGB.
    """
    if new.version == seen.version:
        if new.commit_id == seen.commit_id:
            return None
        return (
            f"manifest version {new.version} changed: this client saw it as commit "
            f"{seen.commit_id} (next_step {seen.next_step}), it is now commit {new.commit_id} "
            f"(next_step {new.next_step}); a version is written once"
        )
    if new.version < seen.version:
        return None
    for field, why in (
        ("next_step", "steps are never taken back"),
        ("base_step", "reclaimed steps never return"),
    ):
        before, after = getattr(seen, field), getattr(new, field)
        if after < before:
            return (
                f"manifest version {new.version} has {field} {after}, but version "
                f"{seen.version}, which this client saw before, has {field} {before}: {why}"
            )
    step = seen.next_step - 1
    if step >= max(seen.tail_start, new.tail_start, new.base_step):
        before_tgb = seen.tail[step - seen.tail_start]
        after_tgb = new.tail[step - new.tail_start]
        if before_tgb is not after_tgb and _tgb_identity(before_tgb) != _tgb_identity(after_tgb):
            return (
                f"step {step} is {_tgb_name(after_tgb)} in manifest version {new.version}, but "
                f"{_tgb_name(before_tgb)} in version {seen.version}, which this client saw "
                "before: a step never changes its TGB"
            )
    return None


@dataclass(frozen=True)
class _Stamp:
    """When a segment that no version references yet began to be written, on both clocks of
    the log that wrote it (see PREPARED_MERGE_MAX_AGE).

    A commit may reference such a segment only while it is young: the reclaimer deletes an
    unreferenced segment once its ``last_modified`` (the store's clock) is ``2 x
    metadata_grace`` (at least 240 s) old by the reclaimer's own clock. Judged by the writer's
    wall clock alone, a clock stepped back (NTP) or standing still made a segment written hours
    ago look fresh. The monotonic clock neither steps back nor stands still, but on Linux it
    stops while the host is suspended, when the wall clock keeps counting: a segment counts as
    young only while *both* say so, so it is stale-but-trusted only if both fail at once. The
    gap between the two bounds (180 s at least) must cover the skew between the reclaimer's
    clock and the store's plus the commit's fragile window after the check; the stamp is taken
    before the write, so the object is never younger than it says.
    """

    monotonic: float
    wall: float

    def within(self, now: _Stamp, limit: float) -> bool:
        """Whether at most ``limit`` seconds passed from this stamp to ``now`` on both clocks.
        A clock that went back counts as too old: dropping a young segment only costs a rewrite."""
        return 0 <= now.monotonic - self.monotonic <= limit and 0 <= now.wall - self.wall <= limit


@dataclass(frozen=True)
class _Roll:
    """A segment a commit attempt wrote for its tail, kept for the next attempt to reuse.

    A commit that fails after its roll (a throttled or unreachable manifest PUT) would
    otherwise write everything still pending into a new segment on every retry: an outage of
    the manifest prefix alone left one orphan of every pending descriptor per attempt.
    """

    namespace_id: str
    before: tuple[SegmentRef, ...]
    """The references the roll started from."""
    tail: tuple[TgbDescriptor, ...]
    """The descriptors it wrote (the tail it rolled), from ``tail_start`` on."""
    tail_start: int
    base_step: int
    after: tuple[SegmentRef, ...]
    """The references it returned: ``before`` (less what it merged) and the new segment."""
    written_at: _Stamp
    """When the roll began, on both of the log's clocks (see :class:`_Stamp`)."""

    def reuse(
        self,
        namespace_id: str,
        segments: Sequence[SegmentRef],
        tail: Sequence[TgbDescriptor],
        tail_start: int,
        base_step: int,
        now: _Stamp,
    ) -> tuple[SegmentRef, ...] | None:
        """The references after this roll, if a roll of ``tail`` from ``segments`` may start
        with it: same references, start and base step, ``tail`` beginning with the rolled
        descriptors, and the segment young enough that no reclaimer deleted it as an orphan."""
        if (
            not self.after
            or not self.written_at.within(now, PREPARED_MERGE_MAX_AGE)
            or (namespace_id, tail_start, base_step)
            != (self.namespace_id, self.tail_start, self.base_step)
            or len(tail) < len(self.tail)
            or tuple(segments) != self.before
        ):
            return None
        if not all(a is b or a == b for a, b in zip(self.tail, tail, strict=False)):
            return None
        return self.after


class ManifestLog:
    """Manifest versions of one namespace in one store.

    ``namespace`` is a relative path such as ``"runs/job-42"``; every object lives under
    ``f"{namespace}/"``. Thread-safe; segment reads are cached: at most ``segment_cache``
    segments, and beyond the two most recently used (a reader's segment and the next) at most
    ``segment_cache_tgbs`` descriptors (default ``max_segment_tgbs``; a decoded descriptor takes
    about 4 KB at ``dp=2``, 10 KB at ``dp=64``).
    ``tail_limit`` descriptors, or ``tail_bytes_limit`` bytes of their JSON (``None``: no byte
    bound), stay inline before the tail rolls into a segment object, and segments hold at
    most ``max_segment_tgbs`` descriptors (default ``64 * tail_limit``) and
    ``SEGMENT_BYTES_BUDGET`` bytes. A manifest or segment over the size readers accept
    (``MAX_MANIFEST_BYTES``, ``MAX_SEGMENT_BYTES``) is refused before its PUT
    (:class:`NamespaceError`).
    ``merge_fanout`` segments of one level merge into one of the next (``docs/protocol.md``).

    ``clock`` (wall-clock seconds) stamps versions and judges their age; ``monotonic`` times
    the intervals a wall-clock step must not stretch: the short one a commit trusts a listing
    for, how long a missing successor of a version first seen is trusted, and (with ``clock``
    too) the age of segments no version references yet.

    With ``deferred_merges`` a commit only ever writes its tail as a segment; the level merges
    that roll calls for are written by :meth:`prepare_merge`, which the caller runs *outside*
    the fragile window (after a commit), and the next commit through this log swaps them in.
    The producer does this; other callers (the reclaimer, tools) keep merging inside ``commit``.
    """

    def __init__(
        self,
        store: ObjectStore,
        namespace: str,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        tail_limit: int = DEFAULT_TAIL_LIMIT,
        tail_bytes_limit: int | None = DEFAULT_TAIL_BYTES_LIMIT,
        segment_cache: int = 64,
        segment_cache_tgbs: int | None = None,
        max_segment_tgbs: int | None = None,
        merge_fanout: int = DEFAULT_MERGE_FANOUT,
        deferred_merges: bool = False,
    ) -> None:
        check_store(store)  # every reader and writer of a namespace starts here
        check_namespace(namespace)
        if tail_limit < 1:
            raise ValueError(f"tail_limit must be >= 1, got {tail_limit}")
        if tail_bytes_limit is not None and tail_bytes_limit < 1:
            raise ValueError(f"tail_bytes_limit must be >= 1 or None, got {tail_bytes_limit}")
        self.store = store
        self.namespace = namespace
        self._clock = clock
        self._monotonic = monotonic
        self.tail_limit = tail_limit
        self.tail_bytes_limit = tail_bytes_limit
        self.last_commit_bytes = 0
        """Manifest and segment bytes the latest :meth:`commit` sent (for pacing policies)."""
        self.max_segment_tgbs = max_segment_tgbs or 64 * tail_limit
        if self.max_segment_tgbs < tail_limit:
            raise ValueError(
                f"max_segment_tgbs ({self.max_segment_tgbs}) must be >= tail_limit ({tail_limit})"
            )
        if merge_fanout < 2:
            raise ValueError(f"merge_fanout must be >= 2, got {merge_fanout}")
        self.merge_fanout = merge_fanout
        self.deferred_merges = deferred_merges
        self._segments = SegmentFiles(
            store,
            self.key,
            cache=segment_cache,
            cache_tgbs=self.max_segment_tgbs if segment_cache_tgbs is None else segment_cache_tgbs,
        )
        self._merge_lock = threading.Lock()
        self._rolled: str | None = None
        """Key of the segment the last commit built by this log rolled (deferred merges)."""
        self._last_roll: _Roll | None = None
        """The roll of the last commit attempt, until a commit lands (see :class:`_Roll`)."""
        self._prepared: tuple[tuple[SegmentRef, ...], SegmentRef] | None = None
        """A merge written outside the fragile window: (references it replaces, its reference)."""
        self._prepared_at = _Stamp(0.0, 0.0)
        """When the prepared merge began to be written (see :class:`_Stamp`)."""
        self._namespace_id: str | None = None
        self._mesh: Mesh | None = None
        self._newest: Manifest | None = None
        """The newest version this client read, was given or committed (see ``_observe``)."""
        self._newest_since = 0.0
        """``monotonic()`` when this client first saw ``_newest`` (see :meth:`_trusts_probe`)."""
        self._observe_lock = threading.Lock()
        self._reclaimed_below = 0
        """Versions below this were seen reclaimed: ``latest`` must not trust them as current."""
        self._listed: tuple[Manifest, float] | None = None
        """The version the last :meth:`latest` confirmed by a LIST, and ``monotonic()`` at its
        call."""
        self._confirmed: tuple[Manifest, float] | None = None
        """The ``known`` version :meth:`_read_back` last read back, and ``monotonic()`` then."""

    def __repr__(self) -> str:
        return f"ManifestLog({self.store.url!r}, {self.namespace!r})"

    def key(self, relative: str) -> str:
        """Store key of ``relative`` (a key inside the namespace)."""
        return f"{self.namespace}/{relative}"

    @property
    def _where(self) -> str:
        return f"{self.store.url}/{self.namespace}"

    def missing_segment(self, latest: Manifest, ref: SegmentRef) -> str:
        """What to tell of segment ``ref``, which ``latest`` (the newest version) lists but the
        store no longer holds: damage no reader can work around, and what to do about it."""
        return (
            f"segment {self.key(ref.key)!r}, which manifest version {latest.version} (the "
            f"latest) lists for TGB steps {ref.first_step}..{ref.end_step - 1}, is missing: the "
            "namespace is damaged (a segment is never deleted while the latest version lists "
            "it; was it deleted by hand?), and those steps are unreadable for every consumer. "
            "Run `batchweave verify` on the namespace; restore the segment object from a "
            "backup, or continue in a new namespace"
        )

    # -- discovery ---------------------------------------------------------------------------

    def create_or_open(self, mesh: Mesh | None = None) -> Manifest:
        """Open the namespace, creating version 0 for ``mesh`` if nothing exists yet.

        With a ``mesh``, a namespace created with another mesh is :class:`NamespaceMismatch`, as
        is a prefix holding objects BatchWeave did not write. Concurrent creators agree on one
        ``namespace_id``: version 0 is a conditional create. Without a ``mesh``, only opening is
        possible (:class:`NamespaceNotFound` if nothing was committed). Returns the latest version.
        """
        if not self._has_versions():
            if mesh is None:
                raise NamespaceNotFound(
                    f"no BatchWeave namespace at {self._where} (no {MANIFESTS_DIR}/ versions); "
                    "create it by opening a Producer with mesh=..., or check the namespace name"
                )
            self._refuse_foreign_prefix()
            genesis = Manifest(
                namespace_id=uuid.uuid4().hex,
                mesh=mesh,
                version=0,
                commit_id=uuid.uuid4().hex,
                created_at=self._clock(),
            )
            self._create_genesis(genesis)
            manifest = self._open_created()
        else:
            manifest = self.latest()
        if mesh is not None and manifest.mesh != mesh:
            raise NamespaceMismatch(
                f"namespace {self._where} was created for mesh ({manifest.mesh}), "
                f"this client asked for mesh ({mesh}); use the namespace's mesh or a new namespace"
            )
        return manifest

    def _open_created(self) -> Manifest:
        """The newest version of a namespace whose version 0 was just created, by us or by a
        concurrent creator: version 0 read directly, then probed forward from it.

        Not a LIST: a store whose listing lags behind its writes (SeaweedFS) may not list the
        version 0 that was just written, and the namespace would be "not found" right after its
        creation. Only a version 0 that is gone again (reclaimed in a namespace created long
        ago, whose listing also lagged) falls back to a LIST.
        """
        try:
            first = self.read(0)
        except ObjectNotFound:
            return self.latest()
        return self.latest(first)

    def _create_genesis(self, genesis: Manifest) -> None:
        key, data = self.key(manifest_key(0)), encode_manifest(genesis)
        for _ in range(_AMBIGUOUS_RESENDS + 1):
            try:
                self.store.put_if_absent(key, data)
                _log.info("created namespace %s (id %s)", self._where, genesis.namespace_id)
                return
            except ObjectExists:
                return  # a concurrent creator, or our own landed write: read back by the caller
            except AmbiguousWriteError as exc:
                _log.warning("creating %s: ambiguous outcome (%s); reading back", key, exc)
                try:
                    self.store.head(key)  # not a LIST: a lagging one would not show it yet
                except ObjectNotFound:
                    if self._has_versions():  # a namespace whose version 0 was reclaimed
                        return
                else:
                    return
        raise AmbiguousWriteError(
            f"could not create {key}: every attempt had an unknown outcome and nothing is there; "
            "check the store and retry"
        )

    def _has_versions(self) -> bool:
        return next(self._version_keys(), None) is not None

    def _refuse_foreign_prefix(self) -> None:
        """Refuse to create a namespace on a prefix holding objects that are not its own.

        A namespace under the prefix (``a/b`` when creating ``a``, even one named like
        ``a/_manifests`` by an older version) is named as such: namespaces cannot nest around
        an existing one, since the outer one's objects would mix with the inner one's.
        """
        prefix = f"{self.namespace}/"
        for meta in self.store.list(prefix):
            relative = meta.key[len(prefix) :]
            nested = _NESTED_VERSION_RE.fullmatch(relative)
            if nested is not None:
                raise NamespaceMismatch(
                    f"cannot create namespace {self.namespace!r} in {self.store.url}: namespace "
                    f"{prefix + nested.group(1)!r} exists under it ({meta.key!r}), and "
                    "namespaces cannot be created around an existing one; choose a prefix "
                    "that holds no namespace"
                )
            top = relative.split("/", 1)[0]
            if top not in NAMESPACE_DIRS:
                raise NamespaceMismatch(
                    f"prefix {self.store.url}/{prefix} already holds {meta.key!r}, which "
                    "BatchWeave did not write; choose an empty prefix for a new namespace"
                )

    def _version_keys(
        self, start_after: str | None = None
    ) -> Generator[tuple[int, str], None, None]:
        prefix = self.key(f"{MANIFESTS_DIR}/")
        for meta in self.store.list(prefix, start_after=start_after):
            match = _VERSION_RE.fullmatch(meta.key[len(prefix) :])
            if match is not None:
                yield int(match.group(1)), meta.key

    def _listed_page(self, after: int | None) -> tuple[int | None, bool]:
        """One LIST page of the versions after version ``after`` (``None``: from the start):
        the newest of them (``None``: none listed), and whether the page was full, so that more
        may follow. The listing is abandoned after a page: a probe costs one request."""
        start_after = None if after is None else self.key(manifest_key(after))
        newest: int | None = None
        listing = self._version_keys(start_after)
        for count, (version, _) in enumerate(listing, 1):
            if after is None or version > after:
                newest = version if newest is None else max(newest, version)  # not trusting order
            if count == LIST_PAGE_SIZE:
                listing.close()
                return newest, True
        return newest, False

    def _newest_listed(self, after: int | None) -> int | None:
        """The newest version listed after version ``after`` (``None``: from the start), or
        ``None`` when none is; O(log(versions / page)) LIST requests, not one per page.

        Version keys sort as version numbers, and the versions above the reclaimed ones are
        dense, so a LIST page after any version tells whether the newest lies within it (a page
        that is not full) or beyond it. Past a full first page, pages after versions ever
        farther ahead (one page, two, four...) find one that lists nothing, and bisecting
        between the highest version listed and it finds the last page. What a probe lists
        never lowers the answer: a listing that lags behind the writes, or versions reclaimed
        meanwhile, make a probe list nothing too early, and the answer is then at least the
        newest version listed so far (:meth:`_not_behind_seen` checks it as before).
        """
        newest, full = self._listed_page(after)
        if not full or newest is None:
            return newest
        empty: int | None = None  # a probe listed nothing after this version
        stride = LIST_PAGE_SIZE
        while True:
            if empty is None:
                probe = newest + stride
                stride *= 2
            elif empty - newest > LIST_PAGE_SIZE:
                probe = (newest + empty) // 2
            else:
                probe = newest  # the newest lies within one page after it
            found, full = self._listed_page(probe)
            if found is None:
                if probe == newest:
                    return newest
                empty = probe
                continue
            newest = max(newest, found)
            if not full or newest == empty:  # the page ended where nothing was listed after
                return newest
            if empty is not None and newest > empty:  # committed since that probe
                empty, stride = None, LIST_PAGE_SIZE

    def versions(self) -> Iterator[int]:
        """Committed version numbers in increasing order (one LIST; for tools and the reclaimer)."""
        for version, _ in self._version_keys():
            yield version

    def latest(self, known: Manifest | None = None) -> Manifest:
        """The newest version.

        With ``known`` current this costs one GET (of ``known.version + 1``, absent). When behind,
        LISTs after that version find the newest (:meth:`_newest_listed`: a few, however far
        behind), which is then read. Without ``known`` the search starts from the first version;
        so does it for a ``known`` that a commit found reclaimed, since its successor may be gone
        too.
        Never older than the newest version this client saw: a :class:`FormatError` if that
        one is gone with only older ones left (see :meth:`_not_behind_seen`).
        """
        asked_at = self._monotonic()
        newest, listed = self._not_behind_seen(*self._find_latest(known))
        self._listed = (newest, asked_at) if listed else None
        return newest

    def _not_behind_seen(self, found: Manifest, listed: bool) -> tuple[Manifest, bool]:
        """``(found, listed)``, unless ``found`` is older than the newest version this client
        saw: then that version is read again. Still there, a LIST lagging behind the writes
        (SeaweedFS) hid it, and the newest is probed from it; gone, history went back, a
        :class:`FormatError`.

        The reclaimer never deletes the newest version, so a version this client saw goes only
        once a newer one exists. The newest versions gone with only older ones left means an
        older copy of the namespace was restored over it, or versions were deleted by hand: the
        steps after the older version's, which this client may have served, would go to other
        TGBs at the next commit.
        """
        seen = self._newest
        if seen is None or found.version >= seen.version:
            return found, listed
        try:
            again = self.read(seen.version)  # another commit there is refused by _observe
        except ObjectNotFound:
            raise FormatError(
                f"{self._where}: manifest version {seen.version}, the newest this client saw "
                f"({_steps(seen)}), is gone, and the newest version left is {found.version} "
                f"({_steps(found)}). The newest version is never deleted by BatchWeave, so "
                "an older copy of the namespace was restored over it or its newest versions "
                "were deleted by hand; history went back, and committing on it would give steps "
                "already served to other TGBs. Stop writing into this prefix; restore the "
                f"namespace from a backup holding version {seen.version} or later (or put the "
                "deleted versions back), or start a new namespace"
            ) from None
        self._confirmed = (again, self._monotonic())  # read just now: no read-back of it
        newest, listed = self._find_latest(again)
        if newest.version < seen.version:  # only a listing that contradicts the reads
            raise FormatError(
                f"{self._where}: the newest version listed is {newest.version}, but version "
                f"{seen.version} was read just now; the store's listing of {MANIFESTS_DIR}/ "
                "contradicts its reads. Check the store, and retry"
            )
        return newest, listed

    def _trusts_probe(self, known: Manifest) -> bool:
        """Whether a missing ``known.version + 1`` shows that ``known`` is the newest version.

        Young versions cannot have lost their successor to reclamation (the reclaimer's grace is
        longer). Two clocks must call ``known`` young: its ``created_at`` (the committer's wall
        clock) within ``PROBE_TRUST_SECONDS`` of ours, either way, and this client's first sight
        of it (a read, a commit, or a manifest it was given) less than ``PROBE_TRUST_SECONDS``
        ago on our monotonic clock. The first makes a version written long ago untrusted from
        the start; the second ends the trust ``PROBE_TRUST_SECONDS`` after we first saw the
        version, whatever the committer's clock said (one running an hour ahead made a reader
        that held a version for an hour trust its reclaimed successor, and stall). Only the
        newest version seen is timed (O(1) memory): an older ``known`` is not trusted, since a
        newer version was seen. A consumer polling at the head keeps seeing new versions as
        they are committed, so its steady state stays one GET.
        """
        if abs(self._clock() - known.created_at) > PROBE_TRUST_SECONDS:
            return False
        with self._observe_lock:
            newest, since = self._newest, self._newest_since
        if newest is None or (newest.version, newest.commit_id) != (
            known.version,
            known.commit_id,
        ):
            return False
        return 0 <= self._monotonic() - since < PROBE_TRUST_SECONDS

    def latest_from(self, known: Manifest | None) -> Manifest:
        """The newest version, found from ``known`` (the newest version an earlier lookup
        returned) with LISTs and one GET, trusting no clock; for callers that look up seldom (a
        checkpoint's watermark, a reclaimer pass), when ``known`` is likely old.

        LISTs after ``known`` find the newest version listed (:meth:`_newest_listed`), which is
        read. It finds the newest even when ``known`` and its successor were reclaimed meanwhile
        (the newest is never deleted). When none is listed, ``known`` is read back and must be the
        same commit (``namespace_id`` and ``commit_id``): nothing listed after a version that is
        gone proves nothing. Its prefix may have been deleted, or re-created with fewer versions,
        and the caller would otherwise go on with another namespace's manifest. A ``known`` that is
        gone or different leads to a lookup without it, as :meth:`latest` does:
        :class:`NamespaceNotFound` when nothing is left, :class:`NamespaceMismatch` for a re-created
        namespace (another ``namespace_id``; reading it back already refuses it). A confirmed
        ``known`` was the newest when listed: the reclaimer deletes versions oldest first and never
        the newest, so had a newer version been written before the LIST, it would still exist, and
        have been listed.
        """
        if known is None:
            return self.latest()
        asked_at = self._monotonic()
        newest = self._newest_listed(known.version)
        if newest is None:
            if not self._still_there(known):  # gone or another commit: a prefix deleted?
                return self.latest()
            found = known
        else:
            try:
                found = self.read(newest)
            except ObjectNotFound:
                return self.latest()  # deleted since the LIST
        found, listed = self._not_behind_seen(found, True)
        self._listed = (found, asked_at) if listed else None
        return found

    def _find_latest(self, known: Manifest | None) -> tuple[Manifest, bool]:
        """The newest version, and whether it was read and a LIST showed nothing after it."""
        after: int | None = None
        found: Manifest | None = None
        if known is not None and known.version < self._reclaimed_below:
            known = None  # its successor may be reclaimed too: a probe would wrongly say "current"
        if known is not None:
            self._observe(known, self.key(manifest_key(known.version)))
            try:
                found = self.read(known.version + 1)
            except ObjectNotFound:
                if self._trusts_probe(known):
                    return known, False
                # An old ``known`` may have had its successor reclaimed, so a missing
                # ``known.version + 1`` proves nothing: one LIST after it decides.
                found = known
            after = found.version
        newest = self._newest_listed(after)
        if newest is not None:
            return self.read(newest), True
        if found is not None and found is not known:
            return found, True  # read a moment ago, and nothing listed after it
        if found is not None:
            # Nothing listed after a ``known`` that is gone too proves nothing: read it back.
            return self._read_back(found)
        raise NamespaceNotFound(
            f"no BatchWeave namespace at {self._where} (no {MANIFESTS_DIR}/ versions); create "
            "it by opening a Producer with mesh=..., or check the namespace name"
        )

    def _read_back(self, known: Manifest) -> tuple[Manifest, bool]:
        """``known``, after a LIST showed no version after it, read back as :meth:`latest_from`
        does; when it is gone (or another commit), the newest version from a lookup without it.

        Nothing listed after a version that is gone proves nothing: an older copy of the
        namespace restored over it (the newest versions a client saw gone, only older ones
        left) or a deleted prefix. The lookup without it then finds what is left, and
        :meth:`_not_behind_seen` refuses an older version with a :class:`FormatError` instead
        of a consumer waiting at the head forever. Read back at most once per
        ``PROBE_TRUST_SECONDS`` (``monotonic``) for the same ``known``: a consumer waiting at an
        old head lists on every poll, and the read-back must not add a request to each one.
        Returns ``(manifest, listed)`` as :meth:`_find_latest` does.
        """
        now = self._monotonic()
        confirmed = self._confirmed
        if (
            confirmed is not None
            and confirmed[0] is known
            and 0 <= now - confirmed[1] < PROBE_TRUST_SECONDS
        ):
            return known, False
        try:
            there = self._still_there(known)
        except ChecksumMismatch:
            # Bit rot in the version this client holds intact: no sign of history going back
            # (commits on it go on, as before the read-back; verify and reclaim name it).
            there = True
        if not there:
            return self._find_latest(None)
        self._confirmed = (known, now)
        return known, True

    def _still_there(self, known: Manifest) -> bool:
        """Whether version ``known.version``, read back, is still the commit ``known`` (gone or
        another commit: ``False``; another commit at the newest seen is refused by ``read``)."""
        try:
            again = self.read(known.version)
        except ObjectNotFound:
            return False
        return (again.namespace_id, again.commit_id) == (known.namespace_id, known.commit_id)

    def read(self, version: int) -> Manifest:
        """Manifest ``version``; :class:`ObjectNotFound` if it does not exist (or was reclaimed).

        One bounded range read: an object larger than ``MAX_MANIFEST_BYTES`` is a
        :class:`FormatError` after ``MAX_MANIFEST_BYTES + 1`` bytes, never downloaded whole.
        The version is then checked against what this client saw before (:meth:`_observe`).
        """
        key = self.key(manifest_key(version))
        limit = _codec.MAX_MANIFEST_BYTES  # the codec's own bound, looked up as it does
        try:
            # One request either way: a range past the end returns the whole (smaller) object on
            # every backend, and a bigger one is refused below without downloading it.
            data = self.store.get_range(key, Bounded(0, limit + 1))
        except ObjectNotFound as exc:
            raise ObjectNotFound(
                f"manifest version {version} does not exist at {key} (not committed yet, or "
                "reclaimed)"
            ) from exc
        if len(data) > limit:
            raise FormatError(
                f"{key}: manifest version {version} is larger than {limit} bytes, the most a "
                "manifest may be (BatchWeave writes kilobytes; only the first "
                f"{limit + 1} bytes were read): the object was replaced by something other than "
                f"BatchWeave. Restore it from a backup, and write nothing else under {self._where}"
            )
        manifest = decode_manifest(data, key=key, previous=self._newest)
        if manifest.version != version:
            raise FormatError(f"{key}: object says it is version {manifest.version}, not {version}")
        self._observe(manifest, key)
        return manifest

    def _observe(self, manifest: Manifest, key: str) -> None:
        """Check ``manifest`` (stored at ``key``) against what this client saw, then note it.

        Every manifest enters a client here: versions it reads, the ``known`` version it asks
        :meth:`latest` about, the base of a commit and the version a commit wrote. So a producer
        (rebasing on a winner or on ``latest``), a consumer (refreshing) and tools all refuse a
        history that changes under them: another namespace id or mesh is
        :class:`NamespaceMismatch`; a version newer than the newest one seen with fewer steps
        (``next_step``) or an earlier ``base_step``, or the newest version seen written again
        with another commit, is :class:`FormatError`. Older versions (a reclaimer bisecting,
        ``batchweave verify`` walking the history) are checked for identity only.
        """
        # One lock for identity and history: a thread whose first read landed between the
        # two stores of another's would see its namespace id with no mesh yet.
        with self._observe_lock:
            if self._namespace_id is None:
                self._namespace_id, self._mesh = manifest.namespace_id, manifest.mesh
            elif manifest.namespace_id != self._namespace_id:
                raise NamespaceMismatch(
                    f"{key} belongs to namespace id {manifest.namespace_id}, but this client "
                    f"opened namespace id {self._namespace_id} at {self._where}; was the prefix "
                    "deleted and re-created?"
                )
            elif manifest.mesh != self._mesh:
                raise NamespaceMismatch(
                    f"{key} says namespace {self._where} has mesh ({manifest.mesh}), but this "
                    f"client opened it with mesh ({self._mesh}); a namespace's mesh never "
                    "changes, so the object is corrupt or forged"
                )
            seen = self._newest
            if seen is not None and seen is not manifest:
                problem = _went_back(seen, manifest)
                if problem is not None:
                    raise FormatError(
                        f"{key}: {problem}, so the manifest history of {self._where} was "
                        "rewritten by something other than BatchWeave (an older copy restored "
                        "over it, versions deleted by hand, an edit, another tool) and its "
                        "step -> TGB mapping cannot be trusted. Stop writing into this prefix; "
                        "restore the namespace from a backup, or start a new namespace"
                    )
            if seen is None or manifest.version > seen.version:
                self._newest, self._newest_since = manifest, self._monotonic()
                if seen is not None and manifest.base_step > seen.base_step:
                    self._segments.drop_below(manifest.base_step)

    # -- steps -------------------------------------------------------------------------------

    def descriptor(self, manifest: Manifest, step: int) -> TgbDescriptor:
        """The TGB at ``step`` in ``manifest``: at most one (cached) segment read.

        :class:`FormatError` if its objects do not hold the mesh's slices in order (see
        :meth:`TgbDescriptor.tiling_problem`): no writer of this library makes one.
        """
        self._check_step(manifest, step)
        if step >= manifest.tail_start:
            desc = manifest.tail[step - manifest.tail_start]
        else:
            ref = find_segment(manifest.segments, step)
            desc = self._segments.read(ref, manifest.namespace_id).tgbs[step - ref.first_step]
        check_tiling(desc, manifest, step, self._where)
        return desc

    def descriptors(
        self, manifest: Manifest, start: int, stop: int
    ) -> Iterator[tuple[int, TgbDescriptor]]:
        """``(step, descriptor)`` for steps ``start .. stop-1``, reading each segment once."""
        if stop <= start:
            return
        self._check_step(manifest, start)
        self._check_step(manifest, stop - 1)
        step = start
        while step < stop:
            if step >= manifest.tail_start:
                for i in range(step - manifest.tail_start, stop - manifest.tail_start):
                    yield manifest.tail_start + i, manifest.tail[i]
                return
            ref = find_segment(manifest.segments, step)
            tgbs = self._segments.read(ref, manifest.namespace_id).tgbs
            end = min(stop, ref.end_step)
            for s in range(step, end):
                yield s, tgbs[s - ref.first_step]
            step = end

    def _check_step(self, manifest: Manifest, step: int) -> None:
        if step < 0:
            # Not "reclaimed": no step below 0 ever existed (and tail[-1] would be the newest).
            raise IndexError(
                f"step {step} is negative: manifest version {manifest.version} of "
                f"{self._where} holds steps {manifest.base_step}..{manifest.next_step - 1}"
            )
        if step < manifest.base_step:
            raise StepReclaimed(
                f"step {step} was reclaimed (base_step {manifest.base_step} in manifest "
                f"version {manifest.version} of {self._where}); resume from a later checkpoint"
            )
        if step >= manifest.next_step:
            raise IndexError(
                f"step {step} is not committed yet: manifest version {manifest.version} of "
                f"{self._where} holds steps {manifest.base_step}..{manifest.next_step - 1}"
            )

    # -- commit ------------------------------------------------------------------------------

    def commit(
        self,
        base: Manifest,
        *,
        append: Sequence[TgbDescriptor] = (),
        producers: Mapping[str, ProducerState] = {},
        base_step: int | None = None,
        seal: bool = False,
        retire: Collection[str] = (),
    ) -> CommitResult:
        """One attempt to write version ``base.version + 1`` = ``base`` plus this change.

        ``append`` gets steps ``base.next_step...``; ``producers`` entries replace whole producer
        states; then every producer that appends gets ``offset`` (its last appended offset),
        ``last_version`` and ``last_commit_at`` updated. ``base_step`` raises the reclamation
        boundary; ``seal`` ends the stream. ``retire`` removes producer ids from the state map
        (their TGBs stay; a running incarnation of a retired id is fenced at its next rebase,
        see :func:`batchweave.retire_producers`); it cannot be combined with a change to the
        same ids. Appended descriptors must not repeat or reorder a
        committed offset (:class:`OffsetOrderError`) nor carry an epoch older than the committed
        one (:class:`ProducerFenced`); appending to a sealed manifest is :class:`NamespaceSealed`.

        Returns :class:`Committed` if our conditional PUT created the version (including when an
        ambiguous or SDK-retried write turns out to be ours), else :class:`Conflict`.
        """
        version = base.version + 1
        key = self.key(manifest_key(version))
        self._observe(base, self.key(manifest_key(base.version)))
        now = self._clock()
        self.last_commit_bytes = 0
        self._check_append(base, append, version)
        _check_retire(retire, append, producers)
        next_step = base.next_step + len(append)
        if base_step is not None and base_step > next_step:
            raise ValueError(
                f"base_step {base_step} is beyond the committed steps (next step {next_step}) "
                f"of {self._where}"
            )
        try:
            if not self._listed_newest_lately(base):
                self.store.head(self.key(manifest_key(base.version)))
        except ObjectNotFound:
            _log.info("base version %d of %s was reclaimed; refresh and retry", base.version, key)
            self._reclaimed_below = max(self._reclaimed_below, base.version + 1)
            return Conflict(None)
        except TransientStoreError as exc:
            _log.warning("commit of %s: transient error checking the parent: %s", key, exc)
            return Conflict(None, exc)
        try:
            manifest = self._build(base, version, now, append, producers, base_step, seal, retire)
        except (TransientStoreError, AmbiguousWriteError) as exc:
            _log.warning("commit of %s: transient error writing segments: %s", key, exc)
            return Conflict(None, exc)
        result = self._put(key, manifest)
        if isinstance(result, Committed):
            self._last_roll = None
            if self.deferred_merges:
                self._keep_mergeable(result.manifest)
        return result

    def _keep_mergeable(self, committed: Manifest) -> None:
        """Cache only the segments a producer may read again after committing ``committed``.

        With ``deferred_merges`` (the producer) this log reads segments only to merge them:
        rolls and merges absorb the newest references that are not full, and
        :meth:`refresh_prepared_merge` rereads the prepared merge. Everything else it wrote or
        merged (full segments, references merged away or reclaimed) is never read again.
        """
        keep = {ref.key for ref in committed.segments if not is_full(ref, self.max_segment_tgbs)}
        with self._merge_lock:
            if self._prepared is not None:
                keep.add(self._prepared[1].key)
        self._segments.retain(keep)

    def stop_caching_segments(self) -> None:
        """Drop every cached segment and cache none from now on (the log's user is done
        reading): a closed reader still referenced then holds no descriptors, even once a read
        that was in flight when it closed ends. Reads after it just read segments again."""
        self._segments.stop_caching()

    def _listed_newest_lately(self, base: Manifest) -> bool:
        """Whether the last :meth:`latest` read ``base`` and then a LIST showed no version
        after it, less than ``LISTED_TRUST_SECONDS`` ago (on the monotonic clock: a wall clock
        stepped back would stretch the interval past a short grace).

        A commit checks that its base still exists (a HEAD) because the reclaimer deletes
        versions oldest first and never the newest: a surviving base means its successor, the
        name the commit is about to create, was not reclaimed. A LIST that shows no version
        after ``base`` proves the same for its moment: had the successor been reclaimed, a newer
        version (the newest, never deleted) would have been listed. Between that LIST and the
        PUT, the successor could only be written, superseded and reclaimed if the reclaimer's
        grace were shorter than that interval, which is what the check it replaces allowed too
        (between the HEAD and the PUT). A base ``latest`` vouched for with a probe alone (a
        missing ``base.version + 1``), a commit's own result, or an older listing is checked:
        a missing successor may have been reclaimed when the grace is short (tests, the demo's
        5 s). Contended producers, the ones whose fragile windows matter, mostly find newer
        versions and list: their attempts lose a request.
        """
        listed = self._listed
        if listed is None or listed[0] is not base:
            return False
        return 0 <= self._monotonic() - listed[1] < LISTED_TRUST_SECONDS

    def _check_append(self, base: Manifest, append: Sequence[TgbDescriptor], version: int) -> None:
        if not append:
            return
        if base.sealed:
            steps = f"steps 0..{base.next_step - 1}" if base.next_step else "no steps"
            raise NamespaceSealed(
                f"namespace {self._where} was sealed at version {base.version} "
                f"({steps}); it accepts no more TGBs"
            )
        last: dict[str, int] = {}
        for desc in append:
            state = base.producers.get(desc.producer_id)
            if state is not None and desc.epoch < state.epoch:
                raise ProducerFenced(
                    f"producer {desc.producer_id!r} epoch {desc.epoch} is fenced: epoch "
                    f"{state.epoch} is committed in version {base.version} of {self._where}"
                )
            floor = last.get(desc.producer_id, state.offset if state is not None else None)
            if floor is not None and desc.offset <= floor:
                raise OffsetOrderError(
                    f"cannot commit offset {desc.offset} of producer {desc.producer_id!r} as "
                    f"version {version} of {self._where}: offset {floor} is already committed "
                    "or earlier in this commit (rebase: drop committed offsets)"
                )
            last[desc.producer_id] = desc.offset

    def _build(
        self,
        base: Manifest,
        version: int,
        now: float,
        append: Sequence[TgbDescriptor],
        producers: Mapping[str, ProducerState],
        base_step: int | None,
        seal: bool,
        retire: Collection[str],
    ) -> Manifest:
        states = {**base.producers, **producers}
        for pid in retire:
            states.pop(pid, None)
        for desc in append:
            prev = states.get(desc.producer_id)
            states[desc.producer_id] = ProducerState(
                epoch=max(desc.epoch, prev.epoch if prev is not None else 0),
                offset=desc.offset,
                last_version=version,
                last_commit_at=now,
                source=prev.source if prev is not None else None,
            )
        new_base = base.base_step if base_step is None else max(base.base_step, base_step)
        segments = cut_below(base.segments, new_base)
        written = self._stamp()  # not ``now`` alone: see _Stamp
        with self._merge_lock:
            prepared = self._prepared
            if prepared is not None and not self._prepared_at.within(
                written, PREPARED_MERGE_MAX_AGE
            ):
                # The reclaimer may have deleted it as an unreferenced segment: never list it.
                _log.info("dropping segment merge %s: prepared too long ago", prepared[1].key)
                prepared = self._prepared = None
        if prepared is not None:
            swapped = swap_in(segments, *prepared)
            if swapped is not None:
                segments = swapped
        tail = (*base.tail, *append)
        tail_start = base.tail_start
        if tail_start < new_base:
            tail = tail[new_base - tail_start :]
            tail_start = new_base
        if self._tail_full(tail):
            segments, tail, tail_start = self._roll(
                base.namespace_id, segments, tail, tail_start, new_base, written
            )
        return Manifest(
            namespace_id=base.namespace_id,
            mesh=base.mesh,
            version=version,
            parent=base.version,
            commit_id=uuid.uuid4().hex,
            created_at=now,
            base_step=new_base,
            segments=segments,
            tail=tail,
            tail_start=tail_start,
            producers=states,
            sealed=base.sealed or seal,
        )

    def _roll(
        self,
        namespace_id: str,
        segments: tuple[SegmentRef, ...],
        tail: tuple[TgbDescriptor, ...],
        tail_start: int,
        base_step: int,
        now: _Stamp,
    ) -> tuple[tuple[SegmentRef, ...], tuple[TgbDescriptor, ...], int]:
        """Roll the full ``tail`` into segments: ``(references, tail, tail_start)`` after it.

        What the last attempt rolled is reused when ``tail`` starts with it (:class:`_Roll`);
        the descriptors after that are rolled into one more segment if they fill a tail
        themselves, else they stay inline.
        """
        last = self._last_roll
        reused = None
        if last is not None:
            reused = last.reuse(namespace_id, segments, tail, tail_start, base_step, now)
        origin, written_at, done = segments, now, 0
        if reused is not None:
            assert last is not None
            _log.info("commit reuses segment %s of its previous attempt", reused[-1].key)
            origin, written_at, done = last.before, last.written_at, len(last.tail)
            segments = reused
        rest = tail[done:]
        if reused is None or self._tail_full(rest):
            before = segments
            segments = self._segments.roll(
                namespace_id,
                segments,
                rest,
                tail_start + done,
                base_step=base_step,
                max_segment_tgbs=self.max_segment_tgbs,
                fanout=self.merge_fanout,
                merge=not self.deferred_merges,
            )
            # Written inside the window: the new references (one per segment a long run took).
            known = {ref.key for ref in before}
            self.last_commit_bytes += sum(ref.bytes for ref in segments if ref.key not in known)
            done = len(tail)
            self._last_roll = _Roll(
                namespace_id, origin, tail, tail_start, base_step, segments, written_at
            )
        with self._merge_lock:
            self._rolled = segments[-1].key if segments else None
        return segments, tail[done:], tail_start + done

    def _stamp(self) -> _Stamp:
        """Now, on both of the log's clocks."""
        return _Stamp(self._monotonic(), self._clock())

    def _tail_full(self, tail: Sequence[TgbDescriptor]) -> bool:
        """Whether ``tail`` reaches ``tail_limit`` descriptors or ``tail_bytes_limit`` bytes."""
        if len(tail) >= self.tail_limit:
            return True
        if self.tail_bytes_limit is None or not tail:
            return False
        # Exact JSON size: the limit bounds what every commit writes, and descriptor sizes vary
        # with keys, meshes and slice tables (each descriptor is serialized once per process).
        return descriptors_json_bytes(tail) >= self.tail_bytes_limit

    def prepare_merge(self, committed: Manifest) -> int:
        """Write, outside any fragile window, the level merge that our last roll calls for.

        Call it after :meth:`commit` returned ``committed`` (with ``deferred_merges``). If that
        commit rolled its tail into a segment and the tiering rule merges that segment with
        older ones, the merged segment is written now, and the next :meth:`commit` through this
        log replaces the merged references with it, if its base still holds them all. Only the
        producer whose commit rolled does this, so producers never duplicate a merge. A merge
        that is never swapped in (this producer stopped, or another commit changed those
        references first) is an orphan for the reclaimer. Returns the bytes written.
        """
        with self._merge_lock:
            if self._prepared is not None and swap_in(committed.segments, *self._prepared) is None:
                self._prepared = None  # swapped in by this commit, or no longer applicable
            if not committed.segments or committed.segments[-1].key != self._rolled:
                return 0
            self._rolled = None
        crowded = most_per_level(
            committed.segments[:-1],
            max_segment_tgbs=self.max_segment_tgbs,
            fanout=self.merge_fanout,
        )
        if self.merge_fanout <= crowded < 2 * self.merge_fanout - 1:
            # Another producer's merge of those segments is pending (written after its commit,
            # swapped in by its next one): merging them again would only duplicate it. If it
            # never lands, the level keeps growing and the rolls after F - 1 more do merge.
            return 0
        started = self._stamp()  # before the write: the segment is at least this old
        result = self._segments.merge_newest(
            committed.namespace_id,
            committed.segments,
            base_step=committed.base_step,
            max_segment_tgbs=self.max_segment_tgbs,
            fanout=self.merge_fanout,
        )
        if result is None:
            return 0
        with self._merge_lock:
            self._prepared, self._prepared_at = result, started
        return result[1].bytes

    def refresh_prepared_merge(self) -> int:
        """Write the prepared merge again, under a fresh key, once it is half its age limit old.

        Call it right before :meth:`commit`, outside the fragile window. A producer committing
        less often than ``PREPARED_MERGE_MAX_AGE`` would otherwise have every merge it prepares
        dropped by its next commit, and its segments would never merge. The old copy is left to
        the reclaimer (an orphan). Returns the bytes written.
        """
        with self._merge_lock:
            prepared, prepared_at = self._prepared, self._prepared_at
        namespace_id = self._namespace_id
        started = self._stamp()  # before the write: the segment is at least this old
        if (
            prepared is None
            or namespace_id is None
            or prepared_at.within(started, PREPARED_MERGE_MAX_AGE / 2)
        ):
            return 0
        replaced, merged = prepared
        try:
            segment = self._segments.read(merged, namespace_id)
        except (ObjectNotFound, FormatError) as exc:  # reclaimed or damaged: a later roll merges
            _log.info("dropping segment merge %s: %s", merged.key, exc)
            fresh = None
        else:
            fresh = self._segments.write(namespace_id, segment.first_step, segment.tgbs)
        with self._merge_lock:
            if self._prepared is prepared:
                self._prepared = None if fresh is None else (replaced, fresh)
                self._prepared_at = started
        return 0 if fresh is None else fresh.bytes

    def _put(self, key: str, manifest: Manifest) -> CommitResult:
        data = encode_manifest(manifest)
        limit = _codec.MAX_MANIFEST_BYTES  # what read() accepts, looked up as it does
        if len(data) > limit:
            # Written, it would make every reader (and every producer's next rebase) refuse the
            # namespace as corrupt; its size comes from the producer map, the rest is bounded.
            raise NamespaceError(
                f"cannot commit {key}: the manifest would be {len(data)} bytes, more than the "
                f"{limit} bytes every reader accepts (it lists {len(manifest.producers)} "
                f"producer ids, {len(manifest.segments)} segments and {len(manifest.tail)} "
                "inline TGBs); nothing was written. Retire idle producer ids with `batchweave "
                "retire` (retire_producers), or use fewer producer ids or shorter ids and sources"
            )
        self.last_commit_bytes += len(data)
        unknown: AmbiguousWriteError | None = None
        for attempt in range(_AMBIGUOUS_RESENDS + 1):
            try:
                self.store.put_if_absent(key, data)
            except ObjectExists:
                result = self._resolve(key, manifest, after="412")
                if result is None:
                    _log.warning("commit of %s: 412, but no object to read back", key)
                    return Conflict(None)
                if isinstance(result, Conflict) and result.failure is not None:
                    # The version exists: a lost race (or our own write), whoever wrote it.
                    return Conflict(None)
                return result
            except AmbiguousWriteError as exc:
                _log.warning("commit of %s: ambiguous outcome (%s); reading back", key, exc)
                unknown = exc
                result = self._resolve(key, manifest, after="ambiguous write")
                if result is not None:
                    return result
                _log.info("commit of %s: not written; re-sending (attempt %d)", key, attempt + 2)
            except ConcurrentWriteConflict as exc:
                _log.warning(
                    "commit of %s: %s; another write to the version is in flight", key, exc
                )
                return Conflict(None)
            except TransientStoreError as exc:
                _log.warning("commit of %s: %s; not written, retrying later", key, exc)
                return Conflict(None, exc)
            else:
                self._observe(manifest, key)
                return Committed(manifest)
        _log.warning("commit of %s: outcome still unknown after %d sends", key, attempt + 1)
        return Conflict(None, unknown)

    def _resolve(self, key: str, ours: Manifest, *, after: str) -> CommitResult | None:
        """Read back the version we tried to write: ours, someone else's, or ``None`` (absent)."""
        try:
            winner = self.read(ours.version)
        except ObjectNotFound:
            return None
        except TransientStoreError as exc:
            _log.warning("commit of %s: cannot read back after %s: %s", key, after, exc)
            return Conflict(None, exc)
        if winner.commit_id == ours.commit_id:
            _log.info("commit of %s: %s, but the version is ours", key, after)
            return Committed(winner)
        return Conflict(winner)

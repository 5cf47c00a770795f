"""Immutable segment objects: runs of TGB descriptors moved out of the manifest.

A manifest lists its TGBs as segment references plus an inline tail. When a commit makes the tail
reach ``tail_limit`` descriptors, the committer writes the tail as a new segment object *before*
its conditional PUT. So that the number of references stays small, the new run may absorb the
newest existing segments (size-tiered merging with fanout ``F``, default 8):

* the *level* of a run of ``n`` descriptors is ``floor(log_F(n))``: what a run holds, whatever
  made the roll that wrote it (``tail_limit`` descriptors, ``tail_bytes_limit`` bytes of them, or
  a commit's whole batch); a segment is *full* once it holds more than ``max_segment_tgbs / 2``
  descriptors or ``SEGMENT_BYTES_BUDGET / 2`` bytes, and is never rewritten again;
* the new run absorbs the newest reference if that reference is of a lower level, or, when it
  is of the run's own level, only together with the ``F - 1`` newest references, all of that
  level (``F`` runs of level ``k`` hold ``F^(k+1)`` to ``F^(k+2) - 1`` descriptors: one run of
  level ``k + 1``); merged runs stay within ``max_segment_tgbs`` and ``SEGMENT_BYTES_BUDGET``
  (reference ``bytes``): a group that would exceed either contributes its newest references
  that fit (the result is full); a roll longer than either bound is written as several
  segments, in step order, so no segment outgrows what readers accept (``MAX_SEGMENT_BYTES``);
* so, between full segments, levels do not increase from old to new and each level holds at
  most ``F - 1`` references: at most ``(F - 1)`` per level from that of the smallest roll ``r``
  to that of ``max_segment_tgbs / 2``, plus about two references per ``max_segment_tgbs`` steps
  of retained history, which reclamation cuts.

Every rewrite moves a descriptor into a run of a higher level, or into a full run, so with
rolls of ``r`` descriptors or more each descriptor is rewritten at most
``ceil(log_F(max_segment_tgbs / r)) + 1`` times, and at most ``ceil(log_F(max_segment_tgbs /
r))`` when the rolls are of one size: 2 for count-triggered rolls of 256 with the defaults, 3
for byte-triggered rolls of 32 (``docs/protocol.md`` has the measurements). Levels used to be
``floor(log_F(n / tail_limit))``: rolls cut short by the byte bound then all stayed level 0 and
level-0 runs kept merging up to ``F * tail_limit`` descriptors, up to 10 rewrites. Reference
lists written that way are read as they are: levels are recomputed from counts and merging
only ever joins contiguous references (nothing is lost or duplicated). Where an old level
straddles two new ones, a new level may start with up to ``2(F - 1)`` references; the first
merges that reach it absorb them (some may stay behind the full segment they fill, a bounded,
one-off leftover). The bytes a commit writes for segments, amortized over a
run, stay proportional to the descriptors it appends. A merge writes one object however many
references it absorbs. A committer that loses its race leaves its segment unreferenced; the
reclaimer deletes such orphans after a grace period.

Segments are immutable, so readers cache them by key (:class:`SegmentFiles`): looking up any step
costs at most one segment read. The cache is bounded in descriptors (by default one full
segment's worth, beyond the two most recently used segments), since one full segment decodes to
tens or hundreds of megabytes.
"""

from __future__ import annotations

import bisect
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator, Sequence

from batchweave._errors import ChecksumMismatch, FormatError, NamespaceError
from batchweave._manifest import _codec
from batchweave._manifest._codec import (
    body_checksum,
    decode_segment,
    descriptors_json_bytes,
    encode_segment,
)
from batchweave._manifest._models import Segment, SegmentRef, TgbDescriptor
from batchweave._store._base import Bounded, ObjectStore

__all__ = [
    "DEFAULT_MERGE_FANOUT",
    "SEGMENTS_DIR",
    "SEGMENT_BYTES_BUDGET",
    "SegmentFiles",
    "cut_below",
    "find_segment",
    "is_full",
    "merge_run_length",
    "most_per_level",
    "segment_key",
    "segment_level",
    "swap_in",
]

SEGMENTS_DIR = "_segments"

DEFAULT_MERGE_FANOUT = 8
"""``F``: segments of one level that merge into one of the next (see the module docstring)."""

SEGMENT_BYTES_BUDGET = _codec.MAX_SEGMENT_BYTES // 4
"""Bytes a segment written by a roll or a merge holds at most (128 MiB), well under the
``MAX_SEGMENT_BYTES`` every reader accepts: a roll measures its descriptors' exact JSON
(:func:`descriptors_json_bytes`) and starts a new segment before this would be exceeded, and the
tiering rule absorbs no reference whose ``bytes`` would take the merged run past it. Looked up at
call time (tests lower it)."""


def segment_key(first_step: int) -> str:
    """A fresh key (relative to the namespace) for a segment starting at ``first_step``."""
    return f"{SEGMENTS_DIR}/{first_step:020d}-{uuid.uuid4().hex}.seg"


def segment_level(count: int, fanout: int = DEFAULT_MERGE_FANOUT) -> int:
    """``floor(log_fanout(count))``: the level of a run of ``count`` (>= 1) descriptors.

    Absolute, not relative to ``tail_limit``: a roll the byte bound cut short starts at its own
    level, so merging ``fanout`` runs of one level always makes one run of the next level.
    """
    level = 0
    while count >= fanout:
        count //= fanout
        level += 1
    return level


def is_full(ref: SegmentRef, max_segment_tgbs: int) -> bool:
    """Whether ``ref`` is never rewritten again: it holds more than ``max_segment_tgbs / 2``
    descriptors or more than ``SEGMENT_BYTES_BUDGET / 2`` bytes."""
    return 2 * ref.count > max_segment_tgbs or 2 * ref.bytes > SEGMENT_BYTES_BUDGET


def merge_run_length(
    segments: Sequence[SegmentRef],
    new_count: int,
    *,
    max_segment_tgbs: int,
    fanout: int = DEFAULT_MERGE_FANOUT,
    new_bytes: int = 0,
) -> int:
    """How many of the newest ``segments`` a new run of ``new_count`` descriptors (``new_bytes``
    bytes) absorbs: the merged run stays within ``max_segment_tgbs`` and
    ``SEGMENT_BYTES_BUDGET``."""

    def level(count: int) -> int:
        return segment_level(count, fanout)

    budget = SEGMENT_BYTES_BUDGET
    absorbed, count, size, end = 0, new_count, new_bytes, len(segments)
    while end > 0:
        ref = segments[end - 1]
        if is_full(ref, max_segment_tgbs):
            break
        run_level = level(count)
        if level(ref.count) < run_level:
            group = [ref]
            taken, merged, merged_bytes = _take(count, size, group, max_segment_tgbs)
        elif level(ref.count) == run_level:
            group = []
            for r in reversed(segments[max(0, end - (fanout - 1)) : end]):
                if is_full(r, max_segment_tgbs) or level(r.count) != run_level:
                    break
                group.insert(0, r)
            taken, merged, merged_bytes = _take(count, size, group, max_segment_tgbs)
            # Fewer than F runs of this level yet: wait, except at the top level, where F runs
            # of this size never fit one segment. There, waiting for them would leave all but
            # the newest few behind the capped (full) merge for good: merge once it is full.
            top = fanout * count > max_segment_tgbs or fanout * size > budget
            full = 2 * merged > max_segment_tgbs or 2 * merged_bytes > budget
            if len(group) < fanout - 1 and not (top and full):
                break
        else:
            break
        count, size = merged, merged_bytes
        absorbed += taken
        end -= taken
        if taken < len(group):
            break  # a bound cut the group short: the merged run is full
    return absorbed


def _take(
    count: int, size: int, group: Sequence[SegmentRef], max_segment_tgbs: int
) -> tuple[int, int, int]:
    """How many of ``group``'s newest runs a run of ``count`` descriptors and ``size`` bytes
    absorbs within the bounds, and the merged run's count and bytes."""
    taken = 0
    for r in reversed(group):
        if count + r.count > max_segment_tgbs or size + r.bytes > SEGMENT_BYTES_BUDGET:
            break
        count += r.count
        size += r.bytes
        taken += 1
    return taken, count, size


def most_per_level(
    segments: Sequence[SegmentRef],
    *,
    max_segment_tgbs: int,
    fanout: int = DEFAULT_MERGE_FANOUT,
) -> int:
    """The most references that one level holds after the newest full segment.

    Merging as :func:`merge_run_length` says keeps it below ``fanout``; more means a merge is
    due that nobody has written yet (or that is written and waits to be swapped in).
    """
    counts: dict[int, int] = {}
    for ref in reversed(segments):
        if is_full(ref, max_segment_tgbs):
            break
        level = segment_level(ref.count, fanout)
        counts[level] = counts.get(level, 0) + 1
    return max(counts.values(), default=0)


def swap_in(
    segments: Sequence[SegmentRef], replaced: Sequence[SegmentRef], merged: SegmentRef
) -> tuple[SegmentRef, ...] | None:
    """``segments`` with the contiguous run ``replaced`` (matched by key) replaced by ``merged``.

    ``None`` if ``segments`` no longer hold that run (another commit merged or reclaimed part of
    it); keys are unique and segments immutable, so a match means the same descriptors.
    """
    keys = [ref.key for ref in segments]
    try:
        i = keys.index(replaced[0].key)
    except ValueError:
        return None
    if keys[i : i + len(replaced)] != [ref.key for ref in replaced]:
        return None
    return (*segments[:i], merged, *segments[i + len(replaced) :])


def cut_below(segments: Sequence[SegmentRef], base_step: int) -> tuple[SegmentRef, ...]:
    """Drop the references whose steps all lie below ``base_step`` (reclaimed)."""
    return tuple(ref for ref in segments if ref.end_step > base_step)


def find_segment(segments: Sequence[SegmentRef], step: int) -> SegmentRef:
    """The reference holding ``step``; the caller ensures it lies in the segments' range."""
    # Bisect on the key instead of building the list of starts: this runs for every step a
    # consumer reads, and a long run has thousands of segments.
    return segments[bisect.bisect_right(segments, step, key=_first_step) - 1]


def _first_step(ref: SegmentRef) -> int:
    return ref.first_step


class SegmentFiles:
    """Reads (with an LRU cache of decoded segments) and writes segment objects of one namespace.

    The cache holds at most ``cache`` segments and, beyond its two most recently used ones, at
    most ``cache_tgbs`` descriptors (``None``: no descriptor bound). Descriptors, not segments, are
    what costs memory: a full segment holds up to ``max_segment_tgbs`` of them (16,384 by
    default) and a decoded descriptor takes about 4 KB at ``dp=2``, 10 KB at ``dp=64``, about
    ten times its JSON. Thread-safe. ``key`` maps a namespace-relative key to a store key.
    """

    def __init__(
        self,
        store: ObjectStore,
        key: Callable[[str], str],
        *,
        cache: int,
        cache_tgbs: int | None = None,
    ) -> None:
        self._store = store
        self._key = key
        self._capacity = max(cache, 0)
        self._max_tgbs = None if cache_tgbs is None else max(cache_tgbs, 0)
        self._cache: OrderedDict[str, tuple[SegmentRef, Segment]] = OrderedDict()
        """Decoded segments by key, with the reference they were verified against."""
        self._tgbs = 0
        """Descriptors the cached segments hold."""
        self._lock = threading.Lock()

    @property
    def cached_tgbs(self) -> int:
        """Descriptors the cached segments hold (what the cache's memory is proportional to)."""
        with self._lock:
            return self._tgbs

    def stop_caching(self) -> None:
        """Forget every cached segment and keep none from now on (reads still work)."""
        with self._lock:
            self._capacity = 0
            self._cache.clear()
            self._tgbs = 0

    def _remember(self, ref: SegmentRef, segment: Segment) -> None:
        with self._lock:
            if self._capacity == 0:
                return
            old = self._cache.pop(ref.key, None)
            if old is not None:
                self._tgbs -= len(old[1].tgbs)
            self._cache[ref.key] = (ref, segment)
            self._tgbs += len(segment.tgbs)
            # The two newest entries stay whatever they hold (segments written with a larger
            # max_segment_tgbs than this reader's): a reader's step and, at a boundary, the
            # next one, read by prefetch threads in either order. Evicting either would make
            # them read the segments again in turns.
            while len(self._cache) > self._capacity or (
                self._max_tgbs is not None and self._tgbs > self._max_tgbs and len(self._cache) > 2
            ):
                _, (_, evicted) = self._cache.popitem(last=False)
                self._tgbs -= len(evicted.tgbs)

    def _drop_where(self, gone: Callable[[str, SegmentRef], bool]) -> None:
        with self._lock:
            for key, (ref, segment) in list(self._cache.items()):
                if gone(key, ref):
                    del self._cache[key]
                    self._tgbs -= len(segment.tgbs)

    def drop_below(self, base_step: int) -> None:
        """Forget the segments whose steps all lie below ``base_step`` (reclaimed)."""
        self._drop_where(lambda _, ref: ref.end_step <= base_step)

    def retain(self, keys: Collection[str]) -> None:
        """Forget every cached segment whose key is not in ``keys``."""
        self._drop_where(lambda key, _: key not in keys)

    def read(self, ref: SegmentRef, namespace_id: str) -> Segment:
        """The segment ``ref`` points to, verified against the reference and namespace."""
        with self._lock:
            cached = self._cache.get(ref.key)
            # Only a reference equal to the verified one may reuse it: a hostile or damaged
            # manifest naming this key for other steps, size or checksum is checked afresh.
            if cached is not None and (cached[0] is ref or cached[0] == ref):
                self._cache.move_to_end(ref.key)
                return cached[1]
        full_key = self._key(ref.key)
        # One byte past the size the reference records: a bigger object is refused below
        # without downloading it whole.
        data = self._store.get_range(full_key, Bounded(0, ref.bytes + 1))
        if len(data) != ref.bytes:
            raise FormatError(
                f"{full_key}: segment has {len(data)} bytes, its manifest reference says "
                f"{ref.bytes}; the object was replaced or truncated"
            )
        segment, stored = decode_segment(data, key=full_key)
        if stored != ref.checksum:
            raise ChecksumMismatch(
                f"{full_key}: segment checksum {stored:08x} differs from its manifest "
                f"reference's {ref.checksum:08x}; the object was replaced"
            )
        if segment.namespace_id != namespace_id:
            raise FormatError(
                f"{full_key}: segment belongs to namespace {segment.namespace_id!r}, "
                f"not {namespace_id!r}"
            )
        if segment.first_step != ref.first_step or len(segment.tgbs) != ref.count:
            raise FormatError(
                f"{full_key}: segment holds steps {segment.first_step}.."
                f"{segment.first_step + len(segment.tgbs) - 1}, its manifest reference says "
                f"{ref.first_step}..{ref.end_step - 1}"
            )
        self._remember(ref, segment)
        return segment

    def write(
        self, namespace_id: str, first_step: int, tgbs: Sequence[TgbDescriptor]
    ) -> SegmentRef:
        """Write a new segment object and return its reference (plain PUT of a fresh key)."""
        segment = Segment(namespace_id=namespace_id, first_step=first_step, tgbs=tuple(tgbs))
        data = encode_segment(segment)
        limit = _codec.MAX_SEGMENT_BYTES  # the codec's own bound, looked up as it does
        if len(data) > limit:
            # Only a descriptor near the limit on its own gets here (rolls and merges keep to
            # SEGMENT_BYTES_BUDGET): no reader could read the segment, so it is not written.
            raise NamespaceError(
                f"{self._key(SEGMENTS_DIR)}: a segment of {len(segment.tgbs)} TGB descriptor(s) "
                f"from step {first_step} would be {len(data)} bytes, more than the {limit} bytes "
                "every reader accepts; not written. Its descriptors are too large: lower the "
                "producer's slice_table_limit (slice tables dominate a descriptor's size)"
            )
        rel = segment_key(first_step)
        self._store.put(self._key(rel), data)
        body = data[data.index(b"\n") + 1 :]
        ref = SegmentRef(
            key=rel,
            first_step=first_step,
            count=len(segment.tgbs),
            bytes=len(data),
            checksum=body_checksum(body),
        )
        self._remember(ref, segment)
        return ref

    def roll(
        self,
        namespace_id: str,
        segments: Sequence[SegmentRef],
        tail: Sequence[TgbDescriptor],
        tail_start: int,
        *,
        base_step: int,
        max_segment_tgbs: int,
        fanout: int = DEFAULT_MERGE_FANOUT,
        merge: bool = True,
    ) -> tuple[SegmentRef, ...]:
        """Write ``tail`` (plus the newest segments it absorbs, if ``merge``) as new segments.

        Returns the new reference list; the tail is then empty and starts at the end of it.
        Descriptors below ``base_step`` are dropped from a merged run. With ``merge=False`` only
        the tail is written (the merge is left to :meth:`merge_newest`, outside the commit).
        A run of more than ``max_segment_tgbs`` descriptors or ``SEGMENT_BYTES_BUDGET`` bytes
        (a commit's whole batch) is written as several segments, in step order.
        """
        absorbed = (
            merge_run_length(
                segments,
                len(tail),
                max_segment_tgbs=max_segment_tgbs,
                fanout=fanout,
                new_bytes=descriptors_json_bytes(tail),
            )
            if merge
            else 0
        )
        keep = tuple(segments[: len(segments) - absorbed])
        run = self._run(namespace_id, segments[len(keep) :], tail, tail_start, base_step)
        if run is None:
            return keep
        first, tgbs = run
        written = []
        for start, stop in _chunks(tgbs, max_segment_tgbs):
            written.append(self.write(namespace_id, first + start, tgbs[start:stop]))
        return (*keep, *written)

    def merge_newest(
        self,
        namespace_id: str,
        segments: Sequence[SegmentRef],
        *,
        base_step: int,
        max_segment_tgbs: int,
        fanout: int = DEFAULT_MERGE_FANOUT,
    ) -> tuple[tuple[SegmentRef, ...], SegmentRef] | None:
        """Write the merge that the newest reference calls for, as :meth:`roll` would have.

        The newest reference plays the new run: it absorbs the newest older references that the
        tiering rule gives it (:func:`merge_run_length`). Returns ``(replaced, merged)``: the
        references the merged segment replaces (contiguous, oldest first) and its reference, or
        ``None`` if no merge is due. Nothing in ``segments`` changes; a commit swaps the merged
        reference in with :func:`swap_in` (a segment lists the same steps as those it replaces,
        minus any below ``base_step``).
        """
        if not segments:
            return None
        absorbed = merge_run_length(
            segments[:-1],
            segments[-1].count,
            max_segment_tgbs=max_segment_tgbs,
            fanout=fanout,
            new_bytes=segments[-1].bytes,
        )
        if absorbed == 0:
            return None
        replaced = tuple(segments[len(segments) - 1 - absorbed :])
        run = self._run(namespace_id, replaced, (), replaced[-1].end_step, base_step)
        if run is None:
            return None
        return replaced, self.write(namespace_id, *run)

    def _run(
        self,
        namespace_id: str,
        refs: Sequence[SegmentRef],
        tail: Sequence[TgbDescriptor],
        tail_start: int,
        base_step: int,
    ) -> tuple[int, list[TgbDescriptor]] | None:
        """The descriptors of ``refs`` then ``tail``, from ``base_step`` on (None if none)."""
        run: list[TgbDescriptor] = []
        first = refs[0].first_step if refs else tail_start
        for ref in refs:
            run.extend(self.read(ref, namespace_id).tgbs)
        run.extend(tail)
        if first < base_step:
            run = run[base_step - first :]
            first = base_step
        return (first, run) if run else None


def _chunks(tgbs: Sequence[TgbDescriptor], max_segment_tgbs: int) -> Iterator[tuple[int, int]]:
    """``(start, stop)`` of consecutive runs of ``tgbs``, each of at most ``max_segment_tgbs``
    descriptors and, unless a single descriptor is larger, ``SEGMENT_BYTES_BUDGET`` bytes of
    descriptor JSON (measured as a segment writes it)."""
    start, size = 0, 2  # the array's brackets
    for i, desc in enumerate(tgbs):
        one = descriptors_json_bytes((desc,)) - 1  # its JSON and a comma
        if i > start and (i - start >= max_segment_tgbs or size + one > SEGMENT_BYTES_BUDGET):
            yield start, i
            start, size = i, 2
        size += one
    if start < len(tgbs):
        yield start, len(tgbs)

"""Immutable segment objects: runs of TGB descriptors moved out of the manifest.

A manifest lists its TGBs as segment references plus an inline tail. When a commit makes the tail
reach ``tail_limit`` descriptors, the committer writes the tail as a new segment object *before*
its conditional PUT. So that the number of references stays small, the new run absorbs the newest
existing segments while they are not bigger than it (a binary counter, as in LSM tiering):

* the *level* of a run of ``n`` descriptors is ``floor(log2(n / tail_limit))`` (0 below that);
* the new run absorbs the newest reference while that reference's level is <= the run's level
  and the merged run stays within ``max_segment_tgbs``;
* so levels strictly decrease from old to new among unfrozen segments: at most
  ``log2(max_segment_tgbs / tail_limit) + 1`` of them, plus one frozen (full) segment per
  ``max_segment_tgbs`` steps of retained history, which reclamation cuts.

Each descriptor is rewritten at most ``log2(max_segment_tgbs / tail_limit)`` times, and a merge
writes one object however many references it absorbs. A committer that loses its race leaves its
segment unreferenced; the reclaimer deletes such orphans after a grace period.

Segments are immutable, so readers cache them by key (:class:`SegmentFiles`): looking up any step
costs at most one segment read.
"""

from __future__ import annotations

import bisect
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable, Sequence

from batchweave._errors import ChecksumMismatch, FormatError
from batchweave._manifest._codec import body_checksum, decode_segment, encode_segment
from batchweave._manifest._models import Segment, SegmentRef, TgbDescriptor
from batchweave._store._base import ObjectStore

__all__ = [
    "SEGMENTS_DIR",
    "SegmentFiles",
    "cut_below",
    "find_segment",
    "merge_run_length",
    "segment_key",
    "segment_level",
]

SEGMENTS_DIR = "_segments"


def segment_key(first_step: int) -> str:
    """A fresh key (relative to the namespace) for a segment starting at ``first_step``."""
    return f"{SEGMENTS_DIR}/{first_step:020d}-{uuid.uuid4().hex}.seg"


def segment_level(count: int, tail_limit: int) -> int:
    """``floor(log2(count / tail_limit))``, and 0 for runs shorter than ``tail_limit``."""
    return max(count // tail_limit, 1).bit_length() - 1


def merge_run_length(
    segments: Sequence[SegmentRef], new_count: int, *, tail_limit: int, max_segment_tgbs: int
) -> int:
    """How many of the newest ``segments`` a new run of ``new_count`` descriptors absorbs."""
    absorbed, count = 0, new_count
    for ref in reversed(segments):
        merged = count + ref.count
        if merged > max_segment_tgbs:
            break
        if segment_level(ref.count, tail_limit) > segment_level(count, tail_limit):
            break
        absorbed, count = absorbed + 1, merged
    return absorbed


def cut_below(segments: Sequence[SegmentRef], base_step: int) -> tuple[SegmentRef, ...]:
    """Drop the references whose steps all lie below ``base_step`` (reclaimed)."""
    return tuple(ref for ref in segments if ref.end_step > base_step)


def find_segment(segments: Sequence[SegmentRef], step: int) -> SegmentRef:
    """The reference holding ``step``; the caller ensures it lies in the segments' range."""
    starts = [ref.first_step for ref in segments]
    return segments[bisect.bisect_right(starts, step) - 1]


class SegmentFiles:
    """Reads (with an LRU cache of decoded segments) and writes segment objects of one namespace.

    Thread-safe. ``key`` maps a namespace-relative key to a store key.
    """

    def __init__(self, store: ObjectStore, key: Callable[[str], str], *, cache: int) -> None:
        self._store = store
        self._key = key
        self._capacity = max(cache, 0)
        self._cache: OrderedDict[str, Segment] = OrderedDict()
        self._lock = threading.Lock()

    def _remember(self, key: str, segment: Segment) -> None:
        if self._capacity == 0:
            return
        with self._lock:
            self._cache[key] = segment
            self._cache.move_to_end(key)
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)

    def read(self, ref: SegmentRef, namespace_id: str) -> Segment:
        """The segment ``ref`` points to, verified against the reference and namespace."""
        with self._lock:
            cached = self._cache.get(ref.key)
            if cached is not None:
                self._cache.move_to_end(ref.key)
                return cached
        full_key = self._key(ref.key)
        data = self._store.get(full_key)
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
        self._remember(ref.key, segment)
        return segment

    def write(
        self, namespace_id: str, first_step: int, tgbs: Sequence[TgbDescriptor]
    ) -> SegmentRef:
        """Write a new segment object and return its reference (plain PUT of a fresh key)."""
        segment = Segment(namespace_id=namespace_id, first_step=first_step, tgbs=tuple(tgbs))
        data = encode_segment(segment)
        rel = segment_key(first_step)
        self._store.put(self._key(rel), data)
        self._remember(rel, segment)
        body = data[data.index(b"\n") + 1 :]
        return SegmentRef(
            key=rel,
            first_step=first_step,
            count=len(segment.tgbs),
            bytes=len(data),
            checksum=body_checksum(body),
        )

    def roll(
        self,
        namespace_id: str,
        segments: Sequence[SegmentRef],
        tail: Sequence[TgbDescriptor],
        tail_start: int,
        *,
        base_step: int,
        tail_limit: int,
        max_segment_tgbs: int,
    ) -> tuple[SegmentRef, ...]:
        """Write ``tail`` (plus the newest segments it absorbs) as one segment.

        Returns the new reference list; the tail is then empty and starts at the end of it.
        Descriptors below ``base_step`` are dropped from a merged run.
        """
        absorbed = merge_run_length(
            segments, len(tail), tail_limit=tail_limit, max_segment_tgbs=max_segment_tgbs
        )
        keep = tuple(segments[: len(segments) - absorbed])
        run: list[TgbDescriptor] = []
        first = tail_start
        if absorbed:
            first = segments[len(keep)].first_step
            for ref in segments[len(keep) :]:
                run.extend(self.read(ref, namespace_id).tgbs)
        run.extend(tail)
        if first < base_step:
            run = run[base_step - first :]
            first = base_step
        if not run:
            return keep
        return (*keep, self.write(namespace_id, first, run))

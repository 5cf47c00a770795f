"""Segments: flat commit cost, bounded reference count, one-read lookups, integrity.

Also deferred (prepared) merges against the reclaimer: a merge prepared after the commit that
rolled is swapped in by a later commit only within ``PREPARED_MERGE_MAX_AGE`` (an older one may
already be deleted as an orphan); a producer committing less often than that still merges, by
refreshing its prepared merge, and a refreshed copy survives the reclaimer deleting the first.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

import pytest
from fake_time import FakeTime
from hypothesis import given, settings
from hypothesis import strategies as st
from manifest_helpers import CountingStore, FaultyPutStore, descriptor, grow
from pydantic import TypeAdapter

from batchweave import (
    AttemptOutcome,
    ChecksumMismatch,
    CommitPolicy,
    FormatError,
    MemoryStore,
    Mesh,
    NamespaceError,
    ObjectStore,
    Producer,
    PutMode,
    Reclaimer,
    TransientStoreError,
)
from batchweave._manifest import (
    Committed,
    Conflict,
    ManifestLog,
    SegmentRef,
    _codec,
    _segments,
    encode_manifest,
    encode_segment,
    manifest_key,
)
from batchweave._manifest._codec import descriptors_json_bytes
from batchweave._manifest._log import PREPARED_MERGE_MAX_AGE
from batchweave._manifest._models import Manifest, TgbDescriptor
from batchweave._manifest._segments import (
    DEFAULT_MERGE_FANOUT,
    SegmentFiles,
    merge_run_length,
    segment_level,
)
from batchweave._store._file import FileStore

MESH = Mesh(dp=8, cp=1)
NS = "runs/seg"
GRACE = 600.0


def test_commit_cost_stays_flat_over_5000_commits() -> None:
    store = CountingStore(MemoryStore())
    log = ManifestLog(store, NS)  # default tail_limit=256 and tail_bytes_limit=64 KiB
    head = log.create_or_open(MESH)
    sizes: list[int] = []
    head = grow(log, head, 5000, sizes)
    assert head.next_step == 5000
    # The tail cycles every 230-odd commits (64 KiB of descriptors), so compare the largest
    # manifest of a window of 500 commits early and late in history. Measured: ~1.01x (only a
    # few segment refs differ).
    early, late = max(sizes[250:750]), max(sizes[4500:5000])
    assert late <= 1.05 * early, (early, late)
    # What does grow: a handful of segment refs, bounded by the merge policy (levels).
    assert len(head.segments) <= 7
    # Segment bytes: each descriptor is written once, then rewritten at most twice (rolls of
    # ~230 are level 2: 8 of them make a level-3 run of ~1,840, 8 of those a full one).
    seg_bytes = sum(len(store.inner.get(k)) for k in _segment_keys(store))
    per_descriptor = len(encode_segment_sample())
    assert seg_bytes <= 3 * 5000 * per_descriptor  # measured: ~1.7x (2.7x with fanout 2)


def encode_segment_sample() -> bytes:
    from batchweave._manifest import Segment

    one = encode_segment(Segment(namespace_id="x" * 32, first_step=0, tgbs=(descriptor("p", 1),)))
    two = encode_segment(
        Segment(namespace_id="x" * 32, first_step=0, tgbs=(descriptor("p", 1),) * 2)
    )
    return two[len(one) :]  # the marginal bytes of one descriptor


def _segment_keys(store: CountingStore) -> list[str]:
    return [m.key for m in store.inner.list(f"{NS}/_segments/")]


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_descriptor_lookup_costs_at_most_one_segment_read(backend: str, tmp_path: Path) -> None:
    inner = MemoryStore() if backend == "memory" else FileStore(tmp_path / "s", fsync=False)
    writer = ManifestLog(inner, NS, tail_limit=16)
    head = grow(writer, writer.create_or_open(MESH), 700)
    assert len(head.segments) >= 3
    counting = CountingStore(inner)
    reader = ManifestLog(counting, NS, tail_limit=16, segment_cache=2)
    rng = random.Random(7)
    for step in [rng.randrange(head.next_step) for _ in range(200)] + [0, 699]:
        counting.reset()
        d = reader.descriptor(head, step)
        assert d.offset == step
        assert counting.calls["get"] <= 1
        assert sum(counting.calls.values()) == counting.calls["get"]
        assert all("/_segments/" in k for k in counting.gets)
    # Repeated lookups in one segment hit the cache.
    counting.reset()
    for step in range(head.segments[0].first_step, head.segments[0].first_step + 10):
        reader.descriptor(head, step)
    assert counting.calls["get"] <= 1


def test_range_iteration_reads_each_segment_once() -> None:
    store = CountingStore(MemoryStore())
    log = ManifestLog(store, NS, tail_limit=8, segment_cache=0)
    head = grow(log, log.create_or_open(MESH), 100)
    store.reset()
    steps = [s for s, d in log.descriptors(head, 3, 97) if d.offset == s]
    assert steps == list(range(3, 97))
    touched = [r for r in head.segments if r.end_step > 3 and r.first_step < 97]
    assert store.calls["get"] == len(touched)


_TAIL_JSON = TypeAdapter(tuple[TgbDescriptor, ...])


def test_the_tail_rolls_at_its_byte_bound_before_its_count_bound() -> None:
    one = len(_TAIL_JSON.dump_json((descriptor("p", 0),)))
    limit = 10 * one  # about ten descriptors' JSON
    log = ManifestLog(MemoryStore(), NS, tail_limit=1000, tail_bytes_limit=limit)
    head = log.create_or_open(MESH)
    longest = 0
    for _ in range(100):
        result = log.commit(head, append=[descriptor("p", head.next_step)])
        assert isinstance(result, Committed)
        head = result.manifest
        assert len(_TAIL_JSON.dump_json(head.tail)) < limit
        longest = max(longest, len(head.tail))
    assert 8 <= longest <= 10
    assert sum(r.count for r in head.segments) + len(head.tail) == 100
    assert [d.offset for _, d in log.descriptors(head, 0, 100)] == list(range(100))
    # One commit far beyond the bound rolls all of it at once.
    batch = [descriptor("p", head.next_step + i) for i in range(30)]
    result = log.commit(head, append=batch)
    assert isinstance(result, Committed)
    assert result.manifest.tail == ()
    assert result.manifest.next_step == 130


def test_the_count_bound_still_applies_and_the_byte_bound_can_be_off() -> None:
    counted = ManifestLog(MemoryStore(), NS, tail_limit=4, tail_bytes_limit=1 << 30)
    head = grow(counted, counted.create_or_open(MESH), 10)
    assert len(head.tail) == 2  # rolled at 4 and 8
    unbounded = ManifestLog(MemoryStore(), NS, tail_limit=10_000, tail_bytes_limit=None)
    head = grow(unbounded, unbounded.create_or_open(MESH), 300)
    assert head.segments == ()
    assert len(head.tail) == 300
    with pytest.raises(ValueError, match="tail_bytes_limit"):
        ManifestLog(MemoryStore(), NS, tail_bytes_limit=0)


def test_last_commit_bytes_counts_the_manifest_and_a_rolled_segment() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS, tail_limit=4, tail_bytes_limit=None)
    head = log.create_or_open(MESH)
    result = log.commit(head, append=[descriptor("p", i) for i in range(3)])
    assert isinstance(result, Committed)
    manifest_bytes = len(store.get(f"{NS}/{manifest_key(1)}"))
    assert log.last_commit_bytes == manifest_bytes
    result = log.commit(result.manifest, append=[descriptor("p", 3)])  # rolls 4 descriptors
    assert isinstance(result, Committed)
    (segment,) = result.manifest.segments
    manifest_bytes = len(store.get(f"{NS}/{manifest_key(2)}"))
    assert log.last_commit_bytes == manifest_bytes + segment.bytes


def test_merge_policy_with_fanout_2_is_a_binary_counter_with_a_cap() -> None:
    log = ManifestLog(MemoryStore(), NS, tail_limit=2, max_segment_tgbs=16, merge_fanout=2)
    head = log.create_or_open(MESH)
    for n in range(1, 101):
        head = grow(log, head, 1)
        counts = [r.count for r in head.segments]
        assert sum(counts) + len(head.tail) == n
        levels = [segment_level(c, 2) for c in counts]
        unfrozen = [lv for c, lv in zip(counts, levels, strict=True) if c < 16]
        assert unfrozen == sorted(unfrozen, reverse=True)
        assert len(set(unfrozen)) == len(unfrozen)
        assert all(c <= 16 for c in counts)
    assert [r.count for r in head.segments] == [16] * 6 + [4]
    assert len(head.tail) == 0


@pytest.mark.parametrize("fanout", [4, 8])
def test_tiered_merge_keeps_fanout_minus_one_segments_per_level(fanout: int) -> None:
    cap = 2 * fanout * fanout  # tail_limit 2: levels 0, 1 and full segments
    log = ManifestLog(MemoryStore(), NS, tail_limit=2, max_segment_tgbs=cap, merge_fanout=fanout)
    head = log.create_or_open(MESH)
    rng = random.Random(11)
    while head.next_step < 1500:
        n = rng.randint(1, 5)
        result = log.commit(head, append=[descriptor("p", head.next_step + i) for i in range(n)])
        assert isinstance(result, Committed)
        head = result.manifest
        counts = [r.count for r in head.segments]
        assert all(c <= cap for c in counts)
        # After the newest full segment, levels never rise and each level holds <= F-1 segments.
        full = [i for i, c in enumerate(counts) if 2 * c > cap]
        recent = [segment_level(c, fanout) for c in counts[full[-1] + 1 if full else 0 :]]
        assert recent == sorted(recent, reverse=True)
        assert all(recent.count(lv) <= fanout - 1 for lv in set(recent))
    assert [d.offset for _, d in log.descriptors(head, 0, head.next_step)] == list(
        range(head.next_step)
    )
    # Full segments hold more than cap/2 descriptors; at most two references per cap steps.
    assert len(head.segments) <= 2 * head.next_step / cap + (fanout - 1) * 2 + 1


class _BytesStore(CountingStore):
    """Also sums the bytes of every PUT."""

    def __init__(self, inner: MemoryStore) -> None:
        super().__init__(inner)
        self.bytes_put = 0

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.bytes_put += len(data)
        super().put(key, data, mode=mode)


def _bytes_per_descriptor(fanout: int) -> tuple[float, float]:
    """Amortized manifest+segment bytes per committed descriptor: whole run, last tenth."""
    store = _BytesStore(MemoryStore())
    log = ManifestLog(store, NS, tail_limit=16, merge_fanout=fanout)  # cap 64 x 16
    head = log.create_or_open(MESH)
    rng = random.Random(3)
    per_commit: list[tuple[int, int]] = []
    while head.next_step < 20_000:
        n = rng.randint(32, 96)  # every commit carries more than tail_limit: every commit rolls
        before = store.bytes_put
        result = log.commit(head, append=[descriptor("p", head.next_step + i) for i in range(n)])
        assert isinstance(result, Committed)
        head = result.manifest
        per_commit.append((store.bytes_put - before, n))
    last = per_commit[-len(per_commit) // 10 :]
    return (
        sum(b for b, _ in per_commit) / head.next_step,
        sum(b for b, _ in last) / sum(n for _, n in last),
    )


def test_amortized_bytes_per_descriptor_stay_bounded_with_large_batches() -> None:
    d = len(encode_segment_sample())
    whole, last = _bytes_per_descriptor(8)
    # Each descriptor is written once and rewritten <= ceil(log_8(1024 / 32)) + 1 = 3 times
    # (rolls of 32-111 straddle levels 1 and 2); manifests (tail, segment references) add the
    # rest. Measured: 2.3 d over the run, 2.6 d in the last tenth.
    assert whole <= 3 * d, (whole, d)
    assert last <= 3.5 * d, (last, d)
    # The binary counter (fanout 2) rewrites each descriptor up to 6 times. Measured: 2.9 d.
    binary_whole, _ = _bytes_per_descriptor(2)
    assert whole < 0.85 * binary_whole, (whole, binary_whole)


def _contiguous_refs(counts: list[int]) -> list[SegmentRef]:
    """Segment references of the given sizes, back to back from step 0."""
    refs, step = [], 0
    for c in counts:
        refs.append(SegmentRef(key=f"k{step}", first_step=step, count=c, bytes=1, checksum=0))
        step += c
    return refs


@settings(max_examples=100, deadline=None)
@given(
    counts=st.lists(st.integers(1, 300), max_size=12),
    new=st.integers(1, 300),
    tail_limit=st.integers(1, 64),
    fanout=st.integers(2, 9),
)
def test_merge_run_length_respects_cap_and_fanout(
    counts: list[int], new: int, tail_limit: int, fanout: int
) -> None:
    cap = 64 * tail_limit
    refs = _contiguous_refs(counts)
    k = merge_run_length(refs, new, max_segment_tgbs=cap, fanout=fanout)
    assert 0 <= k <= len(refs)
    absorbed = refs[len(refs) - k :]
    assert new + sum(r.count for r in absorbed) <= max(cap, new)
    assert all(2 * r.count <= cap for r in absorbed)  # full segments are never rewritten
    level = [segment_level(r.count, fanout) for r in absorbed]
    # A run absorbs a segment of its own level only as part of a group of F-1 such segments.
    run = new
    for r, lv in zip(reversed(absorbed), reversed(level), strict=True):
        assert lv <= segment_level(run, fanout)
        run += r.count


@settings(max_examples=100, deadline=None)
@given(
    counts=st.lists(st.integers(1, 300), max_size=12),
    new=st.integers(1, 300),
    tail_limit=st.integers(1, 64),
)
def test_merge_run_length_with_fanout_2_respects_cap_and_levels(
    counts: list[int], new: int, tail_limit: int
) -> None:
    cap = 64 * tail_limit
    refs = _contiguous_refs(counts)
    k = merge_run_length(refs, new, max_segment_tgbs=cap, fanout=2)
    assert 0 <= k <= len(refs)
    absorbed = refs[len(refs) - k :]
    assert new + sum(r.count for r in absorbed) <= max(cap, new)
    if k < len(refs):
        nxt = refs[len(refs) - k - 1]
        total = new + sum(r.count for r in absorbed)
        assert total + nxt.count > cap or segment_level(nxt.count, 2) > segment_level(total, 2)


def _count_segment_writes(monkeypatch: pytest.MonkeyPatch) -> Counter[int]:
    """How many segment objects each descriptor (by offset) was written into, from now on."""
    writes: Counter[int] = Counter()
    real = SegmentFiles.write

    def counting(
        self: SegmentFiles, namespace_id: str, first_step: int, tgbs: Sequence[TgbDescriptor]
    ) -> SegmentRef:
        writes.update(d.offset for d in tgbs)
        return real(self, namespace_id, first_step, tgbs)

    monkeypatch.setattr(SegmentFiles, "write", counting)
    return writes


@pytest.mark.parametrize(("by_bytes", "most"), [(False, 2), (True, 3)])
def test_each_descriptor_is_rewritten_log_f_times_whatever_triggers_the_roll(
    monkeypatch: pytest.MonkeyPatch, by_bytes: bool, most: int
) -> None:
    # Levels used to be counted in tail_limits: rolls that the byte bound cut at ~8
    # descriptors all stayed level 0 and level-0 runs kept merging up to F * tail_limit
    # descriptors (10 rewrites with the defaults and ~32-descriptor rolls). Now a descriptor
    # rolled in runs of r is rewritten at most ceil(log_F(max_segment_tgbs / r)) times:
    # log_8(4096 / 64) = 2 by count, ceil(log_8(4096 / 9)) = 3 by bytes.
    writes = _count_segment_writes(monkeypatch)
    one = len(_TAIL_JSON.dump_json((descriptor("p", 10**6),)))
    log = ManifestLog(
        MemoryStore(), NS, tail_limit=64, tail_bytes_limit=8 * one if by_bytes else None
    )
    head = log.create_or_open(MESH)
    for i in range(6000):
        result = log.commit(head, append=[descriptor("p", 10**6 + i)])
        assert isinstance(result, Committed)
        head = result.manifest
    smallest = min(r.count for r in head.segments)
    assert smallest == (9 if by_bytes else 64)  # what triggered the rolls
    rewrites = [n - 1 for n in writes.values()]
    assert max(rewrites) == most, Counter(rewrites)
    assert [d.offset - 10**6 for _, d in log.descriptors(head, 0, 6000)] == list(range(6000))


def _simulate_rolls(rolls: Sequence[int], cap: int, fanout: int) -> tuple[list[int], list[int]]:
    """Reference counts after rolling runs of ``rolls`` descriptors (merging as a roll does),
    and how many times the descriptors of each roll were rewritten."""
    refs: list[tuple[int, list[int]]] = []  # (count, indices of the rolls it holds)
    rewrites = [0] * len(rolls)
    for i, new in enumerate(rolls):
        k = merge_run_length(
            _contiguous_refs([c for c, _ in refs]), new, max_segment_tgbs=cap, fanout=fanout
        )
        absorbed = refs[len(refs) - k :]
        for _, held in absorbed:
            for j in held:
                rewrites[j] += 1
        merged = [j for _, held in absorbed for j in held] + [i]
        refs = [*refs[: len(refs) - k], (new + sum(c for c, _ in absorbed), merged)]
        counts = [c for c, _ in refs]
        full = [i for i, c in enumerate(counts) if 2 * c > cap]
        recent = [segment_level(c, fanout) for c in counts[full[-1] + 1 if full else 0 :]]
        assert recent == sorted(recent, reverse=True)
        assert all(recent.count(lv) <= fanout - 1 for lv in set(recent))
    return [c for c, _ in refs], rewrites


@settings(max_examples=100, deadline=None)
@given(
    smallest=st.integers(1, 300),
    spread=st.sampled_from([1, 1, 2, 4]),
    cap=st.sampled_from([64, 256, 1024, 4096]),
    fanout=st.integers(2, 9),
    seed=st.integers(0, 2**32),
)
def test_rewrites_are_bounded_by_the_smallest_roll_not_the_tail_limit(
    smallest: int, spread: int, cap: int, fanout: int, seed: int
) -> None:
    # Every rewrite moves a descriptor into a run of a higher level (floor(log_F(count))) or
    # into a full one, so with rolls of r or more descriptors none is rewritten more than
    # ceil(log_F(cap / r)) + 1 times, and rolls of one size never pass ceil(log_F(cap / r)).
    rng = random.Random(seed)
    largest = min(cap, smallest * spread)
    smallest = min(smallest, largest)
    rolls = [rng.randint(smallest, largest) for _ in range(2 * cap // smallest + 20)]
    counts, rewrites = _simulate_rolls(rolls, cap, fanout)
    assert sum(counts) == sum(rolls)
    assert all(c <= cap for c in counts)
    bound = math.ceil(math.log(cap / smallest, fanout) - 1e-9)
    assert max(rewrites) <= bound + (smallest != largest), (rolls[:5], Counter(rewrites))


def _old_segment_level(count: int, fanout: int = DEFAULT_MERGE_FANOUT) -> int:
    """The level rule of earlier releases, for ``tail_limit=16``: ``floor(log_F(count / 16))``."""
    ratio, level = count // 16, 0
    while ratio >= fanout:
        ratio //= fanout
        level += 1
    return level


@pytest.mark.parametrize("deferred", [False, True])
def test_reference_lists_written_with_the_old_levels_are_merged_on(
    monkeypatch: pytest.MonkeyPatch, deferred: bool
) -> None:
    # A namespace whose segments were merged by an earlier release (levels counted in
    # tail_limits, rolls cut by the byte bound): a newer writer continues from that list. Nothing
    # is lost or duplicated, and its levels are back within F - 1 references (F while a merge
    # is pending) once a few rolls have merged the old runs in.
    store = MemoryStore()
    one = len(_TAIL_JSON.dump_json((descriptor("p", 10**6),)))
    cap = 64 * 16

    def writer() -> ManifestLog:
        return ManifestLog(
            store, NS, tail_limit=16, tail_bytes_limit=3 * one, deferred_merges=deferred
        )

    def commit(log: ManifestLog, head: Manifest, n: int) -> Manifest:
        for _ in range(n):
            step = head.next_step
            result = log.commit(head, append=[descriptor("p", 10**6 + step)])
            assert isinstance(result, Committed)
            head = result.manifest
            log.prepare_merge(head)
        return head

    with monkeypatch.context() as old:
        old.setattr(_segments, "segment_level", _old_segment_level)
        log = writer()
        head = commit(log, log.create_or_open(MESH), 2500)
    old_counts = [r.count for r in head.segments]
    assert old_counts[-5:] == [4] * 5  # measured: [576] * 4 + [144, 32] + [4] * 5
    writes = _count_segment_writes(monkeypatch)
    log = writer()
    head = commit(log, head, 1200)
    counts = [r.count for r in head.segments]
    full = [i for i, c in enumerate(counts) if 2 * c > cap]
    recent = [segment_level(c) for c in counts[full[-1] + 1 if full else 0 :]]
    assert recent == sorted(recent, reverse=True), (old_counts, counts)
    assert all(recent.count(lv) <= DEFAULT_MERGE_FANOUT for lv in set(recent)), counts
    assert [d.offset - 10**6 for _, d in log.descriptors(head, 0, 3700)] == list(range(3700))
    fresh = ManifestLog(store, NS).latest()
    assert fresh.next_step == 3700
    # Descriptors committed by the newer writer: rolls of 4, cap 1024: ceil(log_8(256)) + 1.
    assert max(n for offset, n in writes.items() if offset >= 10**6 + 2500) - 1 <= 4


@pytest.mark.parametrize("deferred", [False, True])
def test_an_old_list_with_more_than_f_references_of_one_new_level_is_merged_in(
    deferred: bool,
) -> None:
    # The old levels for tail_limit=16: 16-127 descriptors level 0, 128-1023 level 1. A list
    # valid under them (<= F - 1 references per old level, levels falling) can hold 11
    # references of the new level 2 (64-511 descriptors), more than a merge pending explains:
    # a deferred writer must not wait on them for good, and nothing may be lost on the way.
    store = MemoryStore()
    one = len(_TAIL_JSON.dump_json((descriptor("p", 10**6),)))
    log = ManifestLog(store, NS, tail_limit=16, tail_bytes_limit=3 * one, deferred_merges=deferred)
    genesis = log.create_or_open(MESH)
    refs, step = [], 0
    for count in [300] * 7 + [100] * 4 + [3] * 3:
        tgbs = [descriptor("p", 10**6 + step + i) for i in range(count)]
        refs.append(log._segments.write(genesis.namespace_id, step, tgbs))
        step += count
    fields = {name: getattr(genesis, name) for name in Manifest.model_fields}
    del fields["format"]
    fields.update(version=1, parent=0, segments=tuple(refs), tail_start=step, commit_id="old")
    store.put_if_absent(log.key(manifest_key(1)), encode_manifest(Manifest(**fields)))
    head = log.latest()
    assert [segment_level(r.count) for r in head.segments].count(2) == 11
    while head.next_step < step + 2000:
        result = log.commit(head, append=[descriptor("p", 10**6 + head.next_step)])
        assert isinstance(result, Committed)
        head = result.manifest
        log.prepare_merge(head)
    counts = [r.count for r in head.segments]
    full = [i for i, c in enumerate(counts) if 2 * c > log.max_segment_tgbs]
    assert full, counts  # the old runs were merged into full segments
    recent = [segment_level(c) for c in counts[full[-1] + 1 :]]
    assert recent == sorted(recent, reverse=True), counts
    assert all(recent.count(lv) <= DEFAULT_MERGE_FANOUT for lv in set(recent)), counts
    assert len(counts) <= 2 * head.next_step / log.max_segment_tgbs + 3 * DEFAULT_MERGE_FANOUT
    offsets = [d.offset - 10**6 for _, d in log.descriptors(head, 0, head.next_step)]
    assert offsets == list(range(head.next_step))


def test_corrupt_or_replaced_segment_is_detected() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS, tail_limit=4, merge_fanout=2)  # segments of two sizes
    head = grow(log, log.create_or_open(MESH), 12)
    assert [r.count for r in head.segments] == [8, 4]
    ref = head.segments[0]
    key = log.key(ref.key)
    good = store.get(key)
    damaged = bytearray(good)
    damaged[-3] ^= 0x04
    store.put(key, bytes(damaged))
    with pytest.raises(ChecksumMismatch, match=ref.key):
        ManifestLog(store, NS).descriptor(head, 0)
    store.put(key, good + b" ")
    with pytest.raises(FormatError, match="bytes"):
        ManifestLog(store, NS).descriptor(head, 0)
    other = head.segments[1]
    store.put(key, store.get(log.key(other.key)))  # a valid segment, but the wrong one
    with pytest.raises(FormatError):
        ManifestLog(store, NS).descriptor(head, 0)
    store.put(key, good)
    assert ManifestLog(store, NS).descriptor(head, 0).offset == 0


def test_reclamation_cuts_segment_refs_and_merges_drop_reclaimed_steps() -> None:
    log = ManifestLog(MemoryStore(), NS, tail_limit=4)
    head = grow(log, log.create_or_open(MESH), 40)
    result = log.commit(head, base_step=35)
    assert isinstance(result, Committed)
    cut = result.manifest
    assert cut.segments == tuple(r for r in head.segments if r.end_step > 35)
    grown = grow(log, cut, 30)
    assert grown.segments[0].first_step >= 32
    assert [d.offset for _, d in log.descriptors(grown, 35, 70)] == list(range(35, 70))


def _deferred_log(
    store: ObjectStore, *, tail_limit: int, fanout: int, cap: int | None = None
) -> ManifestLog:
    """A log in the producer's mode: level merges written after a commit, not inside it."""
    return ManifestLog(
        store,
        NS,
        tail_limit=tail_limit,
        max_segment_tgbs=cap,
        merge_fanout=fanout,
        deferred_merges=True,
    )


def test_deferred_merges_leave_only_the_tail_inside_the_commit() -> None:
    # The producer's mode: a commit writes at most its tail as a segment; the level merges are
    # written afterwards (prepare_merge, outside the fragile window) and swapped in next time.
    fanout, tail_limit = 4, 2
    cap = tail_limit * fanout * fanout
    store = _BytesStore(MemoryStore())
    log = _deferred_log(store, tail_limit=tail_limit, fanout=fanout, cap=cap)
    d = len(encode_segment_sample())
    head = log.create_or_open(MESH)
    rng = random.Random(5)
    merged_bytes = 0
    while head.next_step < 1500:
        n = rng.randint(1, 5)
        before, tail = store.bytes_put, len(head.tail)
        result = log.commit(head, append=[descriptor("p", head.next_step + i) for i in range(n)])
        assert isinstance(result, Committed)
        head = result.manifest
        # Inside the commit: the manifest plus at most the rolled tail, never a level merge.
        rolled = store.bytes_put - before - len(encode_manifest(head))
        assert rolled <= (tail + n) * d + 200, (rolled, tail, n)
        merged_bytes += log.prepare_merge(head)
        counts = [r.count for r in head.segments]
        full = [i for i, c in enumerate(counts) if 2 * c > cap]
        recent = [segment_level(c, fanout) for c in counts[full[-1] + 1 if full else 0 :]]
        # One merge may be pending (written, not yet swapped in): F runs of a level, not F - 1.
        assert all(recent.count(lv) <= fanout for lv in set(recent)), recent
    assert merged_bytes > 0
    assert [d.offset for _, d in log.descriptors(head, 0, head.next_step)] == list(
        range(head.next_step)
    )
    assert len(head.segments) <= 2 * head.next_step / cap + fanout * 2 + 1


def test_a_prepared_merge_is_not_swapped_in_once_its_segments_changed() -> None:
    store = MemoryStore()
    deferred = _deferred_log(store, tail_limit=2, fanout=2)
    inline = ManifestLog(store, NS, tail_limit=2, merge_fanout=2)
    head = deferred.create_or_open(MESH)
    head = grow(deferred, head, 2)  # one level-0 segment
    result = deferred.commit(head, append=[descriptor("p", 2), descriptor("p", 3)])
    assert isinstance(result, Committed)
    head = result.manifest
    assert [r.count for r in head.segments] == [2, 2]  # the merge was not done inside
    assert deferred.prepare_merge(head) > 0  # written now: one segment of 4
    # Another writer merges those segments itself first (and adds two more steps).
    result = inline.commit(head, append=[descriptor("p", 4), descriptor("p", 5)])
    assert isinstance(result, Committed)
    head = result.manifest
    replaced = {r.key for r in head.segments}
    # The deferred log's next commit cannot swap its merge in; it commits a valid version.
    result = deferred.commit(head, append=[descriptor("p", 6)])
    assert isinstance(result, Committed)
    assert {r.key for r in result.manifest.segments} == replaced
    assert [d.offset for _, d in deferred.descriptors(result.manifest, 0, 7)] == list(range(7))


def test_a_prepared_merge_is_swapped_in_by_the_next_commit() -> None:
    store = MemoryStore()
    log = _deferred_log(store, tail_limit=2, fanout=2)
    head = grow(log, log.create_or_open(MESH), 4)
    assert [r.count for r in head.segments] == [2, 2]
    log.prepare_merge(head)
    head = grow(log, head, 1)
    assert [r.count for r in head.segments] == [4]
    assert [d.offset for _, d in log.descriptors(head, 0, 5)] == list(range(5))


def test_interleaved_deferred_merges_are_not_duplicated() -> None:
    # Two producers' logs commit in turn, every commit rolling: a merge that one of them has
    # prepared (swapped in by its next commit) is not prepared again by the other, so every
    # prepared merge is swapped in; a level holds at most 2F - 1 segments meanwhile.
    fanout, tail_limit = 4, 2
    cap = tail_limit * fanout**3
    store = MemoryStore()
    logs = [_deferred_log(store, tail_limit=tail_limit, fanout=fanout, cap=cap) for _ in range(2)]
    head = logs[0].create_or_open(MESH)
    prepared: set[str] = set()
    listed: set[str] = set()
    step = 0
    for i in range(400):
        log = logs[i % 2]
        result = log.commit(head, append=[descriptor("p", step), descriptor("p", step + 1)])
        assert isinstance(result, Committed)
        head = result.manifest
        step += 2
        listed.update(r.key for r in head.segments)
        if log.prepare_merge(head):
            assert log._prepared is not None
            prepared.add(log._prepared[1].key)
        counts = [r.count for r in head.segments]
        full = [i for i, c in enumerate(counts) if 2 * c > cap]
        recent = [segment_level(c, fanout) for c in counts[full[-1] + 1 if full else 0 :]]
        assert all(recent.count(lv) <= 2 * fanout - 1 for lv in set(recent)), recent
    assert len(prepared) >= 20
    # All but the last pending ones were swapped in: no merge was written twice.
    assert len(prepared - listed) <= 2
    assert [d.offset for _, d in logs[0].descriptors(head, 0, head.next_step)] == list(range(step))


# -- prepared merges and the reclaimer ---------------------------------------------------------


class _Wall:
    """One wall clock for the store's ``last_modified``, the log and the reclaimer."""

    def __init__(self) -> None:
        self.now = 1.7e9

    def __call__(self) -> float:
        return self.now


def test_a_stale_prepared_merge_the_reclaimer_deleted_is_never_swapped_in() -> None:
    # A producer prepares a level merge after a commit, then commits nothing for longer than
    # 2 x grace (a slow source, or append blocked by max_lag while checkpointing stalls). The
    # reclaimer deletes the merged segment as an unreferenced orphan. The producer's next commit
    # must not swap that deleted segment in for the live ones: the new version would list steps
    # whose descriptors no longer exist anywhere.
    wall = _Wall()
    store = MemoryStore(clock=wall)
    log = ManifestLog(store, NS, clock=wall, tail_limit=2, merge_fanout=2, deferred_merges=True)
    head = grow(log, log.create_or_open(MESH), 4)
    assert [r.count for r in head.segments] == [2, 2]
    assert log.prepare_merge(head) > 0  # the merge of both, waiting for the next commit

    wall.now += 3 * GRACE
    report = Reclaimer(store, NS, grace=GRACE, clock=wall).run_once()
    assert report.segments_deleted == 1  # the prepared merge: referenced by no version

    result = log.commit(head, append=[descriptor("p", 4)])
    assert isinstance(result, Committed)
    fresh = ManifestLog(store, NS)
    latest = fresh.latest()
    assert [d.offset for _, d in fresh.descriptors(latest, 0, latest.next_step)] == list(range(5))


def test_a_prepared_merge_is_swapped_in_within_its_age_limit_and_dropped_after() -> None:
    wall = _Wall()
    store = MemoryStore(clock=wall)
    log = ManifestLog(store, NS, clock=wall, tail_limit=2, merge_fanout=2, deferred_merges=True)
    head = grow(log, log.create_or_open(MESH), 4)
    log.prepare_merge(head)
    wall.now += PREPARED_MERGE_MAX_AGE / 2
    head = grow(log, head, 1)
    assert [r.count for r in head.segments] == [4]  # swapped in

    head = grow(log, head, 3)  # two more rolls: a merge of all three is due
    assert [r.count for r in head.segments] == [4, 2, 2]
    assert log.prepare_merge(head) > 0
    wall.now += PREPARED_MERGE_MAX_AGE + 1
    head = grow(log, head, 1)
    assert [r.count for r in head.segments] == [4, 2, 2]  # too old: left unreferenced
    assert [d.offset for _, d in log.descriptors(head, 0, head.next_step)] == list(range(9))


class _EveryMinuteAndABit(CommitPolicy):
    """Commits at most every 61 s: a producer whose source is slower than one TGB a minute."""

    name: ClassVar[str] = "every-61s"

    def ready(self, pending: int, since_last_attempt: float) -> bool:
        return since_last_attempt >= self.gap

    def record(self, outcome: AttemptOutcome) -> None:
        pass

    @property
    def gap(self) -> float:
        return PREPARED_MERGE_MAX_AGE + 1


def test_segments_still_merge_when_a_producer_commits_less_than_once_a_minute() -> None:
    # A merge is prepared after the commit that rolled, and swapped in by this producer's
    # next commit; one prepared more than PREPARED_MERGE_MAX_AGE ago is dropped (the reclaimer
    # may delete it). A producer that commits less often than that dropped every merge: its
    # segments never merged, and every manifest version listed one reference per rolled tail
    # (commit cost growing with history). 64 rolls must merge into a few tiered segments.
    time = FakeTime()
    store = MemoryStore(clock=time.wall)
    with Producer(
        store,
        "slow",
        producer_id="p",
        mesh=Mesh(dp=1),
        policy=_EveryMinuteAndABit(),
        tail_limit=2,
        clock=time.clock,
        wall_clock=time.wall,
        sleep=time.sleep,
    ) as p:
        for offset in range(128):
            p.append([b"x"], offset=offset)
            p.flush()
    latest = ManifestLog(store, "slow").latest()
    assert latest.next_step == 128
    # Three levels (2, 16 and 128 TGBs) of at most F - 1 segments each; unmerged: 64.
    assert len(latest.segments) <= 3 * (DEFAULT_MERGE_FANOUT - 1), [
        s.count for s in latest.segments
    ]


def test_a_refreshed_merge_survives_the_reclaimer_deleting_the_first_copy() -> None:
    wall = _Wall()
    store = MemoryStore(clock=wall)
    log = ManifestLog(store, "ns", clock=wall, tail_limit=2, merge_fanout=2, deferred_merges=True)
    head = log.create_or_open(Mesh(dp=8))
    for offset in range(4):
        result = log.commit(head, append=[descriptor("p", offset)])
        assert isinstance(result, Committed)
        head = result.manifest
    assert log.prepare_merge(head) > 0
    assert log.refresh_prepared_merge() == 0  # fresh: nothing to do
    wall.now += 3 * 600.0  # long idle: the first copy is an orphan older than 2 x grace
    assert log.refresh_prepared_merge() > 0
    assert Reclaimer(store, "ns", grace=600.0, clock=wall).run_once().segments_deleted == 1
    result = log.commit(head, append=[descriptor("p", 4)])
    assert isinstance(result, Committed)
    assert [r.count for r in result.manifest.segments] == [4]  # the fresh copy was swapped in
    fresh = ManifestLog(store, "ns")
    latest = fresh.latest()
    assert [d.offset for _, d in fresh.descriptors(latest, 0, latest.next_step)] == list(range(5))


def _segment_keys(store: MemoryStore) -> set[str]:
    return {meta.key for meta in store.list(f"{NS}/_segments/")}


@pytest.mark.parametrize("deferred", [False, True])
def test_a_commit_retried_after_a_failed_manifest_put_reuses_the_segment_it_rolled(
    deferred: bool,
) -> None:
    # Before: every retry of a commit whose manifest PUT failed (a throttled _manifests/
    # prefix) wrote everything pending into a new segment: one orphan per attempt.
    wall = _Wall()
    inner = MemoryStore(clock=wall)
    refused = [False]

    def fault(key: str) -> tuple[bool, Exception | None]:
        if refused[0] and "/_manifests/" in key:
            return False, TransientStoreError(f"{key}: 503 SlowDown (injected)")
        return True, None

    log = ManifestLog(
        FaultyPutStore(inner, fault), NS, clock=wall, tail_limit=4, deferred_merges=deferred
    )
    head = log.create_or_open(MESH)
    refused[0] = True
    pending = [descriptor("p", offset) for offset in range(6)]
    for _ in range(3):
        assert isinstance(log.commit(head, append=pending), Conflict)
    assert len(_segment_keys(inner)) == 1  # written once, reused twice

    pending += [descriptor("p", offset) for offset in range(6, 9)]  # appends went on
    assert isinstance(log.commit(head, append=pending), Conflict)
    assert len(_segment_keys(inner)) == 1  # the new 3 stay inline (under tail_limit)
    pending += [descriptor("p", 9)]
    assert isinstance(log.commit(head, append=pending), Conflict)
    assert len(_segment_keys(inner)) == 2  # only the 4 new ones were written

    wall.now += PREPARED_MERGE_MAX_AGE + 1  # a reclaimer may have deleted it as an orphan
    assert isinstance(log.commit(head, append=pending), Conflict)
    assert len(_segment_keys(inner)) == 3

    refused[0] = False
    result = log.commit(head, append=pending)
    assert isinstance(result, Committed)
    latest = ManifestLog(inner, NS).latest()
    assert [d.offset for _, d in log.descriptors(latest, 0, latest.next_step)] == list(range(10))


# -- size bounds on writes: what a roll or a merge writes, every reader can read --------------


def _segment_tgbs(log: ManifestLog, head: Manifest) -> list[tuple[TgbDescriptor, ...]]:
    return [log._segments.read(ref, head.namespace_id).tgbs for ref in head.segments]


@pytest.mark.parametrize("deferred", [False, True])
def test_a_commit_of_more_than_max_segment_tgbs_rolls_into_several_segments(
    deferred: bool,
) -> None:
    # Before: one commit of 40,000 descriptors became one segment of 40,000 (over 512 MiB at
    # dp=4096 with slice tables, which no reader accepts).
    log = ManifestLog(MemoryStore(), NS, tail_limit=4, max_segment_tgbs=8, deferred_merges=deferred)
    head = log.create_or_open(MESH)
    head = grow(log, head, 3)  # a tail to roll with the batch
    result = log.commit(head, append=[descriptor("p", offset) for offset in range(3, 30)])
    assert isinstance(result, Committed)
    head = result.manifest
    assert [ref.count for ref in head.segments] == [8, 8, 8, 6]
    assert [ref.first_step for ref in head.segments] == [0, 8, 16, 24]
    assert head.tail == ()
    assert head.tail_start == 30
    offsets = [d.offset for tgbs in _segment_tgbs(log, head) for d in tgbs]
    assert offsets == list(range(30))
    assert [d.offset for _, d in log.descriptors(head, 0, 30)] == list(range(30))


def test_a_roll_starts_a_new_segment_at_the_byte_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    one = descriptors_json_bytes([descriptor("p", 0)])
    budget = 3 * one + 10  # three descriptors' JSON fit, four do not
    monkeypatch.setattr(_segments, "SEGMENT_BYTES_BUDGET", budget, raising=False)
    log = ManifestLog(MemoryStore(), NS, tail_limit=4, tail_bytes_limit=None)
    head = log.create_or_open(MESH)
    result = log.commit(head, append=[descriptor("p", offset) for offset in range(10)])
    assert isinstance(result, Committed)
    head = result.manifest
    assert [ref.count for ref in head.segments] == [3, 3, 3, 1]
    for tgbs in _segment_tgbs(log, head):
        assert descriptors_json_bytes(tgbs) <= budget
    assert [d.offset for _, d in log.descriptors(head, 0, 10)] == list(range(10))


@pytest.mark.parametrize("deferred", [False, True])
def test_merges_stay_within_the_byte_budget(
    monkeypatch: pytest.MonkeyPatch, deferred: bool
) -> None:
    # Before: merges went up to max_segment_tgbs descriptors whatever their size (16,384 of
    # 42.7 KB each: 700 MB, over the 512 MiB readers accept).
    budget = 12 * len(encode_segment_sample())  # about 11 descriptors' segment
    monkeypatch.setattr(_segments, "SEGMENT_BYTES_BUDGET", budget, raising=False)
    log = _deferred_log(MemoryStore(), tail_limit=2, fanout=2, cap=1024)
    log.deferred_merges = deferred
    head = log.create_or_open(MESH)
    for _ in range(200):
        result = log.commit(head, append=[descriptor("p", head.next_step)])
        assert isinstance(result, Committed)
        head = result.manifest
        log.prepare_merge(head)
    assert all(ref.bytes <= budget for ref in head.segments), [r.bytes for r in head.segments]
    assert max(ref.count for ref in head.segments) > 4  # merges did happen
    assert [d.offset for _, d in log.descriptors(head, 0, 200)] == list(range(200))


@settings(max_examples=100, deadline=None)
@given(
    counts=st.lists(st.integers(1, 300), max_size=12),
    new=st.integers(1, 300),
    per=st.integers(1, 50),
    budget=st.integers(1, 5000),
    fanout=st.integers(2, 9),
)
def test_merge_run_length_respects_the_byte_budget(
    counts: list[int], new: int, per: int, budget: int, fanout: int
) -> None:
    refs = [ref.model_copy(update={"bytes": ref.count * per}) for ref in _contiguous_refs(counts)]
    saved = _segments.SEGMENT_BYTES_BUDGET
    _segments.SEGMENT_BYTES_BUDGET = budget  # (hypothesis and monkeypatch do not mix)
    try:
        k = merge_run_length(refs, new, max_segment_tgbs=4096, fanout=fanout, new_bytes=new * per)
    finally:
        _segments.SEGMENT_BYTES_BUDGET = saved
    absorbed = refs[len(refs) - k :]
    if k:
        assert new * per + sum(r.bytes for r in absorbed) <= budget
        assert all(2 * r.bytes <= budget for r in absorbed)  # full segments are never rewritten


def test_a_segment_over_the_read_limit_is_refused_before_the_put(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Before: written, then every read said "the object is corrupt or not a BatchWeave object".
    from batchweave._manifest import Segment

    one = encode_segment(Segment(namespace_id="x" * 32, first_step=0, tgbs=(descriptor("p", 0),)))
    monkeypatch.setattr(_codec, "MAX_SEGMENT_BYTES", len(one) - 1)
    store = MemoryStore()
    log = ManifestLog(store, NS, tail_limit=1)
    head = log.create_or_open(MESH)
    with pytest.raises(NamespaceError, match=r"more than the \d+ bytes every reader accepts"):
        log.commit(head, append=[descriptor("p", 0)])
    assert not list(store.list(f"{NS}/_segments/"))
    assert ManifestLog(store, NS).latest().version == 0

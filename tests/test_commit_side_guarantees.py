"""Guarantees of the commit path that mutation testing found no test for.

Each test pins one promise of the manifest log, its models and segments, or the producer (named
in its docstring) that a one-line change to the code broke without any other test failing.
"""

from __future__ import annotations

import random

import pytest
from fake_time import FakeTime
from manifest_helpers import descriptor, grow
from pydantic import ValidationError

from batchweave import (
    ChecksumMismatch,
    MemoryStore,
    Mesh,
    NamespaceSealed,
    Producer,
    TransientStoreError,
)
from batchweave._manifest import Committed, Conflict, Manifest, ManifestLog, ProducerState
from batchweave._manifest._codec import encode_segment
from batchweave._manifest._log import CommitResult, commit_until
from batchweave._manifest._models import Segment, SegmentRef, SliceTable
from batchweave._manifest._segments import swap_in

MESH = Mesh(dp=4, cp=2)
NS = "runs/gaps"


def _log() -> tuple[ManifestLog, Manifest]:
    log = ManifestLog(MemoryStore(), NS)
    return log, log.create_or_open(MESH)


def test_commit_until_gives_up_after_exactly_its_attempts() -> None:
    """``commit_until`` raises :class:`TransientStoreError` after ``attempts`` lost races: the
    budget is the number of attempts made, not one more."""
    log, genesis = _log()
    calls: list[int] = []

    def lose(m: Manifest) -> CommitResult:
        calls.append(m.version)
        return Conflict(None)

    with pytest.raises(TransientStoreError, match="after 3 lost races"):
        commit_until(
            log, genesis, lose, what="x", attempts=3, sleep=lambda _: None, rng=random.Random(1)
        )
    assert len(calls) == 3


def test_appending_never_lowers_a_committed_epoch() -> None:
    """Appending updates a producer's offset, ``last_version`` and ``last_commit_at``, never its
    epoch downwards: an epoch set in the same commit (``producers``) stays, so a process with
    the older epoch remains fenced."""
    log, genesis = _log()
    result = log.commit(
        genesis,
        append=[descriptor("p", 0, epoch=1)],
        producers={"p": ProducerState(epoch=2, last_version=1)},
    )
    assert isinstance(result, Committed)
    state = result.manifest.producers["p"]
    assert (state.epoch, state.offset) == (2, 0)


def _refs(*counts: int) -> list[SegmentRef]:
    """Segment references of the given sizes, back to back from step 0, keyed by first step."""
    refs, step = [], 0
    for count in counts:
        refs.append(SegmentRef(key=f"k{step}", first_step=step, count=count, bytes=1, checksum=0))
        step += count
    return refs


def test_a_prepared_merge_whose_run_changed_after_its_first_segment_is_not_swapped_in() -> None:
    """``swap_in`` replaces the contiguous run it merged, matched by key, or returns ``None``:
    a list that still starts with the run's first reference but then holds another commit's
    references (which merged or replaced the rest) must not lose them to the stale merge."""
    a, b, c = _refs(2, 2, 2)
    merged = SegmentRef(key="merged", first_step=0, count=4, bytes=1, checksum=0)
    other = SegmentRef(key="other", first_step=2, count=4, bytes=1, checksum=0)
    assert swap_in([a, b, c], [a, b], merged) == (merged, c)
    assert swap_in([a, other], [a, b], merged) is None
    assert swap_in([a], [a, b], merged) is None


def test_a_segment_replaced_by_a_valid_one_of_the_same_size_and_steps_is_refused() -> None:
    """A segment reference's ``checksum`` guards against replacement: a well-formed segment of
    the same namespace, steps and byte size, but other descriptors, is a ChecksumMismatch."""
    store = MemoryStore()
    log = ManifestLog(store, NS, tail_limit=4)
    head = grow(log, log.create_or_open(MESH), 4)
    ref = head.segments[0]
    forged = encode_segment(
        Segment(
            namespace_id=head.namespace_id,
            first_step=ref.first_step,
            tgbs=tuple(descriptor("q", step) for step in range(ref.first_step, ref.end_step)),
        )
    )
    assert len(forged) == ref.bytes  # it passes the size check
    store.put(log.key(ref.key), forged)
    with pytest.raises(ChecksumMismatch, match=ref.key):
        ManifestLog(store, NS).descriptor(head, 0)


def test_segment_references_with_a_gap_between_them_are_refused() -> None:
    """A manifest's segments are contiguous and in step order: a reference starting after the
    previous one's end (steps that no reference holds) is refused."""
    first, second = _refs(2, 2)
    moved = second.model_copy(update={"first_step": 3})
    with pytest.raises(ValueError, match="starts at step 3, expected 2"):
        Manifest(
            namespace_id="ns",
            mesh=MESH,
            version=1,
            commit_id="c",
            segments=(first, moved),
            tail_start=5,
        )


def test_a_base_step_below_the_first_listed_segment_is_refused() -> None:
    """Every step from ``base_step`` on is listed: a manifest whose segments start above its
    ``base_step`` would send reads of the steps in between to the wrong segment."""
    _, second = _refs(2, 2)
    with pytest.raises(ValueError, match=r"base_step 1 outside the listed steps \[2, 4\]"):
        Manifest(
            namespace_id="ns",
            mesh=MESH,
            version=1,
            commit_id="c",
            base_step=1,
            segments=(second,),
            tail_start=4,
        )


def test_a_packed_checksum_column_longer_than_its_count_is_a_validation_error() -> None:
    """A compact table's packed checksums hold exactly ``count`` values: extra bytes are a
    validation error (a FormatError when decoded), not a ``struct.error`` from unpacking."""
    compact = {
        "codec": "raw",
        "checksum_algo": "crc32c",
        "lengths": [3, 4],
        "sample_counts": 1,
        "count": 2,
        "checksums": "AAAAAQAAAAIAAAAD",  # three packed values
    }
    with pytest.raises(ValidationError, match="12 packed bytes, expected 2 slices x 4 bytes"):
        SliceTable.model_validate(compact)


def test_a_producer_whose_namespace_another_writer_sealed_stops_naming_its_pending_tgbs() -> None:
    """A producer that finds its namespace sealed by someone else while it still holds
    uncommitted TGBs raises :class:`NamespaceSealed` saying so (it did not seal it itself)."""
    store = MemoryStore()
    fake = FakeTime(1000.0)
    producer = Producer(
        store,
        NS,
        producer_id="p0",
        mesh=MESH,
        policy="fixed100",  # nothing commits before the flush
        clock=fake.clock,
        wall_clock=fake.wall,
        sleep=fake.sleep,
    )
    try:
        for offset in range(3):
            producer.append([b"x"] * MESH.slices, offset=offset)
        log = ManifestLog(store, NS)
        assert isinstance(log.commit(log.latest(), seal=True), Committed)
        with pytest.raises(NamespaceSealed, match="still had 3 uncommitted TGBs"):
            producer.flush()
    finally:
        producer.abort()
    assert ManifestLog(store, NS).latest().next_step == 0

"""Decoded segments are cached by size (descriptors held), not only by count.

A full segment holds up to ``max_segment_tgbs`` descriptors (16,384 by default) and a decoded
descriptor takes about 4 KB at ``dp=2``: caches bounded by entries alone let a consumer catching
up, a producer or a process running several consumers hold gigabytes. These tests read and write
many more segments than the bounds hold, and check both the bound and that sequential readers and
merging writers still read each segment once.
"""

from __future__ import annotations

import threading
from collections import Counter

from manifest_helpers import CountingStore, descriptor, grow

from batchweave import Consumer, ConsumerError, MemoryStore, Mesh, Producer, StoreWrapper
from batchweave._manifest import Committed, ManifestLog, _codec
from batchweave._manifest._log import DEFAULT_TAIL_LIMIT
from batchweave._manifest._models import Manifest, Segment
from batchweave._store._base import ByteRange

MESH = Mesh(dp=8, cp=1)
NS = "runs/cache"


def _held(log: ManifestLog) -> int:
    """Descriptors the log's segment cache holds (read from its entries)."""
    return sum(len(segment.tgbs) for _, segment in log._segments._cache.values())


def _segment_gets(store: CountingStore) -> Counter[str]:
    return Counter(key for key in store.gets if "/_segments/" in key)


def _history(steps: int, tail_limit: int = 2) -> tuple[MemoryStore, Manifest]:
    inner = MemoryStore()
    writer = ManifestLog(inner, NS, tail_limit=tail_limit)
    head = grow(writer, writer.create_or_open(MESH), steps)
    return inner, head


def test_a_sequential_reader_holds_about_one_full_segment_and_reads_each_once() -> None:
    inner, head = _history(1500)  # max_segment_tgbs = 128: a dozen full segments
    assert len(head.segments) > 10
    counting = CountingStore(inner)
    reader = ManifestLog(counting, NS, tail_limit=2)
    # The cap (max_segment_tgbs), or the two newest segments if they hold more.
    bound = 2 * reader.max_segment_tgbs
    most = 0
    for step in range(head.next_step):
        assert reader.descriptor(head, step).offset == step
        most = max(most, _held(reader))
    assert most <= bound
    assert _held(reader) <= bound
    gets = _segment_gets(counting)
    assert set(gets) == {reader.key(r.key) for r in head.segments}
    assert max(gets.values()) == 1  # each segment read once


def test_an_explicit_descriptor_bound_keeps_the_two_newest_segments() -> None:
    inner, head = _history(600)
    counting = CountingStore(inner)
    reader = ManifestLog(counting, NS, tail_limit=2, segment_cache_tgbs=1)
    for step in range(head.next_step):
        reader.descriptor(head, step)
    assert len(reader._segments._cache) == 2
    assert max(_segment_gets(counting).values()) == 1
    # Going back and forth between the two newest never reads again.
    counting.reset()
    last, previous = head.segments[-1], head.segments[-2]
    for _ in range(3):
        reader.descriptor(head, previous.first_step)
        reader.descriptor(head, last.first_step)
    assert counting.calls["get"] == 0


def test_a_merging_writer_caches_only_the_segments_it_may_merge() -> None:
    counting = CountingStore(MemoryStore())
    log = ManifestLog(counting, NS, tail_limit=2, deferred_merges=True)
    head = log.create_or_open(MESH)
    most = 0
    for _ in range(2000):
        result = log.commit(head, append=[descriptor("p", head.next_step)])
        assert isinstance(result, Committed)
        head = result.manifest
        log.prepare_merge(head)
        most = max(most, _held(log))
    mergeable = sum(r.count for r in head.segments if 2 * r.count <= log.max_segment_tgbs)
    assert most <= 2 * log.max_segment_tgbs
    assert _held(log) <= mergeable + log.max_segment_tgbs  # plus a prepared merge
    assert not _segment_gets(counting)  # every merge found its segments in the cache


def test_adopting_a_newer_base_step_forgets_segments_below_it() -> None:
    inner, head = _history(400)
    reader = ManifestLog(inner, NS, tail_limit=2, max_segment_tgbs=10_000)  # holds all 400
    reader.latest()
    for _ in reader.descriptors(head, 0, head.next_step):
        pass
    assert _held(reader) == head.tail_start
    cut = head.segments[-1].first_step
    writer = ManifestLog(inner, NS, tail_limit=2)
    result = writer.commit(writer.latest(), base_step=cut)
    assert isinstance(result, Committed)
    assert reader.latest().base_step == cut
    assert _held(reader) == head.segments[-1].count


def test_the_process_wide_decoded_cache_is_bounded_in_descriptors() -> None:
    _codec.forget_decoded()
    one = descriptor("p", 0)
    try:
        for i in range(12):  # 12 x 4,000 descriptors: about three full default segments
            tgbs = tuple(one.model_copy(update={"offset": i * 4000 + j}) for j in range(4000))
            data = _codec.encode_segment(Segment(namespace_id="ns", first_step=i * 4000, tgbs=tgbs))
            _codec.decode_segment(data, key=f"{NS}/_segments/{i}")
        held = 0
        for item in _codec._DECODED._items.values():
            decoded = item[1]
            if isinstance(decoded, tuple):
                held += len(decoded[0].tgbs)
        assert 0 < held <= 2 * 64 * 256  # two full segments of the default size
        assert _codec._DECODED.cached_tgbs == held
    finally:
        _codec.forget_decoded()


def test_the_process_wide_decoded_cache_keeps_a_full_segment_beside_manifests() -> None:
    # Ranks run as threads of one process share a full segment (max_segment_tgbs = 64 x 256 by
    # default) through this cache, and decode manifests with tails in between. Before, the bound
    # was exactly one full segment: the first manifest decoded after it evicted it, and every
    # rank reaching the segment later decoded it again (about 10 us per descriptor).
    _codec.forget_decoded()
    one = descriptor("p", 0)
    full = 64 * DEFAULT_TAIL_LIMIT
    try:
        tgbs = tuple(one.model_copy(update={"offset": j}) for j in range(full))
        segment = _codec.encode_segment(Segment(namespace_id="ns", first_step=0, tgbs=tgbs))
        key = f"{NS}/_segments/full"
        decoded, _ = _codec.decode_segment(segment, key=key)
        tail = tuple(one.model_copy(update={"offset": full + j}) for j in range(DEFAULT_TAIL_LIMIT))
        for version in range(1, 4):  # manifests read by the ranks while they read the segment
            manifest = Manifest(
                namespace_id="ns",
                mesh=MESH,
                version=version,
                parent=version - 1,
                commit_id=f"c{version}",
                tail=tail,
                base_step=full,
                tail_start=full,
            )
            _codec.decode_manifest(_codec.encode_manifest(manifest), key=f"{NS}/m/{version}")
        assert _codec.decode_segment(segment, key=key)[0] is decoded  # not decoded again
    finally:
        _codec.forget_decoded()


def test_a_consumer_reads_each_segment_once() -> None:
    inner = MemoryStore()
    with Producer(inner, NS, producer_id="p0", mesh=Mesh(dp=2, cp=1), tail_limit=2) as producer:
        for offset in range(700):
            producer.append([b"a" * 16, b"b" * 16], offset=offset)
    counting = CountingStore(inner)
    consumer = Consumer(counting, NS, mesh=Mesh(dp=2, cp=1), dp_rank=0, sleep=lambda s: None)
    try:
        it = iter(consumer)
        for _ in range(700):
            next(it)
    finally:
        consumer.close()
    gets = _segment_gets(counting)
    assert gets
    assert max(gets.values()) == 1


def test_a_closed_consumer_holds_no_segments_or_footers() -> None:
    # Before: close() only stopped its threads; a closed consumer still referenced (a variable,
    # a traceback, a list of replaced consumers) kept up to max_segment_tgbs descriptors.
    store = MemoryStore()
    options = {"policy": "naive", "tail_limit": 2, "slice_table_limit": 0}  # footers are read
    with Producer(store, NS, producer_id="p", mesh=Mesh(dp=1), **options) as p:
        for offset in range(12):
            p.append([b"x"], offset=offset)
        p.seal()
    consumer = Consumer(store, NS, mesh=Mesh(dp=1), dp_rank=0)
    assert len(list(consumer)) == 12
    assert _held(consumer._log) > 0
    assert len(consumer._reader._footers) > 0
    consumer.close()
    assert _held(consumer._log) == 0
    assert len(consumer._reader._footers) == 0


def test_a_consumer_closed_during_a_segment_read_holds_no_segment_once_the_read_ends() -> None:
    # Before: close() from another thread dropped the cache, then the read in flight put its
    # segment back, and the closed consumer held it again.
    entered, gate = threading.Event(), threading.Event()

    class SlowSegments(StoreWrapper):
        slow = False

        def get_range(self, key: str, rng: ByteRange) -> bytes:
            if self.slow and "/_segments/" in key:
                entered.set()
                gate.wait(10)
            return super().get_range(key, rng)

    inner = MemoryStore()
    with Producer(inner, NS, producer_id="p", mesh=Mesh(dp=1), tail_limit=2) as p:
        for offset in range(12):
            p.append([b"x"], offset=offset)
    store = SlowSegments(inner)
    consumer = Consumer(store, NS, mesh=Mesh(dp=1), dp_rank=0, prefetch=0)
    consumer.open()
    store.slow = True
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(next(consumer))
        except ConsumerError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    assert entered.wait(10)
    consumer.close()
    gate.set()
    reader.join(10)
    assert isinstance(outcome[0], ConsumerError)
    assert _held(consumer._log) == 0

"""Regressions found reviewing the session-9 fixes (consumer, producer, manifest, worker pool)."""

from __future__ import annotations

import threading
from typing import ClassVar

import pytest
from fake_time import FakeTime
from manifest_helpers import descriptor
from test_consumer import produce

from batchweave import (
    AttemptOutcome,
    ByteRange,
    CommitPolicy,
    Consumer,
    ConsumerError,
    MemoryStore,
    Mesh,
    ObjectStore,
    Producer,
    Reclaimer,
    StoreWrapper,
)
from batchweave._format._checksum import checksum
from batchweave._format._tgb import encode_tgb
from batchweave._manifest import Committed, ManifestLog, TgbDescriptor, TgbObjectRef
from batchweave._manifest._log import PREPARED_MERGE_MAX_AGE
from batchweave._manifest._segments import DEFAULT_MERGE_FANOUT

STEPS = 20


class _SlowNetworkReads(StoreWrapper):
    """Every range read takes 2 ms of (fake) wall time and 0.1 ms of (fake) CPU: a network read."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.time = FakeTime()
        self.cpu_now = 0.0
        self._lock = threading.Lock()

    def cpu_clock(self) -> float:
        with self._lock:
            return self.cpu_now

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        with self._lock:
            self.cpu_now += 0.0001
        self.time.advance(0.002)
        return self.inner.get_range(key, rng)


def _two_objects_per_tgb(store: ObjectStore, namespace: str) -> None:
    """A sealed namespace (mesh dp=1, cp=2) whose TGBs each hold CP chunk ``c`` in object ``c``.

    The format allows a TGB to be several objects (``TgbObjectRef.first_slice``); a consumer
    with ``cp=1`` then reads both chunks of a step from two objects, on pool threads.
    """
    log = ManifestLog(store, namespace)
    base = log.create_or_open(Mesh(dp=1, cp=2))
    for step in range(STEPS):
        refs = []
        for chunk in range(2):
            encoded = encode_tgb([f"{step}:{chunk}".encode()], Mesh(dp=1))
            key = f"data/ext/0/{step:020d}-{chunk:032x}.tgb"
            store.put_parts(log.key(key), encoded.parts)
            refs.append(
                TgbObjectRef(
                    key=key,
                    size=encoded.size,
                    first_slice=chunk,
                    slice_count=1,
                    footer_offset=encoded.footer_offset,
                    footer_length=encoded.footer_length,
                    footer_checksum=checksum(encoded.footer_bytes, encoded.footer.checksum_algo),
                )
            )
        desc = TgbDescriptor(
            producer_id="ext", epoch=0, offset=step, objects=tuple(refs), bytes=0, samples=2
        )
        result = log.commit(base, append=[desc], seal=step == STEPS - 1)
        assert isinstance(result, Committed)
        base = result.manifest


def test_steps_in_several_objects_are_read_ahead_when_reads_wait() -> None:
    # docs/consumer.md: steps whose slices lie in several objects are read on pool threads, so
    # their CPU share is not measured, "and such streams follow the latency rule alone". Slow
    # reads (2 ms, above prefetch_min_latency) are then read ahead; no read-ahead at all
    # would leave every step's latency on the training loop.
    inner = MemoryStore()
    _two_objects_per_tgb(inner, "multi")
    store = _SlowNetworkReads(inner)
    c = Consumer(
        store,
        "multi",
        mesh=Mesh(dp=1, cp=1),
        dp_rank=0,
        prefetch=4,
        ramp_every=1,
        max_process_reads=1 << 30,
        clock=store.time.clock,
        sleep=store.time.sleep,
        cpu_clock=store.cpu_clock,
    )
    in_flight = []
    for step, data in c:
        assert data == [f"{step}:0".encode(), f"{step}:1".encode()]
        in_flight.append(c.stats.in_flight)
    c.close()
    assert len(in_flight) == STEPS
    assert c.stats.read_cpu_share is None  # never measured: the latency rule alone decides
    assert max(in_flight) >= 2


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


class _Wall:
    def __init__(self) -> None:
        self.now = 1.7e9

    def __call__(self) -> float:
        return self.now


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


def test_close_from_a_signal_handler_while_next_starts_a_read_thread_does_not_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/consumer.md: close() may come from "a shutdown handler". A SIGTERM handler runs on
    # the main thread between bytecodes, also while that thread waits in Thread.start() for a
    # new read thread, inside Workers._spawn, which holds the workers' spawn lock: close() then
    # waited for that same lock (Workers.close) forever. Simulated deterministically: the
    # handler's close() runs on the reading thread from inside Thread.start().
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2), tgbs=8)
    c = Consumer(
        store,
        "run",
        mesh=Mesh(dp=2),
        dp_rank=0,
        prefetch_min_latency=0,
        ramp_every=1,
        max_process_reads=1 << 20,
    )
    real_start = threading.Thread.start
    handled = threading.Event()

    def start_with_signal(thread: threading.Thread) -> None:
        if thread.name.startswith("batchweave-consumer") and not handled.is_set():
            handled.set()
            c.close()  # the shutdown handler
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_with_signal)
    outcome: list[object] = []

    def loop() -> None:
        try:
            outcome.extend(step for step, _ in c)
        except ConsumerError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=loop, daemon=True)
    real_start(reader)
    reader.join(10)
    assert handled.is_set()
    assert not reader.is_alive(), "close() from the signal handler deadlocked next()"
    assert isinstance(outcome[-1], ConsumerError)
    assert c.state_dict()["step"] == len(outcome) - 1  # every step counted was delivered

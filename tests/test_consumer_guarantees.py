"""Consumer, loader and Lance-source guarantees that planted one-line mutants broke unnoticed.

Each test pins one promise of a docstring or of ``docs/consumer.md`` that a planted change broke
while every other test still passed. A strided consumer (a DataLoader worker's) reads ahead
``prefetch`` of its own steps; reads of *at least* ``map_threshold`` bytes are mapped and of *at
least* ``split_threshold`` bytes split (the boundary included); the poll backoff restarts when the
namespace appears and when a new version arrives; in a forked child ``open()``,
``load_state_dict()`` and ``resume_tgb_step()`` are refused; a loaded state restarts the read-ahead
ramp; every count below its smallest value and every interval pair out of order is refused (also by
``WeaveDataset``), equal bounds are not; exactly ``footer_cache`` footers are kept; ``WeaveLoader``
refuses ``in_order=False``; ``LanceSource.iter_from`` ends at the last epoch whatever ``stop`` says,
and an open dataset at another version than ``version=`` is refused.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from fake_time import FakeTime
from test_consumer import payload, produce

import batchweave as bw
from batchweave import ByteRange, Consumer, ConsumerError, MemoryStore, ObjectStore, StoreWrapper
from batchweave.lance import LanceSource
from batchweave.torch import WeaveDataset, WeaveLoader

ANY = 1 << 30
"""A read budget no number of consumers left open by other tests of this process can exhaust."""


class RangeRecorder(StoreWrapper):
    """Passes through to ``inner``, recording the length of every range read and mapping."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.reads: list[int] = []
        self.maps: list[int] = []

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        data = self.inner.get_range(key, rng)
        self.reads.append(len(data))
        return data

    def map_range(self, key: str, start: int, end: int) -> memoryview | None:
        self.maps.append(end - start)
        return None  # cannot map: the consumer falls back to range reads


SIZE = 4096
"""The bytes of each step's slice: one range read of exactly this length reads it."""


def _three_steps() -> MemoryStore:
    store = MemoryStore()
    produce(store, "run", bw.Mesh(dp=1), tgbs=3, size=SIZE)
    return store


def test_a_strided_consumer_reads_ahead_prefetch_of_its_own_steps() -> None:
    # "Up to prefetch steps are read ahead": a consumer with stride=2 (one of two DataLoader
    # workers) reads ahead steps 2, 4, 6, ... of its own, as many as a stride-1 consumer would.
    store = MemoryStore()
    produce(store, "run", bw.Mesh(dp=1), tgbs=20)

    def in_flight(stride: int) -> Iterator[int]:
        with Consumer(
            store,
            "run",
            mesh=bw.Mesh(dp=1),
            dp_rank=0,
            stride=stride,
            prefetch=3,
            ramp_every=1,
            prefetch_min_latency=0,
            max_process_reads=ANY,
        ) as consumer:
            for _ in consumer:
                yield consumer.stats.in_flight

    assert list(in_flight(1)) == [0] + [3] * 16 + [2, 1, 0]
    # steps 2..18: three in flight (not the one or two below next_step + 3), draining at the end
    assert list(in_flight(2)) == [0] + [3] * 6 + [2, 1, 0]


def test_a_read_of_exactly_map_threshold_bytes_is_mapped() -> None:
    # "Reads of at least map_threshold bytes are mapped instead of copied".
    recorder = RangeRecorder(_three_steps())
    with Consumer(recorder, "run", mesh=bw.Mesh(dp=1), dp_rank=0, map_threshold=SIZE) as consumer:
        got = [data for _, data in consumer]
    assert got == [payload(0, o, 0, 0, SIZE) for o in range(3)]
    assert recorder.maps == [SIZE] * 3
    assert SIZE in recorder.reads  # it could not map: the same slices were read instead


def test_a_read_of_exactly_split_threshold_bytes_is_split_into_parts() -> None:
    # "reads of at least split_threshold bytes are split into part_size range reads".
    recorder = RangeRecorder(_three_steps())
    with Consumer(
        recorder,
        "run",
        mesh=bw.Mesh(dp=1),
        dp_rank=0,
        split_threshold=SIZE,
        part_size=SIZE // 2,
    ) as consumer:
        got = [data for _, data in consumer]
    assert got == [payload(0, o, 0, 0, SIZE) for o in range(3)]
    assert recorder.reads.count(SIZE // 2) == 6  # two parts per step
    assert SIZE not in recorder.reads  # no step read whole


def test_the_poll_backoff_restarts_once_the_namespace_appears() -> None:
    # "polls ... no more often than the current poll delay, which doubles while nothing new
    # arrives (up to max_poll_interval) and resets when a version does": the version that
    # creates the namespace resets it too, so a consumer started long before its producers does
    # not poll the head of the stream at max_poll_interval from then on.
    store = MemoryStore()
    mesh = bw.Mesh(dp=1)
    producers: list[bw.Producer] = []

    def create() -> None:
        p = bw.Producer(store, "late", producer_id="p0", mesh=mesh, policy="naive")
        producers.append(p)
        p.append([payload(0, 0, 0, 0)], offset=0)
        p.flush()

    script: list[Callable[[], None]] = [lambda: None] * 5 + [create]
    fake = FakeTime(on_sleep=lambda: script.pop(0)() if script else None)
    consumer = Consumer(
        store,
        "late",
        mesh=mesh,
        dp_rank=0,
        clock=fake.clock,
        sleep=fake.sleep,
        poll_interval=0.01,
        max_poll_interval=0.16,
    )
    try:
        assert next(consumer)[0] == 0
        assert fake.sleeps == [0.01, 0.02, 0.04, 0.08, 0.16, 0.16]  # waiting to open
        opened = len(fake.sleeps)
        script.extend([lambda: None] * 3 + [lambda: producers[0].seal()])
        assert list(consumer) == []
        assert fake.sleeps[opened:] == [0.02, 0.04, 0.08, 0.16]  # not 0.16 each
    finally:
        consumer.close()
        for p in producers:
            p.close()


@pytest.mark.filterwarnings("ignore:lance is not fork-safe")  # the child uses no lance
@pytest.mark.parametrize("call", ["open()", "load_state_dict()", "resume_tgb_step()"])
def test_every_documented_call_in_a_forked_child_is_refused(call: str) -> None:
    # docs/consumer.md: "in a forked child next(), open(), load_state_dict() and
    # resume_tgb_step() raise ConsumerError at once" (next() is checked in test_misuse_consumer).
    store = MemoryStore()
    produce(store, "run", bw.Mesh(dp=1), tgbs=2)
    consumer = Consumer(store, "run", mesh=bw.Mesh(dp=1), dp_rank=0)
    state = consumer.state_dict()
    context = multiprocessing.get_context("fork")
    received, sent = context.Pipe(duplex=False)
    calls: dict[str, Callable[[], object]] = {
        "open()": consumer.open,
        "load_state_dict()": lambda: consumer.load_state_dict(state),
        "resume_tgb_step()": lambda: consumer.resume_tgb_step(state),
    }

    def child() -> None:
        try:
            calls[call]()
            outcome = "accepted"
        except ConsumerError as exc:
            outcome = f"refused: {exc}"
        sent.send(outcome)

    process = context.Process(target=child)
    process.start()
    try:
        assert received.poll(5.0), "the child did not answer"
        outcome = received.recv()
    finally:
        process.join(5.0)
        if process.is_alive():
            process.kill()
    assert outcome.startswith("refused: "), outcome
    assert f"{call} was called in process" in outcome
    assert next(consumer)[0] == 0  # the parent goes on
    consumer.close()


def test_a_loaded_state_restarts_the_read_ahead_ramp() -> None:
    # "Up to prefetch steps are read ahead ..., starting with one and adding one per ramp_every
    # delivered steps": a consumer resumed with load_state_dict() starts its ramp again, as a
    # new consumer does, instead of issuing a full window of reads for the state's first step.
    store = MemoryStore()
    produce(store, "run", bw.Mesh(dp=1), tgbs=8)

    def reader() -> Consumer:
        return Consumer(
            store,
            "run",
            mesh=bw.Mesh(dp=1),
            dp_rank=0,
            prefetch=3,
            ramp_every=2,
            prefetch_min_latency=0,
            max_process_reads=ANY,
        )

    with reader() as fresh:
        fresh.load_state_dict({**fresh.state_dict(), "step": 4})
        expected = [fresh.stats.prefetch_depth for _ in fresh]
    assert expected == [1, 2, 2, 3]
    with reader() as resumed:
        for _ in range(4):
            next(resumed)
        assert resumed.stats.prefetch_depth == 3
        resumed.load_state_dict({**resumed.state_dict(), "step": 4})
        assert [resumed.stats.prefetch_depth for _ in resumed] == expected


@pytest.mark.parametrize(
    ("option", "smallest"),
    [
        ("start_step", 0),
        ("stride", 1),  # stride=0 would deliver the same step for ever
        ("prefetch", 0),
        ("ramp_every", 1),
        ("max_process_reads", 1),
        ("max_workers", 1),
        ("footer_cache", 1),
        ("retry_budget", 0),
    ],
)
def test_every_count_below_its_smallest_value_is_refused_naming_it(
    option: str, smallest: int
) -> None:
    store = MemoryStore()
    below: dict[str, Any] = {option: smallest - 1}
    with pytest.raises(ValueError, match=rf"{option} must be >= {smallest}, got {smallest - 1}"):
        Consumer(store, "run", mesh=bw.Mesh(dp=1), dp_rank=0, **below)
    least: dict[str, Any] = {option: smallest}
    Consumer(store, "run", mesh=bw.Mesh(dp=1), dp_rank=0, **least).close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"poll_interval": 0.0}, r"need 0 < poll_interval <= max_poll_interval, got 0\.0 and 2\.0"),
        ({"poll_interval": 3.0}, r"got 3\.0 and 2\.0"),  # against the default max_poll_interval
        ({"poll_interval": 1.0, "max_poll_interval": 0.5}, r"got 1\.0 and 0\.5"),
        ({"retry_backoff": 2.0, "max_retry_backoff": 1.0}, r"retry_backoff <= max_retry_backoff"),
    ],
)
def test_interval_pairs_out_of_order_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Consumer(MemoryStore(), "run", mesh=bw.Mesh(dp=1), dp_rank=0, **options)
    with pytest.raises(ValueError, match=message):  # also by the dataset, before any worker
        WeaveDataset(MemoryStore(), "run", mesh=bw.Mesh(dp=1), dp_rank=0, **options)


@pytest.mark.parametrize(
    "options",
    [
        {"poll_interval": 0.5, "max_poll_interval": 0.5},
        {"retry_backoff": 1.0, "max_retry_backoff": 1.0},
        {"retry_backoff": 0.0},
    ],
)
def test_equal_interval_bounds_are_accepted(options: dict[str, Any]) -> None:
    # "need 0 < poll_interval <= max_poll_interval", "need 0 <= retry_backoff <= max_retry_backoff"
    Consumer(MemoryStore(), "run", mesh=bw.Mesh(dp=1), dp_rank=0, **options).close()


@pytest.mark.parametrize(("footer_cache", "footer_reads"), [(1, 3), (2, 2)])
def test_the_footer_cache_keeps_exactly_footer_cache_footers(
    footer_cache: int, footer_reads: int
) -> None:
    # "The last footer_cache parsed footers are kept": after steps 0 and 1 (one TGB each, no
    # slice tables in the manifest), going back to step 0 finds its footer only if two are kept.
    store = MemoryStore()
    produce(store, "run", bw.Mesh(dp=1), tgbs=3, slice_table_limit=0)
    with Consumer(
        store, "run", mesh=bw.Mesh(dp=1), dp_rank=0, prefetch=0, footer_cache=footer_cache
    ) as consumer:
        start = consumer.state_dict()
        assert [next(consumer)[0], next(consumer)[0]] == [0, 1]
        consumer.load_state_dict(start)
        assert next(consumer)[0] == 0
        assert consumer.stats.footer_reads == footer_reads


def test_lance_iter_from_stops_at_the_last_epoch_even_with_a_later_stop(tmp_path: Path) -> None:
    # LanceSource.iter_from: "batches offset, offset + 1, ... up to stop (exclusive) or the end
    # of the last epoch": a stop past the end is no IndexError from take().
    table = pa.table({"id": pa.array(np.arange(25, dtype=np.int64))})
    lance.write_dataset(table, str(tmp_path / "rows.lance"))
    source = LanceSource(str(tmp_path / "rows.lance"), rows_per_batch=10, epochs=1)
    assert source.num_batches == 3
    got = list(source.iter_from(1, stop=100))
    assert [offset for offset, _ in got] == [1, 2]
    assert [batch.num_rows for _, batch in got] == [10, 5]


def test_lance_an_open_dataset_at_another_version_than_asked_is_refused(tmp_path: Path) -> None:
    # Offsets map to the rows of one version: an open dataset at version 2 passed with
    # version=1 must not be read at version 2 (a resumed producer would publish other rows).
    uri = str(tmp_path / "rows.lance")
    lance.write_dataset(pa.table({"id": pa.array(np.arange(10, dtype=np.int64))}), uri)
    more = pa.table({"id": pa.array(np.arange(10, 20, dtype=np.int64))})
    newest = lance.write_dataset(more, uri, mode="append")
    assert newest.version == 2
    with pytest.raises(ValueError, match=r"open at version 2, not the version=1 asked for"):
        LanceSource(newest, rows_per_batch=4, version=1)
    assert LanceSource(newest, rows_per_batch=4, version=2).version == 2


def test_the_poll_backoff_restarts_when_a_new_version_arrives() -> None:
    # _await_step: the poll delay "doubles while nothing new arrives (up to max_poll_interval)
    # and resets when a version does": after waiting long for step 1, the wait for step 2
    # starts polling at poll_interval again.
    store = MemoryStore()
    mesh = bw.Mesh(dp=1)
    with bw.Producer(store, "live", producer_id="p0", mesh=mesh, policy="naive") as producer:

        def add(offset: int) -> None:
            producer.append([payload(0, offset, 0, 0)], offset=offset)
            producer.flush()

        add(0)
        script: list[Callable[[], None]] = (
            [lambda: None] * 4 + [lambda: add(1)] + [lambda: None] * 3 + [producer.seal]
        )
        fake = FakeTime(on_sleep=lambda: script.pop(0)() if script else None)
        with Consumer(
            store,
            "live",
            mesh=mesh,
            dp_rank=0,
            prefetch=0,
            clock=fake.clock,
            sleep=fake.sleep,
            poll_interval=0.01,
            max_poll_interval=0.16,
        ) as consumer:
            assert [step for step, _ in consumer] == [0, 1]
    waiting_for_1, waiting_for_2 = fake.sleeps[:5], fake.sleeps[5:]
    assert waiting_for_1 == [0.02, 0.04, 0.08, 0.16, 0.16]
    assert waiting_for_2 == [0.01, 0.02, 0.04, 0.08]  # not 0.16 each


def test_the_loader_refuses_out_of_order_delivery() -> None:
    # WeaveLoader: "in_order=False (delivery order is the step order)" is refused; with it a
    # slow worker's step would be delivered after later steps.
    dataset = WeaveDataset(MemoryStore(), "run", mesh=bw.Mesh(dp=1), dp_rank=0)
    with pytest.raises(ValueError, match=r"in_order=False would deliver steps out of order"):
        WeaveLoader(dataset, in_order=False)
    WeaveLoader(dataset, in_order=True).close()

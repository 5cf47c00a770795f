"""Consumer and loader misuse found by the API audit: each is refused at once, saying what to do.

- ``load_state_dict()`` from another thread while ``next()`` runs there: refused (it used to be
  accepted, and the waiting ``next()`` failed an assert, or under ``python -O`` delivered step 3
  labelled with step 0's data).
- Two live iterators over one ``WeaveLoader``: the newer replaces the older (which used to
  deliver the same steps again), with and without worker processes.
- A consumer used in a ``fork()``ed child: refused (a step its read-ahead thread was reading in
  the parent was waited for forever, ``timeout`` notwithstanding).
- Wrong argument types and values: refused by the constructor, naming the argument (a float
  ``part_size`` used to fail at the first large read, a tuple mesh with ``'tuple' object has no
  attribute 'cp'``, ``tp=0`` with explicit coordinates not at all).

Waits are on events and a fake clock; nothing sleeps to synchronise.
"""

from __future__ import annotations

import math
import multiprocessing
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_time import FakeTime

from batchweave import (
    ByteRange,
    Consumer,
    ConsumerError,
    FileStore,
    MemoryStore,
    Mesh,
    ObjectStore,
    Producer,
    StoreWrapper,
)
from batchweave._consumer._options import check_options
from batchweave.torch import WeaveDataset, WeaveLoader

MESH = Mesh(dp=1)
NS = "run"
WAIT = 5.0
"""Seconds an event wait may take before the test fails instead of hanging."""


def publish(store: ObjectStore, offsets: range, *, seal: bool) -> None:
    """Commit one TGB per offset (its only slice is ``b"step-<offset>"``), then seal if asked."""
    with Producer(store, NS, producer_id="p0", mesh=MESH, policy="naive") as producer:
        for offset in offsets:
            producer.append([f"step-{offset}".encode()], offset=offset)
        producer.flush()
        if seal:
            producer.seal()


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A sealed namespace of 8 steps in a file store (worker processes can read it): its URL."""
    root = tmp_path_factory.mktemp("sealed")
    publish(FileStore(root, fsync=False), range(8), seal=True)
    return root.as_uri()


# -- load_state_dict() while next() runs on another thread ---------------------------------------


def test_load_state_dict_while_next_waits_on_another_thread_is_refused() -> None:
    # Before: accepted; the waiting next() then failed `assert pending.step == step` (under
    # python -O it returned step 3 with step 0's data) and the loaded state was lost.
    store = MemoryStore()
    publish(store, range(3), seal=False)
    waiting, released = threading.Event(), threading.Event()

    def on_sleep() -> None:  # the consumer polls for step 3: hold it there until released
        waiting.set()
        assert released.wait(WAIT)

    fake = FakeTime(on_sleep=on_sleep)
    consumer = Consumer(store, NS, mesh=MESH, dp_rank=0, clock=fake.clock, sleep=fake.sleep)
    assert [next(consumer)[1] for _ in range(3)] == [b"step-0", b"step-1", b"step-2"]
    rewind = dict(consumer.state_dict(), step=0)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(next(consumer)))
    reader.start()
    assert waiting.wait(WAIT)
    with pytest.raises(ConsumerError, match=r"while next\(\) is reading a step on another thread"):
        consumer.load_state_dict(rewind)
    publish(store, range(3, 4), seal=True)
    released.set()
    reader.join(WAIT)
    assert got == [(3, b"step-3")]  # the refused call changed nothing
    assert consumer.state_dict()["step"] == 4
    consumer.load_state_dict(rewind)  # between steps it works, from any thread
    assert [data for _, data in consumer] == [f"step-{i}".encode() for i in range(4)]
    consumer.close()


def test_a_read_window_out_of_step_is_an_error_also_under_python_minus_o() -> None:
    # Before: an assert, which python -O removes: next() then delivered step 5 with step 2's
    # data. The position is moved by hand here: only a bug (or the race above) can do that.
    script = """
import batchweave as bw
store = bw.MemoryStore()
with bw.Producer(store, "run", producer_id="p0", mesh=bw.Mesh(dp=1), policy="naive") as p:
    for o in range(8):
        p.append([b"step-%d" % o], offset=o)
    p.seal()
c = bw.Consumer(store, "run", mesh=bw.Mesh(dp=1), dp_rank=0, prefetch_min_latency=0)
next(c), next(c)  # the second call reads steps ahead
assert c.stats.in_flight > 0
c._next_step = 5
try:
    print("delivered", next(c))
except bw.ConsumerError as exc:
    print("refused", exc)
print("then", next(c))
c.close()
"""
    out = subprocess.run(
        [sys.executable, "-O", "-c", script], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    first, then = out.stdout.splitlines()
    assert first.startswith("refused ")
    assert "step 5 is due but step 2 was read for it" in first
    assert then == "then (5, b'step-5')"  # the next call reads the step afresh


# -- two iterators over one WeaveLoader -----------------------------------------------------------


def _loader(url: str, workers: int) -> WeaveLoader:
    dataset = WeaveDataset(url, NS, mesh=MESH, dp_rank=0, prefetch=2)
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options["multiprocessing_context"] = "fork"
    return WeaveLoader(dataset, **options)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_newer_iterator_replaces_the_older_one(sealed: str, workers: int) -> None:
    # Before (num_workers=0): a, a, a, b, b, a, a delivered steps 0, 1, 2, 3, 4, 3, 4.
    loader = _loader(sealed, workers)
    older = iter(loader)
    steps = [int(next(older)[0]) for _ in range(3)]
    newer = iter(loader)
    steps += [int(next(newer)[0]) for _ in range(2)]
    with pytest.raises(ConsumerError, match=r"replaced by a newer iter\(loader\) at step 3"):
        next(older)
    with pytest.raises(ConsumerError, match="replaced"):  # and stays refused
        next(older)
    steps += [int(step) for step, _ in newer]
    assert steps == list(range(8))  # each step once
    assert multiprocessing.active_children() == []  # the older one's workers were stopped
    assert list(iter(loader)) == []  # a third one, at the sealed end
    with pytest.raises(StopIteration):  # an iterator that ran out stays so, even replaced
        next(newer)
    loader.close()


def test_an_inner_loop_over_the_same_loader_ends_the_outer_one(sealed: str) -> None:
    # Before: the outer loop went on with steps 3 and 4 again after the inner one read them.
    loader = _loader(sealed, 0)
    seen: list[int] = []

    def nested() -> None:
        for step, _ in loader:
            seen.append(int(step))
            if step == 2:
                for inner, _ in loader:
                    seen.append(int(inner))
                    if inner == 4:
                        break

    with pytest.raises(ConsumerError, match="only its newest iterator can be used"):
        nested()
    assert seen == [0, 1, 2, 3, 4]
    loader.load_state_dict(loader.state_dict())  # no loop runs any more
    assert [int(step) for step, _ in loader] == [5, 6, 7]
    loader.close()


def test_breaking_out_of_epochs_still_continues_where_the_last_loop_stopped(sealed: str) -> None:
    loader = _loader(sealed, 0)
    seen: list[int] = []
    for _epoch in range(3):
        for step, _ in loader:
            seen.append(int(step))
            if len(seen) % 3 == 0:
                break
    assert seen == list(range(8))
    loader.close()


def test_an_iterator_replaced_while_it_waits_on_another_thread_does_not_deliver() -> None:
    # Before: the older iterator, waiting for step 3 on another thread when the newer one was
    # made, still delivered step 3 (which the newer one delivered too), and its bookkeeping
    # could set the loader's next step back below the newer one's.
    store = MemoryStore()
    producer = Producer(store, NS, producer_id="p0", mesh=MESH, policy="naive")
    for offset in range(3):
        producer.append([f"step-{offset}".encode()], offset=offset)
    producer.flush()
    got_two, waiting = threading.Event(), threading.Event()

    def sleep(seconds: float) -> None:  # the consumer's waits for producers
        if got_two.is_set():
            waiting.set()
        time.sleep(seconds)

    dataset = WeaveDataset(
        store, NS, mesh=MESH, dp_rank=0, poll_interval=0.01, max_poll_interval=0.01, sleep=sleep
    )
    loader = WeaveLoader(dataset)
    older_steps: list[int] = []
    errors: list[ConsumerError] = []

    def older_loop() -> None:
        try:
            for step, _ in loader:
                older_steps.append(int(step))
                if step == 2:
                    got_two.set()
        except ConsumerError as exc:
            errors.append(exc)

    older = threading.Thread(target=older_loop)
    older.start()
    try:
        assert waiting.wait(WAIT), "the older loop does not wait for step 3"
        newer = iter(loader)  # while the older loop waits for step 3 on its thread
        for offset in (3, 4):
            producer.append([f"step-{offset}".encode()], offset=offset)
        producer.seal()
        newer_steps = [int(step) for step, _ in newer]
    finally:
        producer.close()
        older.join(WAIT)
    assert not older.is_alive()
    assert older_steps == [0, 1, 2]  # not step 3, which it waited for when it was replaced
    assert newer_steps == [3, 4]
    assert len(errors) == 1
    assert "replaced by a newer iter(loader) at step 3" in str(errors[0])
    assert loader.state_dict()["step"] == 5
    loader.close()


def _inputs_and_labels(data: bytes) -> tuple[bytes, int]:
    """A collate_fn returning the model's ``(inputs, labels)``; a worker cannot record calls."""
    if not isinstance(data, bytes):
        raise TypeError(f"collate_fn got {data!r}, not the step's data")
    return data, len(data)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_collate_fn_gets_the_steps_data_and_its_result_is_the_batch(
    sealed: str, workers: int
) -> None:
    # Before: the loader took the collate_fn's result for (step, data): with (inputs, labels)
    # the checkpoint recorded the step as int(inputs) (silently), and a collate_fn returning
    # data alone failed with a bare "not enough values to unpack".
    dataset = WeaveDataset(sealed, NS, mesh=MESH, dp_rank=0, prefetch=2)
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options["multiprocessing_context"] = "fork"
    loader = WeaveLoader(dataset, collate_fn=_inputs_and_labels, **options)
    delivered = []
    for step, (inputs, labels) in loader:
        delivered.append((step, inputs, labels))
        if step == 2:
            break
    assert delivered == [(s, f"step-{s}".encode(), 6) for s in range(3)]
    assert loader.state_dict()["step"] == 3
    assert [step for step, _ in loader] == [3, 4, 5, 6, 7]  # resumed at the right step
    loader.close()
    seen: list[Any] = []
    plain = WeaveLoader(dataset, collate_fn=lambda data: seen.append(data) or data.upper())
    assert list(plain) == [(s, f"STEP-{s}".encode()) for s in range(8)]
    assert seen == [f"step-{s}".encode() for s in range(8)]  # the data alone, not the step
    assert plain.state_dict()["step"] == 8
    plain.close()


def test_an_infinite_dataloader_timeout_is_none_and_one_torch_cannot_wait_is_refused(
    sealed: str,
) -> None:
    # Before: accepted, then the first step with workers raised a raw OverflowError from the
    # selector torch waits on (also for 1e12, and for anything over about 24.8 days).
    dataset = WeaveDataset(sealed, NS, mesh=MESH, dp_rank=0, prefetch=2)
    loader = WeaveLoader(dataset, num_workers=1, multiprocessing_context="fork", timeout=math.inf)
    assert loader.dataloader_options["timeout"] == 0  # torch's "no timeout"
    assert [int(step) for step, _ in loader] == list(range(8))
    loader.close()
    for too_long in (1e12, 3e6):
        with pytest.raises(ValueError, match=r"timeout must be at most 2147483 seconds"):
            WeaveLoader(dataset, num_workers=1, timeout=too_long)
    WeaveLoader(dataset, num_workers=1, timeout=2e6).close()
    WeaveLoader(dataset, timeout=1e12).close()  # without workers it bounds the consumer's waits
    assert [int(step) for step, _ in WeaveLoader(dataset, timeout=math.inf)] == list(range(8))


# -- a consumer in a forked child -----------------------------------------------------------------


class _Gate(StoreWrapper):
    """Holds every read of step ``held``'s object until ``release`` is set."""

    def __init__(self, inner: ObjectStore, held: int) -> None:
        super().__init__(inner)
        self.marker = f"/{held:020d}-"
        self.entered, self.release = threading.Event(), threading.Event()

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        if self.marker in key:
            self.entered.set()
            self.release.wait(WAIT)
        return super().get_range(key, rng)


def test_a_consumer_used_in_a_forked_child_is_refused_at_once() -> None:
    # Before: the child's next() waited forever for the step a parent thread was reading
    # (ignoring timeout=5), since that thread does not exist in the child.
    inner = MemoryStore()
    publish(inner, range(6), seal=True)
    store = _Gate(inner, held=2)
    consumer = Consumer(store, NS, mesh=MESH, dp_rank=0, prefetch_min_latency=0, timeout=5)
    next(consumer), next(consumer)  # the second call hands steps 2 and 3 to read threads
    assert store.entered.wait(WAIT)  # a read thread is inside step 2's read
    context = multiprocessing.get_context("fork")
    received, sent = context.Pipe(duplex=False)

    def child() -> None:
        from batchweave._consumer._registry import OPEN_CONSUMERS

        try:
            outcome = f"delivered {next(consumer)[0]}"
        except ConsumerError as exc:
            outcome = f"refused: {exc}"
        sent.send((outcome, OPEN_CONSUMERS.count))

    process = context.Process(target=child)
    process.start()
    try:
        assert received.poll(WAIT), "the child's next() hangs"
        outcome, open_in_child = received.recv()
    finally:
        store.release.set()
        process.join(WAIT)
        if process.is_alive():
            process.kill()
    assert outcome.startswith("refused: ")
    assert f"was created in process {multiprocessing.current_process().pid}" in outcome
    assert "Create the Consumer in the child process" in outcome
    assert open_in_child == 0  # the parent's consumers take no share of the child's reads
    assert next(consumer)[0] == 2  # the parent goes on
    consumer.close()


# -- arguments ------------------------------------------------------------------------------------

BAD_ARGUMENTS = [
    ({"part_size": 16.5e6 + 0.5}, TypeError, r"part_size must be an integer, got the float"),
    ({"prefetch": 2.5}, TypeError, r"prefetch must be an integer, got the float 2\.5"),
    ({"prefetch": True}, TypeError, r"prefetch must be an integer, got the bool True"),
    ({"max_workers": "4"}, TypeError, r"max_workers must be an integer, got the str '4'"),
    ({"footer_cache": 1.5}, TypeError, r"footer_cache must be an integer"),
    ({"retry_budget": 1.5}, TypeError, r"retry_budget must be an integer"),
    ({"map_threshold": 0}, ValueError, r"map_threshold must be >= 1, got 0"),
    ({"timeout": "5"}, TypeError, r"timeout must be a number of seconds, got the str '5'"),
    ({"timeout": float("nan")}, ValueError, r"timeout must be >= 0 seconds, got nan"),
    ({"poll_interval": "0.1"}, TypeError, r"poll_interval must be a number of seconds"),
    ({"retry_backoff": "0.1"}, TypeError, r"retry_backoff must be a number of seconds"),
    ({"max_retry_backoff": -1}, ValueError, r"max_retry_backoff must be a finite number"),
    ({"prefetch_max_cpu_share": "0.3"}, TypeError, r"prefetch_max_cpu_share must be a number"),
    ({"tp": 0}, ValueError, r"tp must be >= 1, got 0"),
    ({"pp": -1}, ValueError, r"pp must be >= 1, got -1"),
    ({"tp": 2.0}, TypeError, r"tp must be an integer, got the float 2\.0"),
    ({"rank_order": "tp-dp"}, ValueError, r"rank order 'tp-dp' must name each of tp, cp, dp, pp"),
    ({"rank_order": 5}, TypeError, r"rank_order must be a str, got the int 5"),
]


@pytest.mark.parametrize(("options", "error", "message"), BAD_ARGUMENTS)
def test_bad_consumer_arguments_are_refused_by_the_constructor(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        Consumer(MemoryStore(), NS, mesh=MESH, dp_rank=0, **options)


@pytest.mark.parametrize(("options", "error", "message"), BAD_ARGUMENTS)
def test_bad_consumer_options_are_refused_by_the_dataset(
    options: dict[str, Any], error: type[Exception], message: str
) -> None:
    # Before: accepted, and each DataLoader worker's consumer failed (or read) with them.
    with pytest.raises(error, match=message):
        WeaveDataset("memory://x", NS, mesh=MESH, dp_rank=0, **options)


@pytest.mark.parametrize("name", ["clock", "sleep", "cpu_clock"])
def test_a_time_function_that_cannot_be_called_is_refused_naming_it(name: str) -> None:
    # Before: the dataset took clock=1.5 and every DataLoader worker's consumer failed with
    # "'float' object is not callable"; check_options, which the dataset runs, now refuses it.
    with pytest.raises(
        TypeError, match=rf"{name} must be callable \(like time\.\w+\), got the float"
    ):
        WeaveDataset("memory://x", NS, mesh=MESH, dp_rank=0, **{name: 1.5})
    with pytest.raises(TypeError, match=rf"{name} must be callable"):
        check_options(**{name: None})
    assert check_options(**{name: time.monotonic})[name] is time.monotonic


@pytest.mark.parametrize(
    ("namespace", "mesh", "message"),
    [
        (123, MESH, r"namespace must be a str, got the int 123"),
        (NS, (2, 1), r"mesh must be a batchweave\.Mesh, got the tuple \(2, 1\)"),
        (NS, {"dp": 2}, r"mesh must be a batchweave\.Mesh, got the dict"),
    ],
)
def test_a_namespace_or_mesh_of_the_wrong_type_is_a_type_error_naming_it(
    namespace: Any, mesh: Any, message: str
) -> None:
    # Before: AttributeError: 'int' object has no attribute 'endswith' / 'tuple' ... 'cp'.
    with pytest.raises(TypeError, match=message):
        Consumer(MemoryStore(), namespace, mesh=mesh, dp_rank=0)
    with pytest.raises(TypeError, match=message):
        WeaveDataset("memory://x", namespace, mesh=mesh, dp_rank=0)


def test_a_namespace_ending_in_a_slash_is_refused_when_the_dataset_is_made() -> None:
    # The consumer refused it (through its manifest log); the dataset took it, and every
    # DataLoader worker's consumer then failed.
    with pytest.raises(ValueError, match="namespace 'ns/' must not end with '/'"):
        Consumer(MemoryStore(), "ns/", mesh=MESH, dp_rank=0)
    with pytest.raises(ValueError, match="namespace 'ns/' must not end with '/'"):
        WeaveDataset("memory://x", "ns/", mesh=MESH, dp_rank=0)


def test_numbers_of_other_types_are_kept_as_plain_ints_and_floats() -> None:
    consumer = Consumer(
        MemoryStore(),
        NS,
        mesh=MESH,
        dp_rank=0,
        start_step=np.int64(3),
        prefetch=np.int32(2),
        part_size=np.int64(1 << 20),
        timeout=np.int64(5),
        poll_interval=np.float64(0.5),
        prefetch_max_cpu_share=np.float32(0.5),
    )
    step = consumer.state_dict()["step"]
    assert step == 3
    assert type(step) is int
    assert type(consumer.prefetch) is int
    assert type(consumer.part_size) is int
    assert consumer.timeout == 5.0
    assert type(consumer.timeout) is float
    assert type(consumer.poll_interval) is float
    assert type(consumer.prefetch_max_cpu_share) is float
    consumer.close()


def test_whole_float_sizes_and_an_infinite_timeout_are_taken_but_not_an_infinite_sleep() -> None:
    # part_size=16e6 failed at next() (range() of a float), so the checks first refused every
    # float size; a size holding a whole number is taken as that int. An infinite timeout waits
    # for ever, as None; an infinite poll interval would make time.sleep raise.
    consumer = Consumer(
        MemoryStore(),
        NS,
        mesh=MESH,
        dp_rank=0,
        part_size=16e6,  # type: ignore[arg-type]
        split_threshold=np.float32(32e6),  # type: ignore[arg-type]
        timeout=float("inf"),
    )
    assert (consumer.part_size, consumer.split_threshold) == (16_000_000, 32_000_000)
    assert type(consumer.part_size) is int
    assert consumer.timeout == float("inf")
    consumer.close()
    with pytest.raises(ValueError, match="max_poll_interval must be a finite number of seconds"):
        Consumer(MemoryStore(), NS, mesh=MESH, dp_rank=0, max_poll_interval=float("inf"))


def test_the_read_sizes_and_backoffs_cannot_be_changed_after_construction() -> None:
    # The slice reader is made with them: assigning one to the consumer used to be accepted and
    # ignored by every read, so the attribute no longer said what the reads used.
    given = {"part_size": 1 << 20, "retry_backoff": 0.5, "max_retry_backoff": 4.0}
    consumer = Consumer(MemoryStore(), NS, mesh=MESH, dp_rank=0, **given)  # type: ignore[arg-type]
    expected = {"map_threshold": 32 << 20, "split_threshold": 64 << 20, **given}
    for name, value in expected.items():
        with pytest.raises(AttributeError):
            setattr(consumer, name, 2 * value)
        assert getattr(consumer, name) == value
    consumer.close()


def test_the_loaders_own_arguments_are_checked_when_it_is_made(tmp_path: Path) -> None:
    dataset = WeaveDataset(tmp_path.as_uri(), NS, mesh=MESH, dp_rank=0)
    with pytest.raises(TypeError, match=r"store must be an opened store or a store URL"):
        WeaveDataset(tmp_path, NS, mesh=MESH, dp_rank=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"dataset must be a batchweave\.torch\.WeaveDataset"):
        WeaveLoader([1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"num_workers must be an integer, got the str '2'"):
        WeaveLoader(dataset, num_workers="2")
    with pytest.raises(ValueError, match=r"num_workers must be >= 0, got -1"):
        WeaveLoader(dataset, num_workers=-1)
    with pytest.raises(TypeError, match=r"timeout must be a number of seconds, got the str"):
        WeaveLoader(dataset, timeout="5")
    with pytest.raises(TypeError, match=r"prefetch_factor must be an integer, got the float"):
        WeaveLoader(dataset, num_workers=1, prefetch_factor=1.5)
    WeaveLoader(dataset, num_workers=np.int64(1), timeout=np.int64(5)).close()

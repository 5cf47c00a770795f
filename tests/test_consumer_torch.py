"""batchweave.torch: the same sequence with and without DataLoader workers, and resume.

``WeaveDataset(...)`` checks its arguments when it is made, with the consumer's own checks (a
rank outside the mesh, half the coordinates, a mesh that is not a ``Mesh``, unknown options),
not later inside a DataLoader worker. The first ``WeaveLoader.state_dict()`` reads the manifest
for the namespace id: during a store outage it waits like a consumer, bounded by the dataset's
``timeout`` or else the DataLoader's. Outages are played by ``OutageStore`` (every request
raises ``StoreUnavailable``) on a fake clock whose sleeps move time: nothing really waits, and a
wait that would never end fails the test instead of hanging it.
"""

from __future__ import annotations

import collections
import multiprocessing
import pickle
import socket
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import torch
from fake_time import FakeTime
from test_consumer import parse, produce
from test_consumer import take as take_steps
from test_outage import OutageStore

import batchweave as bw
from batchweave import (
    Consumer,
    ConsumerTimeout,
    FileStore,
    InvalidStoreURL,
    MemoryStore,
    Mesh,
    ObjectStore,
    open_store,
)
from batchweave._manifest._log import ManifestLog
from batchweave._store import _obstore
from batchweave.torch import WeaveDataset, WeaveLoader, to_tensors

MESH = Mesh(dp=2, cp=2)
STEPS = 9
NS = "runs/torch"
MAX_SLEEPS = 1_000
"""More sleeps than any bounded wait here takes: a wait without end fails the test instead."""


def produce_reference(root: Path, *, producers: int, tgbs: int) -> list[tuple[int, Any]]:
    """Produce namespace ``run`` of ``MESH`` in a file store at ``root`` (``tgbs`` TGBs per
    producer); what rank (dp 1, cp 0) reads of it, the sequence its loaders must deliver."""
    store = FileStore(root, fsync=False)
    produce(store, "run", MESH, producers=producers, tgbs=tgbs)
    with Consumer(store, "run", mesh=MESH, dp_rank=1, cp_rank=0) as c:
        return list(c)


def take(loader: WeaveLoader, n: int | None = None) -> list[tuple[int, Any]]:
    """``test_consumer.take`` of a loop over ``loader``, its steps as plain ints."""
    return [(int(step), data) for step, data in take_steps(loader, n)]


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[int, Any]]]:
    root: Path = tmp_path_factory.mktemp("weave")
    reference = produce_reference(root, producers=2, tgbs=5)
    assert len(reference) == 10
    return f"file://{root}", reference


def _loader(url: str, workers: int, **kw: Any) -> WeaveLoader:
    dataset = WeaveDataset(url, "run", mesh=MESH, dp_rank=1, cp_rank=0, prefetch=2, **kw)
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options["multiprocessing_context"] = "forkserver"
    return WeaveLoader(dataset, **options)


@pytest.mark.parametrize("workers", [0, 3])
def test_same_sequence_with_any_number_of_workers(
    namespace: tuple[str, list[tuple[int, Any]]], workers: int
) -> None:
    url, reference = namespace
    loader = _loader(url, workers)
    assert take(loader) == reference
    assert loader.state_dict()["step"] == len(reference)
    loader.close()


@pytest.mark.parametrize(("before", "after"), [(0, 2), (2, 0)])
def test_resume_from_a_loader_checkpoint(
    namespace: tuple[str, list[tuple[int, Any]]], before: int, after: int
) -> None:
    url, reference = namespace
    first = _loader(url, before)
    head = take(first, 4)
    state = first.state_dict()  # workers may have prefetched more; only yielded steps count
    first.close()
    assert head == reference[:4]
    assert state["step"] == 4
    second = _loader(url, after)
    second.load_state_dict(state)
    assert take(second) == reference[4:]
    second.close()


def test_a_new_iteration_continues_where_the_last_stopped(
    namespace: tuple[str, list[tuple[int, Any]]],
) -> None:
    url, reference = namespace
    loader = _loader(url, 0)
    assert take(loader, 3) == reference[:3]
    assert take(loader) == reference[3:]
    assert [parse(d)[2:] for _, d in reference] == [(1, 0)] * len(reference)
    loader.close()


def test_load_state_dict_inside_a_running_loop_is_refused(
    namespace: tuple[str, list[tuple[int, Any]]],
) -> None:
    # Before: accepted and silently ignored; the running workers went on from where they were.
    url, reference = namespace
    loader = _loader(url, 0)
    seen: list[int] = []
    for step, _ in loader:
        seen.append(int(step))
        if step == 2:
            state = loader.state_dict()
        if step == 4:
            with pytest.raises(bw.ConsumerError, match="while a loop over the loader is running"):
                loader.load_state_dict(state)
    assert seen == [s for s, _ in reference]  # the refused call changed nothing
    loader.load_state_dict(state)  # outside the loop it works: the next loop starts at 3
    assert [int(s) for s, _ in loader] == [s for s, _ in reference[3:]]
    loader.close()


def test_checkpoint_hook_refuses_a_loader_of_another_namespace(
    namespace: tuple[str, list[tuple[int, Any]]], tmp_path: Path
) -> None:
    # Before: WeaveLoader had no namespace attribute, so the hook recorded this loader's step
    # in the other namespace's watermarks.
    url, _ = namespace
    loader = _loader(url, 0)
    assert loader.namespace == "run"
    marks = bw.Watermarks(FileStore(tmp_path, fsync=False), "other")
    with pytest.raises(ValueError, match="reads namespace 'run'"):
        bw.checkpoint_hook(loader, marks, "ckpt-1", rank=0)
    assert marks.live() == []
    loader.close()


def test_a_memory_store_is_refused_with_worker_processes() -> None:
    # Before: each worker read an empty copy of its own and waited for steps for ever.
    for store in (bw.MemoryStore(), "memory://x"):
        dataset = WeaveDataset(store, "run", mesh=MESH, dp_rank=0, cp_rank=0)
        with pytest.raises(ValueError, match="memory:// store exists only in this process"):
            WeaveLoader(dataset, num_workers=2)
        WeaveLoader(dataset, num_workers=0).close()  # in-process is fine


def test_a_wrapped_memory_store_is_refused_with_worker_processes() -> None:
    # Before: CountingStore(MemoryStore()) was accepted; forked workers read a copy taken when
    # they started and waited for ever for the steps producers committed later.
    for store in (
        bw.CountingStore(bw.MemoryStore()),
        bw.CountingStore(bw.CountingStore(bw.MemoryStore())),
    ):
        dataset = WeaveDataset(store, "run", mesh=MESH, dp_rank=0, cp_rank=0)
        with pytest.raises(ValueError, match="memory:// store exists only in this process"):
            WeaveLoader(dataset, num_workers=2, multiprocessing_context="fork")
        WeaveLoader(dataset, num_workers=0).close()  # in-process is fine


@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_a_store_object_that_spawned_workers_cannot_receive_is_refused_naming_the_fix(
    tmp_path: Path, context: str
) -> None:
    class Unpicklable(FileStore):
        def __reduce__(self) -> Any:
            raise TypeError("cannot pickle '_thread.lock' object")

    dataset = WeaveDataset(Unpicklable(tmp_path), "run", mesh=MESH, dp_rank=0, cp_rank=0)
    with pytest.raises(TypeError, match="pass the store URL instead") as info:
        WeaveLoader(dataset, num_workers=2, multiprocessing_context=context)
    assert context in str(info.value)
    WeaveLoader(dataset, num_workers=2, multiprocessing_context="fork").close()  # inherited
    picklable = WeaveDataset(FileStore(tmp_path), "run", mesh=MESH, dp_rank=0, cp_rank=0)
    WeaveLoader(picklable, num_workers=2, multiprocessing_context=context).close()


def test_loader_refuses_options_that_break_step_order(
    namespace: tuple[str, list[tuple[int, Any]]],
) -> None:
    dataset = WeaveDataset(namespace[0], "run", mesh=MESH, dp_rank=0, cp_rank=0)
    with pytest.raises(TypeError, match="batch_size"):
        WeaveLoader(dataset, batch_size=4)
    with pytest.raises(ValueError, match="persistent_workers"):
        WeaveLoader(dataset, num_workers=2, persistent_workers=True)
    with pytest.raises(TypeError, match="stride"):
        WeaveDataset(namespace[0], "run", mesh=MESH, dp_rank=0, cp_rank=0, stride=2)


def test_dataset_refuses_environ_naming_how_to_pass_other_coordinates(
    namespace: tuple[str, list[tuple[int, Any]]],
) -> None:
    # Before: "sets the consumer's 'environ' itself; resume with WeaveLoader.load_state_dict".
    with pytest.raises(TypeError, match=r"takes no 'environ'.*coordinates_from_env") as info:
        WeaveDataset(namespace[0], "run", mesh=MESH, environ={"RANK": "0", "WORLD_SIZE": "4"})
    assert "load_state_dict" not in str(info.value)


# -- arguments are checked when the dataset is made --------------------------------------------


@pytest.mark.parametrize(
    ("dp_rank", "cp_rank", "message"),
    [
        (2, 0, r"outside mesh dp=2, cp=2: dp_rank must be in \[0, 2\), got 2"),
        (-1, 1, r"outside mesh dp=2, cp=2: dp_rank must be in \[0, 2\), got -1"),
        (1, 2, r"outside mesh dp=2, cp=2: cp_rank must be in \[0, 2\), got 2"),
        (np.int64(0), -3, r"cp_rank must be in \[0, 2\), got -3"),
    ],
)
def test_a_rank_outside_the_mesh_is_refused_by_the_dataset(
    dp_rank: Any, cp_rank: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        WeaveDataset("memory://torch", NS, mesh=MESH, dp_rank=dp_rank, cp_rank=cp_rank)


def test_half_the_coordinates_and_non_integers_are_refused_by_the_dataset() -> None:
    with pytest.raises(ValueError, match=r"give both dp_rank and cp_rank for mesh \(dp=2, cp=2\)"):
        WeaveDataset("memory://torch", NS, mesh=MESH, cp_rank=1)
    with pytest.raises(TypeError, match=r"dp_rank must be an integer, got the str '1'"):
        WeaveDataset("memory://torch", NS, mesh=MESH, dp_rank="1", cp_rank=0)  # type: ignore[arg-type]


def test_a_mesh_that_is_not_a_mesh_and_unknown_options_are_refused_by_the_dataset() -> None:
    with pytest.raises(TypeError, match=r"mesh must be a batchweave\.Mesh, got the dict"):
        WeaveDataset("memory://torch", NS, mesh={"dp": 2}, dp_rank=0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"unknown consumer option\(s\) prefech, timout"):
        WeaveDataset("memory://torch", NS, mesh=MESH, dp_rank=0, cp_rank=0, prefech=2, timout=1)


BAD_STORES = [
    ("s3://bucket/runs", {"endpoint_urll": "http://127.0.0.1:9000"}, r"unknown option.*urll"),
    ("gs://bucket/runs", {}, r"unsupported scheme 'gs'"),
    ("file://relative/dir", {}, r"names host 'relative'"),
    ("file:///data", {"fsync": False, "region": "x"}, r"unknown option.*region.*file://"),
    ("s3://bucket", {"s3_client": "obstore", "max_pool_connections": 8}, r"on obstore"),
    ("s3://no spaces", {}, r"not a valid S3 bucket name"),
    ("s3://bucket", {"endpoint_url": "http://127.0.0.1:9000/bucket"}, r"has a path"),
    ("s3://bucket", {"max_attempts": 0}, r"max_attempts must be an integer >= 1"),
    ("s3://bucket", {"max_pool_connections": 0}, r"max_pool_connections must be"),
    ("s3://bucket", {"s3_client": "obstore", "read_timeout": -1}, r"read_timeout must be"),
    ("s3://bucket", {"access_key_id": "AKIAEXAMPLEKEY"}, r"access_key_id was given without"),
]


@pytest.mark.parametrize(("url", "options", "message"), BAD_STORES)
def test_a_store_open_store_refuses_is_refused_by_the_dataset_before_any_worker(
    monkeypatch: pytest.MonkeyPatch, url: str, options: dict[str, Any], message: str
) -> None:
    # Before: checked only when a DataLoader worker opened the store ("Caught InvalidStoreURL
    # in DataLoader worker process 0").
    _refuse_network_and_credentials(monkeypatch)
    with pytest.raises(InvalidStoreURL, match=message) as refused:
        WeaveDataset(url, NS, mesh=MESH, dp_rank=0, cp_rank=0, store_options=options)
    # the same refusal, word for word, as the worker's open_store gives
    with pytest.raises(InvalidStoreURL) as opened:
        open_store(url, verify_conditional_writes=False, **options)
    assert str(refused.value) == str(opened.value)


def test_store_options_cannot_turn_the_probe_on() -> None:
    # Workers open the store with verify_conditional_writes=False; before, this option was a
    # TypeError ("multiple values") in each worker.
    with pytest.raises(InvalidStoreURL, match=r"unknown option.*verify_conditional_writes"):
        WeaveDataset(
            "memory://torch",
            NS,
            mesh=MESH,
            dp_rank=0,
            cp_rank=0,
            store_options={"verify_conditional_writes": True},
        )


@pytest.mark.parametrize(
    ("url", "options"),
    [
        ("s3://bucket/runs", {"endpoint_url": "http://127.0.0.1:9", "max_attempts": 1}),
        ("s3://bucket/runs", {"s3_client": "obstore", "region": "eu-west-1"}),
        ("file:///nonexistent/weave", {"fsync": False}),
        ("memory://torch", {}),
    ],
)
def test_a_valid_store_url_is_checked_without_opening_anything(
    monkeypatch: pytest.MonkeyPatch, url: str, options: dict[str, Any]
) -> None:
    _refuse_network_and_credentials(monkeypatch)
    dataset = WeaveDataset(url, NS, mesh=MESH, dp_rank=0, cp_rank=0, store_options=options)
    assert not Path("/nonexistent/weave").exists()  # the file root is created by the worker
    copy = pickle.loads(pickle.dumps(dataset))  # goes to spawn/forkserver workers as it is
    assert (copy.store, copy.store_options) == (url, options)
    assert not any(isinstance(v, ObjectStore) for v in vars(dataset).values())


def _refuse_network_and_credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test on any connection, boto3 session (credential lookup) or obstore client."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("checking a store URL must not open a store")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(boto3.session, "Session", refuse)
    monkeypatch.setattr(_obstore, "_import_obstore", refuse)
    monkeypatch.setattr(FileStore, "__init__", refuse)


def test_valid_coordinates_are_stored_as_plain_ints() -> None:
    dataset = WeaveDataset(
        "memory://torch", NS, mesh=Mesh(dp=4), dp_rank=np.int32(3), prefetch=2, timeout=1.0
    )
    assert (dataset.dp_rank, dataset.cp_rank) == (3, 0)
    assert type(dataset.dp_rank) is int
    assert dataset.consumer_options == {"prefetch": 2, "timeout": 1.0}


def test_coordinates_from_the_environment_are_checked_against_the_mesh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "7")
    dataset = WeaveDataset("memory://torch", NS, mesh=MESH, tp=2)
    assert (dataset.dp_rank, dataset.cp_rank) == (1, 1)
    with pytest.raises(ValueError, match=r"WORLD_SIZE"):
        WeaveDataset("memory://torch", NS, mesh=MESH, tp=3)


# -- a checkpoint during a store outage --------------------------------------------------------


@pytest.fixture
def store() -> OutageStore:
    inner = MemoryStore()
    produce(inner, NS, MESH, tgbs=2)
    return OutageStore(inner)


@pytest.fixture
def fake() -> FakeTime:
    fake = FakeTime()

    def guard() -> None:
        if len(fake.sleeps) > MAX_SLEEPS:
            raise AssertionError(f"still waiting after {fake.now:.0f} fake seconds")

    fake.on_sleep = guard
    return fake


def _outage_loader(
    store: OutageStore, fake: FakeTime, *, consumer_timeout: float | None = None, **options: Any
) -> WeaveLoader:
    """A loader on ``store`` with the fake clock; ``options`` go to the DataLoader."""
    dataset = WeaveDataset(
        store,
        NS,
        mesh=MESH,
        dp_rank=1,
        cp_rank=0,
        clock=fake.clock,
        sleep=fake.sleep,
        timeout=consumer_timeout,
    )
    return WeaveLoader(dataset, **options)


def test_state_dict_in_an_outage_gives_up_after_the_dataloader_timeout(
    store: OutageStore, fake: FakeTime
) -> None:
    loader = _outage_loader(store, fake, timeout=5.0)
    store.down()
    with pytest.raises(ConsumerTimeout, match=r"WeaveLoader\.state_dict\(\).*unreachable") as info:
        loader.state_dict()
    assert isinstance(info.value.__cause__, ConsumerTimeout)
    assert fake.now == pytest.approx(5.0)
    assert store.failures > 1  # retried, not refused at the first failure
    store.up()  # the checkpoint can be taken again once the store is back
    state = loader.state_dict()
    assert state["namespace_id"] == ManifestLog(store, NS).latest().namespace_id
    assert state["step"] == 0
    loader.close()


def test_the_dataset_timeout_wins_over_the_dataloader_timeout(
    store: OutageStore, fake: FakeTime
) -> None:
    loader = _outage_loader(store, fake, consumer_timeout=1.5, timeout=2.0)
    store.down()
    with pytest.raises(ConsumerTimeout, match=r"WeaveLoader\.state_dict\(\)"):
        loader.state_dict()
    assert fake.now == pytest.approx(1.5)
    loader.close()


def test_load_state_dict_in_an_outage_gives_up_after_the_timeout(
    store: OutageStore, fake: FakeTime
) -> None:
    saved = _outage_loader(store, fake).state_dict()
    loader = _outage_loader(store, fake, timeout=3.0)
    store.down()
    started = fake.now
    with pytest.raises(ConsumerTimeout, match="unreachable"):
        loader.load_state_dict(saved)
    assert fake.now - started == pytest.approx(3.0)
    store.up()
    loader.load_state_dict(saved)
    assert loader.state_dict() == saved
    loader.close()


def test_without_a_timeout_state_dict_waits_for_the_store_to_come_back(
    store: OutageStore, fake: FakeTime
) -> None:
    loader = _outage_loader(store, fake)
    store.down()
    guard = fake.on_sleep

    def come_back_after_a_while() -> None:
        assert guard is not None
        guard()
        if store.failures >= 20:
            store.up()

    fake.on_sleep = come_back_after_a_while
    state = loader.state_dict()
    assert store.failures == 20
    assert fake.now > 5.0  # it waited (backing off) rather than giving up
    assert state["namespace_id"] == ManifestLog(store, NS).latest().namespace_id
    loader.close()


_Pair = collections.namedtuple("_Pair", "tokens labels")


def test_to_tensors_converts_namedtuples_and_keeps_container_types() -> None:
    # Before: copying the read-only arrays rebuilt a namedtuple with type(item)(generator),
    # a TypeError (missing field), where torch's default_convert returns the namedtuple.
    frozen = np.arange(3.0)
    frozen.flags.writeable = False
    out = to_tensors(_Pair(frozen, [frozen]))
    assert isinstance(out, _Pair)
    assert isinstance(out.tokens, torch.Tensor)
    assert isinstance(out.labels[0], torch.Tensor)
    out.tokens.add_(1)  # a copy, not a view of the read-only array
    assert frozen.tolist() == [0.0, 1.0, 2.0]
    ordered = to_tensors(collections.OrderedDict(x=frozen))
    assert type(ordered) is collections.OrderedDict
    assert torch.equal(ordered["x"], torch.arange(3.0, dtype=torch.float64))


def test_a_loader_without_workers_takes_the_dataloader_timeout_as_the_consumers(
    store: OutageStore, fake: FakeTime
) -> None:
    # Before: torch's bare AssertionError ("requires timeout == 0") from the first iter().
    loader = _outage_loader(store, fake, timeout=5.0)
    assert [step for step, _ in loader] == [0, 1]  # the two TGBs produced
    loader = _outage_loader(store, fake, timeout=5.0)
    store.down()
    started = fake.now
    with pytest.raises(ConsumerTimeout):
        next(iter(loader))
    assert fake.now - started == pytest.approx(5.0)
    loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_next_after_a_steps_error_retries_the_step_on_the_same_iterator(
    tmp_path: Path, fake: FakeTime, workers: int
) -> None:
    # Before: the error finished the iterator's generator, so the next next() raised
    # StopIteration: a retry loop ended as if the stream had, though the producer went on.
    mesh = Mesh(dp=1, cp=1)
    producer = bw.Producer(FileStore(tmp_path, fsync=False), NS, producer_id="p", mesh=mesh)
    for offset in range(3):
        producer.append([bytes([offset])], offset=offset)
    producer.flush()
    dataset = WeaveDataset(
        tmp_path.as_uri(),
        NS,
        mesh=mesh,
        dp_rank=0,
        cp_rank=0,
        timeout=1.0,  # fake seconds: each worker forks its own copy of the fake clock
        clock=fake.clock,
        sleep=fake.sleep,
    )
    options: dict[str, Any] = {"num_workers": workers, "collate_fn": bytes}
    if workers:
        options["multiprocessing_context"] = "fork"
    loader = WeaveLoader(dataset, **options)
    steps = iter(loader)
    assert [next(steps) for _ in range(3)] == [(0, b"\0"), (1, b"\1"), (2, b"\2")]
    with pytest.raises(ConsumerTimeout):  # producers are behind: the head times out
        next(steps)
    assert multiprocessing.active_children() == []  # the failed iteration's workers are gone
    for offset in range(3, 6):
        producer.append([bytes([offset])], offset=offset)
    producer.seal()
    producer.close()
    assert [(int(step), data) for step, data in steps] == [(3, b"\3"), (4, b"\4"), (5, b"\5")]
    assert loader.state_dict()["step"] == 6
    with pytest.raises(StopIteration):  # sealed and delivered: the iterator stays ended
        next(steps)
    assert multiprocessing.active_children() == []
    loader.close()

"""Consumer fixes: stale manifests on resume, argument errors up front, obstore and fork().

An open consumer (a WeaveLoader's checking consumer is opened once per run) checked a loaded
state against the manifest it held, however stale: a step reclaimed since was accepted and every
``next()`` then failed with "object is gone". A read finding its object deleted by a reclamation
pass says ``StepReclaimed``. The public coordinate helpers refuse what is not a Mesh, an order or
an integer, instead of a raw ``AttributeError`` or a truncated ``RANK``; ``WeaveLoader`` refuses
DataLoader options torch refuses only at the first step. Workers of a loader reading with obstore
(not fork-safe) are not forked.
"""

from __future__ import annotations

import multiprocessing
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_consumer import produce, take

import batchweave as bw
from batchweave import (
    Consumer,
    ConsumerError,
    FileStore,
    MemoryStore,
    Mesh,
    ObjectNotFound,
    Producer,
    Reclaimer,
    StepReclaimed,
    Watermarks,
)
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._segments import find_segment
from batchweave.testing import S3Endpoint
from batchweave.torch import WeaveDataset, WeaveLoader

MESH = Mesh(dp=2)


def _reclaim_below(store: bw.ObjectStore, step: int) -> int:
    """Hold a checkpoint at TGB step ``step`` (only it: earlier ones are released) and run one
    reclamation pass: its new base step."""
    marks = Watermarks(store, "run")
    for old in marks.live():
        marks.release(old.checkpoint_id)
    marks.record(f"ck{step}", step)
    base = Reclaimer(store, "run", grace=0).run_once().base_step_after
    assert base == step
    return base


# ---------------------------------------------------------------------------------------------
# A: resuming an open consumer, and reads that find their step reclaimed


def test_an_open_consumer_refuses_a_state_reclaimed_since_it_opened() -> None:
    """Before: the open consumer accepted the state (its manifest, read before the reclamation,
    still listed step 1), and every next() then raised ConsumerError "the object is gone"."""
    store = MemoryStore()
    produce(store, "run", MESH, tgbs=10)
    opened = Consumer(store, "run", mesh=MESH, dp_rank=0, prefetch=0)
    assert [s for s, _ in take(opened, 6)] == list(range(6))
    early = {**opened.state_dict(), "step": 1}
    _reclaim_below(store, 5)
    fresh = Consumer(store, "run", mesh=MESH, dp_rank=0)
    with pytest.raises(StepReclaimed) as fresh_error:
        fresh.load_state_dict(early)
    with pytest.raises(StepReclaimed) as open_error:
        opened.load_state_dict(early)
    assert str(open_error.value) == str(fresh_error.value)
    assert "step 1 needs TGB step 1" in str(open_error.value)
    assert "set the step of the state you loaded to 5" in str(open_error.value)
    # a refused state changes nothing: the consumer goes on from where it was
    assert [s for s, _ in take(opened, 4)] == [6, 7, 8, 9]
    fresh.close()
    opened.close()


def test_an_open_consumer_loads_a_state_still_readable_after_a_reclamation() -> None:
    store = MemoryStore()
    produce(store, "run", MESH, tgbs=10)
    c = Consumer(store, "run", mesh=MESH, dp_rank=0, prefetch=0)
    take(c, 2)
    state = {**c.state_dict(), "step": 7}
    _reclaim_below(store, 5)
    c.load_state_dict(state)
    assert [s for s, _ in take(c)] == [7, 8, 9]
    c.close()


def test_a_read_whose_object_was_reclaimed_raises_step_reclaimed() -> None:
    """Before: ConsumerError "the object is gone ... reclaimed ... or deleted by hand", for ever:
    the consumer kept the stale manifest. Now the read asks the namespace, finds the step below
    its base step, and says so (naming the first readable step) on this and every next call."""
    store = MemoryStore()
    produce(store, "run", MESH, tgbs=10)
    c = Consumer(store, "run", mesh=MESH, dp_rank=0, prefetch=0)
    take(c, 2)
    held = c.manifest_version
    _reclaim_below(store, 5)
    with pytest.raises(StepReclaimed) as info:
        next(c)
    message = str(info.value)
    assert "step 2 needs TGB step 2" in message
    assert "can still read is step 5" in message
    assert "the object is gone" in message
    assert "run/data/" in message  # the object, and the read that found it gone
    assert isinstance(info.value.__cause__, ObjectNotFound)
    assert (c.manifest_version or 0) > (held or 0)
    with pytest.raises(StepReclaimed, match="can still read is step 5"):
        next(c)  # from the manifest now held, without reading the object again
    c.load_state_dict({**c.state_dict(), "step": 5})
    assert [s for s, _ in take(c)] == list(range(5, 10))
    c.close()


def test_an_open_consumer_names_a_step_readable_now_not_when_it_opened() -> None:
    """Before: a consumer opened at base step 1 and reclaimed below 3 since said "can still
    read is step 1 ... Consumer(start_step=1)" from the manifest it held: following that advice
    was another StepReclaimed, and every next() repeated it, never reading a newer version."""
    store = MemoryStore()
    produce(store, "run", MESH, tgbs=6)
    _reclaim_below(store, 1)
    c = Consumer(store, "run", mesh=MESH, dp_rank=0)
    c.open()
    held = c.manifest_version
    _reclaim_below(store, 3)
    for _ in range(2):  # the second from the version the first adopted
        with pytest.raises(StepReclaimed) as info:
            next(c)
        message = str(info.value)
        assert "step 0 needs TGB step 0, but steps below 3 were reclaimed" in message
        assert "can still read is step 3" in message
        assert "Consumer(start_step=3)" in message
    assert (c.manifest_version or 0) > (held or 0)
    assert [s for s, _ in Consumer(store, "run", mesh=MESH, dp_rank=0, start_step=3)] == [3, 4, 5]
    c.close()


def test_a_read_whose_segment_was_reclaimed_names_the_first_readable_step() -> None:
    """A dp=1 consumer of a dp=2 namespace holds an old version whose segment a reclamation
    pass deleted. Before: "step 1: step 0 was reclaimed (...); resume from a later checkpoint",
    a TGB step named as if it were the consumer's and no readable step; now the same advice a
    fresh consumer gives."""

    def written_long_ago() -> float:  # so that the pass may delete superseded metadata
        return time.time() - 5000

    store = MemoryStore(clock=written_long_ago)
    producer = Producer(
        store, "run", producer_id="p0", mesh=MESH, policy="naive", tail_limit=2,
        wall_clock=written_long_ago,
    )  # fmt: skip
    with producer:
        for offset in range(6):
            producer.append([b"a%d" % offset, b"b%d" % offset], offset=offset)
            producer.flush()
        old = Consumer(store, "run", mesh=Mesh(dp=1), dp_rank=0, start_step=1, prefetch=0)
        old.open()  # holds a version whose TGB 0 is in a segment
        log = ManifestLog(store, "run")
        segment = find_segment(log.read(old.manifest_version or 0).segments, 0)
        for offset in range(6, 40):  # segments merge
            producer.append([b"a%d" % offset, b"b%d" % offset], offset=offset)
            producer.flush()
    _reclaim_below(store, 4)
    with pytest.raises(ObjectNotFound):
        store.head(log.key(segment.key))  # the held version's segment is gone
    fresh = Consumer(store, "run", mesh=Mesh(dp=1), dp_rank=0, start_step=1)
    with pytest.raises(StepReclaimed) as fresh_error:
        next(fresh)
    with pytest.raises(StepReclaimed) as old_error:
        next(old)
    message = str(old_error.value)
    assert message == str(fresh_error.value)
    assert "step 1 needs TGB step 0, but steps below 4 were reclaimed" in message
    assert "can still read is step 8" in message
    later = Consumer(store, "run", mesh=Mesh(dp=1), dp_rank=0, start_step=8)
    assert [s for s, _ in take(later, 2)] == [8, 9]
    for consumer in (fresh, old, later):
        consumer.close()


def test_an_object_deleted_by_hand_is_still_an_object_gone_error() -> None:
    """Only a step below the namespace's base step is StepReclaimed: a listed step whose object
    was deleted stays the ConsumerError that says the object is gone."""
    store = MemoryStore()
    produce(store, "run", MESH, tgbs=4)
    c = Consumer(store, "run", mesh=MESH, dp_rank=0, prefetch=0)
    take(c, 1)
    log = ManifestLog(store, "run")
    ref = log.descriptor(log.latest(), 2).objects[0]
    store.delete_many([log.key(ref.key)])
    assert next(c)[0] == 1
    with pytest.raises(ConsumerError, match="the object is gone") as info:
        next(c)
    assert not isinstance(info.value, StepReclaimed)
    assert isinstance(info.value.__cause__, ObjectNotFound)
    c.close()


def test_a_loader_checks_a_loaded_state_against_the_latest_manifest(tmp_path: Path) -> None:
    """WeaveLoader's checking consumer is opened by the first state_dict() and stays open all
    run: before, its load_state_dict() accepted a state reclaimed since, and the loop failed
    later, in the DataLoader, with "object is gone"."""
    store = FileStore(tmp_path, fsync=False)
    produce(store, "run", MESH, tgbs=10)
    loader = WeaveLoader(WeaveDataset(tmp_path.as_uri(), "run", mesh=MESH, dp_rank=0))
    assert [int(s) for s, _ in take(loader, 6)] == list(range(6))
    early = {**loader.state_dict(), "step": 1}
    _reclaim_below(store, 5)
    with pytest.raises(StepReclaimed, match="set the step of the state you loaded to 5"):
        loader.load_state_dict(early)
    loader.load_state_dict({**early, "step": 5})
    assert [int(s) for s, _ in loader] == list(range(5, 10))
    loader.close()


# ---------------------------------------------------------------------------------------------
# B: argument errors, clear and early


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: bw.coordinates_for_rank(0, 2, mesh=(2, 1)),  # type: ignore[arg-type]
            TypeError,
            "mesh must be a batchweave.Mesh",
        ),
        (
            lambda: bw.coordinates_for_rank(0, 2, mesh=MESH, order=None),  # type: ignore[arg-type]
            TypeError,
            "order must be a str",
        ),
        (
            lambda: bw.coordinates_from_env(
                {"dp": 2},  # type: ignore[arg-type]
                environ={"RANK": "0", "WORLD_SIZE": "2"},
            ),
            TypeError,
            "mesh must be a batchweave.Mesh",
        ),
        (
            lambda: bw.coordinates_from_env(
                MESH,
                order=3,  # type: ignore[arg-type]
                environ={"RANK": "0", "WORLD_SIZE": "2"},
            ),
            TypeError,
            "order must be a str",
        ),
        (
            lambda: bw.coordinates_from_env(MESH, environ=[("RANK", "0")]),  # type: ignore[arg-type]
            TypeError,
            "environ must be a mapping",
        ),
    ],
    ids=["tuple-mesh", "none-order", "dict-mesh-env", "int-order-env", "list-environ"],
)
def test_the_public_coordinate_helpers_refuse_wrong_types_clearly(
    call: Any, error: type[Exception], match: str
) -> None:
    """Before: AttributeError ('tuple' object has no attribute 'cp', 'NoneType' object has no
    attribute 'lower'), as Consumer would not have let through."""
    with pytest.raises(error, match=match):
        call()


@pytest.mark.parametrize("rank", [1.9, 1.0, True])
def test_a_rank_in_environ_that_is_no_integer_is_refused_not_truncated(rank: object) -> None:
    """Before: RANK=1.9 was int()-ed to rank 1, by coordinates_from_env and by Consumer."""
    environ: Any = {"RANK": rank, "WORLD_SIZE": "2"}
    with pytest.raises(TypeError, match=r"RANK=.* is not an integer"):
        bw.coordinates_from_env(MESH, environ=environ)
    with pytest.raises(TypeError, match=r"RANK=.* is not an integer"):
        Consumer(MemoryStore(), "n", mesh=MESH, environ=environ)


def test_integer_and_string_ranks_in_environ_still_work() -> None:
    environ: Any = {"RANK": 1, "WORLD_SIZE": 2}
    assert bw.coordinates_from_env(MESH, environ=environ).dp_rank == 1
    assert bw.coordinates_from_env(MESH, environ={"RANK": "1", "WORLD_SIZE": "2"}).dp_rank == 1
    assert Consumer(MemoryStore(), "n", mesh=MESH, environ=environ).dp_rank == 1
    with pytest.raises(ValueError, match=r"RANK='1\.9' is not an integer"):
        bw.coordinates_from_env(MESH, environ={"RANK": "1.9", "WORLD_SIZE": "2"})


@pytest.mark.parametrize("option", ["clock", "sleep", "cpu_clock"])
def test_a_time_function_that_cannot_be_called_is_refused_naming_it(option: str) -> None:
    """Before: Consumer(clock=1.5) was accepted and failed at once with a bare TypeError
    "'float' object is not callable" that named no option (sleep and cpu_clock, later)."""
    kwargs: Any = {option: 1.5}
    with pytest.raises(TypeError, match=rf"^{option} must be callable .*float 1\.5"):
        Consumer(MemoryStore(), "n", mesh=MESH, dp_rank=0, **kwargs)


@pytest.fixture(scope="module")
def file_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("weave")
    produce(FileStore(root, fsync=False), "run", MESH, tgbs=3)
    return root.as_uri()


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"prefetch_factor": 2}, ValueError, "prefetch_factor"),
        ({"num_workers": 2, "multiprocessing_context": "bogus"}, ValueError, "bogus"),
        ({"multiprocessing_context": "spawn"}, ValueError, "multiprocessing_context"),
        ({"bogus_opt": 1}, TypeError, "bogus_opt"),
        ({"generator": 5}, TypeError, "generator must be a torch.Generator"),
        ({"worker_init_fn": 3}, TypeError, "worker_init_fn must be callable"),
        ({"collate_fn": "x"}, TypeError, "collate_fn must be callable"),
    ],
    ids=["prefetch-no-workers", "bogus-context", "context-no-workers", "unknown", "generator",
         "worker-init", "collate"],
)  # fmt: skip
def test_dataloader_options_torch_refuses_are_refused_when_the_loader_is_made(
    file_url: str, options: dict[str, Any], error: type[Exception], match: str
) -> None:
    """Before: each was accepted and failed at the first next() (the generator one with torch's
    "random_() received an invalid combination of arguments")."""
    dataset = WeaveDataset(file_url, "run", mesh=MESH, dp_rank=0)
    with pytest.raises(error, match=match):
        WeaveLoader(dataset, **options)
    assert multiprocessing.active_children() == []  # checking started no worker


def test_valid_dataloader_options_still_work(file_url: str) -> None:
    dataset = WeaveDataset(file_url, "run", mesh=MESH, dp_rank=0)
    loader = WeaveLoader(
        dataset,
        generator=torch.Generator().manual_seed(1),
        worker_init_fn=lambda worker: None,
        pin_memory_device="",
        prefetch_factor=None,
    )
    assert [int(s) for s, _ in loader] == [0, 1, 2]
    loader.close()


# ---------------------------------------------------------------------------------------------
# C: obstore is not fork-safe: its workers are not forked

OBSTORE_URL = "s3://bucket/prefix"
OBSTORE_OPTIONS = {"s3_client": "obstore", "endpoint_url": "http://127.0.0.1:9"}


def _obstore_dataset(**options: Any) -> WeaveDataset:
    return WeaveDataset(
        OBSTORE_URL, "run", mesh=MESH, dp_rank=0, store_options={**OBSTORE_OPTIONS, **options}
    )


def test_an_obstore_loader_starts_its_workers_without_fork() -> None:
    """Before: the default start method on Linux (fork) was used, and the workers hung in their
    first request once the loader had read the manifest (state_dict(), load_state_dict())."""
    loader = WeaveLoader(_obstore_dataset(), num_workers=2)
    assert loader.dataloader_options["multiprocessing_context"] in ("forkserver", "spawn")
    spawned = WeaveLoader(_obstore_dataset(), num_workers=2, multiprocessing_context="spawn")
    assert spawned.dataloader_options["multiprocessing_context"] == "spawn"
    inline = WeaveLoader(_obstore_dataset(), num_workers=0)
    assert "multiprocessing_context" not in inline.dataloader_options
    boto3 = WeaveDataset(OBSTORE_URL, "run", mesh=MESH, dp_rank=0)
    assert "multiprocessing_context" not in WeaveLoader(boto3, num_workers=2).dataloader_options


@pytest.mark.parametrize(
    "context", ["fork", multiprocessing.get_context("fork")], ids=["name", "context"]
)
def test_an_obstore_loader_refuses_fork_at_construction(context: Any) -> None:
    with pytest.raises(ValueError, match=r"obstore is not fork-safe.*forkserver.*boto3"):
        WeaveLoader(_obstore_dataset(), num_workers=2, multiprocessing_context=context)


def test_an_obstore_store_object_is_not_forked_either() -> None:
    from batchweave._store._obstore import ObstoreS3Store

    store = bw.CountingStore(ObstoreS3Store("bucket", "prefix", endpoint_url="http://127.0.0.1:9"))
    dataset = WeaveDataset(store, "run", mesh=MESH, dp_rank=0)
    with pytest.raises(ValueError, match="obstore is not fork-safe"):
        WeaveLoader(dataset, num_workers=2, multiprocessing_context="fork")


@pytest.mark.moto_server
def test_an_obstore_loader_resumes_with_workers(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> None:
    """The documented flow: a URL with s3_client="obstore", workers, and a state_dict() (which
    reads the manifest with obstore in this process) before iterating. Before: every forked
    worker hung in its first request and the loop failed after the DataLoader's timeout."""
    options = moto_endpoint.store_options()
    produce(bw.S3Store(s3_bucket, s3_prefix, **options), "run", MESH, tgbs=6)
    dataset = WeaveDataset(
        f"s3://{s3_bucket}/{s3_prefix}",
        "run",
        mesh=MESH,
        dp_rank=0,
        store_options={**options, "s3_client": "obstore"},
    )
    loader = WeaveLoader(dataset, num_workers=2, timeout=60)
    assert loader.state_dict()["step"] == 0  # obstore used in this process
    assert [int(s) for s, _ in take(loader, 3)] == [0, 1, 2]
    state = loader.state_dict()
    loader.close()
    resumed = WeaveLoader(dataset, num_workers=2, timeout=60)
    resumed.load_state_dict(state)
    assert [int(s) for s, _ in resumed] == [3, 4, 5]
    resumed.close()

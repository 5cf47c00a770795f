"""batchweave.torch with DataLoader workers, as a demanding PyTorch user drives it.

Spawn-started workers resume in a loader without workers and a finished loader stays finished;
DCP save and load resume with another mesh and worker count; a store error in a worker surfaces
with its type and the step is retried; credentials stay out of reprs and worker errors; and
leaving the loop while workers wait for producers is prompt.
"""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from test_consumer import produce
from test_consumer_torch import MESH, produce_reference, take
from torch.distributed.checkpoint.stateful import Stateful

from batchweave import ChecksumMismatch, Consumer, ConsumerTimeout, FileStore, Mesh
from batchweave.torch import WeaveDataset, WeaveLoader


@pytest.fixture(scope="module")
def sealed(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[int, Any]]]:
    root: Path = tmp_path_factory.mktemp("weave")
    reference = produce_reference(root, producers=1, tgbs=6)
    assert len(reference) == 6
    return root.as_uri(), reference


def _loader(url: str, workers: int, mesh: Mesh = MESH, **options: Any) -> WeaveLoader:
    dataset = WeaveDataset(url, "run", mesh=mesh, dp_rank=mesh.dp - 1, cp_rank=0, prefetch=2)
    if workers:
        options.setdefault("multiprocessing_context", "fork")
    return WeaveLoader(dataset, num_workers=workers, **options)


def _steps(loader: WeaveLoader) -> Iterator[int]:
    for step, _ in loader:
        yield int(step)


def test_spawn_workers_resume_without_workers_and_a_finished_loader_stays_finished(
    sealed: tuple[str, list[tuple[int, Any]]],
) -> None:
    url, reference = sealed
    first = _loader(url, 2, multiprocessing_context="spawn", prefetch_factor=1)
    head = take(first, 3)
    state = first.state_dict()
    first.close()
    assert multiprocessing.active_children() == []
    second = _loader(url, 0)
    second.load_state_dict(state)
    assert head + take(second) == reference
    assert take(second) == []  # a second epoch of a sealed namespace: nothing more
    assert second.state_dict()["step"] == len(reference)
    second.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture
def gloo_group() -> Any:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("gloo_group")
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_dcp_save_and_load_resume_with_another_mesh_and_worker_count(
    sealed: tuple[str, list[tuple[int, Any]]], tmp_path: Path
) -> None:
    url, _ = sealed
    first = _loader(url, 2)
    assert isinstance(first, Stateful)
    take(first, 3)  # workers have prefetched further: only the 3 yielded steps count
    dcp.save({"data": first}, checkpoint_id=tmp_path / "ckpt")
    saved = first.state_dict()
    first.close()

    # resume with dp=1: the same re-anchoring a Consumer does, through 3 workers
    resumed = _loader(url, 3, mesh=Mesh(dp=1, cp=2))
    dcp.load({"data": resumed}, checkpoint_id=tmp_path / "ckpt")
    assert resumed.state_dict()["step"] == 3
    store = FileStore(Path(url.removeprefix("file://")), fsync=False)
    with Consumer(store, "run", mesh=Mesh(dp=1, cp=2), dp_rank=0, cp_rank=0) as c:
        c.load_state_dict(saved)
        expected = list(c)
    assert len(expected) == 12 - 2 * 3
    assert take(resumed) == expected
    resumed.close()


def test_a_store_error_in_a_worker_surfaces_with_its_type_and_the_step_is_retried(
    tmp_path: Path,
) -> None:
    store = FileStore(tmp_path, fsync=False)
    produce(store, "run", MESH, producers=1, tgbs=3)
    victim = sorted(p for p in (tmp_path / "run" / "data").rglob("*") if p.is_file())[1]
    victim.write_bytes(b"X" * victim.stat().st_size)  # TGB step 1: logical step 1 of any rank
    loader = _loader(tmp_path.as_uri(), 2)
    got: list[int] = []
    with pytest.raises(ChecksumMismatch, match="worker process 1"):
        got.extend(_steps(loader))
    assert got == [0]
    assert loader.state_dict()["step"] == 1
    with pytest.raises(ChecksumMismatch):  # a new iteration reads step 1 again, not step 2
        got.extend(_steps(loader))
    assert got == [0]
    # Torch's re-raised exception holds the DataLoader iterator in a reference cycle, and
    # collected in a cycle it took 5 s per worker to shut down: the workers are gone already.
    assert multiprocessing.active_children() == []
    started = time.monotonic()
    gc.collect()
    assert time.monotonic() - started < 4.0  # not the 5 s of one worker's shutdown
    loader.close()


def test_credentials_stay_out_of_reprs_and_worker_errors() -> None:
    secret = "s3cr3t-Key-1234567890"
    dataset = WeaveDataset(
        "s3://bucket/prefix",
        "run",
        mesh=MESH,
        dp_rank=0,
        cp_rank=0,
        timeout=0.2,
        store_options={
            "endpoint_url": "http://127.0.0.1:1",  # refused at once
            "access_key_id": "AKIDEXAMPLE",
            "secret_access_key": secret,
            "max_attempts": 1,
        },
    )
    loader = WeaveLoader(dataset, num_workers=1, multiprocessing_context="fork")
    assert secret not in repr(dataset) + repr(loader)
    with pytest.raises(ConsumerTimeout) as info:
        next(iter(loader))
    assert "could not be opened" in str(info.value)
    assert secret not in str(info.value)
    loader.close()


def _marking_sleep(marks: Path, seconds: float) -> None:
    """A consumer sleep that leaves a file saying this worker process waits for producers."""
    (marks / str(os.getpid())).touch()
    time.sleep(seconds)


def test_leaving_the_loop_while_workers_wait_for_producers_is_prompt(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "s", fsync=False)
    produce(store, "run", MESH, producers=1, tgbs=2, seal=False)
    marks = tmp_path / "marks"
    marks.mkdir()
    dataset = WeaveDataset(
        (tmp_path / "s").as_uri(),
        "run",
        mesh=MESH,
        dp_rank=1,
        cp_rank=0,
        max_poll_interval=0.2,
        sleep=functools.partial(_marking_sleep, marks),
    )
    loader = WeaveLoader(dataset, num_workers=2, multiprocessing_context="fork", prefetch_factor=1)
    got: list[int] = []
    started = time.monotonic()
    for step, _ in loader:
        got.append(int(step))
        if len(got) == 2:
            deadline = time.monotonic() + 30
            while len(list(marks.iterdir())) < 2:  # both workers wait for steps 2 and 3
                assert time.monotonic() < deadline, "the workers never waited for producers"
                time.sleep(0.01)
            started = time.monotonic()
            break
    left = time.monotonic() - started
    assert got == [0, 1]
    assert loader.state_dict()["step"] == 2
    # torch joins each worker for 5 s before killing it: waiting workers must give up at once
    assert left < 4.5, f"leaving the loop took {left:.1f} s"  # not torch's 5 s join
    assert multiprocessing.active_children() == []
    loader.close()


# ("\tmemory://x" is refused as soon as it is opened: tests/test_store_hostile_inputs.py)
@pytest.mark.parametrize("url", ["MEMORY://x", "Memory://x", " memory://x"])
def test_a_memory_url_is_refused_with_workers_however_open_store_reads_it(url: str) -> None:
    # Before: only a lower-case "memory://" prefix was refused; open_store reads these as
    # memory:// too, so each worker read an empty store of its own and waited for ever.
    dataset = WeaveDataset(url, "run", mesh=MESH, dp_rank=0, cp_rank=0)
    with pytest.raises(ValueError, match="memory:// store exists only in this process"):
        WeaveLoader(dataset, num_workers=2)
    WeaveLoader(dataset, num_workers=0).close()  # in-process is fine

"""batchweave.torch: the same sequence with and without DataLoader workers, and resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_consumer import parse, produce

from batchweave import Consumer, FileStore, Mesh
from batchweave.torch import WeaveDataset, WeaveLoader

MESH = Mesh(dp=2, cp=2)
STEPS = 9


@pytest.fixture(scope="module")
def namespace(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list[tuple[int, Any]]]:
    root: Path = tmp_path_factory.mktemp("weave")
    store = FileStore(root, fsync=False)
    produce(store, "run", MESH, producers=2, tgbs=5)
    with Consumer(store, "run", mesh=MESH, dp_rank=1, cp_rank=0) as c:
        reference = list(c)
    assert len(reference) == 10
    return f"file://{root}", reference


def _loader(url: str, workers: int, **kw: Any) -> WeaveLoader:
    dataset = WeaveDataset(url, "run", mesh=MESH, dp_rank=1, cp_rank=0, prefetch=2, **kw)
    options: dict[str, Any] = {"num_workers": workers}
    if workers:
        options["multiprocessing_context"] = "forkserver"
    return WeaveLoader(dataset, **options)


def _items(loader: WeaveLoader, n: int | None = None) -> list[tuple[int, bytes]]:
    out: list[tuple[int, bytes]] = []
    for step, data in loader:
        out.append((int(step), data))
        if len(out) == n:
            break
    return out


@pytest.mark.parametrize("workers", [0, 3])
def test_same_sequence_with_any_number_of_workers(
    namespace: tuple[str, list[tuple[int, Any]]], workers: int
) -> None:
    url, reference = namespace
    loader = _loader(url, workers)
    assert _items(loader) == reference
    assert loader.state_dict()["step"] == len(reference)
    loader.close()


@pytest.mark.parametrize(("before", "after"), [(0, 2), (2, 0)])
def test_resume_from_a_loader_checkpoint(
    namespace: tuple[str, list[tuple[int, Any]]], before: int, after: int
) -> None:
    url, reference = namespace
    first = _loader(url, before)
    head = _items(first, 4)
    state = first.state_dict()  # workers may have prefetched more; only yielded steps count
    first.close()
    assert head == reference[:4]
    assert state["step"] == 4
    second = _loader(url, after)
    second.load_state_dict(state)
    assert _items(second) == reference[4:]
    second.close()


def test_a_new_iteration_continues_where_the_last_stopped(
    namespace: tuple[str, list[tuple[int, Any]]],
) -> None:
    url, reference = namespace
    loader = _loader(url, 0)
    assert _items(loader, 3) == reference[:3]
    assert _items(loader) == reference[3:]
    assert [parse(d)[2:] for _, d in reference] == [(1, 0)] * len(reference)
    loader.close()


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

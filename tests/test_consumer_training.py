"""A training job's view of the consumer: plain-int states, rank arguments, Ctrl-C mid-step,
read-ahead errors, writable tensors from the PyTorch loader, and the checkpoint hook on it."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import batchweave as bw
from batchweave import Consumer, ConsumerError, FormatError, MemoryStore, Mesh, StoreUnavailable
from batchweave._manifest._log import ManifestLog
from batchweave.torch import WeaveDataset, WeaveLoader

MESH = Mesh(dp=2, cp=1)


def _publish(store: bw.ObjectStore, namespace: str, steps: int, *, seal: bool = True) -> None:
    """``steps`` TGBs of ``MESH``; slice ``d`` of step ``o`` holds ``x`` filled with 10 o + d."""
    with bw.Producer(store, namespace, producer_id="p", mesh=MESH, codec="tensors") as p:
        for o in range(steps):
            p.append(
                [{"x": np.full(4, 10 * o + d, dtype=np.float32)} for d in range(MESH.dp)],
                offset=o,
            )
        p.flush()
        if seal:
            p.seal()


class _ManifestFaults(MemoryStore):
    """Raises ``fault`` on the ``countdown``-th manifest read after it is armed."""

    def __init__(self) -> None:
        super().__init__()
        self.countdown: int | None = None
        self.fault: BaseException = KeyboardInterrupt()

    def arm(self, countdown: int, fault: BaseException) -> None:
        self.countdown, self.fault = countdown, fault

    def _reading(self, key: str) -> None:
        if self.countdown is not None and "/_manifests/" in key:
            self.countdown -= 1
            if self.countdown == 0:
                self.countdown = None
                raise self.fault

    def get(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self._reading(key)
        return super().get(key, *args, **kwargs)

    def get_range(self, key: str, *args: Any, **kwargs: Any) -> Any:
        self._reading(key)
        return super().get_range(key, *args, **kwargs)


def _reading_ahead(store: bw.ObjectStore) -> Consumer:
    """A consumer that reads ahead and polls the manifest whenever it reaches the head."""
    return Consumer(
        store,
        "run",
        mesh=MESH,
        dp_rank=1,
        prefetch_min_latency=0,
        poll_interval=1e-9,
        max_poll_interval=1e-9,
    )


# -- states and rank arguments -----------------------------------------------------------------


def test_numpy_rank_coordinates_give_a_plain_int_state() -> None:
    # np.unravel_index(rank, grid) is a natural way to compute coordinates; it returns np.int64.
    store = MemoryStore()
    _publish(store, "run", 4)
    dp_rank, start = np.int64(1), np.int64(1)
    with Consumer(store, "run", mesh=MESH, dp_rank=dp_rank, start_step=start, stride=2) as c:
        assert [s for s, _ in c] == [1, 3]
        state = c.state_dict()
    assert all(type(v) in (int, str) for v in state.values()), state
    assert json.loads(json.dumps(state)) == state
    buf = io.BytesIO()
    torch.save({"data": state}, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["data"] == state


@pytest.mark.parametrize(("value", "kind"), [(1.0, "float"), ("1", "str")])
def test_a_non_integer_rank_is_refused_when_the_consumer_is_made(value: Any, kind: str) -> None:
    # A float rank used to fail only at the first read, deep inside, with no name attached.
    with pytest.raises(TypeError, match=f"dp_rank must be an integer, got the {kind}"):
        Consumer(MemoryStore(), "run", mesh=MESH, dp_rank=value)


@pytest.mark.parametrize(
    ("world_size", "needle"),
    [
        ("16", "the mesh fits if tp x pp = 4: pass the job's tp= and pp= degrees"),
        ("15", "WORLD_SIZE must be a multiple of dp x cp = 4"),
    ],
)
def test_a_world_size_that_does_not_fit_says_what_would(world_size: str, needle: str) -> None:
    env = {"RANK": "0", "WORLD_SIZE": world_size}
    with pytest.raises(ValueError, match=f"WORLD_SIZE={world_size} does not match") as info:
        Consumer(MemoryStore(), "run", mesh=Mesh(dp=2, cp=2), environ=env)
    assert needle in str(info.value)


def test_a_closed_consumer_says_how_to_continue() -> None:
    store = MemoryStore()
    _publish(store, "run", 3)
    c = Consumer(store, "run", mesh=MESH, dp_rank=0)
    next(c)
    c.close()
    c.close()
    with pytest.raises(ConsumerError, match="is closed; to continue, create a new Consumer"):
        next(c)
    resumed = Consumer(store, "run", mesh=MESH, dp_rank=0)
    resumed.load_state_dict(c.state_dict())
    assert [s for s, _ in resumed] == [1, 2]


# -- interrupted and failing read-ahead --------------------------------------------------------


def test_ctrl_c_while_reading_ahead_neither_skips_nor_repeats_a_step() -> None:
    store = _ManifestFaults()
    _publish(store, "run", 3, seal=False)
    c = _reading_ahead(store)
    seen = [next(c)[0], next(c)[0]]
    # The 2nd manifest read is the poll after step 2 was read, before it is returned.
    store.arm(2, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        next(c)
    state = c.state_dict()
    c.close()
    assert seen == [0, 1]
    assert state["step"] == 2  # step 2 never reached the loop
    resumed = _reading_ahead(store)
    resumed.load_state_dict(state)
    step, data = next(resumed)
    assert (step, float(data["x"][0])) == (2, 21.0)
    resumed.close()


def test_an_error_while_reading_ahead_does_not_take_the_step_with_it() -> None:
    store = _ManifestFaults()
    _publish(store, "run", 3, seal=False)
    c = _reading_ahead(store)
    seen: list[int] = []
    for step, _ in c:
        seen.append(step)
        if step == 1:
            store.arm(2, FormatError("a damaged manifest version (injected)"))
        if step == 2:
            break
    assert store.countdown is None  # the fault was raised, while reading ahead of step 2
    assert seen == [0, 1, 2]
    assert c.state_dict()["step"] == 3
    c.close()


def test_a_poll_failing_before_a_step_in_hand_is_returned_does_not_take_it() -> None:
    # Before: the poll that next() makes before returning a step already read ahead let any
    # error but a transient one escape (a damaged version, expired credentials), and step 2,
    # committed and in hand, was never delivered.
    store = _ManifestFaults()
    _publish(store, "run", 3, seal=False)
    c = _reading_ahead(store)
    assert [next(c)[0], next(c)[0]] == [0, 1]
    store.arm(1, FormatError("a damaged manifest version (injected)"))
    assert next(c)[0] == 2
    assert store.countdown is None  # the fault was raised, by the poll of that next()
    assert c.state_dict()["step"] == 3
    store.arm(1, FormatError("a damaged manifest version (injected)"))
    with pytest.raises(FormatError, match="damaged"):  # step 3 needs the poll: it surfaces
        next(c)
    c.close()


class _DataDown(MemoryStore):
    """Every TGB read fails as if the endpoint were unreachable (an outage)."""

    def get_range(self, key: str, *args: Any, **kwargs: Any) -> Any:
        if "/data/" in key:
            raise StoreUnavailable(f"{key}: 127.0.0.1:9 is unreachable (injected)")
        return super().get_range(key, *args, **kwargs)


@pytest.mark.parametrize("waiting_for", ["producers", "the namespace", "the store"])
def test_close_from_another_thread_stops_a_waiting_next(waiting_for: str) -> None:
    # docs/consumer.md: "interrupt it (Ctrl-C, close()) if waiting is not what you want".
    # Before, close() left the loop waiting forever (and a read-ahead job retrying forever).
    store = _DataDown() if waiting_for == "the store" else MemoryStore()
    if waiting_for != "the namespace":
        _publish(store, "run", 1 if waiting_for == "producers" else 3, seal=False)
    waiting = threading.Event()

    def sleep(seconds: float) -> None:
        waiting.set()
        time.sleep(min(seconds, 0.01))

    c = Consumer(store, "run", mesh=MESH, dp_rank=0, sleep=sleep, retry_backoff=0.01)
    if waiting_for == "producers":
        next(c)
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            for _ in c:
                pass
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    assert waiting.wait(10)
    c.close()
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1
    assert isinstance(errors[0], ConsumerError)
    assert "was closed while" in str(errors[0])


# -- PyTorch -----------------------------------------------------------------------------------

_INPLACE = textwrap.dedent(
    """
    import sys
    import numpy as np
    import batchweave as bw
    from batchweave.torch import WeaveDataset, WeaveLoader

    if __name__ == "__main__":
        url = sys.argv[1]
        store = bw.open_store(url)
        with bw.Producer(store, "run", producer_id="p", mesh=bw.Mesh(dp=1), codec="tensors") as p:
            for o in range(3):
                p.append([{"x": np.full(256, o, dtype=np.float32)}], offset=o)
            p.seal()
        for workers in (0, 2):
            # map_threshold=1: every slice is a view of a read-only memory map, as 32 MiB are
            dataset = WeaveDataset(url, "run", mesh=bw.Mesh(dp=1), dp_rank=0, map_threshold=1)
            total = 0.0
            for step, batch in WeaveLoader(dataset, num_workers=workers):
                batch["x"].mul_(2.0)  # an ordinary in-place op of a training step
                total += float(batch["x"].sum())
            assert total == 2 * 256 * (0 + 1 + 2), total
        print("ok")
    """
)


def test_loader_tensors_of_mapped_slices_can_be_modified_in_place(tmp_path: Path) -> None:
    # Before: with num_workers=0 the tensor viewed the read-only map and mul_ was a SIGSEGV.
    script = tmp_path / "inplace.py"
    script.write_text(_INPLACE)
    proc = subprocess.run(
        [sys.executable, str(script), (tmp_path / "s").as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "ok"
    assert "not writable" not in proc.stderr  # torch's warning about read-only arrays


@pytest.mark.parametrize(("consumer_dp", "stop_after", "tgb_step"), [(2, 4, 4), (1, 5, 2)])
def test_checkpoint_hook_takes_a_loader(
    tmp_path: Path, consumer_dp: int, stop_after: int, tgb_step: int
) -> None:
    store = bw.FileStore(tmp_path / "s", fsync=False)
    _publish(store, "run", 8)
    marks = bw.Watermarks(store, "run")
    url = (tmp_path / "s").as_uri()
    loader = WeaveLoader(WeaveDataset(url, "run", mesh=Mesh(dp=consumer_dp), dp_rank=0))
    for step, _ in loader:
        if step + 1 == stop_after:
            break
    mark = bw.checkpoint_hook(loader, marks, "ckpt", rank=0)
    assert mark is not None
    # logical step 5 of a dp=1 reader is replica slice 5: TGB 2 (of dp=2 TGBs) still needed
    assert mark.step == tgb_step
    assert mark.version == ManifestLog(store, "run").latest().version
    saved = loader.state_dict()
    for _ in loader:
        pass
    again = bw.checkpoint_hook(loader, marks, "ckpt", state=saved, rank=0)
    assert again is not None
    assert again.step == tgb_step  # the saved state's step, not where the loop is now
    loader.close()

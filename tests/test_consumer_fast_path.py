"""The consumer's one-slice path (``_read_slice``) against its path for several slices.

A step whose rank owns one slice (the consumer's ``cp`` equals the stored one) skips grouping
slices by object and into runs. These tests read the same step both ways, each with a fresh
consumer, and check they return the same data, read the same bytes with the same requests, and
fail with the same error and message.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchweave import (
    ChecksumMismatch,
    Consumer,
    ConsumerError,
    FileStore,
    FormatError,
    MemoryStore,
    Mesh,
    ObjectNotFound,
    ObjectStore,
    Producer,
)
from batchweave._consumer._reader import Budget, _group_by_object
from batchweave._manifest._log import ManifestLog

MESH = Mesh(dp=2, cp=2)


def produce(
    store: ObjectStore,
    *,
    slice_table_limit: int = 32,
    size: int = 64,
    codec: str = "raw",
    tgbs: int = 3,
) -> None:
    """Seal ``tgbs`` TGBs of ``MESH``, every slice distinct: ``p:offset:d:c;`` padded."""
    with Producer(
        store,
        "run",
        producer_id="p",
        mesh=MESH,
        policy="naive",
        slice_table_limit=slice_table_limit,
        codec=codec,
    ) as p:
        for offset in range(tgbs):
            slices: list[Any] = []
            for d in range(MESH.dp):
                for c in range(MESH.cp):
                    tag = f"p:{offset}:{d}:{c};".encode().ljust(size, b".")
                    if codec == "tensors":
                        slices.append({"x": np.frombuffer(tag, dtype=np.uint8)})
                    else:
                        slices.append(tag)
            p.append(slices, offset=offset)
        p.seal()


def object_key(store: ObjectStore, tgb_step: int) -> str:
    log = ManifestLog(store, "run")
    ref = log.descriptor(log.latest(), tgb_step).objects[0]
    return log.key(ref.key)


def open_consumer(store: ObjectStore, **kw: Any) -> Consumer:
    c = Consumer(store, "run", mesh=MESH, dp_rank=1, cp_rank=1, retry_budget=0, **kw)
    c.open()
    return c


def fast(c: Consumer, step: int) -> tuple[Any, int]:
    """The step as the consumer reads it: one slice, so ``_read_slice``."""
    assert c._projection is not None
    assert c._manifest is not None
    loc = c._projection.locate(step, c.dp_rank, c.cp_rank)
    assert len(loc.slices) == 1
    return c._fetch_step(step, loc, c._manifest)


def general(c: Consumer, step: int) -> tuple[Any, int]:
    """The same step through the path for several slices: grouped by object, read in runs."""
    assert c._projection is not None
    assert c._manifest is not None
    loc = c._projection.locate(step, c.dp_rank, c.cp_rank)
    what = f"step {step} (TGB step {loc.tgb_step})"
    desc = c._log.descriptor(c._manifest, loc.tgb_step)
    ((ref, indices),) = _group_by_object(desc, loc, what)
    values, nbytes = c._reader.read_object_slices(what, ref, indices, Budget(c.retry_budget))
    return values[0], nbytes


def both(
    store: ObjectStore, step: int, **kw: Any
) -> list[tuple[Any, int, tuple[int, int, int]] | BaseException]:
    """Read ``step`` with each path (a fresh consumer each): the result and (requests, bytes
    read, footer reads) of that read, or the exception raised."""
    outcomes: list[tuple[Any, int, tuple[int, int, int]] | BaseException] = []
    read: Callable[[Consumer, int], tuple[Any, int]]
    for read in (fast, general):
        with open_consumer(store, **kw) as c:
            before = c.stats
            try:
                data, nbytes = read(c, step)
            except Exception as exc:
                outcomes.append(exc)
                continue
            after = c.stats
            counts = (
                after.requests - before.requests,
                after.bytes_read - before.bytes_read,
                after.footer_reads - before.footer_reads,
            )
            outcomes.append((data, nbytes, counts))
    return outcomes


def same_error(outcomes: list[Any], kind: type[BaseException]) -> BaseException:
    fast_exc, general_exc = outcomes
    assert isinstance(fast_exc, kind), fast_exc
    assert type(fast_exc) is type(general_exc)
    assert str(fast_exc) == str(general_exc)
    assert type(fast_exc.__cause__) is type(general_exc.__cause__)
    return fast_exc


@pytest.mark.parametrize("slice_table_limit", [32, 0], ids=["slice-table", "footer"])
def test_both_paths_return_the_same_slice_with_the_same_reads(slice_table_limit: int) -> None:
    store = MemoryStore()
    produce(store, slice_table_limit=slice_table_limit)
    for step in range(3):
        fast_out, general_out = both(store, step)
        assert fast_out == general_out
        assert isinstance(fast_out, tuple)
        data, nbytes, (requests, _, footer_reads) = fast_out
        assert data == f"p:{step}:1:1;".encode().ljust(64, b".")
        assert nbytes == 64
        assert (requests, footer_reads) == ((1, 0) if slice_table_limit else (2, 1))


def test_both_paths_agree_on_split_reads_of_decoded_tensors() -> None:
    store = MemoryStore()
    produce(store, size=4096, codec="tensors")
    fast_out, general_out = both(store, 1, split_threshold=1024, part_size=1024)
    assert isinstance(fast_out, tuple)
    assert isinstance(general_out, tuple)
    data, nbytes, counts = fast_out
    assert bytes(data["x"]).startswith(b"p:1:1:1;")
    assert bytes(data["x"]) == bytes(general_out[0]["x"])
    assert (nbytes, counts) == (general_out[1], general_out[2])
    assert counts[0] > 1  # the slice was read in parts


def test_both_paths_agree_on_mapped_reads(tmp_path: Path) -> None:
    store = FileStore(tmp_path, fsync=False)
    produce(store, size=4096)
    fast_out, general_out = both(store, 2, map_threshold=1024)
    assert isinstance(fast_out, tuple)
    assert isinstance(general_out, tuple)
    assert fast_out[0] == general_out[0]
    assert fast_out[0] == b"p:2:1:1;".ljust(4096, b".")
    assert fast_out[1:] == general_out[1:]


@pytest.mark.parametrize("slice_table_limit", [32, 0], ids=["slice-table", "footer"])
def test_a_corrupt_slice_fails_alike(slice_table_limit: int) -> None:
    store = MemoryStore()
    produce(store, slice_table_limit=slice_table_limit)
    key = object_key(store, 1)
    data = bytearray(store.get(key))
    data[3 * 64 + 10] ^= 0x01  # slice (1, 1), the 4th of the TGB
    store.put(key, bytes(data))
    exc = same_error(both(store, 1), ChecksumMismatch)
    assert f"step 1 (TGB step 1), object {key!r}, slice 3 is corrupt" in str(exc)


@pytest.mark.parametrize("slice_table_limit", [32, 0], ids=["slice-table", "footer"])
def test_a_missing_object_fails_alike(slice_table_limit: int) -> None:
    store = MemoryStore()
    produce(store, slice_table_limit=slice_table_limit)
    key = object_key(store, 2)
    store.delete_many([key])
    exc = same_error(both(store, 2), ConsumerError)
    assert isinstance(exc.__cause__, ObjectNotFound)
    assert str(exc).startswith("step 2 (TGB step 2), object ")
    assert "the object is gone" in str(exc)


def test_a_truncated_object_fails_alike() -> None:
    store = MemoryStore()
    produce(store)
    key = object_key(store, 1)
    store.put(key, store.get(key)[: 3 * 64 + 10])
    exc = same_error(both(store, 1), FormatError)
    assert str(exc) == (
        f"step 1 (TGB step 1), object {key!r}, slice 3: object {key!r} is truncated: bytes "
        f"[192, 256) requested, 10 returned; restore it, or resume past this step"
    )


def test_a_slice_no_object_holds_fails_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    store = MemoryStore()
    produce(store)
    real = ManifestLog.descriptor

    def without_objects(self: ManifestLog, manifest: Any, step: int) -> Any:
        return real(self, manifest, step).model_copy(update={"objects": []})

    monkeypatch.setattr(ManifestLog, "descriptor", without_objects)
    exc = same_error(both(store, 0), FormatError)
    assert str(exc) == "step 0 (TGB step 0): no object of the TGB holds slice 3"

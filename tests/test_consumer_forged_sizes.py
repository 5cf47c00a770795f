"""Sizes a consumer is told but cannot trust, and what it knows without asking the store.

A manifest's slice table is covered by the manifest's checksum, but that only proves the table
is what a writer wrote: a damaged writer, a forged manifest or an object truncated or replaced
after the commit can make it claim more bytes than the object holds. With no footer read (the
table replaces it), nothing checked the claim before a split read preallocated its whole range:
a 64 GiB claim was ``bytearray(2**36)``, a raw ``MemoryError`` (or gigabytes zero-filled). Above
``_UNPROVEN_ALLOCATION`` (1 GiB) the last part is now read first; a short one is a
``FormatError`` naming the key, the step and the sizes, and no buffer is allocated for the claim.

``checkpoint_hook`` checks a state's namespace id on every rank from ``namespace_id``, which
``WeaveLoader`` lacked, so a loader given another namespace's state failed on rank 0 only.
"""

from __future__ import annotations

import builtins
from typing import Any

import pytest

import batchweave as bw
from batchweave import FormatError, NamespaceMismatch
from batchweave._consumer import _reader
from batchweave._manifest._codec import decode_manifest, encode_manifest
from batchweave._manifest._log import ManifestLog, manifest_key

ONE = bw.Mesh(dp=1, cp=1)
HUGE = 64 << 30


def _forge_huge_slice(store: bw.ObjectStore, namespace: str, claim: int) -> tuple[str, int]:
    """Commit a manifest (valid checksum) whose step-0 slice table claims ``claim`` bytes for
    the one slice of its object; return the object's key and its real size."""
    log = ManifestLog(store, namespace)
    latest = log.latest()
    desc = latest.tail[0]
    ref = desc.objects[0]
    assert ref.slices is not None  # the manifest carries the table: no footer read checks it
    table = ref.slices.model_copy(update={"lengths": (claim,)})
    forged_ref = ref.model_copy(
        update={
            "slices": table,
            "footer_offset": claim,
            "size": claim + ref.footer_length + 32,
        }
    )
    forged = latest.model_copy(
        update={
            "tail": (desc.model_copy(update={"objects": (forged_ref,), "bytes": forged_ref.size}),),
            "version": latest.version + 1,
            "parent": latest.version,
            "commit_id": "f" * 32,
        }
    )
    data = encode_manifest(forged)
    decode_manifest(data, key="forged")  # the forgery is a valid manifest
    store.put_if_absent(f"{namespace}/{manifest_key(forged.version)}", data)
    key = log.key(ref.key)
    return key, store.head(key).size


class _ObjectRanges(bw.StoreWrapper):
    """Records the byte ranges read from TGB objects (manifests are range reads too); part reads
    (``get_range_into``) come here through the wrapper's default implementation."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.ranges: list[tuple[int, int]] = []

    def get_range(self, key: str, rng: bw.ByteRange) -> bytes:
        if key.endswith(".tgb"):
            assert isinstance(rng, bw.Bounded)
            self.ranges.append((rng.start, rng.end))
        return super().get_range(key, rng)


class _Allocations:
    """Stands in for ``bytearray`` in the reader: records every size asked for and refuses
    (with ``MemoryError``, as a real allocation that large would) any above ``limit``."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sizes: list[int] = []

    def __call__(self, *args: Any) -> bytearray:
        if args and isinstance(args[0], int):
            self.sizes.append(args[0])
            if args[0] > self.limit:
                raise MemoryError(f"refused to allocate {args[0]} bytes in the test")
        return builtins.bytearray(*args)


@pytest.mark.parametrize(
    ("claim", "options"),
    [
        (HUGE, {}),  # the default thresholds: 4096 parts of 16 MiB
        (10 * 1024 * 1024, {"split_threshold": 4096, "part_size": 4096}),  # 2560 small parts,
    ],  # above a lowered _UNPROVEN_ALLOCATION
    ids=["64GiB-defaults", "10MiB-small-parts"],
)
def test_a_slice_table_claiming_more_than_the_object_is_a_format_error_without_allocating(
    monkeypatch: pytest.MonkeyPatch, claim: int, options: dict[str, Any]
) -> None:
    inner = bw.MemoryStore()
    with bw.Producer(inner, "ns", mesh=ONE, producer_id="p") as producer:
        producer.append([b"hello"], offset=0)
    key, size = _forge_huge_slice(inner, "ns", claim)
    allocations = _Allocations(limit=1 << 20)
    monkeypatch.setattr(_reader, "bytearray", allocations, raising=False)
    monkeypatch.setattr(_reader, "_UNPROVEN_ALLOCATION", min(claim - 1, 1 << 30))
    store = _ObjectRanges(inner)
    consumer = bw.Consumer(store, "ns", mesh=ONE, dp_rank=0, cp_rank=0, timeout=5, **options)
    with consumer, pytest.raises(FormatError) as caught:
        next(consumer)
    message = str(caught.value)
    assert message.startswith(f"step 0 (TGB step 0), object {key!r}, slice 0: ")
    assert f"is smaller than its slice table says: the table places {claim} bytes" in message
    assert f"[0, {claim})" in message
    assert "returned 0 bytes" in message  # the last part lies past the object's end
    assert "restore it, or resume past this step" in message
    assert size < 1024  # the object is tiny ...
    assert allocations.sizes == []  # ... and nothing was allocated for the claim
    # The last part alone was read: not thousands of part reads for a forged claim.
    part = options.get("part_size", 16 << 20)
    assert store.ranges == [((claim - 1) // part * part, claim)]


@pytest.mark.parametrize("proven_first", [False, True])
def test_a_split_read_still_reads_each_part_once(
    monkeypatch: pytest.MonkeyPatch, proven_first: bool
) -> None:
    # Above _UNPROVEN_ALLOCATION the last part is read first; the parts and their count are
    # the same either way.
    if proven_first:
        monkeypatch.setattr(_reader, "_UNPROVEN_ALLOCATION", 4096)
    inner = bw.MemoryStore()
    size = 10_000
    with bw.Producer(inner, "ns", mesh=ONE, producer_id="p") as producer:
        producer.append([bytes(range(256)) * (size // 256) + b"x" * (size % 256)], offset=0)
    store = _ObjectRanges(inner)
    consumer = bw.Consumer(
        store, "ns", mesh=ONE, dp_rank=0, cp_rank=0, split_threshold=4096, part_size=4096
    )
    with consumer:
        step, data = next(consumer)
    assert (step, len(data)) == (0, size)
    assert data == bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    assert (store.ranges[0] == (8192, size)) is proven_first  # the last part first, or not
    assert sorted(store.ranges) == [(0, 4096), (4096, 8192), (8192, size)]


def test_a_claim_below_the_unproven_allocation_reads_its_parts_at_once_and_fails_short(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Up to 1 GiB (here lowered) the parts are read in parallel into the buffer as before; the
    # short ones are a FormatError too.
    inner = bw.MemoryStore()
    with bw.Producer(inner, "ns", mesh=ONE, producer_id="p") as producer:
        producer.append([b"hello"], offset=0)
    claim = 64 * 1024
    _forge_huge_slice(inner, "ns", claim)
    monkeypatch.setattr(_reader, "_UNPROVEN_ALLOCATION", claim)
    allocations = _Allocations(limit=claim)
    monkeypatch.setattr(_reader, "bytearray", allocations, raising=False)
    store = _ObjectRanges(inner)
    options: dict[str, Any] = {"split_threshold": 4096, "part_size": 4096}
    consumer = bw.Consumer(store, "ns", mesh=ONE, dp_rank=0, cp_rank=0, timeout=5, **options)
    with consumer, pytest.raises(FormatError, match=r"truncated|smaller"):
        next(consumer)
    assert allocations.sizes == [claim]  # allocated at once: no part was read ahead


# -- WeaveLoader.namespace_id and the checkpoint hook on every rank -------------------------------


def test_a_weave_loader_knows_its_namespace_id_without_a_request() -> None:
    pytest.importorskip("torch")
    from batchweave.torch import WeaveDataset, WeaveLoader

    inner = bw.MemoryStore()
    with bw.Producer(inner, "ns", mesh=ONE, producer_id="p") as producer:
        producer.append([b"a"], offset=0)
    store = bw.CountingStore(inner)
    loader = WeaveLoader(WeaveDataset(store, "ns", mesh=ONE, dp_rank=0, timeout=5))
    before = store.snapshot()
    assert loader.namespace_id is None  # nothing opened the namespace yet: Consumer's convention
    assert loader.dataset.namespace_id is None
    assert (store.snapshot() - before).requests == 0
    step, _ = next(iter(loader))
    assert step == 0
    expected = ManifestLog(inner, "ns").latest().namespace_id
    before = store.snapshot()
    assert loader.namespace_id == loader.dataset.namespace_id == expected
    assert (store.snapshot() - before).requests == 0
    loader.close()


def test_the_hook_refuses_another_namespaces_state_for_a_weave_loader_on_every_rank() -> None:
    # Before the fix rank 0 raised NamespaceMismatch and rank 1 returned None: WeaveLoader had no
    # namespace_id for the every-rank check to compare the state with.
    pytest.importorskip("torch")
    from batchweave.torch import WeaveDataset, WeaveLoader

    mesh = bw.Mesh(dp=2, cp=1)
    inner = bw.MemoryStore()
    for namespace in ("runs/a", "runs/other"):
        with bw.Producer(inner, namespace, mesh=mesh, producer_id="p") as producer:
            producer.append([b"0", b"1"], offset=0)
    with bw.Consumer(inner, "runs/other", mesh=mesh, dp_rank=0, cp_rank=0, timeout=5) as other:
        next(other)
        state = other.state_dict()
    store = bw.CountingStore(inner)
    marks = bw.Watermarks(store, "runs/a")
    for rank in (0, 1):
        loader = WeaveLoader(WeaveDataset(store, "runs/a", mesh=mesh, dp_rank=rank, timeout=5))
        step, _ = next(iter(loader))  # each rank delivered a step
        assert step == 0
        before = store.snapshot()
        with pytest.raises(NamespaceMismatch, match=r"state belongs to namespace 'runs/other'"):
            bw.checkpoint_hook(loader, marks, "step-1", state=state, rank=rank)
        if rank:
            assert (store.snapshot() - before).requests == 0  # no request off rank 0
        loader.close()
    assert marks.live() == []

"""Hostile and broken input that the per-module tests do not already cover.

Unit-level cases (corrupt, truncated, foreign and future-format manifests, segments, watermarks
and TGB objects; overlapping or out-of-bounds slices; ``..`` keys on ``file://``) live in
``test_manifest_codec.py``, ``test_manifest_segments.py``, ``test_watermarks.py``,
``test_format_tgb.py`` and ``test_store_file.py``; ``docs/guarantees.md`` lists which test covers
what. Here: hostile input met through the clients (producer, consumer, reclaimer, verify), sizes
chosen to make a naive reader allocate without bound, and credentials that are wrong.
"""

from __future__ import annotations

import json
import struct
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zstandard
from manifest_helpers import body, envelope

from batchweave import (
    AccessDenied,
    Consumer,
    CountingStore,
    FileStore,
    FormatError,
    InvalidKey,
    MemoryStore,
    Mesh,
    ObjectStore,
    Producer,
    ProducerError,
    Reclaimer,
    S3Store,
    UnsupportedFormatVersion,
    Watermarks,
    encode_tgb,
    read_footer,
    read_slice,
)
from batchweave._format._checksum import checksum
from batchweave._format._tgb_write import _pack_trailer
from batchweave._manifest._codec import encode_manifest
from batchweave._manifest._log import ManifestLog, manifest_key
from batchweave.cli._verify import verify_namespace
from batchweave.testing import S3Endpoint

KEY = "ns/data/p/0/00000000000000000000-00000000000000000000000000000000.tgb"
MESH = Mesh(dp=2)
NS = "runs/hostile"
ALLOCATION_BUDGET = 16 << 20
"""Peak traced allocation allowed while rejecting a hostile object (the lies claim terabytes)."""


def peak_allocation(fn: Callable[[], Any]) -> tuple[BaseException | None, int]:
    """Run ``fn``; return what it raised (or None) and the peak traced allocation in bytes."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    error: BaseException | None = None
    try:
        fn()
    except Exception as exc:
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, peak


def craft_object(payload: bytes, footer: dict[str, Any]) -> bytes:
    """A TGB object with an arbitrary footer and a correctly checksummed trailer."""
    raw = json.dumps(footer).encode()
    return payload + raw + _pack_trailer(raw, 1, "crc32c")


def footer_doc(data: bytes, footer_offset: int, footer_length: int) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(data[footer_offset : footer_offset + footer_length])
    return doc


# ---------------------------------------------------------------------------------------------
# TGB objects whose footers or frames lie about sizes: rejected, and nothing huge is allocated


def _lying_zstd_object() -> bytes:
    """A zstd slice whose frame header *and* footer both claim 1 TiB (the data holds 10 bytes)."""
    real = zstandard.ZstdCompressor(write_content_size=True).compress(b"x" * 10)
    assert real[4] == 0x20  # single-segment frame with a one-byte content size
    # Frame header descriptor 0xE0: single segment, eight-byte content size.
    lying = real[:4] + bytes([0xE0]) + struct.pack("<Q", 1 << 40) + real[6:]
    enc = encode_tgb([b"x" * 10], Mesh(dp=1), compression="zstd")
    doc = footer_doc(enc.data, enc.footer_offset, enc.footer_length)
    doc["payload_length"] = len(lying)
    doc["slices"][0].update(
        offset=0, length=len(lying), uncompressed_length=1 << 40, checksum=checksum(lying, "crc32c")
    )
    return craft_object(lying, doc)


def test_lying_zstd_frame_and_footer_allocate_nothing() -> None:
    store = MemoryStore()
    store.put(KEY, _lying_zstd_object())
    footer = read_footer(store, KEY)
    error, peak = peak_allocation(lambda: read_slice(store, KEY, footer, 0))
    assert isinstance(error, FormatError), error
    assert "slice (0, 0)" in str(error)
    assert peak < ALLOCATION_BUDGET


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("length", 1 << 62),
        ("offset", 1 << 62),
        ("uncompressed_length", 1 << 62),
        ("payload_length", 1 << 62),
    ],
)
def test_huge_footer_numbers_are_rejected_without_allocating(field: str, value: int) -> None:
    enc = encode_tgb([b"abc", b"defg"], MESH)
    doc = footer_doc(enc.data, enc.footer_offset, enc.footer_length)
    if field == "payload_length":
        doc[field] = value
    else:
        doc["slices"][1][field] = value
    store = MemoryStore()
    store.put(KEY, craft_object(enc.data[: enc.footer_offset], doc))

    def read_everything() -> None:
        footer = read_footer(store, KEY)
        for i in range(MESH.slices):
            read_slice(store, KEY, footer, i)

    error, peak = peak_allocation(read_everything)
    assert isinstance(error, FormatError), error
    assert KEY in str(error)
    assert peak < ALLOCATION_BUDGET


def test_manifest_claiming_a_huge_footer_is_refused_before_reading() -> None:
    enc = encode_tgb([b"abc", b"defg"], MESH)
    store = CountingStore(MemoryStore())
    store.put(KEY, enc.data)
    error, peak = peak_allocation(
        lambda: read_footer(store, KEY, footer_offset=enc.footer_offset, footer_length=1 << 40)
    )
    assert isinstance(error, FormatError), error
    assert peak < ALLOCATION_BUDGET
    assert store.snapshot().bytes_read <= enc.size


# ---------------------------------------------------------------------------------------------
# manifests from the future and corrupt manifests, met by the clients


def _future_manifest(store: ObjectStore, version: int) -> None:
    log = ManifestLog(store, NS)
    current = log.read(version - 1)
    doc = json.loads(body(encode_manifest(current)))
    doc.update(format=99, version=version, parent=version - 1, new_thing={"x": 1})
    store.put(log.key(manifest_key(version)), envelope(json.dumps(doc).encode()))


def _produce(store: ObjectStore, tgbs: int, pid: str = "p0") -> None:
    with Producer(store, NS, producer_id=pid, mesh=MESH, policy="naive") as p:
        for offset in range(p.resume_offset, p.resume_offset + tgbs):
            p.append([b"a" * 8, b"b" * 8], offset=offset)


def test_clients_refuse_a_manifest_from_a_newer_batchweave() -> None:
    store = MemoryStore()
    _produce(store, 2)
    latest = ManifestLog(store, NS).latest().version
    _future_manifest(store, latest + 1)
    consumer = Consumer(store, NS, mesh=MESH, dp_rank=0)
    with pytest.raises(UnsupportedFormatVersion, match="upgrade batchweave"):
        list(consumer)
    with pytest.raises(UnsupportedFormatVersion, match="format 99"):
        Producer(store, NS, producer_id="p1", mesh=MESH)
    with pytest.raises(UnsupportedFormatVersion):
        Reclaimer(store, NS).run_once()


def test_corrupt_latest_manifest_stops_the_consumer_with_a_named_error() -> None:
    store = MemoryStore()
    _produce(store, 2)
    log = ManifestLog(store, NS)
    latest = log.latest().version
    key = log.key(manifest_key(latest + 1))
    store.put(key, encode_manifest(log.read(latest))[:-7])  # truncated next version
    consumer = Consumer(store, NS, mesh=MESH, dp_rank=1, timeout=5)
    with pytest.raises(FormatError, match="truncated") as info:
        list(consumer)
    assert key in str(info.value)
    report = verify_namespace(store, NS)  # a finding (exit 1), not a failure to run
    assert not report.ok
    assert "truncated" in report.problems[0]
    assert key in report.problems[0]


# ---------------------------------------------------------------------------------------------
# a namespace that also holds another tool's objects


FOREIGN = {
    "README.md": b"# written by another tool\n",
    "data/othertool/blob.bin": b"\x00" * 100,
    "data/p0/0/not-a-tgb.txt": b"notes",
    "_segments/notes.txt": b"not a segment",
    "_manifests/backup.json": b"{}",
    "_manifests/00000000000000000000.manifest.bak": b"stale copy",
    "_watermarks/foreign.txt": b"watermark? no",
}


def test_another_tools_objects_are_ignored_and_never_deleted() -> None:
    store = MemoryStore()
    _produce(store, 3)
    for rel, data in FOREIGN.items():
        store.put(f"{NS}/{rel}", data)
    _produce(store, 2)
    consumer = Consumer(store, NS, mesh=MESH, dp_rank=0)
    assert [step for step, _ in (next(consumer) for _ in range(5))] == [0, 1, 2, 3, 4]
    assert verify_namespace(store, NS).ok
    Watermarks(store, NS).record("ckpt", 5)
    far_future = time.time() + 10 * 86400  # every orphan and old version is past its grace
    report = Reclaimer(store, NS, grace=600, clock=lambda: far_future).run_once()
    assert report.base_step_after == 5
    assert report.tgbs_deleted == 5
    for rel, data in FOREIGN.items():
        assert store.get(f"{NS}/{rel}") == data, f"{rel} was touched"


# ---------------------------------------------------------------------------------------------
# traversal attempts on file://


TRAVERSALS = ["..", "../escape", "a/../../escape", "/abs", "a\\..\\b", "a/./b", "a//b", "a\x00b"]


@pytest.mark.parametrize("name", TRAVERSALS)
def test_traversal_through_the_client_api_is_refused(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    store = FileStore(root)
    before = sorted(p.name for p in tmp_path.iterdir())
    attempts: list[Callable[[], object]] = [
        lambda: Producer(store, name, producer_id="p0", mesh=MESH),
        lambda: Producer(store, NS, producer_id=name, mesh=MESH),
        lambda: Consumer(store, name, mesh=MESH, dp_rank=0).open(wait=False),
        lambda: Watermarks(store, NS).record(name, 0),
        lambda: Reclaimer(store, name).run_once(),
    ]
    for attempt in attempts:
        with pytest.raises((InvalidKey, ValueError)):
            attempt()
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not any(p.is_file() for p in root.rglob("*"))


@pytest.mark.parametrize("name", ["%2e%2e", "..%2fescape", "\u2025", "..\u2215escape", "...."])
def test_lookalike_keys_stay_inside_the_root(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    store = FileStore(root)
    store.put(f"{name}/x", b"1")
    assert store.get(f"{name}/x") == b"1"
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written
    assert all(root in p.parents for p in written)


def test_a_namespace_directory_swapped_for_a_symlink_is_refused(tmp_path: Path) -> None:
    # Someone with write access inside the root moves the data directory out and leaves a
    # symlink: producers must not write through it, consumers must not read through it.
    root = tmp_path / "root"
    store = FileStore(root)
    _produce(store, 1)
    data = root / NS / "data"
    stolen = tmp_path / "stolen"
    data.rename(stolen)
    data.symlink_to(stolen, target_is_directory=True)
    before = sorted(p.relative_to(stolen) for p in stolen.rglob("*"))
    with pytest.raises(ProducerError, match="outside the root"):
        _produce(store, 1)
    with pytest.raises(InvalidKey, match="outside the root"):
        next(Consumer(store, NS, mesh=MESH, dp_rank=0))
    assert sorted(p.relative_to(stolen) for p in stolen.rglob("*")) == before


# ---------------------------------------------------------------------------------------------
# wrong credentials against a real server


@pytest.fixture
def wrong_secret(
    seaweedfs_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> Iterator[tuple[S3Store, S3Store, str]]:
    good = S3Store(s3_bucket, s3_prefix, **seaweedfs_endpoint.store_options())
    secret = "wrong-secret-Xq7zP3kL9"
    opts = seaweedfs_endpoint.store_options() | {"secret_access_key": secret, "max_attempts": 1}
    bad = S3Store(s3_bucket, s3_prefix, **opts)
    yield good, bad, secret
    good.close()
    bad.close()


@pytest.mark.seaweedfs
def test_wrong_secret_stops_clients_at_once_with_a_clear_error(
    wrong_secret: tuple[S3Store, S3Store, str],
) -> None:
    good, bad, secret = wrong_secret
    _produce(good, 1)
    started = time.monotonic()
    errors: list[AccessDenied] = []
    for attempt in (
        lambda: Producer(bad, NS, producer_id="p9", mesh=MESH),
        lambda: next(iter(Consumer(bad, NS, mesh=MESH, dp_rank=0))),
        lambda: Watermarks(bad, NS).record("c", 0),
        lambda: Reclaimer(bad, NS).run_once(),
    ):
        with pytest.raises(AccessDenied) as info:
            attempt()
        errors.append(info.value)
    # Denied is not an outage: nobody retries it for long.
    assert time.monotonic() - started < 30
    for err in errors:
        text = f"{err} {err!r}"
        assert secret not in text
        assert "check the credentials" in text
        assert good.url in text or "s3://" in text

"""Hardened manifest reading: bounded reads, strict JSON, and a history that never goes back.

Three gaps, each reproduced here against the store the way a damaged or rewritten namespace
presents it:

- a manifest version replaced by a huge object was downloaded whole before the size limit
  refused it (now one ranged GET of ``limit + 1`` bytes, on every backend);
- pydantic coerced persisted JSON (``"version": "3"``, ``"dp": true``, ``3.0`` for an integer,
  an infinite ``last_commit_at``) instead of refusing it;
- a client that had seen version ``v`` with ``next_step`` ``n`` silently accepted a newer
  version with fewer steps (or an earlier ``base_step``): a different step -> TGB mapping.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from fake_time import FakeTime
from manifest_helpers import descriptor, grow
from moto import mock_aws

from batchweave import (
    Consumer,
    CountingStore,
    FileStore,
    FormatError,
    MemoryStore,
    Mesh,
    NamespaceMismatch,
    ObjectStore,
    ObstoreS3Store,
    Producer,
    S3Store,
    UnsupportedFormatVersion,
)
from batchweave._manifest import (
    MANIFEST_FORMAT,
    MAX_MANIFEST_BYTES,
    Committed,
    Conflict,
    Manifest,
    ManifestLog,
    ProducerState,
    Segment,
    SegmentRef,
    SliceTable,
    TgbDescriptor,
    TgbObjectRef,
    _codec,
    decode_manifest,
    decode_segment,
    encode_manifest,
    encode_segment,
    manifest_key,
)
from batchweave.testing import S3Endpoint

MESH = Mesh(dp=2, cp=2)
NS = "runs/strict"


def _forge(log: ManifestLog, manifest: Manifest, **update: Any) -> Manifest:
    """Write ``manifest`` with ``update`` applied under its (new) version's key, as a tool that
    rewrites history would: same namespace id and mesh, valid bytes, plain overwrite."""
    forged = manifest.model_copy(update={"commit_id": "f" * 32, **update})
    log.store.put(log.key(manifest_key(forged.version)), encode_manifest(forged))
    return forged


# -- 1. bounded manifest reads ----------------------------------------------------------------


def test_an_oversized_manifest_version_is_refused_after_one_bounded_read() -> None:
    """Before: ``read`` did a whole-object GET, so a version replaced by a multi-GB blob was
    downloaded (and held in memory) in full before the 64 MiB limit refused it."""
    inner = MemoryStore()
    log = ManifestLog(inner, NS)
    head = grow(log, log.create_or_open(MESH), 2)
    key = log.key(manifest_key(head.version + 1))
    inner.put(key, b"\0" * (MAX_MANIFEST_BYTES + (1 << 20)))
    store = CountingStore(inner)
    with pytest.raises(FormatError) as err:
        ManifestLog(store, NS).latest(head)
    counts = store.snapshot()
    assert (counts.gets, counts.range_gets) == (0, 1), counts
    assert counts.range_bytes == MAX_MANIFEST_BYTES + 1, "more than limit + 1 bytes came back"
    message = str(err.value)
    assert key in message
    assert f"manifest version {head.version + 1}" in message
    assert f"{MAX_MANIFEST_BYTES} bytes" in message
    assert "restore it from a backup" in message.lower()  # says what to do


@pytest.fixture(
    params=[
        "memory",
        "file",
        "moto",
        pytest.param("obstore-moto-server", marks=pytest.mark.moto_server),
        pytest.param("seaweedfs", marks=pytest.mark.seaweedfs),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    """Every kind of store a manifest is read from; ranges past the end clamp on all of them."""
    kind = request.param
    if kind == "memory":
        yield MemoryStore()
    elif kind == "file":
        with FileStore(tmp_path / "root", fsync=False) as store:
            yield store
    elif kind == "moto":
        with mock_aws():
            boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="strict")
            with S3Store("strict", "p", region="us-east-1") as store:
                yield store
    else:
        prefix: str = request.getfixturevalue("s3_prefix")
        bucket: str = request.getfixturevalue("s3_bucket")
        if kind == "seaweedfs":
            endpoint: S3Endpoint = request.getfixturevalue("seaweedfs_endpoint")
            with S3Store(bucket, prefix, **endpoint.store_options()) as store:
                yield store
        else:
            endpoint = request.getfixturevalue("moto_endpoint")
            with ObstoreS3Store(bucket, prefix, **endpoint.store_options()) as store:
                yield store


def test_each_manifest_read_is_one_bounded_range_read_on_every_backend(
    backend: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = 8192  # lowered so that every backend refuses an oversized version cheaply
    monkeypatch.setattr(_codec, "MAX_MANIFEST_BYTES", limit)
    log = ManifestLog(backend, NS)
    m0 = log.create_or_open(MESH)
    head = grow(log, m0, 3)
    store = CountingStore(backend)
    reader = ManifestLog(store, NS)

    # A version smaller than the limit comes back whole from one ranged read.
    assert reader.read(head.version) == head
    counts = store.snapshot()
    assert (counts.requests, counts.range_gets) == (1, 1), counts
    assert counts.range_bytes == len(encode_manifest(head))

    # The steady-state probe for a newer version (absent) stays one request.
    store.reset()
    assert reader.latest(head) == head
    counts = store.snapshot()
    assert (counts.requests, counts.range_gets) == (1, 1), counts

    # Behind: one probe, one LIST, one read of the newest.
    store.reset()
    assert reader.latest(m0) == head
    counts = store.snapshot()
    assert (counts.range_gets, counts.lists, counts.gets) == (2, 1, 0), counts

    # An oversized version: one request, limit + 1 bytes, a FormatError naming the limit.
    key = log.key(manifest_key(head.version + 1))
    backend.put(key, b"x" * (4 * limit))
    store.reset()
    with pytest.raises(FormatError, match=rf"version {head.version + 1} .*{limit} bytes"):
        reader.latest(head)
    counts = store.snapshot()
    assert (counts.requests, counts.range_gets) == (1, 1), counts
    assert counts.range_bytes == limit + 1


# -- 2. strict parsing of persisted JSON --------------------------------------------------------

KEY = "runs/x/_manifests/00000000000000000007.manifest"
SEG_KEY = "runs/x/_segments/00000000000000000000-abc.seg"


def _table(count: int = 4) -> SliceTable:
    return SliceTable(
        codec="raw",
        checksum_algo="crc32c",
        lengths=(25,) * count,
        checksums=tuple(range(count)),
        sample_counts=(2,) * count,
    )


def _descriptor(offset: int) -> TgbDescriptor:
    return TgbDescriptor(
        producer_id="p",
        epoch=1,
        offset=offset,
        objects=(
            TgbObjectRef(
                key=f"data/p/1/{offset:020d}.tgb",
                size=200,
                slice_count=4,
                footer_offset=100,
                footer_length=80,
                footer_checksum=7,
                slices=_table(),
            ),
        ),
        bytes=200,
        samples=8,
    )


def _manifest() -> Manifest:
    return Manifest(
        namespace_id="n" * 32,
        mesh=MESH,
        version=7,
        parent=6,
        commit_id="c" * 32,
        created_at=1.7e9,
        segments=(SegmentRef(key="_segments/a.seg", first_step=0, count=2, bytes=9, checksum=5),),
        tail=(_descriptor(2),),
        tail_start=2,
        producers={"p": ProducerState(epoch=1, offset=2, last_version=7, last_commit_at=1.7e9)},
    )


def _envelope(body: dict[str, Any], magic: str = "batchweave-manifest") -> bytes:
    raw = json.dumps(body).encode()  # Python's json writes NaN and Infinity as bare tokens
    return f"{magic} crc32c={_codec.body_checksum(raw):08x} length={len(raw)}\n".encode() + raw


def _body(data: bytes) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(data.split(b"\n", 1)[1])
    return body


def _set(path: str, value: object) -> Callable[[dict[str, Any]], None]:
    def apply(body: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = body
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(last) if isinstance(node, list) else last] = value

    return apply


COERCED = {
    "version as a string": ("version", "7"),
    "version as a float": ("version", 7.0),
    "parent as a bool": ("parent", True),
    "mesh dp as a bool": ("mesh.dp", True),
    "mesh cp as a float": ("mesh.cp", 2.0),
    "base_step as a string": ("base_step", "0"),
    "tail_start as a float": ("tail_start", 2.0),
    "sealed as an int": ("sealed", 0),
    "an infinite last_commit_at": ("producers.p.last_commit_at", math.inf),
    "a NaN last_commit_at": ("producers.p.last_commit_at", math.nan),
    "an infinite created_at": ("created_at", -math.inf),
    "an epoch as a string": ("producers.p.epoch", "1"),
    "a descriptor offset as a float": ("tail.0.offset", 2.0),
    "an object size as a string": ("tail.0.objects.0.size", "200"),
    "a slice length list of floats": ("tail.0.objects.0.slices.lengths", [25.0] * 4),
    "a segment checksum as a bool": ("segments.0.checksum", True),
}


@pytest.mark.parametrize(("path", "value"), list(COERCED.values()), ids=list(COERCED))
def test_coercible_manifest_json_is_a_format_error_naming_key_and_field(
    path: str, value: object
) -> None:
    """Before: pydantic's lax mode turned each of these into a valid-looking manifest."""
    body = _body(encode_manifest(_manifest()))
    _set(path, value)(body)
    with pytest.raises(FormatError) as err:
        decode_manifest(_envelope(body), key=KEY)
    message = str(err.value)
    assert KEY in message
    assert "invalid manifest" in message
    assert path in message, message


def test_an_overflowing_float_literal_is_refused() -> None:
    raw = encode_manifest(_manifest()).split(b"\n", 1)[1]
    raw = raw.replace(b'"created_at":1700000000.0', b'"created_at":1e999')
    data = f"batchweave-manifest crc32c={_codec.body_checksum(raw):08x} length={len(raw)}\n"
    with pytest.raises(FormatError, match="created_at"):
        decode_manifest(data.encode() + raw, key=KEY)


@pytest.mark.parametrize(
    ("path", "value"),
    [("first_step", "0"), ("tgbs.0.epoch", True), ("tgbs.0.objects.0.footer_length", 80.0)],
)
def test_coercible_segment_json_is_a_format_error_naming_key_and_field(
    path: str, value: object
) -> None:
    segment = Segment(namespace_id="n" * 32, first_step=0, tgbs=(_descriptor(0), _descriptor(1)))
    body = _body(encode_segment(segment))
    _set(path, value)(body)
    with pytest.raises(FormatError) as err:
        decode_segment(_envelope(body, "batchweave-segment"), key=SEG_KEY)
    assert SEG_KEY in str(err.value)
    assert path in str(err.value)


def test_a_coerced_version_in_the_store_is_refused_by_the_log() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 2)
    key = log.key(manifest_key(head.version))
    body = _body(store.get(key))
    body["version"] = str(body["version"])
    store.put(key, _envelope(body))
    with pytest.raises(FormatError, match=rf"{key}: invalid manifest: version"):
        ManifestLog(store, NS).read(head.version)


def test_what_the_writer_produces_still_decodes_strictly() -> None:
    """Every value our encoder writes (compact slice tables included) passes strict mode."""
    manifest = _manifest()
    assert decode_manifest(encode_manifest(manifest), key=KEY + ".rt") == manifest
    segment = Segment(namespace_id="n" * 32, first_step=0, tgbs=(_descriptor(0),))
    assert decode_segment(encode_segment(segment), key=SEG_KEY + ".rt")[0] == segment


def test_format_2_per_slice_lists_still_decode_strictly() -> None:
    body = _body(encode_manifest(_manifest()))
    body["format"] = 2
    table = body["tail"][0]["objects"][0]["slices"]
    count = table.pop("count")
    table["lengths"] = [table["lengths"]] * count
    table["sample_counts"] = [table["sample_counts"]] * count
    table["checksums"] = list(range(count))
    decoded = decode_manifest(_envelope(body), key=KEY + ".f2")
    assert decoded.format == 2
    assert decoded.tail[0].objects[0].slices == _table()


@pytest.mark.parametrize("extra", [{}, {"a_field_of_the_future": 1}])
def test_a_future_format_keeps_its_upgrade_message(extra: dict[str, Any]) -> None:
    body = {**_body(encode_manifest(_manifest())), "format": MANIFEST_FORMAT + 1, **extra}
    with pytest.raises(UnsupportedFormatVersion, match="upgrade batchweave") as err:
        decode_manifest(_envelope(body), key=KEY)
    assert KEY in str(err.value)


def test_a_writer_cannot_persist_a_non_finite_time() -> None:
    """pydantic writes inf/NaN as ``null``: such a manifest would be unreadable by anyone."""
    with pytest.raises(ValueError, match="last_commit_at"):
        ProducerState(epoch=0, last_version=0, last_commit_at=math.inf)
    with pytest.raises(ValueError, match="created_at"):
        Manifest(namespace_id="n", mesh=MESH, version=0, commit_id="c", created_at=math.nan)


# -- 3. the history a client has seen never goes back -----------------------------------------


def test_a_newer_version_with_fewer_steps_is_refused_naming_both_versions() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 5)
    old = log.read(2)
    _forge(log, old, version=head.version + 1, parent=head.version)
    with pytest.raises(FormatError) as err:
        log.latest(head)
    message = str(err.value)
    assert f"version {head.version + 1}" in message
    assert f"version {head.version}" in message
    assert f"next_step {old.next_step}" in message
    assert f"next_step {head.next_step}" in message
    assert "rewritten" in message
    assert "backup" in message


def test_a_base_step_that_moves_back_is_refused() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 4)
    result = log.commit(head, base_step=3)
    assert isinstance(result, Committed)
    cut = result.manifest
    before_cut = head.model_copy(update={"producers": cut.producers})
    reader = ManifestLog(store, NS)
    assert reader.latest() == cut
    _forge(log, before_cut, version=cut.version + 1, parent=cut.version)
    with pytest.raises(FormatError, match=r"base_step 0.*base_step 3|base_step 3.*base_step 0"):
        reader.latest(cut)


def test_a_fresh_client_sees_the_same_check_once_it_has_read_a_version() -> None:
    """The check lives where every manifest enters a client: reading versions in order works."""
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 3)
    _forge(log, log.read(1), version=head.version + 1, parent=head.version)
    reader = ManifestLog(store, NS)
    for version in range(head.version + 1):
        reader.read(version)
    with pytest.raises(FormatError, match="rewritten"):
        reader.read(head.version + 1)


def test_reading_older_versions_after_newer_ones_is_fine() -> None:
    """Tools (the reclaimer's bisection, verify) read old versions after the latest."""
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 4)
    reader = ManifestLog(store, NS)
    assert reader.latest() == head
    assert [reader.read(v).next_step for v in range(head.version + 1)] == list(range(5))
    assert reader.latest(head) == head


def test_a_version_rewritten_in_place_is_refused() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 3)
    reader = ManifestLog(store, NS)
    assert reader.latest() == head
    _forge(log, head)  # same version number, another commit
    with pytest.raises(FormatError, match=rf"version {head.version}.*rewritten"):
        reader.latest()


def test_a_lost_race_against_a_rewritten_history_is_refused_not_adopted() -> None:
    """The producer's rebase path: a 412 on ``v + 1`` reads the winner back and adopts it."""
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 4)
    _forge(log, log.read(1), version=head.version + 1, parent=head.version)
    with pytest.raises(FormatError, match=rf"version {head.version + 1}.*rewritten"):
        log.commit(head, append=[descriptor("p", 99)])


def test_an_honest_lost_race_is_still_a_conflict() -> None:
    store = MemoryStore()
    a, b = ManifestLog(store, NS), ManifestLog(store, NS)
    head = grow(a, a.create_or_open(MESH), 2)
    assert isinstance(b.commit(head, append=[descriptor("q", 0)]), Committed)
    result = a.commit(head, append=[descriptor("p", 99)])
    assert isinstance(result, Conflict)
    assert result.winner is not None
    assert result.winner.next_step == head.next_step + 1


def test_a_newer_version_of_another_namespace_or_mesh_is_refused() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 2)
    _forge(log, head, version=head.version + 1, parent=head.version, namespace_id="o" * 32)
    with pytest.raises(NamespaceMismatch, match="namespace id"):
        log.latest(head)
    store.delete_many([log.key(manifest_key(head.version + 1))])
    _forge(log, head, version=head.version + 1, parent=head.version, mesh=Mesh(dp=4, cp=1))
    with pytest.raises(NamespaceMismatch, match="mesh"):
        log.latest(head)


def test_a_consumer_refuses_a_rewritten_history_instead_of_serving_other_steps() -> None:
    """Before: the consumer adopted the shorter version and waited (then timed out) for steps
    it had already delivered from the old mapping."""
    store = MemoryStore()
    mesh = Mesh(dp=2)
    with Producer(store, NS, producer_id="p", mesh=mesh, policy="naive") as p:
        for offset in range(3):
            p.append([b"a%d" % offset, b"b%d" % offset], offset=offset)
    fake = FakeTime()
    c = Consumer(
        store,
        NS,
        mesh=mesh,
        dp_rank=1,
        timeout=60.0,
        prefetch=0,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    assert [next(c)[0] for _ in range(3)] == [0, 1, 2]
    log = ManifestLog(store, NS)
    head = log.latest()
    _forge(log, log.read(1), version=head.version + 1, parent=head.version)
    with pytest.raises(FormatError, match="rewritten"):
        next(c)
    c.close()


def test_a_producer_refuses_to_rebase_on_a_rewritten_history() -> None:
    store = MemoryStore()
    mesh = Mesh(dp=2)
    p = Producer(store, NS, producer_id="p", mesh=mesh, policy="naive")
    try:
        for offset in range(3):
            p.append([b"a", b"b"], offset=offset)
        p.flush()
        log = ManifestLog(store, NS)
        head = log.latest()
        _forge(log, log.read(1), version=head.version + 1, parent=head.version)
        p.append([b"a", b"b"], offset=3)  # committed by the background thread
        with pytest.raises(FormatError, match="rewritten"):
            p.flush()
    finally:
        with pytest.raises(FormatError):
            p.close()

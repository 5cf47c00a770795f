"""Hardened manifest reading: bounded reads, strict JSON, and a history that never goes back.

Each gap is reproduced against the store the way a damaged or rewritten namespace presents it:

- a manifest version replaced by a huge object must not be downloaded whole before the size
  limit refuses it: one ranged GET of ``limit + 1`` bytes, on every backend, and on an S3 server
  that ignores the Range header (200, whole body, no Content-Range) ``S3Store.get_range`` reads
  only as far as the bounded range needs;
- persisted JSON is not coerced (``"version": "3"``, ``"dp": true``, ``3.0`` for an integer, an
  infinite ``last_commit_at``) but refused, while what older BatchWeave versions wrote (format-1
  and format-2 manifests and segments, written by those producers themselves, not derived from
  today's encoder) still decodes strictly;
- a client that has seen version ``v`` with ``next_step`` ``n`` refuses a newer version with
  fewer steps (or an earlier ``base_step``): a different step -> TGB mapping. Legitimate
  histories never trip that check: one log shared by committing threads, a reclaimer raising
  ``base_step``, a retire and readers walking old versions.
"""

from __future__ import annotations

import functools
import io
import json
import math
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.response import StreamingBody
from botocore.stub import Stubber
from fake_time import FakeTime
from manifest_helpers import KEY, SEG_KEY, body, descriptor, envelope, grow
from moto import mock_aws

from batchweave import (
    Bounded,
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
from batchweave._manifest._log import CommitResult, commit_until
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
    # Python's json writes NaN and Infinity as bare tokens
    return envelope(json.dumps(body).encode(), magic)


def _body(data: bytes) -> dict[str, Any]:
    """The parsed JSON body of a manifest or segment object (the inverse of ``_envelope``)."""
    doc: dict[str, Any] = json.loads(body(data))
    return doc


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
    raw = body(encode_manifest(_manifest()))
    raw = raw.replace(b'"created_at":1700000000.0', b'"created_at":1e999')
    with pytest.raises(FormatError, match="created_at"):
        decode_manifest(envelope(raw), key=KEY)


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


def test_the_newest_versions_gone_is_refused_not_followed_back() -> None:
    """Before: ``latest()`` returned version 3 to a client that had seen version 5, and a
    commit on it reassigned steps 3 and 4 (an older backup restored, or versions deleted)."""
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 5)
    store.delete_many([log.key(manifest_key(v)) for v in (4, 5)])
    with pytest.raises(FormatError) as err:
        log.latest()
    message = str(err.value)
    assert "version 5, the newest this client saw (steps 0..4), is gone" in message
    assert "newest version left is 3 (steps 0..2)" in message
    assert "restored" in message
    assert "backup" in message
    # A commit on the vanished version finds its parent gone; the lookup after it refuses too.
    assert log.commit(head, append=[descriptor("p", 5)]) == Conflict(None)
    with pytest.raises(FormatError, match="is gone"):
        log.latest(head)
    with pytest.raises(FormatError, match="is gone"):
        log.latest_from(log.read(2))
    assert list(log.versions()) == [0, 1, 2, 3]  # nothing was written


def test_a_history_rewritten_from_an_older_copy_and_grown_past_is_refused() -> None:
    """Before: a reader that had served step 3 of version 5 followed a history restored to
    version 3 and grown to version 6 by a restarted producer, where step 3 is another TGB."""
    store = MemoryStore()
    log = ManifestLog(store, NS)
    grow(log, log.create_or_open(MESH), 5)
    reader = ManifestLog(store, NS)
    seen = reader.latest()
    assert seen.version == 5
    store.delete_many([log.key(manifest_key(v)) for v in (4, 5)])
    restarted = ManifestLog(store, NS)
    base = restarted.latest()
    for offset in (100, 101, 102):
        result = restarted.commit(base, append=[descriptor("q", offset)])
        assert isinstance(result, Committed)
        base = result.manifest
    assert base.version == 6
    with pytest.raises(FormatError, match=r"step 4 is the TGB of producer 'q' offset 101") as err:
        reader.latest(seen)
    assert "producer 'p' offset 4" in str(err.value)
    assert "rewritten" in str(err.value)
    with pytest.raises(FormatError, match="step 4"):
        reader.latest()


def test_a_version_recreated_over_a_gap_is_refused_at_the_next_lookup() -> None:
    """Version 7 deleted while 8 exists: a writer whose young base is 6 probes 7, finds it
    missing and re-creates it (its commit looks successful, but no newest version holds its
    TGB). Not prevented (that would cost a request per commit), but its next lookup reads
    version 8, where the step it committed is another TGB: a FormatError instead of going on
    as if its TGB were committed."""
    store = MemoryStore()
    a, b = ManifestLog(store, NS), ManifestLog(store, NS)
    head = grow(a, a.create_or_open(MESH), 6)
    b_base = b.latest()
    head = grow(a, head, 2)
    store.delete_many([a.key(manifest_key(7))])
    result = b.commit(b.latest(b_base), append=[descriptor("b", 0)])
    assert isinstance(result, Committed)
    assert result.manifest.version == 7
    with pytest.raises(FormatError, match=r"step 6 is the TGB of producer 'p'.*version 8"):
        b.latest(result.manifest)


def test_a_lagging_listing_that_hides_the_newest_version_seen_is_not_history_going_back() -> None:
    """A LIST behind the writes (SeaweedFS) may not show the version this client committed;
    reading that version directly tells a lagging listing from a vanished version."""
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 3)
    newest_key = log.key(manifest_key(head.version))

    class Lagging(CountingStore):
        def list(self, prefix: str = "", *, start_after: str | None = None):  # type: ignore[no-untyped-def]
            return (m for m in super().list(prefix, start_after=start_after) if m.key != newest_key)

    lagging = ManifestLog(Lagging(store), NS)
    assert lagging.read(head.version) == head
    assert lagging.latest() == head
    assert lagging.latest_from(lagging.read(1)) == head


def test_a_producer_whose_newest_version_vanished_stops_with_the_error() -> None:
    """Its flush and close raise the FormatError (before: the commit loop retried about 150
    times a second, flush timed out and close never returned)."""
    store = MemoryStore()
    p = Producer(store, NS, producer_id="p", mesh=Mesh(dp=1), policy="naive")
    try:
        for offset in range(3):
            p.append([b"x"], offset=offset)
            p.flush(timeout=30)
        log = ManifestLog(store, NS)
        store.delete_many([log.key(manifest_key(max(log.versions())))])
        p.append([b"y"], offset=3)
        with pytest.raises(FormatError, match="is gone"):
            p.flush(timeout=30)
        assert p.stats().attempts < 20
    finally:
        with pytest.raises(FormatError, match="is gone"):
            p.close()


# -- legitimate histories are never refused ----------------------------------------------------


def test_one_log_shared_by_committers_a_reclaimer_a_retire_and_readers_refuses_nothing() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS, tail_limit=4)
    log.create_or_open(MESH)
    errors: list[BaseException] = []
    done = threading.Event()
    per_producer = 15

    def guarded(fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return run

    def produce(pid: str) -> None:
        for offset in range(per_producer):

            def attempt(m: Manifest, offset: int = offset) -> CommitResult | None:
                state = m.producers.get(pid)
                if state is not None and state.offset is not None and state.offset >= offset:
                    return None
                return log.commit(m, append=[descriptor(pid, offset)])

            commit_until(log, log.latest(), attempt, what=pid, attempts=500, sleep=lambda _: None)

    def reclaim() -> None:
        while not done.is_set():
            latest = log.latest()
            target = latest.next_step // 2

            def cut(m: Manifest, target: int = target) -> CommitResult | None:
                if target <= m.base_step:
                    return None
                return log.commit(m, base_step=target)

            commit_until(log, latest, cut, what="cut", attempts=500, sleep=lambda _: None)

    def retire() -> None:
        while not done.is_set():

            def drop(m: Manifest) -> CommitResult | None:
                if "gone" not in m.producers:  # an idle id, retired again and again
                    return log.commit(m, producers={"gone": ProducerState(epoch=0, last_version=0)})
                return log.commit(m, retire=["gone"])

            commit_until(log, log.latest(), drop, what="retire", attempts=500, sleep=lambda _: None)

    def read() -> None:
        rng = random.Random(7)
        known = log.latest()
        while not done.is_set():
            known = log.latest(known)
            versions = list(log.versions())
            for version in rng.sample(versions, min(3, len(versions))):
                log.read(version)  # older versions, as verify and the reclaimer read them

    workers = [
        threading.Thread(target=guarded(functools.partial(produce, p))) for p in ("p0", "p1")
    ]
    others = [threading.Thread(target=guarded(f)) for f in (reclaim, retire, read, read)]
    for t in workers + others:
        t.start()
    for t in workers:
        t.join(60)
    done.set()
    for t in others:
        t.join(60)
    assert not errors, errors
    final = ManifestLog(store, NS).latest()
    assert final.next_step == 2 * per_producer
    assert final.base_step > 0


# -- bounded reads on a server that ignores Range ----------------------------------------------


class _CountingBody(io.BytesIO):
    """A response body that counts the bytes the client took from it."""

    taken = 0

    def read(self, size: int | None = -1) -> bytes:
        data = super().read(size)
        self.taken += len(data)
        return data


def _ignores_range(data: bytes) -> tuple[S3Store, Stubber, _CountingBody]:
    client = boto3.client(
        "s3",
        region_name="us-east-1",
        endpoint_url="http://127.0.0.1:9",  # never reached: the Stubber answers
        aws_access_key_id="AKIAEXAMPLEACCESSKEY",
        aws_secret_access_key="example-secret",
        config=Config(retries={"total_max_attempts": 1}),
    )
    store = S3Store("bucket", "pre", client=client)
    stubber = Stubber(client)
    raw = _CountingBody(data)
    # What a server that ignores Range sends: 200, the whole object, no Content-Range.
    stubber.add_response("get_object", {"Body": StreamingBody(raw, len(data))})
    stubber.activate()
    return store, stubber, raw


def test_a_bounded_range_on_a_server_ignoring_range_reads_only_what_it_needs() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    store, stubber, raw = _ignores_range(data)
    assert store.get_range("k", Bounded(10, 1000)) == data[10:1000]
    stubber.assert_no_pending_responses()
    assert raw.taken <= 1000


def test_an_oversized_manifest_is_refused_without_reading_it_whole_on_such_a_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limit = 4096
    monkeypatch.setattr(_codec, "MAX_MANIFEST_BYTES", limit)
    store, stubber, raw = _ignores_range(b"x" * (256 * limit))
    log = ManifestLog(store, NS)
    key = f"{NS}/{manifest_key(7)}"
    with pytest.raises(FormatError, match=rf"{key}: manifest version 7 is larger than {limit}"):
        log.read(7)
    stubber.assert_no_pending_responses()
    assert raw.taken == limit + 1


# -- what older writers produced still decodes strictly ----------------------------------------


_OLD_OBJECTS: dict[str, bytes] = {
    "format1/_manifests/00000000000000000002.manifest": (
        b'batchweave-manifest crc32c=48d81133 length=603\n{"format":1,"namespace_id":"a3618c193'
        b'49c42b5b077c1264a78b8d6","mesh":{"dp":2,"cp":1},"version":2,"parent":1,"commit_id":"'
        b'80c93b9f60ad4e2bb83c41ff66b67c21","created_at":1700000000.5,"base_step":0,"segments"'
        b':[],"tail":[{"producer_id":"p0","epoch":0,"offset":0,"objects":[{"key":"data/p0/0/00'
        b'000000000000000000-4f63efcaae0c41f8a2403eee7aa27103.tgb","size":357,"first_slice":0,'
        b'"slice_count":2,"footer_offset":6,"footer_length":319,"footer_checksum":3150552277}]'
        b',"bytes":357,"samples":2}],"tail_start":0,"producers":{"p0":{"epoch":0,"offset":0,"l'
        b'ast_version":2,"last_commit_at":1700000000.5}},"sealed":false}'
    ),
    "format1/_manifests/00000000000000000003.manifest": (
        b'batchweave-manifest crc32c=9d16b6b6 length=473\n{"format":1,"namespace_id":"a3618c193'
        b'49c42b5b077c1264a78b8d6","mesh":{"dp":2,"cp":1},"version":3,"parent":2,"commit_id":"'
        b'6d019ecd2fd84dbfab6edfefcf417f82","created_at":1700000000.5,"base_step":0,"segments"'
        b':[{"key":"_segments/00000000000000000000-7abf055a0ff14140a620837d7c63fc92.seg","firs'
        b't_step":0,"count":3,"bytes":930,"checksum":264907951}],"tail":[],"tail_start":3,"pro'
        b'ducers":{"p0":{"epoch":0,"offset":2,"last_version":3,"last_commit_at":1700000000.5}}'
        b',"sealed":false}'
    ),
    "format1/_segments/00000000000000000000-7abf055a0ff14140a620837d7c63fc92.seg": (
        b'batchweave-segment crc32c=0fca2caf length=884\n{"format":1,"namespace_id":"a3618c1934'
        b'9c42b5b077c1264a78b8d6","first_step":0,"tgbs":[{"producer_id":"p0","epoch":0,"offset'
        b'":0,"objects":[{"key":"data/p0/0/00000000000000000000-4f63efcaae0c41f8a2403eee7aa271'
        b'03.tgb","size":357,"first_slice":0,"slice_count":2,"footer_offset":6,"footer_length"'
        b':319,"footer_checksum":3150552277}],"bytes":357,"samples":2},{"producer_id":"p0","ep'
        b'och":0,"offset":1,"objects":[{"key":"data/p0/0/00000000000000000001-92470f960e2c4eef'
        b'bfd97d296a36cb18.tgb","size":357,"first_slice":0,"slice_count":2,"footer_offset":6,"'
        b'footer_length":319,"footer_checksum":3150552277}],"bytes":357,"samples":2},{"produce'
        b'r_id":"p0","epoch":0,"offset":2,"objects":[{"key":"data/p0/0/00000000000000000002-ae'
        b'bdff0334d2496e97b921a42eb49218.tgb","size":357,"first_slice":0,"slice_count":2,"foot'
        b'er_offset":6,"footer_length":319,"footer_checksum":3150552277}],"bytes":357,"samples'
        b'":2}]}'
    ),
    "format2/_manifests/00000000000000000002.manifest": (
        b'batchweave-manifest crc32c=5b406e31 length=774\n{"format":2,"namespace_id":"be374fdc0'
        b'6b74b169977794a4ccbcb97","mesh":{"dp":2,"cp":1},"version":2,"parent":1,"commit_id":"'
        b'845bbff108a9468ea0c4848cc19dc7dd","created_at":1700000000.5,"base_step":0,"segments"'
        b':[],"tail":[{"producer_id":"p0","epoch":0,"offset":0,"objects":[{"key":"data/p0/0/00'
        b'000000000000000000-ec540a58837346f087869417902a71fb.tgb","size":357,"first_slice":0,'
        b'"slice_count":2,"footer_offset":6,"footer_length":319,"footer_checksum":3150552277,"'
        b'slices":{"codec":"raw","compression":null,"checksum_algo":"crc32c","lengths":[4,2],"'
        b'checksums":[2462583345,1806884853],"uncompressed_lengths":null,"sample_counts":[1,1]'
        b'}}],"bytes":357,"samples":2}],"tail_start":0,"producers":{"p0":{"epoch":0,"offset":0'
        b',"last_version":2,"last_commit_at":1700000000.5}},"sealed":false}'
    ),
    "format2/_manifests/00000000000000000003.manifest": (
        b'batchweave-manifest crc32c=b9609ece length=475\n{"format":2,"namespace_id":"be374fdc0'
        b'6b74b169977794a4ccbcb97","mesh":{"dp":2,"cp":1},"version":3,"parent":2,"commit_id":"'
        b'e32dcdd98b1b4e379804dc5c1fad1b11","created_at":1700000000.5,"base_step":0,"segments"'
        b':[{"key":"_segments/00000000000000000000-3fbf36784ae64c539c922718cbc3260e.seg","firs'
        b't_step":0,"count":3,"bytes":1444,"checksum":3036904331}],"tail":[],"tail_start":3,"p'
        b'roducers":{"p0":{"epoch":0,"offset":2,"last_version":3,"last_commit_at":1700000000.5'
        b'}},"sealed":false}'
    ),
    "format2/_segments/00000000000000000000-3fbf36784ae64c539c922718cbc3260e.seg": (
        b'batchweave-segment crc32c=b5037b8b length=1397\n{"format":2,"namespace_id":"be374fdc0'
        b'6b74b169977794a4ccbcb97","first_step":0,"tgbs":[{"producer_id":"p0","epoch":0,"offse'
        b't":0,"objects":[{"key":"data/p0/0/00000000000000000000-ec540a58837346f087869417902a7'
        b'1fb.tgb","size":357,"first_slice":0,"slice_count":2,"footer_offset":6,"footer_length'
        b'":319,"footer_checksum":3150552277,"slices":{"codec":"raw","compression":null,"check'
        b'sum_algo":"crc32c","lengths":[4,2],"checksums":[2462583345,1806884853],"uncompressed'
        b'_lengths":null,"sample_counts":[1,1]}}],"bytes":357,"samples":2},{"producer_id":"p0"'
        b',"epoch":0,"offset":1,"objects":[{"key":"data/p0/0/00000000000000000001-4d40524f5720'
        b'4b0db6cdf3ff5b62f587.tgb","size":357,"first_slice":0,"slice_count":2,"footer_offset"'
        b':6,"footer_length":319,"footer_checksum":3150552277,"slices":{"codec":"raw","compres'
        b'sion":null,"checksum_algo":"crc32c","lengths":[4,2],"checksums":[2462583345,18068848'
        b'53],"uncompressed_lengths":null,"sample_counts":[1,1]}}],"bytes":357,"samples":2},{"'
        b'producer_id":"p0","epoch":0,"offset":2,"objects":[{"key":"data/p0/0/0000000000000000'
        b'0002-4e2f0a3ebb8744098a585baae36723fc.tgb","size":357,"first_slice":0,"slice_count":'
        b'2,"footer_offset":6,"footer_length":319,"footer_checksum":3150552277,"slices":{"code'
        b'c":"raw","compression":null,"checksum_algo":"crc32c","lengths":[4,2],"checksums":[24'
        b'62583345,1806884853],"uncompressed_lengths":null,"sample_counts":[1,1]}}],"bytes":35'
        b'7,"samples":2}]}'
    ),
}


@pytest.mark.parametrize("name", sorted(_OLD_OBJECTS))
def test_objects_written_by_older_batchweave_versions_decode_strictly(name: str) -> None:
    data = _OLD_OBJECTS[name]
    key = f"{NS}/{name.split('/', 1)[1]}"
    if name.endswith(".manifest"):
        manifest = decode_manifest(data, key=key)
        assert manifest.format == int(name[len("format")])
        assert manifest.mesh == Mesh(dp=2)
        assert manifest.created_at == 1700000000.5
    else:
        segment, _ = decode_segment(data, key=key)
        assert segment.format == int(name[len("format")])
        assert [d.offset for d in segment.tgbs] == [0, 1, 2]

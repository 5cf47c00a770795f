"""Session 10 review: regressions the day's manifest, lifecycle and projection changes could bring.

- ``ManifestLog._observe`` noted a client's first namespace id and mesh with two separate
  stores outside any lock: a thread whose first read landed between them saw the id but a mesh
  of ``None``, and refused a healthy namespace as ``NamespaceMismatch`` ("mesh (None)").
- Legitimate histories must never trip the "history never goes back" check: one log shared by
  committing threads, a reclaimer raising ``base_step``, a retire and readers walking old
  versions.
- ``ManifestLog.read`` asks for ``MAX_MANIFEST_BYTES + 1`` bytes so that an oversized object is
  never downloaded whole, but ``S3Store.get_range`` read a server's whole body before noticing
  that the server had ignored the Range header (no Content-Range): on such a server the bound
  did not hold. It now reads only as far as a bounded range needs.
- Strict parsing must keep reading what older BatchWeave versions wrote: the manifests and the
  segment below were written by the format-1 (commit 8909981^) and format-2 (836b441^)
  producers themselves, not derived from today's encoder.
"""

from __future__ import annotations

import functools
import io
import random
import threading
from collections.abc import Callable

import boto3
import pytest
from botocore.config import Config
from botocore.response import StreamingBody
from botocore.stub import Stubber
from manifest_helpers import descriptor

from batchweave import Bounded, FormatError, MemoryStore, Mesh, S3Store
from batchweave._manifest import _codec
from batchweave._manifest._codec import decode_manifest, decode_segment
from batchweave._manifest._log import CommitResult, ManifestLog, commit_until, manifest_key
from batchweave._manifest._models import Manifest, ProducerState

NS = "runs/review"
MESH = Mesh(dp=2)


# -- 1. a fresh log's identity is noted atomically ----------------------------------------------


def test_a_first_read_racing_another_threads_first_read_is_not_a_mesh_mismatch() -> None:
    store = MemoryStore()
    m0 = ManifestLog(store, NS).create_or_open(MESH)
    outcome: list[BaseException | None] = []
    threads: list[threading.Thread] = []

    def other_first_read(log: ManifestLog) -> None:
        try:
            log.latest()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    class Paused(ManifestLog):
        """Lets another thread's first read run right after the namespace id is noted."""

        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, value)
            if name == "_namespace_id" and value is not None and not threads:
                threads.append(threading.Thread(target=other_first_read, args=(self,)))
                threads[0].start()
                threads[0].join(0.2)  # with the identity noted under a lock it waits for us

    log = Paused(store, NS)
    assert log.latest() == m0
    threads[0].join(5)
    assert outcome == [None], outcome


# -- 2. legitimate histories are never refused ------------------------------------------------


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


# -- 3. the bounded read stays bounded on a server that ignores Range -------------------------


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


# -- 4. what older writers produced still decodes strictly --------------------------------------

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
        assert manifest.mesh == MESH
        assert manifest.created_at == 1700000000.5
    else:
        segment, _ = decode_segment(data, key=key)
        assert segment.format == int(name[len("format")])
        assert [d.offset for d in segment.tgbs] == [0, 1, 2]

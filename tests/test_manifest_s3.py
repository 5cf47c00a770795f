"""The manifest log on real S3 servers: conditional creation and the commit race over HTTP."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from manifest_helpers import CountingStore, descriptor

from batchweave import Mesh, ObjectStore
from batchweave._manifest import Committed, Manifest, ManifestLog, TgbDescriptor
from batchweave._store._s3 import S3Store
from batchweave.testing import S3Endpoint

MESH = Mesh(dp=2, cp=2)
NS = "runs/s3"


@pytest.fixture(
    params=[
        pytest.param("moto", marks=pytest.mark.moto_server),
        pytest.param("seaweedfs", marks=pytest.mark.seaweedfs),
    ]
)
def s3_store(request: pytest.FixtureRequest, s3_bucket: str, s3_prefix: str) -> Iterator[S3Store]:
    endpoint: S3Endpoint = request.getfixturevalue(f"{request.param}_endpoint")
    with S3Store(s3_bucket, s3_prefix, **endpoint.store_options()) as store:
        yield store


def test_concurrent_creation_and_commits_on_s3(s3_store: ObjectStore) -> None:
    threads, per_thread = 8, 4
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []
    ids: list[str] = []

    def produce(pid: str) -> None:
        log = ManifestLog(s3_store, NS, tail_limit=4)
        try:
            barrier.wait()
            base = log.create_or_open(MESH)
            ids.append(base.namespace_id)
            for offset in range(per_thread):
                pending: list[TgbDescriptor] = [descriptor(pid, offset)]
                while pending:
                    result = log.commit(base, append=pending)
                    if isinstance(result, Committed):
                        base, pending = result.manifest, []
                        continue
                    base = result.winner or log.latest(base)
                    state = base.producers.get(pid)
                    if state is not None and state.offset is not None:
                        pending = [d for d in pending if d.offset > state.offset]
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=produce, args=(f"p{i}",)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    assert len(set(ids)) == 1

    reader = ManifestLog(s3_store, NS)
    head = reader.latest()
    got = sorted((d.producer_id, d.offset) for _, d in reader.descriptors(head, 0, head.next_step))
    assert got == sorted((f"p{i}", o) for i in range(threads) for o in range(per_thread))
    assert list(reader.versions()) == list(range(head.version + 1))


def test_latest_request_counts_on_s3(s3_store: ObjectStore) -> None:
    counting = CountingStore(s3_store)
    log = ManifestLog(counting, NS)
    first: Manifest = log.create_or_open(MESH)
    head = first
    for i in range(3):
        result = log.commit(head, append=[descriptor("p", i)])
        assert isinstance(result, Committed)
        head = result.manifest
    counting.reset()
    assert log.latest(head) == head
    assert counting.calls == {"get": 1}
    counting.reset()
    assert log.latest(first) == head
    assert counting.calls == {"get": 2, "list": 1}

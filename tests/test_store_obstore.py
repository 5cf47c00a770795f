"""The optional obstore S3 backend passes the shipped conformance suite on moto and SeaweedFS.

It also takes what ``S3Store`` takes (addressing styles) and is selected by ``open_store``.
"""

from __future__ import annotations

import pytest
from test_store_conformance import MotoServerSuite, SeaweedFSSuite

import batchweave as bw
from batchweave import (
    AmbiguousWriteError,
    Consumer,
    InvalidStoreURL,
    Mesh,
    Producer,
    S3Store,
    StoreUnavailable,
    open_store,
)
from batchweave._store._obstore import ObstoreS3Store
from batchweave.testing import S3Endpoint, free_port


@pytest.mark.moto_server
class TestObstoreMotoServer(MotoServerSuite):
    backend = ObstoreS3Store


@pytest.mark.seaweedfs
class TestObstoreSeaweedFS(SeaweedFSSuite):
    backend = ObstoreS3Store
    race_rounds = 5  # contended conditional PUTs stall ~1 s each on SeaweedFS; boto3 runs 10


def test_unreachable_endpoint_and_missing_bucket_are_clear_errors(
    moto_endpoint: S3Endpoint,
) -> None:
    port = free_port()
    secret = "do-not-leak-this-secret"
    options = {"access_key_id": "AKIDEXAMPLE", "secret_access_key": secret, "max_attempts": 1}
    dead = ObstoreS3Store("bucket", endpoint_url=f"http://127.0.0.1:{port}", **options)
    with pytest.raises(StoreUnavailable) as unreachable:
        dead.get("k")
    with pytest.raises(AmbiguousWriteError) as ambiguous:
        dead.put_if_absent("k", b"x")  # a write whose outcome is unknown is never assumed
    for text in (str(unreachable.value), str(ambiguous.value), repr(dead)):
        assert secret not in text
    missing = ObstoreS3Store("no-such-bucket-here", **moto_endpoint.store_options())
    with pytest.raises(InvalidStoreURL, match="no-such-bucket-here"):
        missing.get("k")


def test_consumer_reads_through_obstore(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> None:
    mesh = Mesh(dp=2, cp=2)
    writer = S3Store(s3_bucket, s3_prefix, **moto_endpoint.store_options())
    with writer, Producer(writer, "run", producer_id="p", mesh=mesh, policy="naive") as p:
        for o in range(3):
            p.append([f"{o}:{i}".encode() for i in range(4)], offset=o)
        p.seal()
    with ObstoreS3Store(s3_bucket, s3_prefix, **moto_endpoint.store_options()) as store:
        got = list(Consumer(store, "run", mesh=mesh, dp_rank=1, cp_rank=1))
    assert got == [(o, f"{o}:3".encode()) for o in range(3)]


def test_open_store_selects_obstore_by_name(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> None:
    url = f"s3://{s3_bucket}/{s3_prefix}"
    with open_store(url, s3_client="obstore", **moto_endpoint.store_options()) as store:
        assert isinstance(store, ObstoreS3Store)
        store.put("k", b"v")  # the conditional-write probe passed on the way in
    with open_store(url, **moto_endpoint.store_options()) as store:
        assert isinstance(store, S3Store)
        assert store.get("k") == b"v"
    with pytest.raises(InvalidStoreURL, match="max_pool_connections"):
        open_store(url, s3_client="obstore", max_pool_connections=4)  # a boto3-only option
    with pytest.raises(ValueError, match="s3_client 'aiobotocore'"):
        open_store(url, s3_client="aiobotocore")


def test_obstore_takes_the_addressing_styles_s3store_takes() -> None:
    for style in (None, "auto", "path", "virtual"):
        bw.ObstoreS3Store("bucket", endpoint_url="http://127.0.0.1:9", addressing_style=style)
    with pytest.raises(ValueError, match="'path', 'virtual' or 'auto'"):
        bw.ObstoreS3Store("bucket", endpoint_url="http://127.0.0.1:9", addressing_style="dns")


@pytest.mark.moto_server
def test_open_store_probes_with_probe_timeout_and_keeps_the_data_path_timeouts(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> None:
    options = moto_endpoint.store_options() | {"read_timeout": 7.0, "probe_timeout": 0.5}
    store = open_store(f"s3://{s3_bucket}/{s3_prefix}", s3_client="obstore", **options)
    assert isinstance(store, ObstoreS3Store)
    view = store._probe_view()
    assert (view._answer_within, store._answer_within) == (0.5, None)
    assert view._store is not store._store  # a client of its own; the store's keeps 7 s
    assert store._read_timeout == 7.0
    assert list(store.list()) == []  # the probe passed on a real server and deleted its object

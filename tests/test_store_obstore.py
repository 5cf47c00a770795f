"""The optional obstore S3 backend passes the shipped conformance suite on moto and SeaweedFS.

It also takes what ``S3Store`` takes (addressing styles) and is selected by ``open_store``.
"""

from __future__ import annotations

import contextlib
import http.server
import re
import sys
import threading
from collections.abc import Callable, Iterator

import pytest
from test_store_conformance import MotoServerSuite, SeaweedFSSuite

import batchweave as bw
from batchweave import (
    AccessDenied,
    Consumer,
    InvalidStoreURL,
    Mesh,
    ObjectNotFound,
    Producer,
    S3Store,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
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
    with pytest.raises(StoreUnavailable) as refused:
        dead.put_if_absent("k", b"x")  # refused before a byte was sent: nothing can have landed
    for text in (str(unreachable.value), str(refused.value), repr(dead)):
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


def test_a_missing_obstore_is_an_import_error_naming_the_extra(aws_env: pytest.MonkeyPatch) -> None:
    # Before: InvalidStoreURL (a ValueError: "a URL open_store cannot use"), which
    # `except ImportError` missed, saying `pip install obstore` instead of the extra.
    aws_env.setitem(sys.modules, "obstore", None)  # as if not installed
    for open_one in (
        lambda: bw.ObstoreS3Store("bucket", endpoint_url="http://127.0.0.1:9"),
        lambda: open_store("s3://bucket/p", s3_client="obstore", endpoint_url="http://127.0.0.1:9"),
    ):
        with pytest.raises(
            ImportError, match=re.escape("pip install 'batchweave[obstore]'")
        ) as info:
            open_one()
        assert isinstance(info.value, StoreError)  # still caught where store errors were
        assert not isinstance(info.value, ValueError)
        assert info.value.name == "obstore"


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
    assert view._writer is not store._writer  # and one for PUTs (which put() retries)
    assert (view._write_attempts, store._write_attempts) == (3, options.get("max_attempts", 5))
    assert store._read_timeout == 7.0
    assert list(store.list()) == []  # the probe passed on a real server and deleted its object


@pytest.mark.moto_server
def test_an_empty_listing_is_confirmed_with_one_head_per_store(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # object_store parses a web page as an empty listing; a real S3 server's empty listing is
    # confirmed once by a HEAD it answers 404 (and stays an empty listing), then never again.
    store = ObstoreS3Store(s3_bucket, s3_prefix, **moto_endpoint.store_options())
    heads: list[str] = []
    head = store.head
    monkeypatch.setattr(store, "head", lambda key: heads.append(key) or head(key))
    assert list(store.list("runs/none/")) == []
    assert list(store.list("runs/none/", start_after="runs/none/x")) == []
    assert heads == ["_batchweave/listing-check"]
    store.close()


# -- error translation against canned S3 answers ------------------------------------------------


def _s3_error(code: str) -> bytes:
    """S3's error document as AWS and MinIO send it: the XML declaration on a line of its own."""
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code>'
        f"<Message>said the server</Message><RequestId>R1</RequestId></Error>"
    ).encode()


def _delete_result(code: str) -> bytes:
    """A DeleteObjects result in which key ``p/b`` failed with ``code``."""
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult><Deleted><Key>p/a</Key></Deleted>'
        f"<Error><Key>p/b</Key><Code>{code}</Code><Message>said the server</Message></Error>"
        "</DeleteResult>"
    ).encode()


@contextlib.contextmanager
def _answering(status: int, body: bytes) -> Iterator[ObstoreS3Store]:
    """An obstore store of ``s3://bucket/p`` on a server answering every request alike."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(status)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer  # noqa: N815 (http.server names)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.01,), daemon=True)
    thread.start()
    store = ObstoreS3Store(
        "bucket",
        "p",
        endpoint_url=f"http://127.0.0.1:{server.server_address[1]}",
        access_key_id="AKIDEXAMPLE",
        secret_access_key="secret-of-the-test",
        max_attempts=1,
    )
    try:
        yield store
    finally:
        store.close()
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (400, "InvalidArgument", StoreError),
        (400, "EntityTooLarge", StoreError),
        (400, "KeyTooLongError", StoreError),
        (409, "ConditionalRequestConflict", StoreError),  # to a plain put only
        (400, "RequestTimeout", TransientStoreError),  # S3's "send it again", as on boto3
    ],
)
def test_a_write_refused_with_a_4xx_is_not_ambiguous(
    status: int, code: str, expected: type[StoreError]
) -> None:
    # Before: AmbiguousWriteError ("may have landed, read it back"), which a producer retries;
    # boto3 reports the same answers as the definite refusals they are.
    with _answering(status, _s3_error(code)) as store:
        writes: list[Callable[[], None]] = [lambda: store.put("k", b"x")]
        if code != "ConditionalRequestConflict":
            writes.append(lambda: store.put_if_absent("k", b"x"))
        for write in writes:
            with pytest.raises(StoreError) as info:
                write()
            assert type(info.value) is expected
            assert code in str(info.value)


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        (403, "AccessDenied", AccessDenied),
        (400, "AuthorizationHeaderMalformed", StoreError),
        (503, "SlowDown", TransientStoreError),
    ],
)
def test_errors_name_the_s3_error_code_and_message(
    status: int, code: str, expected: type[StoreError]
) -> None:
    # Before: the message quoted the reply's first line only, the XML declaration.
    with _answering(status, _s3_error(code)) as store, pytest.raises(StoreError) as info:
        store.get("k")
    assert type(info.value) is expected
    assert f"get 'k' in s3://bucket/p: {code} said the server" in str(info.value)
    assert "<?xml" not in str(info.value)


@pytest.mark.parametrize("key", ["runs/NoSuchBucket", "x/latest/meta-data/y", "a", "Code"])
def test_a_key_named_like_an_error_is_only_a_key(key: str) -> None:
    # Before: the whole message was searched, key included: a missing runs/NoSuchBucket was
    # "bucket does not exist" (InvalidStoreURL), x/latest/meta-data/y missing credentials.
    missing = pytest.raises(ObjectNotFound, match="NoSuchKey said the server")
    with _answering(404, _s3_error("NoSuchKey")) as store, missing:
        store.get(key)
    with _answering(503, _s3_error("SlowDown")) as store, pytest.raises(TransientStoreError):
        list(store.list(key + "/"))


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("InternalError", TransientStoreError),  # object_store retries it, then reports it
        ("SlowDown", TransientStoreError),  # the same
        ("ServiceUnavailable", TransientStoreError),
        ("AccessDenied", AccessDenied),
    ],
)
def test_delete_many_reports_a_keys_error_by_its_code(
    code: str, expected: type[StoreError]
) -> None:
    # As S3Store does: transient codes are transient (the Reclaimer retries them rather than
    # falling back to one delete per key), and the failed key is named. Before: the first key
    # of the request was named, and a key's AccessDenied was a plain StoreError.
    with _answering(200, _delete_result(code)) as store, pytest.raises(StoreError) as info:
        store.delete_many(["a", "b"])
    assert type(info.value) is expected
    assert f"delete 'b' in s3://bucket/p: {code} said the server" in str(info.value)

"""Regressions of the S3 backends' parity with each other and with docs/store.md.

A web page's HTML is never returned as an object by boto3 either; both clients retry a 429;
obstore signs for the environment's region as boto3 does; boto3 names the real cause of an
endpoint it cannot use. (put's ``mode``, ``delete_many``'s all-or-nothing key check and
buffer layouts are pinned for every backend by the conformance suite, ``StoreTests``.)
Nothing here sends a request anywhere but to a server of its own on 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

import batchweave as bw
from batchweave._store import _s3

CLIENTS = ("boto3", "obstore")
CREDENTIALS: dict[str, Any] = {
    "access_key_id": "AKIAEXAMPLE0000",
    "secret_access_key": "example-secret-0000",
}
_PAGE = b"<html><body>Welcome to the admin console</body></html>"

Reply = tuple[int, dict[str, str], bytes]


class ScriptedEndpoint:
    """An HTTP server on 127.0.0.1: each request gets the next scripted reply for its method,
    else ``default(method)``. ``requests`` records ``(method, path)``."""

    def __init__(self, default: Callable[[str], Reply]) -> None:
        self.script: list[tuple[str, Reply]] = []
        self.requests: list[tuple[str, str]] = []
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                endpoint.requests.append((self.command, self.path))
                reply = next((r for m, r in endpoint.script if m == self.command), None)
                if reply is not None:
                    endpoint.script.remove((self.command, reply))
                status, headers, body = reply or default(self.command)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _answer  # noqa: N815

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


@contextlib.contextmanager
def scripted(default: Callable[[str], Reply]) -> Iterator[ScriptedEndpoint]:
    endpoint = ScriptedEndpoint(default)
    try:
        yield endpoint
    finally:
        endpoint.stop()


def _web_page(method: str) -> Reply:
    return 200, {"Content-Type": "text/html"}, _PAGE


def _s3_like(method: str) -> Reply:
    """What S3 answers a GET or PUT of an object holding ``b"0123456789"``."""
    headers = {"ETag": '"0123"', "Last-Modified": formatdate(usegmt=True)}
    if method == "GET":
        return 200, {**headers, "Content-Type": "binary/octet-stream"}, b"0123456789"
    return 200, headers, b""


def _open(client: str, url: str, **options: Any) -> bw.ObjectStore:
    return bw.open_store(
        "s3://bkt/run",
        s3_client=client,
        endpoint_url=url,
        region="us-east-1",
        verify_conditional_writes=False,
        **CREDENTIALS,
        **options,
    )


# -- a web page is not an object ---------------------------------------------------------------


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    "read",
    [
        lambda s: s.get("data/tgb-0"),
        lambda s: s.get_range("data/tgb-0", bw.Bounded(0, 20)),
        lambda s: s.get_range("data/tgb-0", bw.Suffix(8)),
        lambda s: s.get_range("data/tgb-0", bw.Offset(3)),
        lambda s: s.get_range_into("data/tgb-0", 0, memoryview(bytearray(16))),
    ],
    ids=["get", "bounded", "suffix", "offset", "into"],
)
def test_a_web_page_answering_every_get_is_not_returned_as_the_object(
    aws_env: pytest.MonkeyPatch, client: str, read: Callable[[bw.ObjectStore], object]
) -> None:
    # Before (boto3): get and get_range returned the console's HTML as the object's bytes (a
    # reader that skips the probe, as consumer ranks do); obstore refused it (_check_meta).
    with scripted(_web_page) as page, _open(client, page.url) as store:
        with pytest.raises(bw.StoreError, match="did not answer like an S3 server") as info:
            read(store)
        assert "no ETag and no Last-Modified" in str(info.value)
        assert page.url in str(info.value)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_get_with_only_one_of_etag_and_last_modified_is_s3s(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Some compatible servers send no ETag on a GET: Last-Modified alone is S3's answer.
    def last_modified_only(method: str) -> Reply:
        return 200, {"Last-Modified": formatdate(usegmt=True)}, b"0123456789"

    with scripted(last_modified_only) as server, _open(client, server.url) as store:
        assert store.get("k") == b"0123456789"
        assert store.get_range("k", bw.Bounded(2, 5)) == b"234"


# -- throttling is retried ---------------------------------------------------------------------


_THROTTLED: dict[str, Reply] = {
    "429 page": (429, {"Content-Type": "text/html"}, b"<html>Too Many Requests</html>"),
    "429 TooManyRequests": (
        429,
        {"Content-Type": "application/xml"},
        b'<?xml version="1.0" encoding="UTF-8"?>'
        b"<Error><Code>TooManyRequests</Code><Message>slow down</Message></Error>",
    ),
    # A throttling code of THROTTLED_CODES that botocore does not retry, in a plain 400.
    "400 TooManyRequests": (
        400,
        {"Content-Type": "application/xml"},
        b"<Error><Code>TooManyRequests</Code><Message>m</Message></Error>",
    ),
}

_OPS: dict[str, tuple[str, Callable[[bw.ObjectStore], object], object]] = {
    "get": ("GET", lambda s: s.get("k"), b"0123456789"),
    "get_range": ("GET", lambda s: s.get_range("k", bw.Bounded(0, 4)), b"0123"),
    "put": ("PUT", lambda s: s.put("k", b"v"), None),
    "put_if_absent": ("PUT", lambda s: s.put_if_absent("k", b"v"), None),
}


@pytest.fixture
def no_backoff(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """boto3's throttling backoff without waiting; records the attempt numbers it was asked."""
    asked: list[int] = []

    def delay(attempts: int) -> float:
        asked.append(attempts)
        return 0.0

    # raising=False: the test also runs (and fails, retrying nothing) where it is missing.
    monkeypatch.setattr(_s3, "_throttle_delay", delay, raising=False)
    return asked


@pytest.mark.parametrize("reply", _THROTTLED, ids=str)
@pytest.mark.parametrize("op", _OPS)
def test_boto3_retries_a_429_and_throttling_codes(
    aws_env: pytest.MonkeyPatch, no_backoff: list[int], reply: str, op: str
) -> None:
    # Before: botocore's standard mode retries neither the 429 status nor every throttling
    # code (TooManyRequests): one throttled answer failed the call (TransientStoreError),
    # where the obstore backend backs off and retries, as docs/store.md says both do.
    method, call, expected = _OPS[op]
    if op == "get_range":  # an S3 server's answer to a Range GET
        expected_reply: Reply = (
            206,
            {**_s3_like("GET")[1], "Content-Range": "bytes 0-3/10"},
            b"0123",
        )
    with scripted(_s3_like) as server, _open("boto3", server.url, max_attempts=3) as store:
        server.script = [(method, _THROTTLED[reply])] * 2
        if op == "get_range":
            server.script.append((method, expected_reply))
        assert call(store) == expected
        assert [m for m, _ in server.requests] == [method] * 3
        assert no_backoff == [1, 2]


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("op", ["get", "put", "put_if_absent"])
def test_throttling_on_every_attempt_is_transient_not_ambiguous(
    aws_env: pytest.MonkeyPatch, no_backoff: list[int], client: str, op: str
) -> None:
    # A 429 stores nothing: a write throttled on every attempt was refused, not ambiguous.
    method, call, _ = _OPS[op]
    sleeps: dict[str, Any] = {"sleep": lambda seconds: None} if client == "obstore" else {}
    with scripted(_s3_like) as server, _open(client, server.url, max_attempts=3, **sleeps) as s:
        server.script = [(method, _THROTTLED["429 page"])] * 3
        with pytest.raises(bw.TransientStoreError) as info:
            call(s)
        assert not isinstance(info.value, bw.AmbiguousWriteError)
        assert len(server.requests) == 3


def test_a_create_retried_after_a_429_keeps_the_412_of_its_last_attempt(
    aws_env: pytest.MonkeyPatch, no_backoff: list[int]
) -> None:
    # The retried create is a conditional PUT like the first: a 412 to it is ObjectExists, a
    # 500 after it is ambiguous (that attempt may have landed), as for any create.
    failed = (412, {"Content-Type": "application/xml"}, b"<Error><Code>PreconditionFailed"
              b"</Code><Message>m</Message></Error>")  # fmt: skip
    server_error = (500, {"Content-Type": "application/xml"}, b"<Error><Code>InternalError"
                    b"</Code><Message>m</Message></Error>")  # fmt: skip
    with scripted(_s3_like) as server, _open("boto3", server.url, max_attempts=3) as store:
        server.script = [("PUT", _THROTTLED["429 page"]), ("PUT", failed)]
        with pytest.raises(bw.ObjectExists):
            store.put_if_absent("k", b"v")
        assert len(server.requests) == 2
        server.requests.clear()
        server.script = [("PUT", server_error), ("PUT", _THROTTLED["429 page"])] * 2
        with pytest.raises(bw.AmbiguousWriteError):
            store.put_if_absent("k", b"v")
        assert len(server.requests) == 3


# -- obstore signs for the environment's region ------------------------------------------------


def _regions(**options: Any) -> tuple[str, str]:
    """The regions the boto3 and obstore backends sign for (no request is sent)."""
    common = dict(endpoint_url="http://127.0.0.1:9", verify_conditional_writes=False, **options)
    boto = bw.open_store("s3://bkt/p", **CREDENTIALS, **common)
    obs = bw.open_store("s3://bkt/p", s3_client="obstore", **CREDENTIALS, **common)
    return boto.client.meta.region_name, obs._store.config["region"]  # type: ignore[attr-defined]


def test_obstore_signs_for_aws_default_region_like_boto3(aws_env: pytest.MonkeyPatch) -> None:
    # Before: obstore always signed for us-east-1 when no region was passed.
    aws_env.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    assert _regions() == ("eu-west-1", "eu-west-1")
    aws_env.setenv("AWS_REGION", "ap-south-1")  # boto3 reads AWS_DEFAULT_REGION first
    assert _regions()[1] == "eu-west-1"
    assert _regions(region="us-west-2") == ("us-west-2", "us-west-2")  # the argument wins


def test_obstore_falls_back_to_aws_region_then_us_east_1(aws_env: pytest.MonkeyPatch) -> None:
    obs = {"s3_client": "obstore", "endpoint_url": "http://127.0.0.1:9"}
    aws_env.setenv("AWS_REGION", "eu-central-1")
    store = bw.open_store("s3://bkt/p", verify_conditional_writes=False, **obs, **CREDENTIALS)
    assert store._store.config["region"] == "eu-central-1"  # type: ignore[attr-defined]
    aws_env.delenv("AWS_REGION")
    aws_env.setenv("AWS_DEFAULT_REGION", "")  # empty: unset
    store = bw.open_store("s3://bkt/p", verify_conditional_writes=False, **obs, **CREDENTIALS)
    assert store._store.config["region"] == "us-east-1"  # type: ignore[attr-defined]


@pytest.mark.parametrize("variable", ["AWS_DEFAULT_REGION", "AWS_REGION"])
@pytest.mark.parametrize("value", ["evil.example/x", "eu west 1", "-eu"])
def test_obstore_refuses_an_environment_region_naming_the_variable(
    aws_env: pytest.MonkeyPatch, variable: str, value: str
) -> None:
    # object_store puts the region into the AWS host name: checked as the region argument is.
    aws_env.setenv(variable, value)
    with pytest.raises(bw.InvalidStoreURL, match=f"{variable} \\(from the environment\\)"):
        bw.ObstoreS3Store("bkt", "p", **CREDENTIALS)


# -- boto3 names the real cause of an endpoint it cannot use -----------------------------------


@pytest.mark.parametrize("endpoint", ["http://minio_1:9000", "http://störe.local:9000"])
def test_boto3_blames_the_endpoint_url_argument_not_the_environment(
    aws_env: pytest.MonkeyPatch, endpoint: str
) -> None:
    # Before: "the endpoint botocore found (AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or the AWS
    # config file) is unusable" for the user's own endpoint_url, with none of those set.
    with pytest.raises(bw.InvalidStoreURL) as info:
        _open("boto3", endpoint)
    said = str(info.value)
    assert "AWS_ENDPOINT_URL" not in said
    assert f"endpoint_url {endpoint!r}" in said
    assert "s3_client='obstore'" in said
    _open("obstore", endpoint).close()  # object_store takes it: no early refusal for both


def test_boto3_blames_an_empty_aws_default_region(aws_env: pytest.MonkeyPatch) -> None:
    # Before: an empty AWS_DEFAULT_REGION (botocore builds https://s3..amazonaws.com) was
    # blamed on AWS_ENDPOINT_URL or the config file.
    aws_env.setenv("AWS_DEFAULT_REGION", "")
    with pytest.raises(bw.InvalidStoreURL) as info:
        bw.open_store("s3://bkt/p", verify_conditional_writes=False, **CREDENTIALS)
    assert "AWS_DEFAULT_REGION is set but empty" in str(info.value)
    assert "AWS_ENDPOINT_URL" not in str(info.value)


@pytest.mark.parametrize("wrapped", [False, True])
def test_get_range_into_a_strided_view_of_bytes_fills_every_item(wrapped: bool) -> None:
    # The default get_range_into cast every buffer to bytes, which a strided view refuses
    # ("casts are restricted to C-contiguous views"): it filled such views before that.
    store: bw.ObjectStore = bw.MemoryStore()
    if wrapped:
        store = bw.CountingStore(store)
    store.put("k", b"0123456789")
    backing = bytearray(20)
    assert store.get_range_into("k", 2, memoryview(backing)[::2]) == 8
    assert bytes(backing[::2]) == b"23456789" + bytes(2)
    assert bytes(backing[1::2]) == bytes(10)  # the items between are not written


def test_a_file_listing_of_a_name_too_long_for_the_file_system_is_empty(tmp_path: Path) -> None:
    # Listing started opening the prefix's directory: a segment too long for the file system
    # (ENAMETOOLONG) became a StoreError; no key can have it, so nothing is listed, as before.
    store = bw.FileStore(tmp_path)
    store.put("a/b", b"x")
    assert list(store.list("x" * 300 + "/")) == []
    assert [m.key for m in store.list("a/")] == ["a/b"]


@pytest.mark.parametrize("parent_exists", [True, False])
def test_a_file_delete_of_a_name_too_long_for_the_file_system_deletes_the_rest(
    tmp_path: Path, parent_exists: bool
) -> None:
    # No object can have such a name: the delete is idempotent for it, as for a missing key.
    # It raised a StoreError part-way when the parent existed (ns/a deleted, ns/z kept).
    store = bw.FileStore(tmp_path)
    store.put("ns/a", b"1")
    store.put("ns/z", b"2")
    parent = "ns" if parent_exists else "elsewhere"
    store.delete_many(["ns/a", f"{parent}/{'a' * 300}/x", f"{parent}/{'b' * 300}", "ns/z"])
    assert list(store.list()) == []

"""A hostile environment met through the public API and the CLI: malformed endpoints and options,
endpoints that are not S3 servers (a web page, a 404 page, a port that accepts and never answers),
missing and wrong credentials, and credentials in botocore's own DEBUG logs.

Every case asserts the error class, that the message names what was wrong, and that no secret
appears in any message, repr, log record or CLI output. The misbehaving endpoints are tiny socket
servers on 127.0.0.1 run by a fixture (threads, closed at teardown); real S3 servers are the
session's moto and SeaweedFS fixtures from ``conftest.py``. Complements
``test_security.py`` (URL credentials, ``file://`` confinement) and ``test_hostile.py``
(hostile stored bytes, wrong secret through the clients).
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import importlib
import importlib.util
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import numpy as np
import pytest
from click.testing import CliRunner
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import batchweave as bw
from batchweave._store import _open as store_open
from batchweave.cli import cli
from batchweave.testing import S3Endpoint, free_port

SECRET = "SECRETzzz123-env-audit"
TOKEN = "TOKENzzz456-env-audit"
CLIENTS = ("boto3", "obstore")
FAST: dict[str, Any] = {"connect_timeout": 1.0, "read_timeout": 0.5, "max_attempts": 1}
"""Client options that keep a silent endpoint's wait short (one attempt, half a second)."""
BOUND = 10.0
"""Seconds any failing call below may take; each configures at most a few 0.5-1 s timeouts."""


def _credentials() -> dict[str, Any]:
    return {"access_key_id": "AKIDENVAUDIT", "secret_access_key": SECRET, "region": "us-east-1"}


def _everything_said(exc: BaseException) -> str:
    """The error as a user can see it: message, repr and the whole chained traceback."""
    return f"{exc} {exc!r} " + "".join(traceback.format_exception(exc))


# -- endpoints that are not S3 servers ---------------------------------------------------------

_PAGE = b"<html><body>Welcome to nginx!</body></html>"


def _reply(status: str, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: text/html\r\nContent-Length: {len(body)}\r\n"
    return head.encode() + b"Connection: close\r\n\r\n" + body


_CONSOLE = (
    b"<!DOCTYPE html><html><head><meta charset=utf-8><title>Console</title></head>"
    b"<body>Sign in<br></body></html>"
)
"""A web console's page: HTML that is not well-formed XML (``<meta>``, ``<br>`` never closed)."""

REPLIES = {
    "web-page": _reply("200 OK", _PAGE),
    "console-page": _reply("200 OK", _CONSOLE),
    "not-found-page": _reply("404 Not Found", b"<html><body>404 Not Found</body></html>"),
    "silent": None,  # accepts the connection, reads the request, never answers
    # Location: a closed port on loopback (obstore follows redirects; botocore does not).
    "redirect": b"HTTP/1.1 301 Moved Permanently\r\nLocation: http://127.0.0.1:9/\r\n"
    b"Content-Length: 0\r\nConnection: close\r\n\r\n",
}


class FakeEndpoint:
    """A socket server on 127.0.0.1 that answers every request with one canned reply."""

    def __init__(self, reply: bytes | None) -> None:
        self._reply = reply
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        self.connections = 0
        self.request_lines: list[str] = []
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                self.connections += 1
                self._open.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            request = conn.recv(65536)
            with self._lock:
                self.request_lines.append(request.split(b"\r\n", 1)[0].decode("latin-1"))
            if self._reply is not None:
                conn.sendall(self._reply)
                conn.close()
        except OSError:
            pass

    def closed_by_client(self, timeout: float) -> bool:
        """Whether the client closed every connection it opened: each reads to EOF in time."""
        with self._lock:
            connections = list(self._open)
        for conn in connections:
            conn.settimeout(timeout)
            try:
                while conn.recv(65536):
                    pass
            except OSError:  # TimeoutError included: the client still holds it open
                return False
        return True

    def stop(self) -> None:
        # shutdown() wakes the accept() blocked in _serve (close() alone does not, on Linux).
        self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(5)
        assert not self._thread.is_alive()
        with self._lock:
            for conn in self._open:
                conn.close()


@contextlib.contextmanager
def fake_endpoint(kind: str) -> Iterator[FakeEndpoint]:
    server = FakeEndpoint(REPLIES[kind])
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.parametrize("client", CLIENTS)
def test_a_web_page_on_the_endpoint_is_called_so_not_an_unsafe_store(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Before: boto3 said ConditionalWritesUnsupported ("upgrade this store") for a web server
    # answering 200 to everything, obstore an AmbiguousWriteError ("read it back").
    with fake_endpoint("web-page") as page:
        with pytest.raises(bw.StoreError) as info:
            bw.open_store(
                "s3://bucket/p", s3_client=client, endpoint_url=page.url, **_credentials()
            )
        assert not isinstance(info.value, bw.ConditionalWritesUnsupported | bw.AmbiguousWriteError)
        said = str(info.value)
        assert "like an S3 server" in said or "does not behave like an object store" in said
        assert page.url in said
        assert SECRET not in _everything_said(info.value)


@pytest.mark.parametrize(
    ("client", "op"),
    # obstore's list: object_store parses the page as an empty listing, which a HEAD confirms
    # (before: NamespaceNotFound, a reclaimer pass over nothing, no live watermarks).
    [
        ("boto3", "head"),
        ("boto3", "get"),
        ("boto3", "list"),
        ("obstore", "head"),
        ("obstore", "get"),
        ("obstore", "list"),
    ],
)
def test_reads_from_a_web_page_are_refused_not_taken_as_objects(
    aws_env: pytest.MonkeyPatch, client: str, op: str
) -> None:
    # Before: boto3's head raised a bare KeyError('LastModified'), and list returned nothing, so
    # `batchweave inspect` reported "no namespace"; both clients' get returned the page as the
    # object.
    with fake_endpoint("web-page") as page:
        store = bw.open_store(
            "s3://bucket/p",
            s3_client=client,
            verify_conditional_writes=False,
            endpoint_url=page.url,
            **_credentials(),
        )
        calls: dict[str, Callable[[], object]] = {
            "head": lambda: store.head("k"),
            "get": lambda: store.get("k"),
            "list": lambda: list(store.list()),
        }
        with pytest.raises(bw.StoreError, match="did not answer like an S3 server"):
            calls[op]()


@pytest.mark.parametrize("client", CLIENTS)
def test_an_html_page_that_is_not_xml_is_not_s3_and_not_retried(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Before (boto3): botocore took the page for an S3 answer cut short and made it a 500, which
    # it retried max_attempts times and BatchWeave called transient (list, delete) or
    # ambiguous (put): a web console on the S3 port read as a flaky S3 server.
    with fake_endpoint("console-page") as page:
        store = bw.open_store(
            "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=page.url, **_credentials(), max_attempts=3,
        )  # fmt: skip
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: store.put("k", b"v"),
            "put_if_absent": lambda: store.put_if_absent("k", b"v"),
            "list": lambda: list(store.list()),
            "delete": lambda: store.delete_many(["k"]),
        }
        for op, call in calls.items():
            before = page.connections
            with pytest.raises(bw.StoreError, match="did not answer like an S3 server") as info:
                call()
            assert not isinstance(info.value, bw.TransientStoreError | bw.AmbiguousWriteError)
            assert page.url in str(info.value), op
            assert page.connections - before == 1, op  # not retried
        with pytest.raises(bw.StoreError, match="did not answer like an S3 server") as opening:
            bw.open_store(
                "s3://bucket/p", s3_client=client, endpoint_url=page.url, **_credentials()
            )
        assert not isinstance(opening.value, bw.TransientStoreError | bw.AmbiguousWriteError)
        assert SECRET not in _everything_said(opening.value)


@pytest.mark.parametrize(
    "reply",
    [
        # An S3 answer cut short (botocore's reason to call a 200 it cannot parse a 500).
        _reply("200 OK", b'<?xml version="1.0" encoding="UTF-8"?>\n<ListBucketResult><Name>buc'),
        # A gateway in front of S3 that is briefly down: its error page is HTML too.
        _reply("503 Service Unavailable", b"<html><body>503 Service Unavailable</body></html>"),
        # S3's error inside a 200 (botocore's other reason), from a server that writes no XML
        # declaration: an S3 answer, not a web page.
        _reply("200 OK", b"<Error><Code>InternalError</Code><Message>retry</Message></Error>"),
        # An S3 answer cut within its XML declaration.
        _reply("200 OK", b"<?x"),
    ],
    ids=["cut-xml", "gateway-503", "error-without-declaration", "cut-in-declaration"],
)
def test_a_cut_s3_answer_or_a_gateway_error_page_stays_transient(
    aws_env: pytest.MonkeyPatch, reply: bytes
) -> None:
    server = FakeEndpoint(reply)
    try:
        store = bw.open_store(
            "s3://bucket/p", verify_conditional_writes=False, endpoint_url=server.url,
            **_credentials(), max_attempts=2,
        )  # fmt: skip
        with pytest.raises(bw.TransientStoreError):
            list(store.list())
        assert server.connections == 2  # retried as before
    finally:
        server.stop()


_LISTING_WITHOUT_IS_TRUNCATED = (
    b"<?xml version='1.0' encoding='UTF-8'?><ListBucketResult>"
    b"<Name>bucket</Name><Prefix>p/</Prefix><KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys>"
    b"<Contents><Key>p/k</Key><Size>1</Size><LastModified>2024-01-01T00:00:00.000Z</LastModified>"
    b'<ETag>"e"</ETag></Contents></ListBucketResult>'
)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_listing_without_is_truncated_is_still_a_listing(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Some S3-compatible servers omit IsTruncated when it is false (gofakes3 did; ambry spells
    # it isTruncated). The web-page check must not refuse their listings: obstore accepts them.
    server = FakeEndpoint(_reply("200 OK", _LISTING_WITHOUT_IS_TRUNCATED))
    try:
        store = bw.open_store(
            "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=server.url, **_credentials(), **FAST,
        )  # fmt: skip
        assert [meta.key for meta in store.list()] == ["k"]
    finally:
        server.stop()


_OBJECT_WITHOUT_ETAG = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/octet-stream\r\nContent-Length: 5\r\n"
    b"Last-Modified: Mon, 01 Jan 2024 00:00:00 GMT\r\nConnection: close\r\n\r\nhello"
)


@pytest.mark.parametrize("client", CLIENTS)
def test_an_object_served_without_an_etag_is_still_an_object(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Some S3-compatible servers send no ETag on GET/HEAD (CubeFS for files written through its
    # file system, s3s-fs); object_store deliberately does not require one for S3, and boto3's
    # checks do not either. Only a reply with neither ETag nor Last-Modified is a web page.
    server = FakeEndpoint(_OBJECT_WITHOUT_ETAG)
    try:
        store = bw.open_store(
            "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=server.url, **_credentials(), **FAST,
        )  # fmt: skip
        assert store.get("k") == b"hello"
        meta = store.head("k")
        assert (meta.size, meta.last_modified) == (5, 1704067200.0)
    finally:
        server.stop()


@pytest.mark.parametrize("client", CLIENTS)
def test_a_404_page_is_a_wrong_endpoint_not_a_missing_object(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Before: ObjectNotFound from open_store ("put_if_absent ...: 404"): S3 answers a PUT with
    # 404 only for a missing bucket, which it names (NoSuchBucket).
    with fake_endpoint("not-found-page") as page:
        with pytest.raises(bw.StoreError) as info:
            bw.open_store(
                "s3://bucket/p", s3_client=client, endpoint_url=page.url, **_credentials()
            )
        assert not isinstance(info.value, bw.ObjectNotFound)
        assert "did not answer like an S3 server" in str(info.value)


# -- a web server's refusal of a write (no S3 XML error in it) ---------------------------------

_NGINX_405 = (
    b"<html>\r\n<head><title>405 Not Allowed</title></head>\r\n<body>\r\n<center><h1>405 Not "
    b"Allowed</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n"
)
"""nginx's answer to a PUT to a static site (not well-formed XML: ``<hr>`` is never closed)."""

_REFUSALS = {
    "nginx-405": _reply("405 Not Allowed", _NGINX_405),
    # Well-formed XML: botocore parses it and finds no error code at all.
    "xhtml-405": _reply("405 Method Not Allowed", b"<!DOCTYPE html><html><body>no</body></html>"),
    "empty-405": _reply("405 Method Not Allowed", b""),
    "400": _reply("400 Bad Request", b"<html><body>Bad Request</body></html>"),
    # S3 refuses with XML AccessDenied; a web server's 403 page is no word on the credentials.
    "403": _reply("403 Forbidden", b"<html><body>Forbidden</body></html>"),
    "411": _reply("411 Length Required", b"<html><body>Length Required</body></html>"),
    "413": _reply("413 Request Entity Too Large", b"<html><body>Too Large</body></html>"),
    "501": _reply("501 Not Implemented", b"<html><body>Not Implemented</body></html>"),
}


@contextlib.contextmanager
def _refusing(kind: str) -> Iterator[FakeEndpoint]:
    server = FakeEndpoint(_REFUSALS[kind])
    try:
        yield server
    finally:
        server.stop()


def _refusal_said(kind: str, exc: BaseException, url: str) -> None:
    """``exc`` is the read path's "not an S3 server" error, naming the endpoint."""
    assert type(exc) is bw.StoreError, repr(exc)  # not AccessDenied, ambiguous, unsupported
    said = str(exc)
    assert "did not answer like an S3 server" in said
    assert "check that endpoint_url is the address of the S3 API" in said
    assert url in said
    if kind == "501":
        assert "a gateway that does not implement this request" in said
    assert SECRET not in _everything_said(exc)


@pytest.mark.parametrize("kind", sorted(_REFUSALS))
@pytest.mark.parametrize("client", CLIENTS)
def test_a_web_servers_refusal_of_the_probe_says_not_s3_and_deletes_nothing(
    aws_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, client: str, kind: str
) -> None:
    # Before: a bare "StoreError: ... 405 Method Not Allowed" (400, 411, 413 alike), AccessDenied
    # for a 403 page, and for a 501 "AmbiguousWriteError: ...; the write may have landed, read
    # it back" (obstore: ConditionalWritesUnsupported) followed by a logged "could not delete
    # the probe object": nothing that named the wrong endpoint.
    with caplog.at_level(logging.WARNING, "batchweave.store"), _refusing(kind) as page:
        with pytest.raises(bw.StoreError) as info:
            bw.open_store(
                "s3://bucket/p", s3_client=client, endpoint_url=page.url, **_credentials()
            )
        requests = list(page.request_lines)
    _refusal_said(kind, info.value, page.url)
    # One PUT: not retried, not read back, no probe object to delete.
    assert [line.split(" ", 1)[0] for line in requests] == ["PUT"], requests
    assert not [r for r in caplog.records if "could not delete" in r.getMessage()]


@pytest.mark.parametrize("kind", ["nginx-405", "403", "501"])
@pytest.mark.parametrize("client", CLIENTS)
def test_a_web_servers_refusal_is_not_s3_for_every_request_but_a_head(
    aws_env: pytest.MonkeyPatch, client: str, kind: str
) -> None:
    with _refusing(kind) as page:
        store = bw.open_store(
            "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=page.url, **_credentials(),
        )  # fmt: skip
        calls: dict[str, Callable[[], object]] = {
            "put": lambda: store.put("k", b"v"),
            "put_if_absent": lambda: store.put_if_absent("k", b"v"),
            "get": lambda: store.get("k"),
            "list": lambda: list(store.list()),
            "delete": lambda: store.delete_many(["k"]),
        }
        for op, call in calls.items():
            with pytest.raises(bw.StoreError) as info:
                call()
            _refusal_said(kind, info.value, page.url)
            assert f"to a {op}" in str(info.value), op


@pytest.mark.parametrize("client", CLIENTS)
def test_s3s_own_answers_without_an_error_code_keep_their_meaning(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # A reply to a HEAD has no body, S3's neither: a bare 403 is S3 refusing the credentials.
    # A 429 page is a proxy throttling in front of S3, a 502/504 page a gateway whose S3 is down.
    def opened(server: FakeEndpoint) -> bw.ObjectStore:
        return bw.open_store(
            "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=server.url, **_credentials(), max_attempts=1,
        )  # fmt: skip

    denied = FakeEndpoint(_reply("403 Forbidden", b""))
    try:
        with pytest.raises(bw.AccessDenied):
            opened(denied).head("k")
    finally:
        denied.stop()
    throttled = FakeEndpoint(_reply("429 Too Many Requests", b"<html>slow down</html>"))
    try:
        with pytest.raises(bw.TransientStoreError):
            opened(throttled).put("k", b"v")
    finally:
        throttled.stop()
    for status in ("502 Bad Gateway", "504 Gateway Timeout"):
        gateway = FakeEndpoint(_reply(status, f"<html><body>{status}</body></html>".encode()))
        try:
            store = opened(gateway)
            with pytest.raises(bw.AmbiguousWriteError):
                store.put_if_absent("k", b"v")
            with pytest.raises(bw.TransientStoreError):
                list(store.list())
        finally:
            gateway.stop()


class _WriteGatewayReadPage(http.server.BaseHTTPRequestHandler):
    """A PUT gets a gateway's 502 page (its outcome unknown), a HEAD a web page's 200 (no
    Last-Modified, no ETag), a delete 405: the probe's read-back shows the endpoint is no S3."""

    requests: list[str]

    def do_PUT(self) -> None:
        self.requests.append("PUT")
        self.send_error(502)

    def do_HEAD(self) -> None:
        self.requests.append("HEAD")
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.requests.append(self.command)
        self.send_error(405)

    do_DELETE = do_POST  # noqa: N815 (http.server names)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("client", CLIENTS)
def test_a_probe_whose_read_back_is_not_s3_deletes_nothing(
    aws_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, client: str
) -> None:
    # Before: the probe went on to delete its object, and logged "could not delete the probe
    # object ... did not answer like an S3 server" above the error that already said so.
    requests: list[str] = []
    handler = type("Handler", (_WriteGatewayReadPage,), {"requests": requests})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with (
            caplog.at_level(logging.WARNING, "batchweave.store"),
            pytest.raises(bw.StoreError, match="did not answer like an S3 server") as info,
        ):
            bw.open_store(
                "s3://bucket/p", s3_client=client, endpoint_url=url, **_credentials(),
                max_attempts=1,
            )  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    assert type(info.value) is bw.StoreError
    assert isinstance(info.value.__cause__, bw.AmbiguousWriteError)
    assert requests[-1] == "HEAD", requests  # read back, nothing deleted
    assert not [r for r in caplog.records if "could not delete" in r.getMessage()]


def test_a_redirecting_endpoint_is_named_not_a_recursion_error(
    aws_env: pytest.MonkeyPatch,
) -> None:
    # Before: botocore chased a bare 301 with region look-ups until the stack overflowed;
    # open_store said "failed: RecursionError", reads were "transient" (spent retry budgets).
    with fake_endpoint("redirect") as redirect:
        with pytest.raises(bw.StoreError) as info:
            bw.open_store("s3://bucket/p", endpoint_url=redirect.url, **_credentials(), **FAST)
        store = bw.open_store(
            "s3://bucket/p", verify_conditional_writes=False, endpoint_url=redirect.url,
            **_credentials(), **FAST,
        )  # fmt: skip
        for call in (lambda: store.get("k"), lambda: list(store.list())):
            with pytest.raises(bw.StoreError) as read:
                call()
            assert not isinstance(read.value, bw.TransientStoreError)
            assert "answered with redirects" in str(read.value)
    assert "answered with redirects" in str(info.value)
    assert "RecursionError" not in str(info.value)


class _BucketInAnotherRegion(http.server.BaseHTTPRequestHandler):
    """A bucket in eu-west-1, as AWS S3 serves it: a request signed for any other region gets
    ``301 PermanentRedirect`` with ``x-amz-bucket-region`` and no Location; the rest is a tiny
    in-memory bucket (PUT with If-None-Match, GET, HEAD, ListObjectsV2, DeleteObjects)."""

    protocol_version = "HTTP/1.1"
    objects: dict[str, bytes]
    serves = "eu-west-1"
    """The signing region answered; any other is redirected (to eu-west-1, which it is not
    when ``serves`` names no region: a redirect no client can follow)."""

    def _send(self, status: int, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name.replace("_", "-"), value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _serve(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if f"/{self.serves}/s3/" not in self.headers.get("Authorization", ""):
            error = b"<Error><Code>PermanentRedirect</Code><Message>use eu-west-1</Message></Error>"
            self._send(301, error, x_amz_bucket_region="eu-west-1")
            return
        path, _, query = self.path.partition("?")
        key = path.partition("/bucket/")[2]
        modified = "Mon, 01 Jan 2024 00:00:00 GMT"
        if self.command == "PUT":
            if self.headers.get("If-None-Match") == "*" and key in self.objects:
                self._send(412, b"<Error><Code>PreconditionFailed</Code></Error>")
            else:
                self.objects[key] = body
                self._send(200, ETag='"e"')
        elif self.command == "POST":  # DeleteObjects
            for name in list(self.objects):
                if f"<Key>{name}</Key>".encode() in body:
                    del self.objects[name]
            self._send(200, b"<DeleteResult></DeleteResult>")
        elif "list-type=2" in query:
            contents = "".join(
                f'<Contents><Key>{name}</Key><Size>{len(data)}</Size><ETag>"e"</ETag>'
                "<LastModified>2024-01-01T00:00:00.000Z</LastModified></Contents>"
                for name, data in sorted(self.objects.items())
            )
            listing = (
                f"<ListBucketResult><Name>bucket</Name><IsTruncated>false</IsTruncated>{contents}"
            )
            self._send(200, (listing + "</ListBucketResult>").encode())
        elif key in self.objects:
            self._send(200, self.objects[key], ETag='"e"', Last_Modified=modified)
        else:
            self._send(404, b"<Error><Code>NoSuchKey</Code></Error>")

    do_GET = do_PUT = do_POST = do_HEAD = _serve  # noqa: N815 (http.server names)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def _bucket_in_another_region(serves: str = "eu-west-1") -> Iterator[str]:
    handler = type("Handler", (_BucketInAnotherRegion,), {"objects": {}, "serves": serves})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_boto3_still_follows_a_region_redirect(aws_env: pytest.MonkeyPatch) -> None:
    # The redirect and 404 checks must leave botocore's own region redirect alone: a bucket in
    # another region than `region` keeps working (AWS answers 301 with x-amz-bucket-region).
    with _bucket_in_another_region() as endpoint:
        store = bw.open_store("s3://bucket/p", endpoint_url=endpoint, **_credentials(), **FAST)
        store.put("k", b"v")
        assert store.get("k") == b"v"
        assert store.head("k").size == 1
        assert [meta.key for meta in store.list()] == ["k"]
        store.delete_many(["k"])
        assert list(store.list()) == []


def test_boto3_names_the_region_of_a_redirect_it_cannot_follow(
    aws_env: pytest.MonkeyPatch,
) -> None:
    # botocore follows one region redirect; when that does not help (an endpoint_url of another
    # region's AWS endpoint), AWS's own words ("must be addressed using the specified
    # endpoint") said neither which region nor what to change.
    with (
        _bucket_in_another_region(serves="no-region") as endpoint,
        pytest.raises(bw.StoreError) as info,
    ):
        bw.open_store("s3://bucket/p", endpoint_url=endpoint, **_credentials(), **FAST)
    assert not isinstance(info.value, bw.TransientStoreError | bw.AmbiguousWriteError)
    assert "region 'eu-west-1'" in str(info.value)
    assert "set region" in str(info.value)


def test_obstore_names_a_bucket_in_another_region_not_a_transient_failure(
    aws_env: pytest.MonkeyPatch,
) -> None:
    # object_store does not follow S3's region redirect ("Received redirect without
    # LOCATION"). Before: TransientStoreError (its debug dump's "retry_timeout" matched the
    # transient pattern), so producers and consumers retried a wrong region for ever, and
    # writes were "ambiguous" although a 301 stores nothing.
    with _bucket_in_another_region() as endpoint:
        with pytest.raises(bw.StoreError) as opening:
            bw.open_store(
                "s3://bucket/p", s3_client="obstore", endpoint_url=endpoint, **_credentials()
            )
        store = bw.open_store(
            "s3://bucket/p", s3_client="obstore", verify_conditional_writes=False,
            endpoint_url=endpoint, **_credentials(),
        )  # fmt: skip
        calls: list[Callable[[], object]] = [
            lambda: store.put("k", b"v"),
            lambda: store.get("k"),
            lambda: list(store.list()),
        ]
        for call in [lambda: opening.value, *calls]:
            try:
                error = call()
            except bw.StoreError as exc:
                error = exc
            assert isinstance(error, bw.StoreError)
            assert not isinstance(error, bw.TransientStoreError | bw.AmbiguousWriteError)
            assert "region" in str(error)
            assert "us-east-1" in str(error)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_silent_endpoint_fails_in_bounded_time_as_a_timeout_on_both_clients(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Before: obstore called a connected-but-silent endpoint "unreachable" (StoreUnavailable,
    # which consumers wait out forever), boto3 a transient read timeout.
    with fake_endpoint("silent") as silent:
        store = bw.open_store(
            "s3://bucket/p",
            s3_client=client,
            verify_conditional_writes=False,
            endpoint_url=silent.url,
            **_credentials(),
            **FAST,
        )
        for call in (lambda: store.get("k"), lambda: store.head("k"), lambda: list(store.list())):
            started = time.monotonic()
            with pytest.raises(bw.TransientStoreError) as info:
                call()
            assert time.monotonic() - started < BOUND
            assert not isinstance(info.value, bw.StoreUnavailable)
            assert silent.url in str(info.value) or "timeout" in str(info.value).lower()
        started = time.monotonic()
        with pytest.raises(bw.AmbiguousWriteError):
            store.put("k", b"v")  # the request was sent: it may have landed
        assert time.monotonic() - started < BOUND
        started = time.monotonic()
        with pytest.raises(bw.StoreError) as opening:
            bw.open_store(
                "s3://bucket/p", s3_client=client, endpoint_url=silent.url, **_credentials(), **FAST
            )
        assert time.monotonic() - started < BOUND
        assert SECRET not in _everything_said(opening.value)


@pytest.mark.parametrize("client", CLIENTS)
def test_open_store_gives_up_on_a_silent_endpoint_after_probe_timeout(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Before: the probe waited read_timeout on every attempt, and then again for its read-back
    # and its delete: minutes with the defaults (60 s x 5 attempts), here 5 s x 3 each.
    probe_timeout = 0.5
    with fake_endpoint("silent") as silent:
        started = time.monotonic()
        with pytest.raises(bw.StoreUnavailable) as info:
            bw.open_store(
                "s3://bucket/p", s3_client=client, endpoint_url=silent.url, **_credentials(),
                read_timeout=5.0, max_attempts=3, probe_timeout=probe_timeout,
            )  # fmt: skip
        elapsed = time.monotonic() - started
        # It waited probe_timeout for an answer, not read_timeout (the bound leaves the time
        # to build the clients to a loaded machine), then gave up: one request, one attempt (a
        # retry, read-back or delete would open another connection to the silent endpoint).
        assert probe_timeout <= elapsed < 5.0
        assert silent.connections == 1
        assert silent.closed_by_client(timeout=5.0)  # no socket left open to the endpoint
    said = str(info.value)
    assert silent.url in said
    assert "accepted the connection but did not answer within 0.5 s" in said
    assert "probe_timeout" in said  # what to change for a server that is only slow
    assert "s3://bucket/p" in said
    assert SECRET not in _everything_said(info.value)


@pytest.mark.parametrize("client", CLIENTS)
def test_the_probe_waits_no_longer_than_read_timeout(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    with fake_endpoint("silent") as silent:
        started = time.monotonic()
        with pytest.raises(bw.StoreUnavailable, match=r"did not answer within 0\.5 s") as info:
            bw.open_store(
                "s3://bucket/p", s3_client=client, endpoint_url=silent.url, **_credentials(),
                read_timeout=0.5, probe_timeout=30.0,
            )  # fmt: skip
        assert time.monotonic() - started < BOUND  # far below probe_timeout
        assert silent.connections == 1
        # read_timeout was the limit: a larger probe_timeout would not help, so it is not asked.
        assert "pass a larger read_timeout (now 0.5 s)" in str(info.value)
        assert "probe_timeout" not in str(info.value)


def test_open_store_says_it_is_waiting_for_a_silent_endpoint(
    aws_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # With default timeouts a silent endpoint fails the probe only after minutes; before, the
    # user saw nothing at all until then.
    aws_env.setattr(store_open, "SLOW_PROBE_NOTICE", 0.05)
    with (
        fake_endpoint("silent") as silent,
        caplog.at_level(logging.WARNING, "batchweave.store"),
        pytest.raises(bw.StoreError),
    ):
        bw.open_store("s3://bucket/p", endpoint_url=silent.url, **_credentials(), **FAST)
    notices = [r.getMessage() for r in caplog.records if "probe" in r.getMessage()]
    assert len(notices) == 1, notices
    assert "s3://bucket/p" in notices[0]
    assert "still waiting" in notices[0]
    assert SECRET not in notices[0]


def test_a_prompt_probe_logs_no_waiting_notice(
    moto_endpoint: S3Endpoint,
    s3_bucket: str,
    s3_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    timers_before = {t for t in threading.enumerate() if isinstance(t, threading.Timer)}
    with caplog.at_level(logging.WARNING, "batchweave.store"):
        store = bw.open_store(f"s3://{s3_bucket}/{s3_prefix}", **moto_endpoint.store_options())
        # The probe returned: its notice timer must be cancelled, not merely not due yet. A
        # timer left running would fire (and log) within this join.
        for timer in set(threading.enumerate()) - timers_before:
            if isinstance(timer, threading.Timer):
                timer.join(store_open.SLOW_PROBE_NOTICE + 5)
    store.close()
    assert not [r for r in caplog.records if "still waiting" in r.getMessage()]


class _StripIfNoneMatch(http.server.BaseHTTPRequestHandler):
    """Forwards every request to ``upstream`` without its If-None-Match header: an S3 server
    that silently ignores conditional writes, as some S3-compatible stores do."""

    protocol_version = "HTTP/1.1"
    upstream: tuple[str, int]

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        dropped = ("if-none-match", "expect", "host", "connection")
        headers = {k: v for k, v in self.headers.items() if k.lower() not in dropped}
        upstream = http.client.HTTPConnection(*self.upstream, timeout=10)
        try:
            upstream.request(self.command, self.path, body=body, headers=headers)
            reply = upstream.getresponse()
            data = reply.read()
        finally:
            upstream.close()
        self.send_response(reply.status, reply.reason)
        for name, value in reply.getheaders():
            if name.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward  # noqa: N815 (http.server names)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.moto_server
@pytest.mark.parametrize("client", CLIENTS)
def test_a_real_s3_server_ignoring_if_none_match_is_refused_as_such(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str, client: str
) -> None:
    # The probe's read-back (added for web pages) must still call a genuine S3 server that
    # ignores If-None-Match what it is: ConditionalWritesUnsupported, probe object deleted.
    parts = urlsplit(moto_endpoint.endpoint_url)
    handler = type("Handler", (_StripIfNoneMatch,), {"upstream": (parts.hostname, parts.port)})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        options = moto_endpoint.store_options()
        options["endpoint_url"] = f"http://127.0.0.1:{proxy.server_address[1]}"
        with pytest.raises(bw.ConditionalWritesUnsupported, match="verify_conditional_writes"):
            bw.open_store(f"s3://{s3_bucket}/{s3_prefix}", s3_client=client, **options)
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join(5)
    direct = bw.S3Store(s3_bucket, s3_prefix, **moto_endpoint.store_options())
    assert list(direct.list()) == []  # the probe cleaned up after itself


# -- malformed endpoints and options -----------------------------------------------------------


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        ("http://127.0.0.1:99999", "Port out of range"),
        ("http://127.0.0.1:-1", "malformed"),
        ("http://127.0.0.1:abc", "malformed"),
        ("http://127.0.0.1:0", "port 0"),
        ("http://[::1:9000", "Invalid IPv6 URL"),
        ("http://127.0.0.1:9000?region=x", "query or fragment"),
        ("http://127.0.0.1:9000#x", "query or fragment"),
        (" http://127.0.0.1:9000", "spaces or control characters"),
        ("http://127.0.0.1:9000\n", "spaces or control characters"),
        ("http://127.0.0.1:9000/bucket", "has a path ('/bucket')"),
    ],
)
def test_malformed_endpoints_are_refused_naming_the_problem(
    client: str, endpoint: str, says: str
) -> None:
    # Before: all accepted; the path silently stored objects under bucket/bucket/prefix/...,
    # a bad IPv6 literal raised a bare ValueError("Invalid IPv6 URL").
    with pytest.raises(bw.InvalidStoreURL) as info:
        bw.open_store("s3://bucket/p", s3_client=client, endpoint_url=endpoint, **_credentials())
    assert says in str(info.value)
    assert "s3://bucket" in str(info.value)


def test_well_formed_endpoints_are_accepted() -> None:
    for endpoint in ("http://127.0.0.1:9000", "http://127.0.0.1:9000/", "https://[::1]:443"):
        for client in CLIENTS:
            store = bw.open_store(
                "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
                endpoint_url=endpoint,
            )  # fmt: skip
            assert store.endpoint_url == endpoint  # type: ignore[attr-defined]
            store.close()


def test_obstore_does_not_take_its_retry_timeout_setting_for_a_timeout() -> None:
    # object_store's debug dump of every RetryError names its retry_timeout setting; matched
    # as "timeout", every otherwise unknown error was transient and retried without end.
    store = bw.open_store(
        "s3://bucket/p", s3_client="obstore", verify_conditional_writes=False,
        endpoint_url="http://127.0.0.1:9", **_credentials(),
    )  # fmt: skip
    dump = (
        "Generic S3 error: Error performing GET http://127.0.0.1:9/bucket/p/k - unexpected "
        "reply\n\nDebug source:\nGeneric {\n    source: RetryError(\n        RetryErrorImpl "
        "{\n            retries: 0,\n            retry_timeout: 180s,\n        },\n    ),\n}"
    )
    error = store._translate(Exception(dump), op="get", key="k")  # type: ignore[attr-defined]
    assert type(error) is bw.StoreError
    timed_out = dump.replace("unexpected reply", "operation timed out")
    error = store._translate(Exception(timed_out), op="get", key="k")  # type: ignore[attr-defined]
    assert isinstance(error, bw.TransientStoreError)
    store.close()


class _IgnoresRange(http.server.BaseHTTPRequestHandler):
    """Answers every GET with 200 and the whole 64 MiB object, whatever Range asked for."""

    protocol_version = "HTTP/1.1"
    size = 64 << 20
    block = bytes(range(256)) * 256  # 64 KiB; byte i of the object is i % 256
    started = 0
    sent: ClassVar[list[int]] = []
    """Bytes sent per GET that has ended (the client read them, or closed the connection)."""
    changed = threading.Condition()

    def _head(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(self.size))
        self.send_header("ETag", '"whole"')
        self.send_header("Last-Modified", "Wed, 25 Nov 2026 10:00:00 GMT")
        self.end_headers()

    def do_HEAD(self) -> None:
        self._head()

    def do_GET(self) -> None:
        with self.changed:
            type(self).started += 1
        self._head()
        sent = 0
        try:
            while sent < self.size:
                self.wfile.write(self.block)
                sent += len(self.block)
        except OSError:
            pass  # the client stopped reading and closed the connection
        with self.changed:
            self.sent.append(sent)
            self.changed.notify_all()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.mark.parametrize("client", CLIENTS)
def test_a_bounded_read_stays_bounded_on_a_server_that_ignores_range(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Before: obstore read the whole body of a server that ignored Range before slicing it, so
    # a manifest read (bounded to 64 MiB + 1) could download any amount (boto3: fixed earlier).
    _IgnoresRange.started = 0
    _IgnoresRange.sent.clear()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _IgnoresRange)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        store = bw.open_store(
            "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=f"http://127.0.0.1:{server.server_address[1]}", **_credentials(),
        )  # fmt: skip
        assert store.get_range("k", bw.Bounded(1000, 1100)) == bytes(
            i % 256 for i in range(1000, 1100)
        )
        store.close()
        with _IgnoresRange.changed:  # every GET made has ended: none is still streaming
            ended = _IgnoresRange.changed.wait_for(
                lambda: len(_IgnoresRange.sent) == _IgnoresRange.started, BOUND
            )
        assert ended
    finally:
        server.shutdown()
        server.server_close()
        thread.join(BOUND)
    assert _IgnoresRange.sent
    assert max(_IgnoresRange.sent) < _IgnoresRange.size // 4  # socket buffers, not the object


@pytest.mark.parametrize("client", CLIENTS)
def test_a_gateway_path_in_the_endpoint_is_kept_before_the_bucket(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Some gateways serve their S3 API under a path (Supabase: /storage/v1/s3); only a path
    # that names the bucket again is the mistake refused above.
    with fake_endpoint("not-found-page") as gateway:
        store = bw.open_store(
            "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=f"{gateway.url}/storage/v1/s3", **_credentials(), **FAST,
        )  # fmt: skip
        with pytest.raises(bw.StoreError):
            store.get("k")
        store.close()
    assert gateway.request_lines
    assert all(" /storage/v1/s3/bucket/p/k " in line for line in gateway.request_lines)


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("max_attempts", 0, "max_attempts must be an integer >= 1"),
        ("max_attempts", 2.5, "max_attempts must be an integer >= 1"),
        ("connect_timeout", -1, "connect_timeout must be a positive number"),
        ("read_timeout", "5", "read_timeout must be a positive number"),
        ("read_timeout", float("nan"), "read_timeout must be a positive number"),
        ("read_timeout", np.float64("inf"), "read_timeout must be a positive number"),
        ("probe_timeout", 0, "probe_timeout must be a positive number"),
        ("probe_timeout", True, "probe_timeout must be a positive number"),
        ("max_attempts", np.int64(0), "max_attempts must be an integer >= 1"),
        ("max_attempts", np.True_, "max_attempts must be an integer >= 1"),
        ("max_attempts", np.float64(2.0), "max_attempts must be an integer >= 1"),
        ("addressing_style", "dns", "addressing_style must be"),
        ("access_key_id", "AKID", "access_key_id was given without secret_access_key"),
        ("secret_access_key", SECRET, "secret_access_key was given without access_key_id"),
    ],
)
def test_bad_client_options_are_refused_naming_the_option(
    client: str, option: str, value: object, says: str
) -> None:
    # Before: botocore's own exceptions (not BatchWeaveErrors), an obstore TypeError or a
    # multi-line "Debug source" dump ("Missing SecretAccessKey").
    with pytest.raises(bw.InvalidStoreURL) as info:
        bw.open_store("s3://bucket/p", s3_client=client, **{option: value})  # type: ignore[arg-type]
    assert says in str(info.value)
    assert "s3://bucket/p" in str(info.value)
    assert SECRET not in _everything_said(info.value)
    # Where the URL is only passed on (WeaveDataset), the same check, in the same words.
    with pytest.raises(bw.InvalidStoreURL) as checked:
        store_open.check_store_url("s3://bucket/p", s3_client=client, **{option: value})
    assert str(checked.value) == str(info.value)


@pytest.mark.parametrize("client", CLIENTS)
def test_numpy_numbers_are_taken_for_numeric_options(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Before: np.int64(8) was "max_attempts must be an integer >= 1, got 8" (a value computed
    # with NumPy, e.g. from a config array), and so for every timeout given as a NumPy float.
    options: dict[str, Any] = {
        "connect_timeout": np.float32(1.5),
        "read_timeout": np.int64(7),
        "probe_timeout": np.float64(2.5),
        "max_attempts": np.int64(4),
    }
    if client == "boto3":
        options["max_pool_connections"] = np.int32(3)
    store_open.check_store_url("s3://bucket/p", s3_client=client, **options)
    store = bw.open_store(
        "s3://bucket/p", s3_client=client, verify_conditional_writes=False, **_credentials(),
        **options,
    )  # fmt: skip
    checked = store._options  # type: ignore[attr-defined]
    assert (checked.connect_timeout, checked.read_timeout, checked.probe_timeout) == (1.5, 7, 2.5)
    assert checked.max_attempts == 4
    # Plain Python numbers reach the clients (obstore's timedelta refuses a NumPy float32).
    for value in (checked.connect_timeout, checked.read_timeout, checked.probe_timeout):
        assert type(value) is float
    assert type(checked.max_attempts) is int
    if client == "boto3":
        config = store.client.meta.config  # type: ignore[attr-defined]
        assert (config.max_pool_connections, config.read_timeout) == (3, 7.0)
        assert config.retries["total_max_attempts"] == 4


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"])
@pytest.mark.parametrize(
    ("endpoint", "says"),
    [
        (f"http://127.0.0.1:{free_port()}/bucket", "has a path ('/bucket')"),
        ("http://127.0.0.1:99999", "Port out of range"),
        ("http://user:PASSzzz@127.0.0.1:9000", "carries credentials"),
        # Before (boto3): botocore's bare ValueError "Invalid endpoint", naming no variable.
        ("127.0.0.1:9000", "e.g. http://127.0.0.1:9000"),
    ],
)
def test_an_endpoint_from_the_environment_is_checked_like_an_explicit_one(
    aws_env: pytest.MonkeyPatch, client: str, variable: str, endpoint: str, says: str
) -> None:
    # Before: boto3 only refused credentials in it; obstore took anything (a bad port made
    # object_store panic, a path misplaced every object, a password went into every request).
    aws_env.setenv(variable, endpoint)
    with pytest.raises(bw.InvalidStoreURL) as info:
        bw.open_store("s3://bucket/p", s3_client=client, **_credentials())
    assert says in str(info.value)
    assert variable in str(info.value)
    assert "PASSzzz" not in _everything_said(info.value)


def test_a_missing_profile_from_the_environment_is_named(aws_env: pytest.MonkeyPatch) -> None:
    # Before: "AWS profile None is not in the AWS config files" for AWS_PROFILE=nope.
    aws_env.setenv("AWS_PROFILE", "nope-audit")
    with pytest.raises(bw.InvalidStoreURL, match=r"'nope-audit' \(from AWS_PROFILE\)"):
        bw.open_store("s3://bucket/p", verify_conditional_writes=False)


@pytest.mark.moto_server
@pytest.mark.parametrize("client", CLIENTS)
def test_an_http_endpoint_from_the_environment_works_on_both_clients(
    aws_env: pytest.MonkeyPatch, moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str,
    client: str,
) -> None:  # fmt: skip
    # Before: obstore refused every request to it with TransientStoreError "builder error"
    # (plain http was allowed only for an explicit endpoint_url).
    aws_env.setenv("AWS_ENDPOINT_URL", moto_endpoint.endpoint_url)
    with bw.open_store(f"s3://{s3_bucket}/{s3_prefix}", s3_client=client, **_credentials()) as st:
        st.put("k", b"v")
        assert st.get("k") == b"v"
    with fake_endpoint("silent") as silent:
        aws_env.setenv("AWS_ENDPOINT_URL", silent.url)
        with pytest.raises(bw.TransientStoreError) as info:
            bw.open_store(
                "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
                **_credentials(), **FAST,
            ).get("k")  # fmt: skip
        assert silent.url in str(info.value)  # the endpoint in use, not "AWS S3"


@pytest.mark.parametrize(("client", "kind"), [("boto3", None), ("obstore", "not-found-page")])
@pytest.mark.parametrize(
    ("key_id", "secret"), [("a", "b"), ("test", "test"), ("testing", "testing")]
)
def test_toy_credentials_do_not_mask_words_of_a_message(
    aws_env: pytest.MonkeyPatch, client: str, kind: str | None, key_id: str, secret: str
) -> None:
    # Before: access key "a" and secret "b" (a test setup) turned the request URL in messages
    # into "/***ucket/p/..." and "_***tchwe***ve"; moto's usual "test"/"testing" masked every
    # "tests/" prefix. Real secrets are 40 characters (AWS) or at least 8 (MinIO).
    credentials = {"access_key_id": key_id, "secret_access_key": secret, "region": "us-east-1"}
    with contextlib.ExitStack() as stack:
        url = f"http://127.0.0.1:{free_port()}"  # nothing listening (boto3 quotes the URL)
        if kind is not None:
            url = stack.enter_context(fake_endpoint(kind)).url  # obstore quotes it on a 404
        store = bw.open_store(
            "s3://bucket/tests-p", s3_client=client, verify_conditional_writes=False,
            endpoint_url=url, **credentials, **FAST,
        )  # fmt: skip
        with pytest.raises(bw.StoreError) as info:
            store.get("batchweave-testing-key")
    assert f"{url}/bucket/tests-p/batchweave-testing-key" in str(info.value)


def test_a_secret_of_eight_characters_is_masked(aws_env: pytest.MonkeyPatch) -> None:
    secret = "s3cr3t-8"
    store = bw.open_store(
        "s3://bucket/p", verify_conditional_writes=False, access_key_id="AKIDTOY",
        secret_access_key=secret, region="us-east-1",
    )  # fmt: skip
    assert store._scrub(f"x {secret} y") == "x *** y"  # type: ignore[attr-defined]


def test_a_pool_of_no_connections_is_refused() -> None:
    with pytest.raises(bw.InvalidStoreURL, match="max_pool_connections must be an integer >= 1"):
        bw.open_store("s3://bucket/p", max_pool_connections=0)


def test_a_malformed_store_url_is_an_invalid_store_url() -> None:
    # Before: a bare ValueError("Invalid IPv6 URL") naming nothing.
    with pytest.raises(bw.InvalidStoreURL, match=r"'s3://\[::1/p' is malformed"):
        bw.open_store("s3://[::1/p")


# -- credentials -------------------------------------------------------------------------------


@contextlib.contextmanager
def _metadata_service(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeEndpoint]:
    """A stand-in for the EC2 instance metadata service on 127.0.0.1 (it answers 404)."""
    with fake_endpoint("not-found-page") as imds:
        monkeypatch.setenv("AWS_METADATA_ENDPOINT", imds.url)  # where object_store asks
        yield imds


def test_obstore_without_credentials_never_asks_a_disabled_metadata_service(
    aws_env: pytest.MonkeyPatch,
) -> None:
    # Before: obstore ignored AWS_EC2_METADATA_DISABLED=true (boto3 honours it), asked the
    # metadata service anyway, and the error called the S3 endpoint unreachable.
    with _metadata_service(aws_env) as imds, fake_endpoint("silent") as s3:
        with pytest.raises(bw.AccessDenied, match="no usable AWS credentials") as info:
            bw.open_store("s3://bucket/p", s3_client="obstore", endpoint_url=s3.url, **FAST)
        assert imds.connections == 0
        assert s3.connections == 0
        assert "AWS_ACCESS_KEY_ID" in str(info.value)


def test_obstore_whose_metadata_service_fails_says_credentials_are_missing(
    aws_env: pytest.MonkeyPatch,
) -> None:
    # Before: only the default metadata address was recognised; a configured one (or a proxy's)
    # read as "the S3 endpoint is unreachable".
    aws_env.delenv("AWS_EC2_METADATA_DISABLED")
    with _metadata_service(aws_env) as imds, fake_endpoint("silent") as s3:
        with pytest.raises(bw.AccessDenied, match="no usable AWS credentials"):
            bw.open_store("s3://bucket/p", s3_client="obstore", endpoint_url=s3.url, **FAST)
        assert imds.connections > 0


@pytest.mark.parametrize("client", CLIENTS)
def test_no_credentials_at_all_are_access_denied_on_both_clients(
    aws_env: pytest.MonkeyPatch, moto_endpoint: S3Endpoint, client: str
) -> None:
    with _metadata_service(aws_env) as imds:  # so that even a regression stays on loopback
        with pytest.raises(bw.AccessDenied, match="no usable AWS credentials"):
            bw.open_store("s3://b/p", s3_client=client, endpoint_url=moto_endpoint.endpoint_url)
        assert imds.connections == 0  # AWS_EC2_METADATA_DISABLED=true is honoured


@pytest.mark.seaweedfs
@pytest.mark.parametrize("client", CLIENTS)
def test_a_wrong_secret_is_access_denied_on_both_clients_without_echoing_it(
    aws_env: pytest.MonkeyPatch,
    seaweedfs_endpoint: S3Endpoint,
    s3_bucket: str,
    s3_prefix: str,
    client: str,
) -> None:
    options = seaweedfs_endpoint.store_options() | {"secret_access_key": SECRET, **FAST}
    started = time.monotonic()
    with pytest.raises(bw.AccessDenied) as info:
        bw.open_store(f"s3://{s3_bucket}/{s3_prefix}", s3_client=client, **options)
    assert time.monotonic() - started < BOUND
    assert "check the credentials" in str(info.value)
    assert SECRET not in _everything_said(info.value)


@pytest.mark.moto_server
@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "environment"])
def test_botocore_debug_logs_never_show_the_session_token_or_the_secret(
    aws_env: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    moto_endpoint: S3Endpoint,
    s3_bucket: str,
    s3_prefix: str,
    explicit: bool,
) -> None:
    # Before: an application logging at DEBUG (logging.basicConfig(level=DEBUG)) wrote every
    # request's X-Amz-Security-Token to its logs through botocore.endpoint and botocore.auth.
    credentials: dict[str, Any] = {"access_key_id": "AKIDENVAUDIT", "secret_access_key": SECRET}
    if explicit:
        credentials["session_token"] = TOKEN
    else:
        aws_env.setenv("AWS_ACCESS_KEY_ID", "AKIDENVAUDIT")
        aws_env.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
        aws_env.setenv("AWS_SESSION_TOKEN", TOKEN)
        credentials = {}
    caplog.set_level(logging.DEBUG)  # the root logger: botocore's loggers included
    store = bw.open_store(
        f"s3://{s3_bucket}/{s3_prefix}",
        endpoint_url=moto_endpoint.endpoint_url,
        region="us-east-1",
        **credentials,
    )
    store.put("k", b"v")
    assert store.get("k") == b"v"
    with pytest.raises(bw.ObjectNotFound) as info:
        store.get("missing")
    store.close()
    logged = caplog.text + "".join(str(r.msg) for r in caplog.records)
    assert "X-Amz-Security-Token" in logged  # the header is logged, its value is not
    for secret in (SECRET, TOKEN):
        assert secret not in logged
        assert secret not in _everything_said(info.value)
        assert secret not in repr(store)


# -- the CLI -----------------------------------------------------------------------------------


def _run_cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(cli, list(args), env=env, catch_exceptions=False)
    return result.exit_code, result.output + (result.stderr if result.stderr_bytes else "")


def test_cli_refuses_a_malformed_url_in_one_named_line() -> None:
    # Before: "batchweave: error: Invalid IPv6 URL" (a bare ValueError, no class, no URL).
    code, out = _run_cli("inspect", "s3://[::1/p", "runs/a")
    assert code == 2
    assert "InvalidStoreURL: store URL 's3://[::1/p' is malformed" in out


def test_cli_names_a_bad_namespace_as_the_namespace(tmp_path: Any) -> None:
    # Before: "object key '../x' has ..." for a namespace argument the user typed.
    code, out = _run_cli("inspect", str(tmp_path), "../x")
    assert code == 2
    assert "namespace '../x' cannot be used in object keys" in out


def test_cli_against_a_web_page_says_so_and_shows_no_secret(aws_env: pytest.MonkeyPatch) -> None:
    # Before: `inspect` (read-only, no probe) read the page as an empty listing and reported
    # "NamespaceNotFound", sending the operator to check the namespace name.
    env = {"AWS_ACCESS_KEY_ID": "AKIDENVAUDIT", "AWS_SECRET_ACCESS_KEY": SECRET}
    env |= {"AWS_SESSION_TOKEN": TOKEN, "BATCHWEAVE_REGION": "us-east-1"}
    with fake_endpoint("web-page") as page:
        for command in ("inspect", "verify", "reclaim"):
            code, out = _run_cli(
                command, "s3://bucket/p", "runs/a", "--endpoint-url", page.url, env=env
            )
            assert code == 2, out
            assert "did not answer like an S3 server" in out or "object store" in out, out
            assert SECRET not in out
            assert TOKEN not in out


@pytest.mark.parametrize("kind", ["nginx-405", "403", "501"])
@pytest.mark.parametrize("command", ["check", "seal"])
def test_cli_against_a_web_servers_refusal_says_so_in_one_line(
    aws_env: pytest.MonkeyPatch, command: str, kind: str
) -> None:
    # Before: "StoreError: ... 405 Method Not Allowed", "AccessDenied", or for a 501 an
    # AmbiguousWriteError below a second stderr line "could not delete the probe object ...".
    # A child process: its stderr is all the user sees, the logged warning included.
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "AKIDENVAUDIT", "AWS_SECRET_ACCESS_KEY": SECRET}
    env |= {"BATCHWEAVE_REGION": "us-east-1"}
    args = [command, "s3://bucket/p", *(["runs/a"] if command == "seal" else [])]
    with _refusing(kind) as page:
        proc = subprocess.run(
            [sys.executable, "-m", "batchweave.cli", *args, "--endpoint-url", page.url],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("batchweave: error: StoreError: "), proc.stderr
    assert "did not answer like an S3 server" in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr


@pytest.mark.parametrize("command", ["check", "seal"])
def test_cli_probe_timeout_bounds_the_wait_for_a_silent_endpoint(
    aws_env: pytest.MonkeyPatch, command: str
) -> None:
    # --probe-timeout (env BATCHWEAVE_PROBE_TIMEOUT) reaches the probe of the commands that run
    # it (check, and open_store's probe before a write), and the message names the option.
    env = {"AWS_ACCESS_KEY_ID": "AKIDENVAUDIT", "AWS_SECRET_ACCESS_KEY": SECRET}
    env |= {"BATCHWEAVE_REGION": "us-east-1", "BATCHWEAVE_PROBE_TIMEOUT": "0.5"}
    with fake_endpoint("silent") as silent:
        args = [command, "s3://bucket/p", *(["runs/a"] if command == "seal" else [])]
        started = time.monotonic()
        code, out = _run_cli(*args, "--endpoint-url", silent.url, env=env)
        assert time.monotonic() - started < BOUND  # far below the default read_timeout (60 s)
    assert code == 2, out
    assert "did not answer within 0.5 s" in out
    assert "--probe-timeout" in out
    assert SECRET not in out


def test_cli_probe_timeout_applies_to_s3_only(tmp_path: Any) -> None:
    code, out = _run_cli("check", str(tmp_path), "--probe-timeout", "5")
    assert code == 2
    assert "--probe-timeout applies to s3:// only" in out
    code, out = _run_cli("check", "s3://bucket/p", "--probe-timeout", "0")
    assert code == 2
    assert "--probe-timeout" in out


def test_cli_refuses_an_endpoint_with_a_path_before_touching_the_store() -> None:
    port = free_port()
    code, out = _run_cli(
        "seal", "s3://bucket/p", "runs/a", "--endpoint-url", f"http://127.0.0.1:{port}/bucket"
    )
    assert code == 2
    assert "has a path ('/bucket')" in out


# -- packaging: optional extras and declared minimum versions ----------------------------------

ROOT = Path(__file__).resolve().parent.parent


def _pyproject() -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with (ROOT / "pyproject.toml").open("rb") as f:
        project: dict[str, Any] = tomllib.load(f)["project"]
    return project


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


@pytest.mark.parametrize(
    ("module", "hidden", "advice"),
    [
        ("batchweave.lance", "lance", "pip install 'batchweave[lance]'"),
        ("batchweave.torch", "torch", "pip install 'batchweave[torch]'"),
    ],
)
def test_an_integration_without_its_extra_names_the_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, hidden: str, advice: str
) -> None:
    # Before: a bare "No module named 'lance'" (the module comes from pylance, not `lance`).
    monkeypatch.setitem(sys.modules, hidden, None)  # as if not installed
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=re.escape(advice)) as info:
        importlib.import_module(module)
    assert info.value.name == hidden
    assert advice.split("[")[1].rstrip("]'") in _pyproject()["optional-dependencies"]


def test_declared_minimum_versions_have_the_apis_batchweave_calls() -> None:
    # Installing old releases is not possible here, so the bounds are checked as declared.
    # botocore 1.35.0 and 1.35.1 reject PutObject's IfNoneMatch, so every conditional create
    # failed; pylance before 6.0.0 has no LanceDataset.read_blobs (LanceSource's blob columns),
    # before 7.0.0 it refuses a blob column inside a struct.
    project = _pyproject()
    extras = project["optional-dependencies"]
    declared = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    for name in ("boto3", "botocore"):  # boto3 1.35.2 is the first to require botocore 1.35.2
        assert not declared[name].contains("1.35.1"), (name, str(declared[name]))
        assert declared[name].contains("1.35.2"), (name, str(declared[name]))
    for extra in ("lance", "test"):
        (pylance,) = [Requirement(r) for r in extras[extra] if r.startswith("pylance")]
        assert not pylance.specifier.contains("6.1.0"), (extra, str(pylance))
        assert pylance.specifier.contains("7.0.0"), (extra, str(pylance))


def test_nox_bench_installs_what_every_benchmark_imports(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: `nox -s bench` installed '.[test]' and died at bench/peers.py, which imports psutil
    # (only in the `bench` extra), so the benchmarks after it never ran.
    pytest.importorskip("nox")
    spec = importlib.util.spec_from_file_location("_noxfile_under_test", ROOT / "noxfile.py")
    assert spec is not None
    assert spec.loader is not None
    noxfile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(noxfile)

    class Session:
        posargs: ClassVar[list[str]] = []
        installed: ClassVar[list[str]] = []
        scripts: ClassVar[list[str]] = []

        def install(self, *args: str) -> None:
            self.installed.extend(args)

        def run(self, *args: str) -> None:
            self.scripts.append(args[1])

    monkeypatch.chdir(ROOT)
    noxfile.bench(Session())
    assert "bench/peers.py" in Session.scripts
    project = _pyproject()
    names = _names(project["dependencies"])
    for spec_text in Session.installed:
        if spec_text.startswith(".["):
            for extra in spec_text[2:-1].split(","):
                names |= _names(project["optional-dependencies"][extra])
    assert _names(project["optional-dependencies"]["bench"]) <= names, Session.installed
    assert "psutil" in names

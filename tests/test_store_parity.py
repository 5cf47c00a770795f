"""The boto3 and obstore S3 backends raise the same error for the same failure.

Each scenario is a scripted fake S3 endpoint on 127.0.0.1 that answers (or does not) attempt by
attempt; the same operation runs against both backends, which must agree on the error class (and
on :func:`~batchweave._outage.no_answer`). The rules are ``docs/store.md``'s error mapping: a
connection refused before anything was sent is ``StoreUnavailable``, also for a write; a write
is ambiguous when its last attempt, or an earlier one, may have landed; a read that got no
answer in time is ``StoreTimeout``.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import batchweave as bw
from batchweave._outage import no_answer
from batchweave.testing import free_port

CLIENTS = ("boto3", "obstore")
FAST: dict[str, Any] = {"connect_timeout": 1.0, "read_timeout": 0.5}
CREDENTIALS = {"access_key_id": "AKIDPARITY", "secret_access_key": "SECRETparity-123"}
LAST_MODIFIED = "Wed, 21 Oct 2026 07:28:00 GMT"
OBJECT = bytes(range(100))

Action = bytes | tuple[str, bytes]
"""A reply: the bytes to send (then close), ``("silent", b"")`` (never answer) or
``("cut", head_and_part_of_body)`` (send, then close before the body is complete)."""


def reply(status: str, body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    fields = {"Content-Type": "application/xml", "Content-Length": str(len(body))}
    fields.update(headers or {})
    fields["Connection"] = "close"
    head = f"HTTP/1.1 {status}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items())
    return (head + "\r\n").encode() + body


def s3_error(status: str, code: str) -> bytes:
    body = f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message></Error>"
    return reply(status, body.encode())


class Request:
    def __init__(self, head: str, attempt: int) -> None:
        lines = head.split("\r\n")
        self.method, self.path, _ = lines[0].split(" ", 2)
        self.headers = {
            k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])
        }
        self.attempt = attempt
        """1 for the first request this endpoint received, 2 for the next, ..."""


class Scripted:
    """An endpoint that answers each request with ``handler(request)``."""

    def __init__(self, handler: Callable[[Request], Action]) -> None:
        self.handler = handler
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.requests = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connections: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._connections.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, body = data.partition(b"\r\n\r\n")
            text = head.decode("latin-1")
            length = 0
            for line in text.lower().split("\r\n"):
                if line.startswith("content-length:"):
                    length = int(line.split(":")[1])
            if "expect: 100-continue" in text.lower():
                conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
            while len(body) < length and (chunk := conn.recv(65536)):
                body += chunk
            with self._lock:
                self.requests += 1
                request = Request(text, self.requests)
            action = self.handler(request)
            if isinstance(action, tuple):
                kind, sent = action
                if kind == "silent":
                    self._stop.wait(30)
                    return
                assert kind == "cut", kind
                conn.sendall(sent)
            else:
                conn.sendall(action)
            conn.shutdown(socket.SHUT_WR)
            self._stop.wait(0.1)
        except OSError:
            pass
        finally:
            conn.close()

    def refuse(self) -> None:
        """Stop listening: later connections are refused."""
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()

    def stop(self) -> None:
        self._stop.set()
        self.refuse()
        for conn in self._connections:
            with contextlib.suppress(OSError):
                conn.close()


@contextlib.contextmanager
def scripted(handler: Callable[[Request], Action]) -> Iterator[Scripted]:
    server = Scripted(handler)
    try:
        yield server
    finally:
        server.stop()


def store_at(url: str, client: str, **options: Any) -> bw.ObjectStore:
    return bw.open_store(
        "s3://bucket/p",
        s3_client=client,
        verify_conditional_writes=False,
        endpoint_url=url,
        region="us-east-1",
        **CREDENTIALS,
        **{**FAST, **options},
    )


OPS: dict[str, Callable[[bw.ObjectStore], object]] = {
    "put": lambda s: s.put("k", b"hello"),
    "create": lambda s: s.put_if_absent("k", b"hello"),
    "get": lambda s: s.get("k"),
    "range": lambda s: s.get_range("k", bw.Bounded(0, 80)),
    "head": lambda s: s.head("k"),
    "list": lambda s: list(s.list()),
    "delete": lambda s: s.delete_many(["k"]),
}


def outcome(
    handler: Callable[[Request], Action] | None, op: str, client: str, **options: Any
) -> bw.StoreError | None:
    """What ``op`` raises on each backend (``None``: it succeeded), with no_answer's verdict."""
    with contextlib.ExitStack() as stack:
        url = (
            stack.enter_context(scripted(handler)).url
            if handler is not None
            else f"http://127.0.0.1:{free_port()}"  # nothing listens: refused
        )
        store = stack.enter_context(store_at(url, client, **options))
        try:
            OPS[op](store)
        except bw.StoreError as exc:
            return exc
    return None


def outcome_of(call: Callable[[], object]) -> bw.StoreError | None:
    try:
        call()
    except bw.StoreError as exc:
        return exc
    return None


def same_error(handler: Callable[[Request], Action] | None, op: str, **options: Any) -> type:
    """The error class both backends raise for ``op`` (they must agree, no_answer included)."""
    errors = {client: outcome(handler, op, client, **options) for client in CLIENTS}
    classes = {client: type(error) for client, error in errors.items()}
    assert classes["boto3"] is classes["obstore"], errors
    verdicts = {client: no_answer(error) if error else False for client, error in errors.items()}
    assert verdicts["boto3"] == verdicts["obstore"], errors
    return classes["boto3"]


# -- connection refused: nothing could have been sent ------------------------------------------


@pytest.mark.parametrize("op", ["put", "create", "get", "head", "list", "delete"])
def test_a_refused_connection_is_unavailable_also_for_a_write(
    aws_env: pytest.MonkeyPatch, op: str
) -> None:
    # Before: obstore called a write to a closed port ambiguous ("read it back"), though no
    # byte of it was sent, on any attempt; boto3 StoreUnavailable.
    assert same_error(None, op, max_attempts=2) is bw.StoreUnavailable


# -- read timeouts: typed, and recognized as "no answer" ---------------------------------------


@pytest.mark.parametrize("op", ["get", "range", "head", "list", "delete"])
def test_a_read_that_gets_no_answer_is_a_store_timeout(
    aws_env: pytest.MonkeyPatch, op: str
) -> None:
    # Before: a TransientStoreError recognized by a timeout in the cause chain (boto3) or by
    # obstore's words "did not answer within".
    assert same_error(lambda r: ("silent", b""), op, max_attempts=1) is bw.StoreTimeout


@pytest.mark.parametrize("op", ["put", "create"])
def test_a_write_that_gets_no_answer_is_ambiguous_and_says_so(
    aws_env: pytest.MonkeyPatch, op: str
) -> None:
    # Before: obstore's AmbiguousWriteError was not recognized as "no answer" (boto3's was, by
    # its cause), so a client waiting for the store did not see an outage.
    for client in CLIENTS:
        error = outcome(lambda r: ("silent", b""), op, client, max_attempts=1)
        assert type(error) is bw.AmbiguousWriteError, error
        assert error.timed_out
        assert no_answer(error)


# -- a 4xx to the last attempt of a write ------------------------------------------------------


@pytest.mark.parametrize("op", ["put", "create"])
def test_a_throttled_single_attempt_write_is_a_definite_refusal(
    aws_env: pytest.MonkeyPatch, op: str
) -> None:
    # Before: obstore called a 429 to a write ambiguous like a 5xx, though 429 refuses it.
    throttled = lambda r: s3_error("429 Too Many Requests", "SlowDown")  # noqa: E731
    assert same_error(throttled, op, max_attempts=1) is bw.TransientStoreError


@pytest.mark.parametrize(
    "code", ["429 Too Many Requests/SlowDown", "400 Bad Request/RequestTimeout"]
)
def test_a_refusal_after_an_attempt_that_timed_out_is_ambiguous(
    aws_env: pytest.MonkeyPatch, code: str
) -> None:
    # Before: boto3 said TransientStoreError (obstore too, for a 400 RequestTimeout), though the
    # first attempt, which got no answer, may have stored the object.
    status, name = code.split("/")

    def handler(request: Request) -> Action:
        return ("silent", b"") if request.attempt == 1 else s3_error(status, name)

    assert same_error(handler, "put", max_attempts=2) is bw.AmbiguousWriteError


@pytest.mark.parametrize("op", ["put", "create"])
def test_a_write_answered_5xx_once_is_retried_and_succeeds(
    aws_env: pytest.MonkeyPatch, op: str
) -> None:
    # The obstore backend retries a PUT itself (object_store's retries would hide what the
    # attempts got): it still retries what object_store retried.
    def handler(request: Request) -> Action:
        if request.attempt == 1:
            return s3_error("503 Slow Down", "SlowDown")
        return reply("200 OK", b"", {"ETag": '"abc"'})

    for client in CLIENTS:
        with scripted(handler) as server, store_at(server.url, client, max_attempts=2) as store:
            OPS[op](store)
            assert server.requests == 2


def test_obstore_backs_off_between_put_attempts_through_its_sleep(
    aws_env: pytest.MonkeyPatch,
) -> None:
    # object_store's backoff (from 50 ms, doubling, jittered) goes through the injected sleep,
    # so retries are tested without waiting. Before: a real time.sleep.
    def handler(request: Request) -> Action:
        if request.attempt < 3:
            return s3_error("503 Slow Down", "SlowDown")
        return reply("200 OK", b"", {"ETag": '"abc"'})

    naps: list[float] = []
    with scripted(handler) as server:
        store = bw.ObstoreS3Store(
            "bucket",
            "p",
            endpoint_url=server.url,
            max_attempts=3,
            sleep=naps.append,
            **CREDENTIALS,
            **FAST,
        )
        with store:
            store.put("k", b"hello")
        assert server.requests == 3
    first, second = naps
    assert 0.05 <= first <= 0.1, naps
    assert 0.05 <= second <= 0.2, naps


# -- answers that are cut short or not S3's ----------------------------------------------------


@pytest.mark.parametrize("op", ["get", "range"])
def test_a_body_cut_short_is_transient(aws_env: pytest.MonkeyPatch, op: str) -> None:
    # Before: obstore raised a plain StoreError "request or response body error".
    def handler(request: Request) -> Action:
        headers = {"ETag": '"abc"', "Last-Modified": LAST_MODIFIED}
        body, status = OBJECT, "200 OK"
        if "range" in request.headers:
            body, status = OBJECT[:80], "206 Partial Content"
            headers["Content-Range"] = f"bytes 0-79/{len(OBJECT)}"
        headers["Content-Length"] = str(len(body))
        return ("cut", reply(status, body[: len(body) // 2], headers))  # half the body

    assert same_error(handler, op, max_attempts=1) is bw.TransientStoreError


def test_a_head_without_last_modified_is_not_s3(aws_env: pytest.MonkeyPatch) -> None:
    # Before: obstore returned last_modified=0.0 (the epoch it takes for a missing header).
    def handler(request: Request) -> Action:
        return reply("200 OK", b"", {"ETag": '"abc"', "Content-Length": "5"})

    assert same_error(handler, "head", max_attempts=1) is bw.StoreError
    for client in CLIENTS:
        assert "did not answer like an S3 server" in str(outcome(handler, "head", client))


def test_a_listed_object_without_last_modified_is_not_s3(aws_env: pytest.MonkeyPatch) -> None:
    # Before: boto3 raised a bare KeyError('LastModified') from list.
    listing = (
        b"<?xml version='1.0'?><ListBucketResult><Name>bucket</Name><Prefix>p/</Prefix>"
        b"<KeyCount>1</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
        b"<Contents><Key>p/k</Key><Size>5</Size></Contents></ListBucketResult>"
    )
    handler = lambda r: reply("200 OK", listing)  # noqa: E731
    assert same_error(handler, "list", max_attempts=1) is bw.StoreError
    for client in CLIENTS:
        assert "did not answer like an S3 server" in str(outcome(handler, "list", client))


@pytest.mark.parametrize("op", ["put", "create"])
def test_a_write_throttled_on_every_attempt_is_transient(
    aws_env: pytest.MonkeyPatch, op: str
) -> None:
    # Every attempt was refused, so nothing can have landed. Before: obstore said ambiguous (its
    # client retried without saying why; the backend now makes the attempts itself).
    throttled = lambda r: s3_error("429 Too Many Requests", "SlowDown")  # noqa: E731
    assert same_error(throttled, op, max_attempts=2) is bw.TransientStoreError


@pytest.mark.parametrize("first", ["503 Slow Down", "429 Too Many Requests"])
def test_a_refused_connection_after_an_answer_is_ambiguous_only_after_a_5xx(
    aws_env: pytest.MonkeyPatch, first: str
) -> None:
    # The server answers the first attempt, then stops listening: the retry is refused. A 5xx
    # attempt may have stored the object; a 429 refused it. (Before: boto3 called any answered
    # attempt "may have landed", obstore any retried write.)
    errors: dict[str, bw.StoreError | None] = {}
    servers: list[Scripted] = []

    def handler(request: Request) -> Action:
        servers[-1].refuse()
        return s3_error(first, "SlowDown")

    for client in CLIENTS:
        with scripted(handler) as server, store_at(server.url, client, max_attempts=2) as store:
            servers.append(server)
            errors[client] = outcome_of(lambda: store.put("k", b"x"))
    expected = bw.AmbiguousWriteError if first.startswith("503") else bw.StoreUnavailable
    assert {client: type(error) for client, error in errors.items()} == dict.fromkeys(
        CLIENTS, expected
    ), errors

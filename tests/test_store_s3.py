"""S3Store specifics: error translation, ranges, batching, credentials hygiene, real servers."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions as bex
import pytest
from botocore.awsrequest import AWSResponse
from botocore.config import Config
from botocore.stub import Stubber

from batchweave import (
    AccessDenied,
    AmbiguousWriteError,
    Bounded,
    ConcurrentWriteConflict,
    ConditionalWritesUnsupported,
    InvalidKey,
    InvalidStoreURL,
    ObjectExists,
    ObjectNotFound,
    Offset,
    PutMode,
    S3Store,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    Suffix,
    TransientStoreError,
    open_store,
)
from batchweave._outage import no_answer
from batchweave._store._s3_location import ScrubbedClientError
from batchweave.testing import S3Endpoint, free_port

BUCKET = "unit-bucket"
ACCESS_KEY = "AKIAEXAMPLEACCESSKEY"
SECRET = "example-secret-value-never-printed"


def _client(max_attempts: int = 1) -> Any:
    return boto3.client(
        "s3",
        region_name="us-east-1",
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET,
        config=Config(
            retries={"mode": "standard", "total_max_attempts": max_attempts},
            connect_timeout=0.5,
            read_timeout=0.5,
        ),
    )


@pytest.fixture
def stubbed() -> Iterator[tuple[S3Store, Stubber]]:
    """An S3Store whose client never reaches the network: responses come from a Stubber."""
    store = S3Store(BUCKET, "pre", client=_client(), access_key_id=ACCESS_KEY)
    with Stubber(store.client) as stubber:
        yield store, stubber
        stubber.assert_no_pending_responses()


# -- error translation -----------------------------------------------------------------------

Call = Callable[[S3Store], object]
_CALLS: dict[str, tuple[str, Call]] = {
    "put": ("put_object", lambda s: s.put("k", b"x")),
    "put_if_absent": ("put_object", lambda s: s.put_if_absent("k", b"x")),
    "get": ("get_object", lambda s: s.get("k")),
    "get_range": ("get_object", lambda s: s.get_range("k", Bounded(0, 4))),
    "head": ("head_object", lambda s: s.head("k")),
    "list": ("list_objects_v2", lambda s: list(s.list())),
    "delete": ("delete_objects", lambda s: s.delete_many(["k"])),
}


@pytest.mark.parametrize(
    ("call", "code", "status", "expected"),
    [
        ("put_if_absent", "PreconditionFailed", 412, ObjectExists),
        ("put_if_absent", "ConditionalRequestConflict", 409, ConcurrentWriteConflict),
        ("put_if_absent", "NotImplemented", 501, ConditionalWritesUnsupported),
        ("put_if_absent", "InternalError", 500, AmbiguousWriteError),
        ("put", "InternalError", 500, AmbiguousWriteError),
        ("put", "SlowDown", 503, AmbiguousWriteError),
        ("put", "AccessDenied", 403, AccessDenied),
        ("get", "NoSuchKey", 404, ObjectNotFound),
        ("get", "InternalError", 500, TransientStoreError),
        ("get", "SlowDown", 503, TransientStoreError),
        ("get", "AccessDenied", 403, AccessDenied),
        ("get", "InvalidAccessKeyId", 403, AccessDenied),
        ("get", "SignatureDoesNotMatch", 403, AccessDenied),
        ("get", "NoSuchBucket", 404, InvalidStoreURL),
        ("get_range", "NoSuchKey", 404, ObjectNotFound),
        ("head", "404", 404, ObjectNotFound),
        ("head", "403", 403, AccessDenied),
        ("list", "ServiceUnavailable", 503, TransientStoreError),
        ("list", "NoSuchBucket", 404, InvalidStoreURL),
        ("delete", "AccessDenied", 403, AccessDenied),
        ("delete", "InternalError", 500, TransientStoreError),
        # A condition is only asked by the conditional PUT: a 412 or 409 to another request
        # says nothing about the key (before: ObjectExists or ConcurrentWriteConflict).
        ("put", "PreconditionFailed", 412, StoreError),
        ("get", "PreconditionFailed", 412, StoreError),
        ("get_range", "PreconditionFailed", 412, StoreError),
        ("head", "PreconditionFailed", 412, StoreError),
        ("list", "PreconditionFailed", 412, StoreError),
        ("delete", "PreconditionFailed", 412, StoreError),
        ("put", "ConditionalRequestConflict", 409, StoreError),
        ("get", "ConditionalRequestConflict", 409, StoreError),
        ("list", "ConditionalRequestConflict", 409, StoreError),
        ("delete", "ConditionalRequestConflict", 409, StoreError),
    ],
)
def test_client_errors_are_translated(
    stubbed: tuple[S3Store, Stubber],
    call: str,
    code: str,
    status: int,
    expected: type[StoreError],
) -> None:
    store, stubber = stubbed
    method, fn = _CALLS[call]
    stubber.add_client_error(method, service_error_code=code, http_status_code=status)
    with pytest.raises(expected) as info:
        fn(store)
    assert type(info.value) is expected
    # The client's exception is chained scrubbed (it may quote credentials): by its type name.
    cause = info.value.__cause__
    assert isinstance(cause, ScrubbedClientError)
    assert cause.client_error.startswith(("botocore.exceptions.", "botocore.errorfactory."))
    assert "s3://unit-bucket/pre" in str(info.value)
    if expected is InvalidStoreURL:
        assert repr(BUCKET) in str(info.value)


def test_unknown_client_error_is_a_plain_store_error(stubbed: tuple[S3Store, Stubber]) -> None:
    store, stubber = stubbed
    stubber.add_client_error("get_object", service_error_code="InvalidArgument")
    with pytest.raises(StoreError) as info:
        store.get("k")
    assert type(info.value) is StoreError
    assert "InvalidArgument" in str(info.value)


def test_error_messages_scrub_credentials(stubbed: tuple[S3Store, Stubber]) -> None:
    store, stubber = stubbed
    stubber.add_client_error(
        "get_object",
        service_error_code="SignatureDoesNotMatch",
        service_message=f"bad signature for {ACCESS_KEY}",
        http_status_code=403,
    )
    with pytest.raises(AccessDenied) as info:
        store.get("k")
    assert ACCESS_KEY not in str(info.value)
    assert "***" in str(info.value)


def _raise_on_send(store: S3Store, operation: str, errors: list[Exception]) -> list[int]:
    """Make each send attempt of ``operation`` raise the next error; return the attempt log."""
    attempts: list[int] = []

    def handler(**_: Any) -> None:
        attempts.append(1)
        raise errors[min(len(attempts), len(errors)) - 1]

    store.client.meta.events.register(f"before-send.s3.{operation}", handler)
    return attempts


def _store_with_attempts(max_attempts: int) -> S3Store:
    return S3Store(BUCKET, client=_client(max_attempts))


def test_connect_error_is_unavailable_and_read_timeout_is_ambiguous_for_puts() -> None:
    url = "http://127.0.0.1:1"
    store = _store_with_attempts(1)
    _raise_on_send(store, "PutObject", [bex.EndpointConnectionError(endpoint_url=url)])
    with pytest.raises(StoreUnavailable):
        store.put_if_absent("k", b"x")

    store = _store_with_attempts(1)
    _raise_on_send(store, "PutObject", [bex.ReadTimeoutError(endpoint_url=url)])
    with pytest.raises(AmbiguousWriteError):
        store.put_if_absent("k", b"x")

    store = _store_with_attempts(1)
    _raise_on_send(store, "PutObject", [bex.ConnectionClosedError(endpoint_url=url)])
    with pytest.raises(AmbiguousWriteError):
        store.put("k", b"x", mode=PutMode.OVERWRITE)


def test_read_errors_are_transient() -> None:
    url = "http://127.0.0.1:1"
    for error in (
        bex.ReadTimeoutError(endpoint_url=url),
        bex.ConnectionClosedError(endpoint_url=url),
    ):
        store = _store_with_attempts(1)
        _raise_on_send(store, "GetObject", [error])
        with pytest.raises(TransientStoreError):
            store.get("k")


def test_put_retried_after_timeout_then_unreachable_is_ambiguous() -> None:
    # The first attempt may have landed; a later "could not connect" must not hide that.
    url = "http://127.0.0.1:1"
    store = _store_with_attempts(2)
    attempts = _raise_on_send(
        store,
        "PutObject",
        [bex.ReadTimeoutError(endpoint_url=url), bex.EndpointConnectionError(endpoint_url=url)],
    )
    with pytest.raises(AmbiguousWriteError):
        store.put_if_absent("k", b"x")
    assert len(attempts) == 2

    store = _store_with_attempts(2)
    attempts = _raise_on_send(store, "PutObject", [bex.EndpointConnectionError(endpoint_url=url)])
    with pytest.raises(StoreUnavailable):
        store.put_if_absent("k", b"x")
    assert len(attempts) == 2


class _Raw:
    def __init__(self, body: bytes) -> None:
        self.body = body

    def stream(self, **_: Any) -> Iterator[bytes]:
        yield self.body


def _answer_or_raise(store: S3Store, operation: str, outcomes: list[Any]) -> list[int]:
    """Like ``_raise_on_send``, but an ``int`` outcome is an S3 error answer with that status."""
    attempts: list[int] = []

    def handler(**_: Any) -> Any:
        attempts.append(1)
        outcome = outcomes[min(len(attempts), len(outcomes)) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        code = "SlowDown" if outcome in (429, 503) else "RequestTimeout"
        body = f"<Error><Code>{code}</Code><Message>m</Message></Error>".encode()
        return AWSResponse("http://127.0.0.1:1/b/k", outcome, {}, _Raw(body))

    store.client.meta.events.register(f"before-send.s3.{operation}", handler)
    return attempts


@pytest.mark.parametrize(
    ("outcomes", "expected"),
    [
        # A 4xx refuses only the attempt it answers; an attempt that got a 5xx or no answer
        # may have landed. Before: any answer (429 too) made a later connect error ambiguous,
        # and a 4xx after a timed-out attempt was transient.
        ([429, "refused"], StoreUnavailable),
        ([503, "refused"], AmbiguousWriteError),
        (["timeout", 429], AmbiguousWriteError),
        (["timeout", 400], AmbiguousWriteError),
        ([429, 400], TransientStoreError),
        (["refused", 429], TransientStoreError),
    ],
)
def test_a_put_is_ambiguous_exactly_when_an_attempt_may_have_landed(
    outcomes: list[Any], expected: type
) -> None:
    url = "http://127.0.0.1:1"
    errors = {
        "refused": bex.EndpointConnectionError(endpoint_url=url),
        "timeout": bex.ReadTimeoutError(endpoint_url=url),
    }
    store = _store_with_attempts(2)
    attempts = _answer_or_raise(store, "PutObject", [errors.get(o, o) for o in outcomes])
    with pytest.raises(StoreError) as info:
        store.put("k", b"x")
    assert type(info.value) is expected
    assert len(attempts) == 2


def test_a_read_timeout_is_a_store_timeout_and_a_timed_out_write_says_so() -> None:
    url = "http://127.0.0.1:1"
    store = _store_with_attempts(1)
    _raise_on_send(store, "GetObject", [bex.ReadTimeoutError(endpoint_url=url)])
    with pytest.raises(StoreTimeout, match=r"did not answer within read_timeout=0\.5 s") as read:
        store.get("k")
    assert no_answer(read.value)
    store = _store_with_attempts(1)
    _raise_on_send(store, "PutObject", [bex.ReadTimeoutError(endpoint_url=url)])
    with pytest.raises(AmbiguousWriteError) as write:
        store.put("k", b"x")
    assert write.value.timed_out
    assert no_answer(write.value)


def test_unreachable_endpoint_fails_fast() -> None:
    store = S3Store(
        BUCKET,
        endpoint_url=f"http://127.0.0.1:{free_port()}",
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET,
        connect_timeout=0.5,
        max_attempts=1,
    )
    started = time.monotonic()
    for call in (lambda: store.get("k"), lambda: store.put_if_absent("k", b"x")):
        with pytest.raises(StoreUnavailable) as info:
            call()
        assert "127.0.0.1" in str(info.value)
    assert time.monotonic() - started < 5


def test_missing_credentials_are_access_denied(
    moto_endpoint: S3Endpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(AccessDenied, match="no usable AWS credentials"):
        open_store("s3://batchweave-tests/x", endpoint_url=moto_endpoint.endpoint_url)


# -- ranges ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rng", "header"),
    [(Bounded(3, 10), "bytes=3-9"), (Offset(4), "bytes=4-"), (Suffix(5), "bytes=-5")],
)
def test_range_headers(stubbed: tuple[S3Store, Stubber], rng: Any, header: str) -> None:
    store, stubber = stubbed
    stubber.add_response(
        "get_object",
        {"Body": _body(b"abc"), "ContentRange": "bytes 0-2/10"},
        {"Bucket": BUCKET, "Key": "pre/k", "Range": header},
    )
    assert store.get_range("k", rng) == b"abc"


def test_range_past_end_returns_empty(stubbed: tuple[S3Store, Stubber]) -> None:
    store, stubber = stubbed
    stubber.add_client_error("get_object", service_error_code="InvalidRange", http_status_code=416)
    assert store.get_range("k", Offset(100)) == b""


def test_server_ignoring_range_is_sliced_locally(stubbed: tuple[S3Store, Stubber]) -> None:
    store, stubber = stubbed
    stubber.add_response("get_object", {"Body": _body(b"0123456789")})
    assert store.get_range("k", Suffix(3)) == b"789"


def _body(data: bytes) -> Any:
    import io

    from botocore.response import StreamingBody

    return StreamingBody(io.BytesIO(data), len(data))


# -- bulk delete -----------------------------------------------------------------------------


def test_delete_many_batches_at_1000_keys(stubbed: tuple[S3Store, Stubber]) -> None:
    store, stubber = stubbed
    keys = [f"k{i:05d}" for i in range(2500)]
    for start in (0, 1000, 2000):
        batch = keys[start : start + 1000]
        stubber.add_response(
            "delete_objects",
            {"Errors": [{"Key": f"pre/{batch[0]}", "Code": "NoSuchKey", "Message": "gone"}]},
            {
                "Bucket": BUCKET,
                "Delete": {"Objects": [{"Key": f"pre/{k}"} for k in batch], "Quiet": True},
            },
        )
    store.delete_many(iter(keys))


def test_delete_many_reports_per_key_errors(stubbed: tuple[S3Store, Stubber]) -> None:
    store, stubber = stubbed
    stubber.add_response(
        "delete_objects",
        {
            "Errors": [
                {"Key": "pre/a", "Code": "AccessDenied", "Message": "no"},
                {"Key": "pre/b", "Code": "AccessDenied", "Message": "no"},
            ]
        },
    )
    with pytest.raises(AccessDenied, match=r"'a'.*1 more"):
        store.delete_many(["a", "b"])


@pytest.mark.parametrize("code", ["InternalError", "ServiceUnavailable"])
def test_delete_many_reports_a_keys_transient_error_as_transient(
    stubbed: tuple[S3Store, Stubber], code: str
) -> None:
    # Before: a key's InternalError or ServiceUnavailable in a DeleteObjects result (which has
    # no status of its own) was a plain StoreError: not retried, the key recorded as refused.
    store, stubber = stubbed
    error = {"Key": "pre/b", "Code": code, "Message": "Please try again."}
    stubber.add_response("delete_objects", {"Errors": [error]})
    with pytest.raises(TransientStoreError, match=rf"'b'.*{code}"):
        store.delete_many(["a", "b"])


def test_delete_many_of_nothing_sends_nothing(stubbed: tuple[S3Store, Stubber]) -> None:
    store, _ = stubbed
    store.delete_many([])  # the Stubber fails on any unexpected request


# -- construction, URL and repr --------------------------------------------------------------


def test_url_prefix_normalization_and_no_credentials_in_repr() -> None:
    store = S3Store(
        "bkt",
        "/runs/job-1/",
        endpoint_url="http://127.0.0.1:9",
        access_key_id=ACCESS_KEY,
        secret_access_key=SECRET,
        session_token="session-token-value",
    )
    assert store.url == "s3://bkt/runs/job-1"
    assert store.prefix == "runs/job-1/"
    assert store.client.meta.config.s3 == {"addressing_style": "path"}
    for text in (repr(store), str(store), store.url):
        for secret in (ACCESS_KEY, SECRET, "session-token-value"):
            assert secret not in text
    assert S3Store("bkt").url == "s3://bkt"


def test_invalid_prefix_and_options_are_rejected() -> None:
    with pytest.raises(InvalidKey):
        S3Store("bkt", "a//b")
    with pytest.raises(InvalidStoreURL, match="both"):
        S3Store("bkt", access_key_id=ACCESS_KEY)
    with pytest.raises(InvalidStoreURL, match="no-such-profile"):
        S3Store("bkt", profile="no-such-profile")


# -- real servers ----------------------------------------------------------------------------


@pytest.mark.moto_server
def test_missing_bucket_is_reported_at_open(moto_endpoint: S3Endpoint) -> None:
    with pytest.raises(InvalidStoreURL, match="no-such-bucket-here"):
        open_store("s3://no-such-bucket-here/p", **moto_endpoint.store_options())


@pytest.mark.moto_server
def test_open_store_probe_cleans_up(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> None:
    with open_store(f"s3://{s3_bucket}/{s3_prefix}", **moto_endpoint.store_options()) as store:
        assert isinstance(store, S3Store)
        assert list(store.list()) == []
        store.put_if_absent("a", b"1")
        with pytest.raises(ObjectExists):
            store.put_if_absent("a", b"2")


@pytest.mark.seaweedfs
def test_wrong_credentials_are_access_denied(
    seaweedfs_endpoint: S3Endpoint, s3_bucket: str
) -> None:
    options = seaweedfs_endpoint.store_options() | {
        "access_key_id": ACCESS_KEY,
        "secret_access_key": SECRET,
        "max_attempts": 1,
    }
    with pytest.raises(AccessDenied) as info:
        open_store(f"s3://{s3_bucket}/wrong-creds", **options)
    for text in (str(info.value), repr(info.value)):
        assert SECRET not in text
        assert ACCESS_KEY not in text


@pytest.mark.moto_server
def test_open_store_probes_through_a_client_of_its_own_and_closes_it(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The probe waits at most probe_timeout per answer; the store open_store returns keeps the
    # data path's read_timeout and max_attempts.
    closed: list[Any] = []
    close = S3Store.close
    monkeypatch.setattr(S3Store, "close", lambda self: (closed.append(self.client), close(self)))
    options = moto_endpoint.store_options() | {"read_timeout": 7.0, "max_attempts": 4}
    store = open_store(f"s3://{s3_bucket}/{s3_prefix}", **options, probe_timeout=0.5)
    assert [c.meta.config.read_timeout for c in closed] == [0.5]  # the probe's, closed
    assert closed[0].meta.config.retries["total_max_attempts"] == 3
    assert closed[0] is not store.client
    config = store.client.meta.config
    assert (config.read_timeout, config.retries["total_max_attempts"]) == (7.0, 4)
    assert list(store.list()) == []  # the probe object was deleted through the probe client
    store.close()


def test_a_store_on_an_injected_client_is_probed_through_that_client() -> None:
    # Its connection options (and so a probe_timeout) are not used: the client is the caller's.
    store = S3Store("bkt", client=_client(), probe_timeout=0.5)
    assert store._probe_view() is None

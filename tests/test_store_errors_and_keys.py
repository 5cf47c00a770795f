"""Stores refuse the same keys and report the same failures, whatever the backend or S3 client.

A key that works on one backend only (control characters, lone surrogates, non-characters) is
``InvalidKey`` on every backend, also as a namespace given to the CLI; an invalid bucket name
is ``InvalidStoreURL`` on both S3 clients, in ``open_store`` and in the CLI, in one line.
boto3 and obstore translate the same answers into the same error leaves: a request refused
before it is sent is neither ambiguous nor transient, an unreachable endpoint is
``StoreUnavailable``, server errors are classified by their status (not by words such as "416"
in the reply), and credentials that cannot be loaded (a failing credential process, an expired
SSO login) are ``AccessDenied``. ``file://`` URLs with a NUL byte or a non-UTF-8 directory are
handled by their bytes.
"""

from __future__ import annotations

import http.server
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import boto3
import botocore.exceptions as bex
import pytest
from click.testing import CliRunner
from moto import mock_aws

import batchweave as bw
from batchweave._store._s3_location import ScrubbedClientError
from batchweave.cli._app import cli
from batchweave.testing import free_port

# -- keys that work on one backend only --------------------------------------------------------

UNPORTABLE_KEYS = (
    "tab\tkey",  # obstore refuses control characters; S3 XML cannot carry most of them
    "new\nline",  # moto answered the PUT with 404
    "del\x7fete",
    "bell\x07",
    "lone\ud800surrogate",  # not UTF-8: S3 cannot name it; FileStore raised UnicodeEncodeError
    "escaped\udcffbyte",  # FileStore wrote a file named with byte 0xff, no S3 store can
    "non\ufffecharacter",  # DeleteObjects XML with U+FFFE failed with HTTP 500 on moto
)


@pytest.fixture
def s3_store() -> Iterator[bw.ObjectStore]:
    with mock_aws():
        boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="audit-bucket")
        with bw.S3Store("audit-bucket", "p", region="us-east-1") as store:
            yield store


def _refuses_everywhere(store: bw.ObjectStore, key: str) -> None:
    calls: list[Callable[[], Any]] = [
        lambda: store.put(key, b"x"),
        lambda: store.put_if_absent(key, b"x"),
        lambda: store.get(key),
        lambda: store.head(key),
        lambda: store.get_range(key, bw.Suffix(1)),
        lambda: store.delete_many([key]),
    ]
    for call in calls:
        with pytest.raises(bw.InvalidKey, match="forbidden character"):
            call()
    assert list(store.list()) == []


@pytest.mark.parametrize("key", UNPORTABLE_KEYS, ids=repr)
def test_unportable_keys_are_invalid_on_every_backend(key: str, store: bw.ObjectStore) -> None:
    # Before: accepted by some backends and failing on others with unrelated errors
    # (AmbiguousWriteError on obstore, ObjectNotFound or HTTP 500 on S3, a bare
    # UnicodeEncodeError from FileStore), so a namespace name working on file:// broke on S3.
    _refuses_everywhere(store, key)


def test_unportable_keys_are_invalid_on_s3(s3_store: bw.ObjectStore) -> None:
    for key in UNPORTABLE_KEYS:
        _refuses_everywhere(s3_store, key)


def test_keys_with_legal_odd_characters_still_work(store: bw.ObjectStore) -> None:
    for key in ("café/naïve-日本-🙂", "a%20b~c#d", "nel\u0085and\x80c1"):
        store.put(key, key.encode())
        assert store.get(key) == key.encode()


def test_namespace_with_a_control_character_is_a_one_line_cli_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["inspect", str(tmp_path), "runs/job\t42"])
    assert result.exit_code == 2, result.output
    assert "InvalidKey" in result.output
    assert "forbidden character" in result.output
    assert "Traceback" not in result.output


# -- bucket names ------------------------------------------------------------------------------

BAD_BUCKETS = ("bad bucket", "bad_bucket!", "host:9000", "b" * 256)
SECRET = "audit-secret-value"
"""The secret key of :func:`_audited`'s clients: no error message may contain it."""


def _audited(
    cls: type[bw.S3Store] | type[bw.ObstoreS3Store],
    endpoint_url: str,
    bucket: str = "bucket",
    *prefix: str,
    **options: Any,
) -> bw.S3Store | bw.ObstoreS3Store:
    """A ``cls`` client of ``bucket`` at ``endpoint_url`` with static keys and one attempt."""
    return cls(
        bucket,
        *prefix,
        endpoint_url=endpoint_url,
        access_key_id="AKIDAUDIT",
        secret_access_key=SECRET,
        max_attempts=1,
        **options,
    )


@pytest.mark.parametrize("bucket", BAD_BUCKETS, ids=lambda b: b[:12])
@pytest.mark.parametrize("cls", [bw.S3Store, bw.ObstoreS3Store])
def test_invalid_bucket_names_are_refused_as_a_bad_url(
    cls: type[bw.S3Store] | type[bw.ObstoreS3Store], bucket: str
) -> None:
    # Before: boto3 raised ParamValidationError at the first request, reported as
    # AmbiguousWriteError for a put and TransientStoreError (retried forever by consumers) for
    # reads; obstore panicked in Rust (pyo3 PanicException, a BaseException, with a backtrace on
    # stderr) on a bucket with a space.
    with pytest.raises(bw.InvalidStoreURL, match="not a valid S3 bucket name"):
        _audited(cls, f"http://127.0.0.1:{free_port()}", bucket, "prefix")


def test_open_store_and_cli_refuse_a_bad_bucket_in_one_line() -> None:
    with pytest.raises(bw.InvalidStoreURL, match="'bad_bucket!' is not a valid S3 bucket"):
        bw.open_store("s3://bad_bucket!/runs", verify_conditional_writes=False)
    result = CliRunner().invoke(
        cli, ["inspect", "s3://bad_bucket!/runs", "ns", "--endpoint-url", "http://127.0.0.1:1"]
    )
    assert result.exit_code == 2, result.output
    assert "InvalidStoreURL" in result.output
    assert "Traceback" not in result.output
    assert "TransientStoreError" not in result.output


def test_bucket_names_botocore_accepts_still_open() -> None:
    arn = "arn:aws:s3:us-west-2:123456789012:accesspoint/ap"
    for bucket in ("my-bucket", "Legacy_Bucket.1", arn):
        bw.S3Store(bucket, region="us-east-1", access_key_id="a", secret_access_key="b").close()


def test_param_validation_error_is_neither_ambiguous_nor_transient(
    s3_store: bw.S3Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: botocore refusing a request before sending it was reported as "the outcome is
    # unknown" for a write and "failed transiently" (retryable) for a read.
    def refuse(**_: Any) -> None:
        raise bex.ParamValidationError(report="Invalid parameter")

    client = s3_store.client
    monkeypatch.setattr(client, "put_object", refuse)
    monkeypatch.setattr(client, "get_object", refuse)
    for call in (lambda: s3_store.put_if_absent("k", b"x"), lambda: s3_store.get("k")):
        with pytest.raises(bw.StoreError, match="refused the request") as info:
            call()
        assert not isinstance(info.value, bw.AmbiguousWriteError | bw.TransientStoreError)
        assert _scrubbed_cause(info.value) == "botocore.exceptions.ParamValidationError"


# -- obstore parity ----------------------------------------------------------------------------


@pytest.mark.parametrize("cls", [bw.S3Store, bw.ObstoreS3Store])
def test_delete_on_an_unreachable_endpoint_is_unavailable_on_both_s3_clients(
    cls: type[bw.S3Store] | type[bw.ObstoreS3Store],
) -> None:
    # Before: obstore reported a failed delete as AmbiguousWriteError (boto3:
    # StoreUnavailable/TransientStoreError), so the reclaimer, which stops at once on an
    # unavailable store, instead retried every key one by one and recorded them as refused.
    store = _audited(cls, f"http://127.0.0.1:{free_port()}")
    with store, pytest.raises(bw.StoreUnavailable) as info:
        store.delete_many(["a", "b"])
    assert SECRET not in str(info.value)


# -- file:// URLs ------------------------------------------------------------------------------


def test_a_nul_byte_in_a_file_url_is_an_invalid_store_url(tmp_path: Path) -> None:
    # Before: a bare ValueError("embedded null byte") from os.mkdir.
    with pytest.raises(bw.InvalidStoreURL, match="NUL"):
        bw.open_store(f"{tmp_path.as_uri()}/a%00b")


def test_a_non_utf8_directory_opens_by_the_url_path_as_uri_gives(tmp_path: Path) -> None:
    # Before: %FF was decoded to U+FFFD, so the store opened (and created) another directory,
    # and the CLI said "no store directory" for a directory that exists.
    directory = Path(os.fsdecode(os.path.join(os.fsencode(tmp_path), b"weave-\xff")))
    directory.mkdir()
    url = directory.as_uri()
    assert url.endswith("weave-%FF")
    store = bw.open_store(url, verify_conditional_writes=False)
    store.put("k", b"v")
    assert (directory / "k").read_bytes() == b"v"
    assert sorted(os.listdir(tmp_path)) == [directory.name]
    result = CliRunner().invoke(cli, ["inspect", url, "ns"])
    assert result.exit_code == 2, result.output
    assert "NamespaceNotFound" in result.output  # the directory was found; the namespace is not


# -- obstore and boto3 translate the same server answers into the same errors ------------------


class _ErrorServer(http.server.BaseHTTPRequestHandler):
    """Answers every request with the status and S3 error code set on the server."""

    server: _FakeS3
    protocol_version = "HTTP/1.1"  # answers boto3's "Expect: 100-continue" at once

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        if self.command == "HEAD" and self.server.head_ok:
            self.send_response(200)
            self.send_header("Content-Length", "10")
            self.send_header("Last-Modified", "Thu, 26 Nov 2026 12:00:00 GMT")
            self.send_header("ETag", '"abc"')
            self.end_headers()
            return
        status, code = self.server.answer
        body = (
            f"<?xml version='1.0'?><Error><Code>{code}</Code><Message>m</Message>"
            f"<RequestId>{self.server.request_id}</RequestId></Error>"
        )
        self.send_response(status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _reply  # noqa: N815 (http.server names)

    def log_message(self, *args: Any) -> None:
        pass


class _FakeS3(http.server.ThreadingHTTPServer):
    answer: tuple[int, str] = (500, "InternalError")
    head_ok = False
    request_id = "7A2B9C0D1E2F3A4B"

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"


@pytest.fixture(scope="module")
def error_server() -> Iterator[_FakeS3]:
    server = _FakeS3(("127.0.0.1", 0), _ErrorServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()
    thread.join()


@pytest.mark.parametrize(
    ("status", "code", "op", "expected"),
    [
        # Before: obstore raised ObjectExists (object_store reports 409 as "already exists"),
        # so a commit read back a version that another writer had not finished writing.
        (409, "ConditionalRequestConflict", "put_if_absent", bw.ConcurrentWriteConflict),
        # Before: AmbiguousWriteError on obstore for a store without conditional writes.
        (501, "NotImplemented", "put_if_absent", bw.ConditionalWritesUnsupported),
        # Before: TransientStoreError on obstore (retried forever) for a refused listing.
        (403, "AccessDenied", "list", bw.AccessDenied),
        (401, "InvalidAccessKeyId", "list", bw.AccessDenied),
        # Before: obstore silently ignored a delete in a bucket that does not exist.
        (404, "NoSuchBucket", "delete", bw.InvalidStoreURL),
        (412, "PreconditionFailed", "put_if_absent", bw.ObjectExists),
        (503, "SlowDown", "get", bw.TransientStoreError),
        (503, "SlowDown", "put", bw.AmbiguousWriteError),
    ],
)
@pytest.mark.parametrize("cls", [bw.S3Store, bw.ObstoreS3Store])
def test_both_s3_clients_map_server_errors_to_the_same_leaf(
    error_server: _FakeS3,
    cls: type[bw.S3Store] | type[bw.ObstoreS3Store],
    status: int,
    code: str,
    op: str,
    expected: type[bw.StoreError],
) -> None:
    error_server.answer = (status, code)
    store = _audited(cls, error_server.url, "bucket", "p", region="us-east-1")
    calls: dict[str, Callable[[], Any]] = {
        "put_if_absent": lambda: store.put_if_absent("k", b"x"),
        "put": lambda: store.put("k", b"x"),
        "get": lambda: store.get("k"),
        "list": lambda: list(store.list()),
        "delete": lambda: store.delete_many(["k"]),
    }
    with store, pytest.raises(bw.StoreError) as info:
        calls[op]()
    assert type(info.value) is expected, info.value
    assert SECRET not in str(info.value)


# -- credentials that cannot be loaded ---------------------------------------------------------

_AWS_CONFIG = """\
[profile broken]
credential_process = /bin/false
region = us-east-1

[profile expired-sso]
sso_session = corp
sso_account_id = 123456789012
sso_role_name = reader
region = us-east-1

[sso-session corp]
sso_start_url = https://example.invalid/start
sso_region = us-east-1
"""


@pytest.fixture
def aws_profiles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "aws-config"
    config.write_text(_AWS_CONFIG)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no SSO token cache either


def test_a_failing_credential_process_is_access_denied_not_a_botocore_traceback(
    aws_profiles: None,
) -> None:
    # Before: botocore's CredentialRetrievalError escaped S3Store and open_store untranslated,
    # and the CLI printed a traceback (exit 1) instead of one line.
    with pytest.raises(bw.AccessDenied, match="no usable AWS credentials") as info:
        bw.S3Store("bucket", profile="broken", endpoint_url=f"http://127.0.0.1:{free_port()}")
    assert _scrubbed_cause(info.value) == "botocore.exceptions.CredentialRetrievalError"
    result = CliRunner().invoke(
        cli,
        [
            "inspect",
            "s3://bucket/runs",
            "ns",
            "--profile",
            "broken",
            "--endpoint-url",
            f"http://127.0.0.1:{free_port()}",
        ],
    )
    assert result.exit_code == 2, result.output
    assert "AccessDenied" in result.output
    assert "Traceback" not in result.output


def test_an_expired_sso_login_is_access_denied_not_transient(aws_profiles: None) -> None:
    # Before: "get 'k' ... failed transiently: Error loading SSO Token" (TransientStoreError),
    # which consumers retry forever, and AmbiguousWriteError for a put that was never sent.
    store = bw.S3Store(
        "bucket", profile="expired-sso", endpoint_url=f"http://127.0.0.1:{free_port()}"
    )
    for call in (lambda: store.get("k"), lambda: store.put_if_absent("k", b"x")):
        with pytest.raises(bw.AccessDenied, match="aws sso login") as info:
            call()
        assert _scrubbed_cause(info.value) in _names_of(bex.SSOError)


# -- reads classified by the server's status ---------------------------------------------------


def test_obstore_range_read_failing_with_416_in_its_request_id_is_not_read_as_empty(
    error_server: _FakeS3, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: any error whose text contained "416" (a request id, a timing "in 1.416ms") was
    # taken for a range past the object's end, and with the object present the range read
    # returned b"" for a transient 503: the consumer then failed with a FormatError ("got 0
    # bytes") instead of retrying.
    monkeypatch.setattr(error_server, "answer", (503, "SlowDown"))
    monkeypatch.setattr(error_server, "head_ok", True)
    monkeypatch.setattr(error_server, "request_id", "4416AB0C9D8E7F60")
    store = _audited(bw.ObstoreS3Store, error_server.url)
    assert store.head("k").size == 10
    with store, pytest.raises(bw.TransientStoreError):
        store.get_range("k", bw.Bounded(2, 6))


@pytest.mark.parametrize(
    ("status", "code", "request_id", "expected"),
    [
        # Before: obstore matched "503" and "dns" anywhere in the server's reply, so a request
        # refused for good (400) whose HostId held "/503+" or "dNs" was "transient" (retried
        # forever by consumers) or "unreachable".
        (400, "InvalidArgument", "k9/503+Zq", bw.StoreError),
        (400, "InvalidArgument", "4dNs7Qw", bw.StoreError),
        (400, "RequestTimeout", "7A2B9C0D", bw.TransientStoreError),
        (500, "InternalError", "7A2B9C0D", bw.TransientStoreError),
    ],
)
@pytest.mark.parametrize("cls", [bw.S3Store, bw.ObstoreS3Store])
def test_reads_are_classified_by_the_server_status_not_by_words_in_its_reply(
    error_server: _FakeS3,
    monkeypatch: pytest.MonkeyPatch,
    cls: type[bw.S3Store] | type[bw.ObstoreS3Store],
    status: int,
    code: str,
    request_id: str,
    expected: type[bw.StoreError],
) -> None:
    monkeypatch.setattr(error_server, "answer", (status, code))
    monkeypatch.setattr(error_server, "request_id", request_id)
    store = _audited(cls, error_server.url, region="us-east-1")
    with store, pytest.raises(bw.StoreError) as info:
        store.get("k")
    assert type(info.value) is expected, info.value


def _scrubbed_cause(error: BaseException) -> str:
    """The type name of the client exception chained (scrubbed) as ``error``'s cause."""
    cause = error.__cause__
    assert isinstance(cause, ScrubbedClientError)
    return cause.client_error


def _names_of(error: type[BaseException]) -> set[str]:
    """Qualified names of ``error`` and its subclasses (``isinstance`` by name)."""
    kinds, names = [error], set()
    while kinds:
        kind = kinds.pop()
        names.add(f"{kind.__module__}.{kind.__qualname__}")
        kinds.extend(kind.__subclasses__())
    return names

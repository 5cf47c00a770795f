"""Both S3 backends treat credentials, regions and endpoints from the environment alike.

What a client finds itself (``AWS_*`` variables) is checked as strictly as explicit arguments
and never echoed; obstore uses exactly the explicit credentials given, checks regions as boto3
does, and lists any prefix the other backends list. A server's reply that quotes the request's
credentials reaches no error, traceback or DEBUG log record.
"""

from __future__ import annotations

import http.server
import logging
import pickle
import re
import socket
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import pytest
from botocore.exceptions import InvalidRegionError
from botocore.utils import validate_region_name

import batchweave as bw
from batchweave import MemoryStore, S3Store
from batchweave._store import _open as store_open
from batchweave._store._obstore import ObstoreS3Store
from batchweave.testing import S3Endpoint, free_port

CLIENTS = ("boto3", "obstore")
KEY_ID = "AKIAIOSFODNN7EXAMPLE"
SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYSECRETKEY"
TOKEN = "FQoGZXIvYXdzSECRETSESSIONTOKENvalue123"
EXPLICIT = {"access_key_id": "AKIAEXPLICIT12345", "secret_access_key": "explicitsecret123456"}


def _closed_endpoint() -> str:
    return f"http://127.0.0.1:{free_port()}"


def _env_credentials(aws_env: pytest.MonkeyPatch, **override: str) -> None:
    values = {"AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}
    values["AWS_SESSION_TOKEN"] = TOKEN
    values.update(override)
    for name, value in values.items():
        aws_env.setenv(name, value)


# -- 1. a credential from the environment with a newline: refused, named, never echoed ------


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("AWS_SESSION_TOKEN", TOKEN + "\n"),
        ("AWS_SESSION_TOKEN", TOKEN + "\r\n"),
        ("AWS_ACCESS_KEY_ID", KEY_ID + "\n"),
        ("AWS_SECRET_ACCESS_KEY", SECRET + " "),
        ("AWS_SESSION_TOKEN", "FQoG\tTOKEN"),
    ],
)
def test_unusable_environment_credential_is_refused_naming_the_variable(
    aws_env: pytest.MonkeyPatch,
    moto_endpoint: S3Endpoint,
    s3_bucket: str,
    caplog: pytest.LogCaptureFixture,
    client: str,
    variable: str,
    value: str,
) -> None:
    # Before: boto3 retried "Invalid header value b'<token>\n'" as a TransientStoreError (also
    # logged by the probe, token included); obstore raised a pyo3 PanicException, which is a
    # BaseException and escapes `except Exception`.
    _env_credentials(aws_env, **{variable: value})
    caplog.set_level(logging.DEBUG)
    with pytest.raises(bw.InvalidStoreURL) as info:
        bw.open_store(
            f"s3://{s3_bucket}/p", s3_client=client, endpoint_url=moto_endpoint.endpoint_url,
            region="us-east-1",
        )  # fmt: skip
    message = str(info.value)
    assert f"{variable} (from the environment) contains whitespace or control" in message
    shown = value.strip()
    for text in (message, repr(info.value), caplog.text):
        assert shown not in text
        assert "FQoG" not in text


@pytest.mark.parametrize("client", CLIENTS)
def test_unusable_environment_credential_is_ignored_beside_explicit_ones(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Explicit keys replace the environment's credentials, token included, on both backends.
    _env_credentials(aws_env, AWS_SESSION_TOKEN=TOKEN + "\n")
    store = bw.open_store(
        "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
        endpoint_url=_closed_endpoint(), **EXPLICIT,
    )  # fmt: skip
    store.close()


@pytest.mark.parametrize("client", CLIENTS)
def test_credentials_found_in_the_environment_are_masked_in_messages(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # Before: only explicitly given credentials were masked; what the client found itself
    # could be quoted by a server's or client's error text as it was.
    _env_credentials(aws_env)
    store = bw.open_store(
        "s3://bucket/p", s3_client=client, verify_conditional_writes=False,
        endpoint_url=_closed_endpoint(),
    )  # fmt: skip
    said = f"key {KEY_ID} secret {SECRET} token {TOKEN}"
    scrubbed = store._scrub(said)  # type: ignore[attr-defined]  # what every message goes through
    for value in (KEY_ID, SECRET, TOKEN):
        assert value not in scrubbed
    assert scrubbed == "key *** secret *** token ***"
    store.close()


def test_boto3_names_credentials_of_a_profile_without_echoing_them(
    aws_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A credential_process answer with a trailing newline in the token: named by its source.
    process = tmp_path / "creds.py"
    process.write_text(
        "import json\n"
        f'print(json.dumps({{"Version": 1, "AccessKeyId": "{KEY_ID}", '
        f'"SecretAccessKey": "{SECRET}", "SessionToken": "{TOKEN}\\n"}}))\n'
    )
    config = tmp_path / "config"
    config.write_text(f"[profile nl]\ncredential_process = {sys.executable} {process}\n")
    aws_env.setenv("AWS_CONFIG_FILE", str(config))
    with pytest.raises(bw.InvalidStoreURL) as info:
        S3Store("bucket", "p", profile="nl", endpoint_url=_closed_endpoint())
    assert "session_token botocore found (custom-process) contains whitespace" in str(info.value)
    assert TOKEN not in str(info.value)


# -- 2. obstore signs explicit keys with exactly the given token ------------------------------


@pytest.fixture
def recorder() -> Iterator[tuple[str, list[bytes]]]:
    """A server on loopback that records each request and answers 404."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    requests: list[bytes] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                requests.append(conn.recv(65536))
                conn.sendall(
                    b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", requests
    server.close()
    thread.join(5)


def _token_sent(request: bytes) -> str | None:
    found = re.search(rb"(?im)^x-amz-security-token:\s*(\S+)", request)
    return found.group(1).decode() if found is not None else None


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("given_token", [None, "GIVENsessionTOKEN123"])
def test_explicit_keys_are_signed_with_exactly_the_given_token(
    aws_env: pytest.MonkeyPatch,
    recorder: tuple[str, list[bytes]],
    client: str,
    given_token: str | None,
) -> None:
    # Before (obstore): the environment's AWS_SESSION_TOKEN went with explicit keys that came
    # without one, a token of another identity (AWS answers InvalidToken: AccessDenied).
    url, requests = recorder
    aws_env.setenv("AWS_SESSION_TOKEN", "ENVTOKENofAnotherIdentity123")
    aws_env.setenv("AWS_TOKEN", "ENVTOKENofAnotherIdentity456")
    store = bw.open_store(
        "s3://bkt/p", s3_client=client, verify_conditional_writes=False, endpoint_url=url,
        region="us-east-1", max_attempts=1, session_token=given_token, **EXPLICIT,
    )  # fmt: skip
    with pytest.raises(bw.StoreError):
        store.head("k")
    store.close()
    assert requests
    for request in requests:
        assert b"ENVTOKEN" not in request
        assert _token_sent(request) == given_token
        assert EXPLICIT["access_key_id"].encode() in request


# -- 3. regions: botocore's rule on both backends ---------------------------------------------

BAD_REGIONS = ["evil.example/x", "a@evil.example", "us_east_1", "", "123", "-us", "x" * 64]
GOOD_REGIONS = ["us-east-1", "eu-central-1", "us-gov-west-1", "garage", "X1", "x" * 63]


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("region", BAD_REGIONS)
def test_malformed_region_is_refused_on_both_backends(
    aws_env: pytest.MonkeyPatch, client: str, region: str
) -> None:
    # Before (obstore): any string was put into the AWS host name ("evil.example/x": requests
    # to s3.evil.example), "" silently became us-east-1.
    with pytest.raises(bw.InvalidStoreURL) as info:
        bw.open_store(
            "s3://bkt/p", s3_client=client, region=region, verify_conditional_writes=False,
            **EXPLICIT,
        )  # fmt: skip
    assert f"region {region!r} is not a valid AWS region name" in str(info.value)
    with pytest.raises(bw.InvalidStoreURL) as checked:
        store_open.check_store_url("s3://bkt/p", s3_client=client, region=region)
    assert str(checked.value) == str(info.value)


@pytest.mark.parametrize("client", CLIENTS)
def test_well_formed_regions_are_accepted(aws_env: pytest.MonkeyPatch, client: str) -> None:
    for region in GOOD_REGIONS:
        store = bw.open_store(
            "s3://bkt/p", s3_client=client, region=region, verify_conditional_writes=False,
            endpoint_url=_closed_endpoint(), **EXPLICIT,
        )  # fmt: skip
        store.close()


def test_region_rule_is_botocores() -> None:
    for region in BAD_REGIONS + GOOD_REGIONS:
        try:
            validate_region_name(region)
            botocore_takes = region != ""  # botocore's rule admits "", then fails to build a host
        except InvalidRegionError:
            botocore_takes = False
        try:
            store_open.check_store_url("s3://bkt/p", region=region)
            ours = True
        except bw.InvalidStoreURL:
            ours = False
        assert ours == botocore_takes, region


# -- 4. an endpoint's query or fragment is not echoed -----------------------------------------

QUERY_SECRET = "SECRETTOKENinQUERY12345"


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("via_env", [False, True])
@pytest.mark.parametrize(
    "endpoint",
    [
        f"http://127.0.0.1:9000/?X-Amz-Security-Token={QUERY_SECRET}",
        f"http://127.0.0.1:9000#{QUERY_SECRET}",
        f"127.0.0.1:9000?token={QUERY_SECRET}",  # no scheme: botocore's own error quotes it
        f"http://127.0.0.1:9000/ x?token={QUERY_SECRET}",
    ],
)
def test_endpoint_query_and_fragment_are_not_echoed(
    aws_env: pytest.MonkeyPatch, client: str, via_env: bool, endpoint: str
) -> None:
    # Before: "endpoint_url for s3://bkt 'http://...?X-Amz-Security-Token=<token>' has a query
    # or fragment", while a store URL's query was already cut to "?...".
    options: dict[str, Any] = dict(EXPLICIT)
    if via_env:
        aws_env.setenv("AWS_ENDPOINT_URL", endpoint)
    else:
        options["endpoint_url"] = endpoint
    with pytest.raises(bw.InvalidStoreURL) as info:
        bw.open_store("s3://bkt/p", s3_client=client, verify_conditional_writes=False, **options)
    assert QUERY_SECRET not in str(info.value)
    assert "?..." in str(info.value)


# -- 5. a key without its secret in the environment: boto3's AccessDenied on obstore too -----


@pytest.mark.parametrize("given", ["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"])
def test_obstore_partial_environment_credentials_are_access_denied(
    aws_env: pytest.MonkeyPatch, given: str
) -> None:
    # Before: InvalidStoreURL "cannot configure obstore ...: Generic S3 error: Missing
    # SecretAccessKey" and object_store's multi-line debug dump.
    aws_env.setenv(given, KEY_ID if given == "AWS_ACCESS_KEY_ID" else SECRET)
    options = {"endpoint_url": _closed_endpoint(), "verify_conditional_writes": False}
    with pytest.raises(bw.AccessDenied) as info:
        bw.open_store("s3://bkt/p", s3_client="obstore", **options)
    message = str(info.value)
    missing = "AWS_SECRET_ACCESS_KEY" if given == "AWS_ACCESS_KEY_ID" else "AWS_ACCESS_KEY_ID"
    assert f"Partial credentials found in env, missing: {missing}" in message
    assert "Debug source" not in message
    assert KEY_ID not in message
    assert SECRET not in message
    if given == "AWS_ACCESS_KEY_ID":  # boto3 ignores a secret without its key id
        with pytest.raises(bw.AccessDenied) as boto3:
            bw.open_store("s3://bkt/p", **options)
        assert message == str(boto3.value)


# -- 6. obstore lists a prefix or start_after that is no valid key ---------------------------

LISTED = ["x", "a/b", "a/c/d", ".hidden", "a/.e", "z"]


@pytest.mark.parametrize(
    ("prefix", "start_after"),
    [
        ("../", None),
        ("./", None),
        ("..", None),
        ("a//", None),
        ("a/./", None),
        ("a/../", None),
        ("a/c//", None),
        ("", "a//b"),
        ("", ".."),
        ("", "."),
        ("a/", "a/.."),
        ("a/", "a//c"),
        ("a", "a/c/../z"),
        ("", "/"),
        ("/", None),
        ("a/", "a/b"),  # valid ones still agree
        ("a", None),
    ],
)
def test_obstore_lists_any_prefix_as_the_other_backends(
    moto_endpoint: S3Endpoint,
    s3_bucket: str,
    s3_prefix: str,
    prefix: str,
    start_after: str | None,
) -> None:
    # Before: StoreError "Could not parse path: ... illegal character sequence '..'".
    obstore = ObstoreS3Store(s3_bucket, s3_prefix, **moto_endpoint.store_options())
    memory = MemoryStore()
    for key in LISTED:
        obstore.put(key, b"1")
        memory.put(key, b"1")
    want = [m.key for m in memory.list(prefix, start_after=start_after)]
    assert [m.key for m in obstore.list(prefix, start_after=start_after)] == want
    boto3 = S3Store(s3_bucket, s3_prefix, **moto_endpoint.store_options())
    assert [m.key for m in boto3.list(prefix, start_after=start_after)] == want


# -- 7. a server's reply quoting the credentials: not in errors, tracebacks or DEBUG logs ----


class _EchoingS3(http.server.BaseHTTPRequestHandler):
    """Refuses every request as AWS does a wrong signature (``SignatureDoesNotMatch``: the body
    names the access key id and dumps the canonical request with the session token header),
    and quotes the key id and the token in its message too, as a hostile server might."""

    status = 403

    def log_message(self, *args: object) -> None:
        pass

    def _refuse(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        key_id = auth.split("Credential=")[1].split("/")[0] if "Credential=" in auth else ""
        token = self.headers.get("X-Amz-Security-Token", "")
        canonical = (
            f"{self.command}\n{self.path}\n\nhost:127.0.0.1\nx-amz-security-token:{token}\n\n"
            "host;x-amz-security-token\nUNSIGNED-PAYLOAD"
        )
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SignatureDoesNotMatch</Code>'
            f"<Message>The request signature we calculated does not match ({key_id} {token})"
            f"</Message><AWSAccessKeyId>{key_id}</AWSAccessKeyId><StringToSign>{escape(auth)}"
            f"</StringToSign><CanonicalRequest>{escape(canonical)}</CanonicalRequest>"
            "<RequestId>4442587FB7D0A2F9</RequestId></Error>"
        ).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/xml")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _refuse  # noqa: N815 (http.server names)


@pytest.fixture(params=[403, 200], ids=["403", "200-with-error"])
def echoing_endpoint(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    """An endpoint on loopback answering as :class:`_EchoingS3`: with 403, or with 200 and the
    error in the body (which botocore logs at DEBUG, body included, before making it a 500)."""
    handler = type("Handler", (_EchoingS3,), {"status": request.param})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", request.param
    server.shutdown()
    server.server_close()
    thread.join(5)


def _printed(error: BaseException) -> str:
    """Everything a printed traceback of ``error`` shows (the causes it prints included), and
    the ``str`` and ``repr`` of each exception in it."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    shown: BaseException | None = error
    while shown is not None:
        text += f"\n{shown}\n{shown!r}"
        # What a traceback follows: the cause, else the context unless suppressed.
        if shown.__cause__ is not None:
            shown = shown.__cause__
        elif not shown.__suppress_context__:
            shown = shown.__context__
        else:
            shown = None
    return text


_OPERATIONS: dict[str, Callable[[bw.ObjectStore], object]] = {
    "get": lambda store: store.get("k"),
    "get_range": lambda store: store.get_range("k", bw.Bounded(0, 4)),
    "put": lambda store: store.put("k", b"x"),
    "put_if_absent": lambda store: store.put_if_absent("k", b"x"),
    "list": lambda store: list(store.list("a/")),
    "delete": lambda store: store.delete_many(["k", "j"]),
}


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("source", ["explicit", "environment"])
def test_a_reply_quoting_the_credentials_reaches_no_error_traceback_or_log(
    aws_env: pytest.MonkeyPatch,
    echoing_endpoint: tuple[str, int],
    caplog: pytest.LogCaptureFixture,
    client: str,
    source: str,
) -> None:
    # Before: the messages were scrubbed, but each error's __cause__ was the client's own
    # exception, which every printed traceback shows: obstore's quotes the server's whole reply
    # (key id and session token included), botocore's ClientError its message; and botocore's
    # DEBUG record "Error found for response with 200 status code: b'<body>'" (logger
    # botocore.handlers) was not masked.
    endpoint, status = echoing_endpoint
    credentials = {"access_key_id": KEY_ID, "secret_access_key": SECRET, "session_token": TOKEN}
    if source == "environment":
        _env_credentials(aws_env)
        credentials = {}
    caplog.set_level(logging.DEBUG)
    store = bw.open_store(
        "s3://bkt/p", s3_client=client, endpoint_url=endpoint, region="us-east-1",
        verify_conditional_writes=False, max_attempts=1, read_timeout=5, **credentials,
    )  # fmt: skip
    errors: list[BaseException] = []
    for operation in _OPERATIONS.values():
        try:
            operation(store)
        except bw.StoreError as exc:
            errors.append(exc)
    store.close()
    # A 200 answers a GET with its body as the object (on boto3; obstore: not S3's reply).
    assert len(errors) == len(_OPERATIONS) if status == 403 else errors
    for error in errors:
        if status == 403:
            assert error.__cause__ is not None  # the client's error, scrubbed, for debugging
        printed = _printed(error)
        for value in (KEY_ID, SECRET, TOKEN):
            assert value not in printed, (type(error).__name__, printed)
    if status == 403:
        assert all(isinstance(e, bw.AccessDenied) for e in errors), errors
    logged = caplog.text + "".join(r.getMessage() for r in caplog.records)
    for value in (KEY_ID, SECRET, TOKEN):
        assert value not in logged


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("echoing_endpoint", [403], indirect=True)
def test_the_scrubbed_cause_keeps_what_the_client_said(
    aws_env: pytest.MonkeyPatch, echoing_endpoint: tuple[str, int], client: str
) -> None:
    # The stand-in chained instead of the client's exception names that exception's type and
    # keeps its (scrubbed) words; it pickles, as errors sent between processes do.
    store = bw.open_store(
        "s3://bkt/p", s3_client=client, endpoint_url=echoing_endpoint[0], region="us-east-1",
        verify_conditional_writes=False, max_attempts=1, read_timeout=5, session_token=TOKEN,
        access_key_id=KEY_ID, secret_access_key=SECRET,
    )  # fmt: skip
    with pytest.raises(bw.StoreError) as info:
        store.put("k", b"x")
    store.close()
    cause = info.value.__cause__
    assert cause is not None
    assert type(cause).__name__ == "ScrubbedClientError"
    expected = "botocore.exceptions." if client == "boto3" else "obstore.exceptions."
    assert cause.client_error.startswith(expected)  # type: ignore[attr-defined]
    assert "***" in str(cause)
    assert TOKEN not in str(cause)
    assert KEY_ID not in str(cause)
    copy = pickle.loads(pickle.dumps(cause))
    assert str(copy) == str(cause)


def test_a_botocore_logger_made_later_is_masked_too(
    aws_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A filter on a logger does not see the records of its children: only the four loggers
    # named in advance were masked, not botocore.handlers nor one a later botocore adds.
    store = bw.open_store(
        "s3://bkt/p", endpoint_url=_closed_endpoint(), verify_conditional_writes=False,
        access_key_id=KEY_ID, secret_access_key=SECRET, session_token=TOKEN,
    )  # fmt: skip
    caplog.set_level(logging.DEBUG)
    for name in ("botocore.handlers", "botocore.batchweave_test_later_module"):
        logging.getLogger(name).debug(
            "body: %s; headers: {'X-Amz-Security-Token': '%s'}; %s",
            f"<AWSAccessKeyId>{KEY_ID}</AWSAccessKeyId>",
            "UNKNOWNtokenVALUE12345",
            SECRET,
        )
    store.close()
    assert len(caplog.records) == 2
    for record in caplog.records:
        message = record.getMessage()
        for value in (KEY_ID, SECRET, TOKEN, "UNKNOWNtokenVALUE12345"):
            assert value not in message
        assert "<AWSAccessKeyId>***</AWSAccessKeyId>" in message

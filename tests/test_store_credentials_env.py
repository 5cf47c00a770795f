"""Both S3 backends treat credentials, regions and endpoints from the environment alike.

What a client finds itself (``AWS_*`` variables) is checked as strictly as explicit arguments
and never echoed; obstore uses exactly the explicit credentials given, checks regions as boto3
does, and lists any prefix the other backends list.
"""

from __future__ import annotations

import logging
import re
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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

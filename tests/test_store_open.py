"""open_store: URL parsing, option checking and the conditional-write probe."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from batchweave import (
    AccessDenied,
    ConditionalWritesUnsupported,
    CountingStore,
    FileStore,
    InvalidStoreURL,
    MemoryStore,
    PutMode,
    S3Store,
    StoreUnavailable,
    open_store,
)
from batchweave._store._open import PROBE_PREFIX, check_store_url, ensure_conditional_writes
from batchweave.testing import S3Endpoint, free_port

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
"""An AWS-style secret access key: they often hold '/'."""


class IgnoresCreateStore(MemoryStore):
    """A store like those S3 look-alikes that silently ignore If-None-Match."""

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        super().put(key, data, mode=PutMode.OVERWRITE)


def test_memory_urls_share_named_stores() -> None:
    a = open_store("memory://open-test")
    b = open_store("memory://open-test")
    assert a is b is MemoryStore.named("open-test")
    assert list(a.list()) == []  # the probe object was deleted


def test_file_url_opens_a_file_store(tmp_path: Path) -> None:
    root = tmp_path / "new dir"
    store = open_store(root.as_uri(), fsync=False)
    assert isinstance(store, FileStore)
    assert store.root == str(root)  # percent-decoded
    assert list(store.list()) == []


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("/abs/path", "no scheme"),
        ("relative/path", "no scheme"),
        ("file://relative/path", "three slashes"),
        ("ftp://host/x", "unsupported scheme 'ftp'"),
        ("s3:///prefix", "no bucket"),
        ("s3://bucket/p?region=x", "keyword arguments"),
    ],
)
def test_bad_urls_are_explained(url: str, message: str) -> None:
    with pytest.raises(InvalidStoreURL, match=message):
        open_store(url)


def test_unknown_options_name_the_option_and_the_accepted_ones(tmp_path: Path) -> None:
    with pytest.raises(InvalidStoreURL, match=r"endpoint.*accepted: fsync$"):
        open_store(tmp_path.as_uri(), endpoint="x")
    with pytest.raises(InvalidStoreURL, match="accepted: none"):
        open_store("memory://x", fsync=True)
    with pytest.raises(InvalidStoreURL, match=r"endpoint_urll.*endpoint_url.*max_attempts"):
        open_store("s3://bucket", endpoint_urll="http://127.0.0.1:1")
    with pytest.raises(InvalidStoreURL, match="client"):
        open_store("s3://bucket", client=None)


def test_s3_url_with_unreachable_endpoint_fails_at_open() -> None:
    with pytest.raises(StoreUnavailable):
        open_store(
            "s3://bucket/prefix",
            endpoint_url=f"http://127.0.0.1:{free_port()}",
            access_key_id="k",
            secret_access_key="s",
            connect_timeout=0.5,
            max_attempts=1,
        )


def test_s3_url_without_probe_does_not_connect() -> None:
    store = open_store(
        "s3://bucket/some/prefix",
        verify_conditional_writes=False,
        endpoint_url=f"http://127.0.0.1:{free_port()}",
    )
    assert isinstance(store, S3Store)
    assert (store.bucket, store.prefix) == ("bucket", "some/prefix/")


def test_probe_refuses_a_store_that_ignores_create() -> None:
    store = IgnoresCreateStore("ignores-create")
    with pytest.raises(ConditionalWritesUnsupported) as info:
        ensure_conditional_writes(store)
    assert "memory://ignores-create" in str(info.value)
    assert "verify_conditional_writes=False" in str(info.value)
    assert list(store.list()) == []  # probe deleted even on failure


def test_probe_runs_once_per_store_instance() -> None:
    counting = CountingStore(MemoryStore())
    ensure_conditional_writes(counting)
    ensure_conditional_writes(counting)
    counts = counting.snapshot()
    assert (counts.conditional_puts, counts.deletes) == (2, 1)
    assert list(counting.list(PROBE_PREFIX)) == []


@pytest.mark.parametrize(
    "url",
    [
        f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix",
        f"s3://AKIAEXAMPLE:{SECRET}@bucket/prefix?x=1",
        "s3://AKIAEXAMPLE:wJalrXUtn?FEMIK7MDENG@bucket/prefix",
        "s3://AKIAEXAMPLE:wJalrXUtn#FEMIK7MDENG@bucket/prefix",
        "s3://AKIAEXAMPLE:wJalrXUtn/FEMI@K7MDENG@bucket/prefix",
    ],
)
def test_url_credentials_holding_slashes_are_refused_unechoed(url: str) -> None:
    # A '/', '?' or '#' in the secret ends the URL's netloc early: it is still refused.
    for check in (check_store_url, open_store):
        with pytest.raises(InvalidStoreURL, match=r"carries credentials.*access_key_id") as info:
            check(url)
        assert "AKIAEXAMPLE" not in str(info.value)
        assert "wJalrXUtn" not in str(info.value)
        assert "@bucket/prefix" in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "s3:AKIAEXAMPLE:wJalrSECRETKEY@bucket/p",
        f"s3:/AKIAEXAMPLE:{SECRET}@bucket/p",
        "AKIAEXAMPLE:wJalrSECRETKEY@bucket/p",
    ],
)
def test_urls_without_slashes_do_not_echo_credentials(url: str) -> None:
    with pytest.raises(InvalidStoreURL) as info:
        check_store_url(url)
    assert "AKIAEXAMPLE" not in str(info.value)
    assert "wJalr" not in str(info.value)
    assert "***@bucket/p" in str(info.value)


def test_endpoint_credentials_holding_a_slash_are_refused_unechoed() -> None:
    with pytest.raises(InvalidStoreURL, match="carries credentials") as info:
        check_store_url("s3://bucket/p", endpoint_url=f"http://AKIAEXAMPLE:{SECRET}@127.0.0.1:9")
    assert "AKIAEXAMPLE" not in str(info.value)
    assert "wJalr" not in str(info.value)


@pytest.mark.parametrize("s3_client", ["boto3", "obstore"])
@pytest.mark.parametrize("field", ["access_key_id", "secret_access_key", "session_token", "region"])
@pytest.mark.parametrize("junk", ["\n", "\r\n", " ", "\x00"])
def test_whitespace_or_control_characters_in_credentials_are_refused(
    s3_client: str, field: str, junk: str
) -> None:
    # A credential read from a file keeps its newline: botocore echoed it escaped (past the
    # scrubbing of secrets) and obstore panicked. Refused before any client is made.
    options = {
        "access_key_id": "AKIAEXAMPLEKEYID",
        "secret_access_key": SECRET,
        "session_token": "FwoGZXIvYXdzEXAMPLESESSIONTOKEN",
        "region": "us-east-1",
        "endpoint_url": f"http://127.0.0.1:{free_port()}",
    }
    value = options[field]
    options[field] = value + junk
    for check in (check_store_url, open_store):
        with pytest.raises(InvalidStoreURL, match=f"{field} contains whitespace") as info:
            check("s3://bucket/p", s3_client=s3_client, **options)
        assert value not in str(info.value)


@pytest.mark.parametrize(("url", "escape"), [("s3://bkt/%FF/x", "%FF"), ("s3://bkt/a%C3b", "%C3")])
def test_s3_prefix_escapes_that_are_not_utf8_are_refused(url: str, escape: str) -> None:
    # Decoding them to U+FFFD would put the store under another prefix than the URL names.
    for check in (check_store_url, open_store):
        with pytest.raises(InvalidStoreURL, match=f"not UTF-8 \\({escape}\\)"):
            check(url)
    with open_store("s3://bkt/caf%C3%A9/x", verify_conditional_writes=False) as store:
        assert isinstance(store, S3Store)
        assert store.prefix == "caf\u00e9/x/"


class RefusesWritesStore(MemoryStore):
    """A store whose every write is refused, as a bucket policy without s3:PutObject does."""

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        raise AccessDenied(f"put {key!r}: AccessDenied")


def test_probe_deletes_nothing_after_its_create_was_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    counting = CountingStore(RefusesWritesStore())
    with caplog.at_level(logging.WARNING, "batchweave"), pytest.raises(AccessDenied) as info:
        ensure_conditional_writes(counting)
    assert counting.snapshot().deletes == 0
    assert caplog.records == []
    # Read-only credentials (a consumer rank's) are told how to open the store without writing.
    assert "verify_conditional_writes=False" in str(info.value)
    assert "only reads" in str(info.value)


def test_probe_of_a_missing_bucket_does_not_warn_about_its_object(
    moto_endpoint: S3Endpoint, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, "batchweave"), pytest.raises(InvalidStoreURL):
        open_store("s3://no-such-bucket-here/p", **moto_endpoint.store_options())
    assert "could not delete the probe object" not in caplog.text

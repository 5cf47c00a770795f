"""open_store: URL parsing, option checking and the conditional-write probe."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchweave import (
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
from batchweave._store._open import PROBE_PREFIX, ensure_conditional_writes
from batchweave.testing import free_port


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

"""Every backend passes the shipped conformance suite: memory, file, moto (in-process and over
HTTP) and SeaweedFS. (The wrappers run it in ``test_store_wrappers.py``; the suite includes the
argument checks every backend and wrapper makes before any request.)

The helpers a custom store builds on are public and agree with the suite: ``validate_key``
refuses exactly the keys the suite expects every store to refuse (and returns legal ones
unchanged), and ``ensure_conditional_writes`` runs on any ``ObjectStore``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto import mock_aws

import batchweave as bw
from batchweave import FileStore, MemoryStore, ObjectStore, ObstoreS3Store, S3Store
from batchweave._store._base import validate_key
from batchweave.testing import S3Endpoint, StoreTests, serialize_moto_puts
from batchweave.testing._store_tests import INVALID_KEYS, ODD_KEYS

DOCS_STORE = Path(__file__).resolve().parent.parent / "docs" / "store.md"


def _docs_dict_store() -> type[ObjectStore]:
    """The ``DictStore`` example of docs/store.md ("Writing your own store"), run as written."""
    blocks = re.findall(r"^```python\n(.*?)^```", DOCS_STORE.read_text(), re.M | re.S)
    (code,) = [block for block in blocks if "class DictStore(bw.ObjectStore)" in block]
    namespace: dict[str, Any] = {"bw": bw, "__name__": "docs_store_example"}
    exec(compile(code, f"{DOCS_STORE}:DictStore", "exec"), namespace)
    store_class: type[ObjectStore] = namespace["DictStore"]
    return store_class


class TestDocsDictStore(StoreTests):
    """The docs tell users to run this suite on their example store: it must pass it."""

    large_object_size = 16 << 20

    @pytest.fixture
    def store(self) -> ObjectStore:
        return _docs_dict_store()()


class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> ObjectStore:
        return MemoryStore()


class TestFileStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[ObjectStore]:
        with FileStore(tmp_path / "root") as store:
            yield store


class TestMotoInProcessStore(StoreTests):
    @pytest.fixture
    def store(self, s3_bucket: str) -> Iterator[ObjectStore]:
        serialize_moto_puts()  # moto's own create is check-then-set; see batchweave.testing._moto
        with mock_aws():
            boto3.client("s3", region_name="us-east-1").create_bucket(Bucket=s3_bucket)
            with S3Store(s3_bucket, "conformance", region="us-east-1") as store:
                yield store


class MotoServerSuite(StoreTests):
    """The suite on the moto server through ``backend`` (an S3 store class)."""

    backend: type[S3Store] | type[ObstoreS3Store] = S3Store
    range_examples = 50

    @pytest.fixture
    def store(
        self, moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
    ) -> Iterator[ObjectStore]:
        with self.backend(s3_bucket, s3_prefix, **moto_endpoint.store_options()) as store:
            yield store


class SeaweedFSSuite(StoreTests):
    """The suite on SeaweedFS through ``backend`` (an S3 store class)."""

    backend: type[S3Store] | type[ObstoreS3Store] = S3Store
    race_rounds = 10
    race_threads = 16
    range_examples = 50

    @pytest.mark.xfail(
        strict=True,
        reason="SeaweedFS 4.48 lists the keys under a directory 'a/' before siblings such as "
        "'a-b' that sort lower bytewise (a filesystem walk, not S3's UTF-8 binary order; the "
        "same with every client)",
    )
    def test_list_order_is_bytewise_across_directories(self, store: ObjectStore) -> None:
        super().test_list_order_is_bytewise_across_directories(store)

    @pytest.fixture
    def store(
        self, seaweedfs_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
    ) -> Iterator[ObjectStore]:
        with self.backend(s3_bucket, s3_prefix, **seaweedfs_endpoint.store_options()) as store:
            yield store


@pytest.mark.moto_server
class TestMotoServerStore(MotoServerSuite):
    pass


@pytest.mark.seaweedfs
class TestSeaweedFSStore(SeaweedFSSuite):
    pass


# -- helpers for custom stores -----------------------------------------------------------------


def test_validate_key_is_exported() -> None:
    assert "validate_key" in bw.__all__
    assert bw.validate_key is validate_key


@pytest.mark.parametrize("key", ODD_KEYS, ids=repr)
def test_legal_keys_are_returned_unchanged(key: str) -> None:
    assert bw.validate_key(key) is key


@pytest.mark.parametrize("key", INVALID_KEYS, ids=repr)
def test_the_keys_the_conformance_suite_refuses_are_refused(key: str) -> None:
    with pytest.raises(bw.InvalidKey, match=r"object key") as info:
        bw.validate_key(key)
    assert isinstance(info.value, ValueError)


class _IgnoresIfNoneMatch(bw.MemoryStore):
    """A store that accepts every create-if-absent, as some S3-compatible servers do."""

    def put_if_absent(self, key: str, data: bytes) -> None:
        self.put(key, data)


def test_custom_stores_can_run_the_conditional_write_probe() -> None:
    bw.ensure_conditional_writes(bw.MemoryStore("enforces"))  # passes, and leaves nothing
    with pytest.raises(bw.ConditionalWritesUnsupported, match="ignores conditional writes"):
        bw.ensure_conditional_writes(_IgnoresIfNoneMatch("ignores"))


# -- the suite catches short reads --------------------------------------------------------------


class _Capped(bw.StoreWrapper):
    """A store whose reads come back short, as a streamed body or one socket read would."""

    def __init__(self, read: str) -> None:
        super().__init__(MemoryStore())
        self.read = read

    def get_range(self, key: str, rng: bw.ByteRange) -> bytes:
        data = self.inner.get_range(key, rng)
        return data[: 1 << 20] if self.read == "get_range" else data

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        if self.read != "get_range_into":
            return super().get_range_into(key, start, buffer)
        view = memoryview(buffer).cast("B")
        data = self.inner.get_range(key, bw.Bounded(start, start + min(view.nbytes, 65536)))
        view[: len(data)] = data
        return len(data)

    def map_range(self, key: str, start: int, end: int) -> memoryview | None:
        if self.read != "map_range":
            return None
        data = self.inner.get_range(key, bw.Bounded(start, min(end, start + 65536)))
        return memoryview(data).toreadonly()


@pytest.mark.parametrize("read", ["get_range", "get_range_into", "map_range"])
def test_the_suite_fails_a_store_whose_large_reads_come_back_short(read: str) -> None:
    # Consumer fails at run time on such a store; the suite must say so first.
    suite = StoreTests()
    with pytest.raises(AssertionError, match=r"read|mapped|differ"):
        suite.test_large_object_round_trip(_Capped(read))
    suite.test_large_object_round_trip(_Capped("none"))  # the wrapper itself is fine


def test_the_docs_example_store_refuses_a_single_key_and_a_tuple_range() -> None:
    store = _docs_dict_store()()
    for key in ("a", "b", "ab"):
        store.put(key, b"x")
    with pytest.raises(TypeError, match=r"pass a list of keys"):
        store.delete_many("ab")
    with pytest.raises(TypeError, match=r"must be a Bounded, Offset or Suffix"):
        store.get_range("ab", (0, 3))  # type: ignore[arg-type]
    assert [m.key for m in store.list()] == ["a", "ab", "b"]

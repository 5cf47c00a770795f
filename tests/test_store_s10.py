"""``batchweave.validate_key`` is public: custom stores refuse exactly the keys ours refuse."""

from __future__ import annotations

import pytest

import batchweave as bw
from batchweave._history import iter_membership
from batchweave._store._base import validate_key
from batchweave.testing._store_tests import INVALID_KEYS, ODD_KEYS


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


def test_obstore_takes_the_addressing_styles_s3store_takes() -> None:
    for style in (None, "auto", "path", "virtual"):
        bw.ObstoreS3Store("bucket", endpoint_url="http://127.0.0.1:9", addressing_style=style)
    with pytest.raises(ValueError, match="'path', 'virtual' or 'auto'"):
        bw.ObstoreS3Store("bucket", endpoint_url="http://127.0.0.1:9", addressing_style="dns")


def test_sample_ids_recorded_with_the_public_helpers_are_exported() -> None:
    store = bw.MemoryStore("ids")
    mesh = bw.Mesh(dp=2)
    with bw.Producer(store, "run", producer_id="p", mesh=mesh) as producer:
        producer.append(
            [b"a", b"b"],
            offset=0,
            metadata={bw.SAMPLE_IDS_KEY: bw.sample_ids_metadata([[1, 2], ["x"]])},
        )
    rows = list(iter_membership(store, "run"))
    assert [row.sample_ids for row in rows] == [("1", "2"), ("x",)]

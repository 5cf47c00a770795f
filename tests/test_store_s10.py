"""``batchweave.validate_key`` is public: custom stores refuse exactly the keys ours refuse."""

from __future__ import annotations

import pytest

import batchweave as bw
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

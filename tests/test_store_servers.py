"""The test-server helpers: endpoints hide secrets, servers answer, and stop when done."""

from __future__ import annotations

import socket

import pytest

from batchweave import S3Store
from batchweave.testing import S3Endpoint, free_port, moto_server


def _accepts_connections(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def test_endpoint_repr_hides_the_secret() -> None:
    endpoint = S3Endpoint("http://127.0.0.1:1", "key-id", "the-secret")
    assert "the-secret" not in repr(endpoint)
    assert endpoint.store_options()["secret_access_key"] == "the-secret"


def test_free_port_with_offset_returns_a_bindable_pair() -> None:
    port = free_port(also_free_at_offset=10000)
    for p in (port, port + 10000):
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


@pytest.mark.moto_server
def test_moto_server_serves_and_stops() -> None:
    with moto_server() as endpoint:
        port = int(endpoint.endpoint_url.rsplit(":", 1)[1])
        endpoint.create_bucket("lifecycle")
        endpoint.create_bucket("lifecycle")  # already owned is fine
        store = S3Store("lifecycle", **endpoint.store_options())
        store.put("k", b"v")
        assert store.get("k") == b"v"
    assert not _accepts_connections(port)

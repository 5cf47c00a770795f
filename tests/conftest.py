"""Shared fixtures: real S3-compatible servers, one per test session, started on demand."""

from __future__ import annotations

import importlib.util
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import settings
from prometheus_client import CollectorRegistry

from batchweave import FileStore, MemoryStore, ObjectStore
from batchweave.testing import S3Endpoint, free_port, moto_server, seaweedfs_server

# Never let boto3 look for credentials on the network (EC2 instance metadata) during tests.
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")

# Hypothesis fails an example that takes over 200 ms by default: on a shared 2-core CI machine a
# scheduling stall does that to examples that take a few ms. Speed is measured in bench/.
settings.register_profile("batchweave", deadline=None)
settings.load_profile("batchweave")

SHARED_BUCKET = "batchweave-tests"
"""One bucket per server and session; every test works under its own prefix."""


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[S3Endpoint]:
    """A moto ThreadedMotoServer (child process) with ``SHARED_BUCKET`` created."""
    with moto_server() as endpoint:
        endpoint.create_bucket(SHARED_BUCKET)
        yield endpoint


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    """A SeaweedFS ``weed mini`` server with ``SHARED_BUCKET`` created."""
    with seaweedfs_server(tmp_path_factory.mktemp("seaweedfs")) as endpoint:
        endpoint.create_bucket(SHARED_BUCKET)
        yield endpoint


@pytest.fixture(scope="session")
def s3_bucket() -> str:
    """The bucket shared by all tests on the session's servers."""
    return SHARED_BUCKET


@pytest.fixture
def s3_prefix(request: pytest.FixtureRequest) -> str:
    """A prefix no other test uses, readable in server listings."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name)[:60]
    return f"tests/{name}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    """The in-memory store and a ``file://`` store (no fsync), for tests that run on both.

    Test modules that need another store define their own ``store`` fixture, which wins.
    """
    s: ObjectStore = (
        MemoryStore() if request.param == "memory" else FileStore(tmp_path, fsync=False)
    )
    yield s
    s.close()


BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture
def load_bench(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """Import a script of ``bench/`` (``"producers"``) as a module, to test its pure functions.

    A benchmark script puts ``bench/`` on ``sys.path`` when imported; that is undone after the
    test.
    """
    monkeypatch.setattr(sys, "path", list(sys.path))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture
def producers(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    """``bench/producers.py`` as a module."""
    return load_bench("producers")


@pytest.fixture
def consumers(load_bench: Callable[[str], ModuleType]) -> ModuleType:
    """``bench/consumers.py`` as a module."""
    return load_bench("consumers")


@pytest.fixture
def registry() -> CollectorRegistry:
    """A Prometheus registry of the test's own, so tracked objects of other tests never show."""
    return CollectorRegistry()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No AWS_* variables and no AWS config files: only what the test sets."""
    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    # Should a client ask the EC2 metadata service anyway, it asks a closed port on loopback.
    closed = f"http://127.0.0.1:{free_port()}"
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", closed)  # object_store (obstore)
    monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", closed)  # botocore
    return monkeypatch

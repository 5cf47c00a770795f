"""Stores used in a fork()ed child of the process that used them.

An ``S3Store`` (boto3) inherited by a forked child (DataLoader workers started with ``fork``)
used the parent's client, so parent and children shared pooled keep-alive sockets and read each
other's responses: garbled reads. Now it builds a fresh client in the child, once, and leaves
the parent's alone. obstore is not fork-safe at all (its runtime's threads stay in the parent):
a forked child of a process that used obstore hung in its first request; now it gets a
``StoreError`` saying what to do instead.
"""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from typing import Any

import pytest
from test_consumer import produce

from batchweave import Mesh, S3Store
from batchweave.testing import S3Endpoint
from batchweave.torch import WeaveDataset, WeaveLoader


def _in_fork(fn: Callable[[], Any], timeout: float = 60) -> Any:
    """``fn()`` in a forked child: its result, or ``"error: <type>: <message>"``."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()

    def run() -> None:
        try:
            results.put(fn())
        except BaseException as exc:
            results.put(f"error: {type(exc).__name__}: {exc}")

    child = context.Process(target=run)
    child.start()
    try:
        return results.get(timeout=timeout)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()


@pytest.mark.moto_server
def test_an_s3_store_builds_its_own_client_in_a_forked_child(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> None:
    store = S3Store(s3_bucket, s3_prefix, **moto_endpoint.store_options())
    for i in range(4):
        store.put(f"k{i}", f"value {i}".encode())
    assert store.get("k0") == b"value 0"  # the parent's pool holds a keep-alive connection
    parent_client = store.client

    def child() -> tuple[bool, int, list[bytes], bool]:
        seen: list[Any] = []

        def use() -> None:  # the child's threads race to use the store first
            seen.append(store.client)
            store.get("k1")

        threads = [threading.Thread(target=use) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        values = [store.get(f"k{i}") for i in range(4)]
        distinct = {id(client) for client in seen}
        return store.client is parent_client, len(distinct), values, seen[0] is store.client

    shared, clients, values, kept = _in_fork(child)
    assert not shared  # before: the child used the parent's client and its sockets
    assert clients == 1  # one client built, however many threads asked at once
    assert kept
    assert values == [f"value {i}".encode() for i in range(4)]
    # the parent's client was left alone (not replaced, not closed) and still works
    assert store.client is parent_client
    assert [store.get(f"k{i}") for i in range(4)] == values
    store.close()


@pytest.mark.seaweedfs
def test_fork_started_workers_read_an_s3_store_object_correctly(
    seaweedfs_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> None:
    """Before: the workers shared the parent's keep-alive sockets (opened by state_dict()) and
    the loop failed with a StoreError quoting another response's bytes, or read wrong data."""
    mesh = Mesh(dp=2)
    store = S3Store(s3_bucket, s3_prefix, **seaweedfs_endpoint.store_options())
    produce(store, "run", mesh, tgbs=120, size=2000)
    dataset = WeaveDataset(store, "run", mesh=mesh, dp_rank=0, prefetch=4, prefetch_min_latency=0)
    loader = WeaveLoader(dataset, num_workers=4, multiprocessing_context="fork", timeout=60)
    assert loader.state_dict()["step"] == 0  # the parent uses the store before forking
    assert [int(step) for step, _ in loader] == list(range(120))
    loader.close()
    store.close()


_OBSTORE_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, sys
    import batchweave as bw

    bucket, prefix, options = json.loads(sys.argv[1])

    def child(store, queue):
        def fresh():
            return bw.ObstoreS3Store(bucket, prefix, **options)

        for name, make in (("inherited", lambda: store), ("fresh", fresh)):
            try:
                queue.put((name, "ok", make().get("k").decode()))
            except Exception as exc:
                queue.put((name, type(exc).__name__, str(exc)))

    def in_fork(store):
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        process = context.Process(target=child, args=(store, queue))
        process.start()
        process.join(15)
        if process.is_alive():
            process.kill()
            process.join()
            return "hung"
        return [queue.get(timeout=10) for _ in range(2)]

    store = bw.ObstoreS3Store(bucket, prefix, **options)
    before = in_fork(store)  # this process has not used obstore yet
    assert store.get("k") == b"hello"
    after = in_fork(store)
    print(json.dumps({"before": before, "after": after, "parent": store.get("k").decode()}))
    """
)


@pytest.mark.moto_server
def test_obstore_in_a_forked_child_of_a_process_that_used_it_is_a_clear_error(
    moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str
) -> None:
    """Run in a fresh interpreter: this test process may have used obstore already."""
    options = moto_endpoint.store_options()
    S3Store(s3_bucket, s3_prefix, **options).put("k", b"hello")
    try:
        run = subprocess.run(
            [sys.executable, "-c", _OBSTORE_SCRIPT, json.dumps([s3_bucket, s3_prefix, options])],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    except subprocess.TimeoutExpired:
        # a child that hung in obstore desynchronises the connection it shared with the parent:
        # the parent's next request hangs too
        pytest.fail("obstore hung in the forked child, and then in its parent")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    # a child of a process that had not used obstore may use it
    assert result["before"] == [["inherited", "ok", "hello"], ["fresh", "ok", "hello"]]
    # before: the child hung in its first request, with the inherited store or a fresh one
    assert result["after"] != "hung"
    for name, kind, message in result["after"]:
        assert kind == "StoreError", (name, kind, message)
        assert "fork" in message
        assert "spawn" in message
        assert "forkserver" in message
        assert "boto3" in message
    assert result["parent"] == "hello"  # the parent is unaffected

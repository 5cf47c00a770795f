"""The store wrappers (pass-through, counting, fault injection): numbers, faults, conformance."""

from __future__ import annotations

import itertools
import math
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from batchweave import (
    AmbiguousWriteError,
    Bounded,
    CountingStore,
    FaultInjectingStore,
    FileStore,
    InvalidKey,
    MemoryStore,
    ObjectExists,
    ObjectNotFound,
    ObjectStore,
    PutMode,
    StoreCounts,
    StoreWrapper,
    Suffix,
    TransientStoreError,
)
from batchweave.testing import StoreTests


class TestCountingStoreConformance(StoreTests):
    @pytest.fixture
    def store(self) -> ObjectStore:
        return CountingStore(MemoryStore())


class TestFaultInjectingStoreConformance(StoreTests):
    """With no faults configured the wrapper must be invisible."""

    @pytest.fixture
    def store(self) -> ObjectStore:
        return FaultInjectingStore(MemoryStore(), seed=1)


class TestStoreWrapperConformance(StoreTests):
    """The bare pass-through base must be invisible."""

    @pytest.fixture
    def store(self) -> ObjectStore:
        return StoreWrapper(MemoryStore())


def test_wrappers_close_the_inner_store_and_name_it_in_their_repr() -> None:
    class ClosableStore(MemoryStore):
        closed = False

        def close(self) -> None:
            self.closed = True

    for wrapper in (StoreWrapper, CountingStore, FaultInjectingStore):
        inner = ClosableStore()
        with wrapper(inner) as store:
            assert store.url == inner.url
            assert repr(store) == f"{wrapper.__name__}({inner!r})"
        assert inner.closed, wrapper


# -- CountingStore ---------------------------------------------------------------------------


def test_counts_requests_and_bytes_by_operation() -> None:
    store = CountingStore(MemoryStore())
    store.put("a", b"12345")
    store.put_if_absent("b", b"xy")
    with pytest.raises(ObjectExists):
        store.put_if_absent("b", b"zz")
    assert store.get("a") == b"12345"
    assert store.get_range("a", Suffix(2)) == b"45"
    assert store.get_range("a", Bounded(0, 1)) == b"1"
    store.head("a")
    with pytest.raises(ObjectNotFound):
        store.get("missing")  # failed requests still cost a round trip
    assert [m.key for m in store.list()] == ["a", "b"]
    store.delete_many(["a", "b"])
    assert store.snapshot() == StoreCounts(
        puts=3,
        conditional_puts=2,
        put_bytes=9,
        gets=2,
        get_bytes=5,
        range_gets=2,
        range_bytes=3,
        heads=1,
        lists=1,
        list_pages=1,
        listed=2,
        deletes=1,
        deleted_keys=2,
    )
    assert store.snapshot().requests == 3 + 2 + 2 + 1 + 1 + 1
    assert store.snapshot().reads == 4
    assert store.snapshot().bytes_read == 8


def test_list_pages_and_delete_batches_follow_s3_page_sizes() -> None:
    store = CountingStore(MemoryStore())
    for i in range(2500):
        store.put(f"k/{i:05d}", b"")
    store.reset()
    assert store.snapshot() == StoreCounts()
    assert len(list(store.list("k/"))) == 2500
    assert store.snapshot().list_pages == 3
    before = store.snapshot()
    assert len(list(itertools.islice(store.list("k/"), 1000))) == 1000
    assert (store.snapshot() - before).list_pages == 1
    store.delete_many(f"k/{i:05d}" for i in range(2500))
    assert store.snapshot().deletes == 3
    assert store.snapshot().deleted_keys == 2500


def test_counting_is_thread_safe() -> None:
    store = CountingStore(MemoryStore())
    store.put("k", b"abc")

    def read() -> None:
        for _ in range(500):
            store.get("k")

    threads = [threading.Thread(target=read) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.snapshot().gets == 4000
    assert store.snapshot().get_bytes == 12000


# -- FaultInjectingStore ---------------------------------------------------------------------


def test_scripted_put_failure_landed_or_not() -> None:
    inner = MemoryStore()
    store = FaultInjectingStore(inner)
    store.fail_next("put", landed=True)
    with pytest.raises(AmbiguousWriteError):
        store.put_if_absent("landed", b"1")
    assert inner.get("landed") == b"1"
    store.fail_next("put")
    with pytest.raises(AmbiguousWriteError):
        store.put_if_absent("lost", b"1")
    with pytest.raises(ObjectNotFound):
        inner.get("lost")
    store.put_if_absent("lost", b"2")  # the script is used up
    assert store.injected == {"scripted_put": 2}


def test_scripted_faults_respect_key_prefix_error_and_times() -> None:
    inner = MemoryStore()
    store = FaultInjectingStore(inner)
    store.fail_next("put", ObjectExists, key_prefix="_manifests/", times=2)
    store.put("data/x", b"not targeted")
    for _ in range(2):
        with pytest.raises(ObjectExists):
            store.put("_manifests/1", b"m")
    store.put("_manifests/1", b"m")
    assert inner.get("_manifests/1") == b"m"
    store.fail_next("get", TransientStoreError("scripted"))
    with pytest.raises(TransientStoreError, match="scripted"):
        store.get("data/x")
    store.fail_next("list")
    with pytest.raises(TransientStoreError):
        list(store.list())
    store.fail_next("delete_many", landed=True)
    with pytest.raises(TransientStoreError):
        store.delete_many(["data/x"])
    with pytest.raises(ObjectNotFound):
        inner.get("data/x")


def test_transient_errors_never_reach_the_inner_store() -> None:
    inner = CountingStore(MemoryStore())
    store = FaultInjectingStore(inner, transient_error_rate=1.0)
    for call in (
        lambda: store.put("k", b"v"),
        lambda: store.get("k"),
        lambda: store.get_range("k", Suffix(1)),
        lambda: store.head("k"),
        lambda: list(store.list()),
        lambda: store.delete_many(["k"]),
    ):
        with pytest.raises(TransientStoreError):
            call()
    assert inner.snapshot() == StoreCounts()
    assert store.injected == {"transient": 6}


def test_ambiguous_puts_land_but_raise() -> None:
    inner = MemoryStore()
    store = FaultInjectingStore(inner, ambiguous_put_rate=1.0)
    with pytest.raises(AmbiguousWriteError):
        store.put_if_absent("k", b"first")
    assert inner.get("k") == b"first"
    with pytest.raises(AmbiguousWriteError):
        store.put_if_absent("k", b"second")  # lost the create race, response lost too
    assert inner.get("k") == b"first"


def test_failed_puts_after_delay_do_not_land() -> None:
    slept: list[float] = []
    inner = MemoryStore()
    store = FaultInjectingStore(
        inner, seed=3, failed_put_after_delay_rate=1.0, failed_put_delay=2.5, sleep=slept.append
    )
    kinds = set()
    for i in range(20):
        with pytest.raises((AmbiguousWriteError, TransientStoreError)) as info:
            store.put(f"k{i}", b"v")
        kinds.add(type(info.value))
    assert kinds == {AmbiguousWriteError, TransientStoreError}
    assert slept == [2.5] * 20
    assert list(inner.list()) == []


def test_latency_uses_the_injected_sleep() -> None:
    slept: list[float] = []
    store = FaultInjectingStore(MemoryStore(), latency=(0.01, 0.02), sleep=slept.append)
    store.put("k", b"v")
    store.get("k")
    store.head("k")
    assert len(slept) == 3
    assert all(0.01 <= s <= 0.02 for s in slept)
    fixed: list[float] = []
    FaultInjectingStore(MemoryStore(), latency=0.5, sleep=fixed.append).delete_many(["k"])
    assert fixed == [0.5]


def _outcomes(seed: int) -> list[str]:
    store = FaultInjectingStore(
        MemoryStore(), seed=seed, transient_error_rate=0.3, ambiguous_put_rate=0.3
    )
    result = []
    for i in range(200):
        try:
            store.put(f"k{i}", b"v")
            result.append("ok")
        except (TransientStoreError, AmbiguousWriteError) as exc:
            result.append(type(exc).__name__)
    return result


def test_random_faults_are_reproducible_from_the_seed() -> None:
    first = _outcomes(7)
    assert first == _outcomes(7)
    assert first != _outcomes(8)
    assert {"ok", "TransientStoreError", "AmbiguousWriteError"} == set(first)


def test_rates_are_validated() -> None:
    with pytest.raises(ValueError, match="ambiguous_put_rate"):
        FaultInjectingStore(MemoryStore(), ambiguous_put_rate=1.5)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"failed_put_delay": -1.0}, "failed_put_delay"),
        ({"failed_put_delay": math.nan}, "failed_put_delay"),
        ({"failed_put_delay": math.inf}, "failed_put_delay"),
        ({"latency": math.nan}, "latency"),
        ({"latency": -1.0}, "latency"),
        ({"latency": math.inf}, "latency"),
        ({"latency": (-2.0, -1.0)}, "latency"),
        ({"latency": (0.2, 0.1)}, "latency"),
        ({"latency": (0.0, math.nan)}, "latency"),
        ({"latency": (0.0, 0.1, 0.2)}, "latency"),
    ],
)
def test_delays_are_validated_when_the_store_is_made(
    kwargs: dict[str, object], message: str
) -> None:
    # Accepted, they surfaced only when a fault fired: as time.sleep's ValueError, not the
    # AmbiguousWriteError/TransientStoreError the test meant to inject.
    with pytest.raises(ValueError, match=message):
        FaultInjectingStore(MemoryStore(), failed_put_after_delay_rate=1.0, **kwargs)  # type: ignore[arg-type]
    FaultInjectingStore(MemoryStore(), latency=(0.0, 0.0), failed_put_delay=0.0)


# -- calls refused before any request ----------------------------------------------------------


def _refused_calls(store: ObjectStore) -> list[Callable[[], object]]:
    """Calls every store refuses before any request: bad keys, a bad mode, range or batch."""
    bad: Any = "create"
    return [
        lambda: store.get("a//b"),
        lambda: store.head("../x"),
        lambda: store.put("a//b", b"xy"),
        lambda: store.put("k", b"xy", mode=bad),
        lambda: store.put_parts("k", [b"x", b"y"], mode=bad),
        lambda: store.put_if_absent("/abs", b"xy"),
        lambda: store.get_range("a//b", Suffix(1)),
        lambda: store.get_range("k", bad),
        lambda: store.get_range_into("a//b", 0, memoryview(bytearray(4))),
        lambda: store.delete_many(["ok", "bad//key"]),
        lambda: store.delete_many(bad),
    ]


def test_counting_store_does_not_count_calls_refused_before_any_request() -> None:
    inner = MemoryStore()
    inner.put("k", b"kept")
    store = CountingStore(inner)
    for call in _refused_calls(store):
        with pytest.raises((InvalidKey, TypeError)):
            call()
    assert store.snapshot() == StoreCounts()
    assert inner.get("k") == b"kept"


def test_fault_injection_lets_refused_calls_fail_as_in_any_store() -> None:
    # An invalid key is InvalidKey (not a retryable injected TransientStoreError), and a
    # scripted fault is not spent on a call that could never reach the store.
    store = FaultInjectingStore(MemoryStore(), seed=3, transient_error_rate=1.0)
    for op in ("put", "get", "get_range", "head", "delete_many"):
        store.fail_next(op)  # type: ignore[arg-type]
    for call in _refused_calls(store):
        with pytest.raises((InvalidKey, TypeError)):
            call()
    assert store.injected == {}
    scripted = FaultInjectingStore(MemoryStore())
    scripted.fail_next("get")
    with pytest.raises(InvalidKey):
        scripted.get("a//b")
    with pytest.raises(TransientStoreError, match="injected failure: get 'k'"):
        scripted.get("k")  # the fault is still there for the first real call
    assert scripted.injected == {"scripted_get": 1}


def test_delete_many_fault_matches_any_key_of_the_batch() -> None:
    inner = MemoryStore()
    store = FaultInjectingStore(inner)
    inner.put("job/data/1", b"x")
    inner.put("job/_manifests/2", b"y")
    store.fail_next("delete_many", key_prefix="job/_manifests/")
    store.delete_many(["job/data/1"])  # no key under the prefix: not failed
    with pytest.raises(TransientStoreError, match=r"delete_many 2 keys \('job/data/0'"):
        store.delete_many(["job/data/0", "job/_manifests/2"])
    assert [m.key for m in inner.list()] == ["job/_manifests/2"]  # not landed
    assert store.injected == {"scripted_delete_many": 1}


def test_an_empty_delete_many_is_no_call_for_faults() -> None:
    slept: list[float] = []
    store = FaultInjectingStore(MemoryStore(), latency=0.5, sleep=slept.append)
    store.fail_next("delete_many")
    store.delete_many([])  # no request: no fault, no latency
    assert store.injected == {}
    assert slept == []
    with pytest.raises(TransientStoreError):
        store.delete_many(["k"])


@pytest.mark.parametrize("times", [0, -1])
def test_fail_next_refuses_times_below_one(times: int) -> None:
    store = FaultInjectingStore(MemoryStore())
    with pytest.raises(ValueError, match=r"times must be >= 1"):
        store.fail_next("put", times=times)
    with pytest.raises(TypeError, match=r"times must be an integer"):
        store.fail_next("put", times=1.5)  # type: ignore[arg-type]
    store.put("k", b"v")  # nothing was scripted
    assert store.injected == {}


# -- StoreWrapper's fallbacks (docs/store.md) -------------------------------------------------


class _SlowPuts(StoreWrapper):
    """docs/store.md's example wrapper (without its sleep): it intercepts ``put`` only."""

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        super().put(key, data, mode=mode)


class _SlowPutsFastReads(_SlowPuts):
    """docs/store.md's way of forwarding the read fast paths."""

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        return self.inner.get_range_into(key, start, buffer)

    def map_range(self, key: str, start: int, end: int) -> memoryview | None:
        return self.inner.map_range(key, start, end)


def test_store_wrapper_falls_back_as_documented_and_subclasses_can_forward(
    tmp_path: Path,
) -> None:
    inner = FileStore(tmp_path)
    inner.put("o", bytes(range(256)) * 64)
    assert inner.map_range("o", 0, 100) is not None
    assert _SlowPuts(inner).map_range("o", 0, 100) is None  # the ObjectStore default
    view = _SlowPutsFastReads(inner).map_range("o", 0, 100)
    assert view is not None
    assert bytes(view) == bytes(range(100))
    view.release()
    buf = bytearray(10)
    assert _SlowPutsFastReads(inner).get_range_into("o", 5, memoryview(buf)) == 10
    assert bytes(buf) == bytes(range(5, 15))

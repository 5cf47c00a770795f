"""Wrong arguments to the lifecycle API are refused up front, before any store request.

Found by an audit of API misuse: ``Watermarks(keep_last=1.5).record`` wrote its watermark and
then failed, leaving the old ones unreleased; ``Reclaimer(delete_batch=2.5).run_once`` committed
its cut and then failed; ``namespace=123`` and string numbers failed deep inside with Python's
own ``AttributeError``/``TypeError``. Each test below fails on the code before the fix.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import pytest

import batchweave as bw
from batchweave._manifest import ManifestLog

NS = "runs/misuse"
MESH = bw.Mesh(dp=1, cp=1)
DAY = 86400.0


def publish(store: bw.ObjectStore, steps: int, producer_id: str = "p0") -> None:
    with bw.Producer(store, NS, producer_id=producer_id, mesh=MESH) as producer:
        for offset in range(steps):
            producer.append([b"%d" % offset], offset=offset)


def contents(store: bw.ObjectStore) -> dict[str, bytes]:
    """Every object under the namespace, with its bytes: what a refused call must not change."""
    return {meta.key: store.get(meta.key) for meta in store.list(f"{NS}/")}


def refused(
    call: Callable[[], object], error: type[Exception], match: str, store: bw.CountingStore
) -> None:
    """``call`` raises ``error`` matching ``match`` having made no request to ``store``."""
    before = store.snapshot()
    with pytest.raises(error, match=match):
        call()
    assert (store.snapshot() - before).requests == 0


# -- Watermarks ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("keep_last", "error", "match"),
    [
        (1.5, TypeError, r"keep_last must be an integer, got the float 1\.5"),
        ("2", TypeError, r"keep_last must be an integer, got the str '2'"),
        (True, TypeError, r"keep_last must be an integer, got the bool True"),
        (0, ValueError, r"keep_last must be >= 1, got 0"),
    ],
)
def test_a_bad_keep_last_is_refused_before_record_writes_anything(
    keep_last: object, error: type[Exception], match: str
) -> None:
    store = bw.MemoryStore()
    bw.Watermarks(store, NS).record("a", 1)
    before = contents(store)
    with pytest.raises(error, match=match):
        # Before the fix the constructor accepted 1.5, and record() wrote "b" and then failed
        # with "slice indices must be integers", never releasing "a".
        bw.Watermarks(store, NS, keep_last=keep_last).record("b", 2)  # type: ignore[arg-type]
    assert contents(store) == before


def test_a_numpy_keep_last_is_kept_as_a_plain_int() -> None:
    store = bw.MemoryStore()
    marks = bw.Watermarks(store, NS, keep_last=np.int64(1))
    assert type(marks.keep_last) is int
    marks.record("a", 1)
    marks.record("b", 2)
    assert [m.checkpoint_id for m in marks.live()] == ["b"]


@pytest.mark.parametrize("make", ["Watermarks", "Reclaimer", "retire_producers"])
def test_a_namespace_that_is_no_str_is_a_type_error_naming_it(make: str) -> None:
    store = bw.CountingStore(bw.MemoryStore())
    calls: dict[str, Callable[[object], object]] = {
        "Watermarks": lambda ns: bw.Watermarks(store, ns),  # type: ignore[arg-type]
        "Reclaimer": lambda ns: bw.Reclaimer(store, ns),  # type: ignore[arg-type]
        "retire_producers": lambda ns: bw.retire_producers(store, ns, idle_for=DAY),  # type: ignore[arg-type]
    }
    refused(lambda: calls[make](123), TypeError, r"namespace must be a str, got the int 123", store)
    refused(lambda: calls[make]("ns/"), ValueError, r"namespace 'ns/' must not end with '/'", store)


def test_checkpoint_ids_and_scopes_that_are_no_str_are_type_errors() -> None:
    store = bw.CountingStore(bw.MemoryStore())
    marks = bw.Watermarks(store, NS)
    match = r"checkpoint_id must be a str, got the int 5"
    refused(lambda: marks.record(5, 1), TypeError, match, store)  # type: ignore[arg-type]
    refused(lambda: marks.release(5), TypeError, match, store)  # type: ignore[arg-type]
    refused(lambda: marks.get(5), TypeError, match, store)  # type: ignore[arg-type]
    refused(
        lambda: bw.Watermarks(store, NS, scope=5),  # type: ignore[arg-type]
        TypeError,
        r"scope must be a str, got the int 5",
        store,
    )
    refused(
        lambda: bw.Watermarks(store, NS, scope="a/b-"),
        ValueError,
        r"scope 'a/b-' is not a safe key segment",
        store,
    )


class _Resumable:
    """A consumer stand-in for the hook: its step, and whether anyone asked for it."""

    manifest_version = 1
    asked = False

    def resume_tgb_step(self, state: Mapping[str, Any] | None = None) -> int:
        self.asked = True
        return 0


@pytest.mark.parametrize("rank", [0, 1])
def test_the_hook_refuses_a_bad_checkpoint_id_on_every_rank(rank: int) -> None:
    # Before the fix rank 1 returned None for checkpoint_id=5 while rank 0 raised: the other
    # ranks then wait at the next collective for a rank that is gone.
    store = bw.CountingStore(bw.MemoryStore())
    consumer = _Resumable()
    marks = bw.Watermarks(store, NS)
    hook = bw.checkpoint_hook
    refused(
        lambda: hook(consumer, marks, 5, rank=rank),  # type: ignore[arg-type]
        TypeError,
        r"checkpoint_id must be a str",
        store,
    )
    refused(
        lambda: hook(consumer, marks, "a/b", rank=rank),
        ValueError,
        r"checkpoint_id 'a/b' is not a safe key segment",
        store,
    )
    assert not consumer.asked


@pytest.mark.parametrize("rank", [0, 1])
def test_the_hook_refuses_what_is_no_consumer_or_no_watermarks_on_every_rank(rank: int) -> None:
    # Before: checkpoint_hook(None, ...) raised "'NoneType' object has no attribute
    # 'resume_tgb_step'" on rank 0 alone; rank 1 returned None.
    store = bw.CountingStore(bw.MemoryStore())
    marks = bw.Watermarks(store, NS)
    hook = bw.checkpoint_hook
    wanted = (
        r"consumer must be a batchweave\.Consumer, a batchweave\.torch\.WeaveLoader, or a reader "
        r"with a resume_tgb_step\(state\) method and a manifest_version attribute, got the "
    )
    refused(
        lambda: hook(None, marks, "ck", rank=rank),  # type: ignore[arg-type]
        TypeError,
        wanted + "NoneType None",
        store,
    )
    refused(
        lambda: hook(marks, _Resumable(), "ck", rank=rank),  # type: ignore[arg-type]
        TypeError,
        wanted + "Watermarks",
        store,
    )
    consumer = _Resumable()
    refused(
        lambda: hook(consumer, None, "ck", rank=rank),  # type: ignore[arg-type]
        TypeError,
        r"watermarks must be a batchweave\.Watermarks .*got the NoneType None",
        store,
    )
    assert not consumer.asked


# -- Reclaimer -------------------------------------------------------------------------------


def test_a_fractional_delete_batch_is_refused_before_the_cut_is_committed() -> None:
    store = bw.MemoryStore()
    publish(store, 6)
    bw.Watermarks(store, NS).record("c", 4)  # a pass would cut at step 4
    before = contents(store)
    with pytest.raises(TypeError, match=r"delete_batch must be an integer, got the float 2\.5"):
        # Before the fix: base_step 4 committed, then "'float' object cannot be interpreted as
        # an integer" at the first delete.
        bw.Reclaimer(store, NS, delete_batch=2.5).run_once()  # type: ignore[arg-type]
    assert contents(store) == before
    assert ManifestLog(store, NS).latest().base_step == 0


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"grace": "600"}, TypeError, r"grace must be a number of seconds, got the str '600'"),
        ({"grace": True}, TypeError, r"grace must be a number of seconds, got the bool True"),
        ({"grace": float("nan")}, ValueError, r"grace must be >= 0 seconds, got nan"),
        ({"grace": -1}, ValueError, r"grace must be >= 0 seconds, got -1"),
        ({"max_commit_attempts": "5"}, TypeError, r"max_commit_attempts must be an integer"),
        ({"max_commit_attempts": 0}, ValueError, r"max_commit_attempts must be >= 1, got 0"),
        ({"delete_batch": "10"}, TypeError, r"delete_batch must be an integer, got the str"),
        ({"delete_batch": 1e3}, TypeError, r"delete_batch must be an integer, got the float"),
        ({"progress": 5}, TypeError, r"progress must be a callable .* got the int 5"),
    ],
)
def test_bad_reclaimer_options_are_refused_by_the_constructor(
    options: dict[str, object], error: type[Exception], match: str
) -> None:
    store = bw.CountingStore(bw.MemoryStore())
    refused(lambda: bw.Reclaimer(store, NS, **options), error, match, store)  # type: ignore[arg-type]


def test_numpy_counts_and_integer_seconds_are_accepted_as_plain_numbers() -> None:
    reclaimer = bw.Reclaimer(
        bw.MemoryStore(),
        NS,
        grace=np.int64(600),
        delete_batch=np.int32(10),
        max_commit_attempts=np.int64(3),
    )
    assert type(reclaimer.grace) is float
    assert reclaimer.grace == 600.0
    assert type(reclaimer._delete_batch) is int
    assert type(reclaimer._max_commit_attempts) is int


def test_start_refuses_a_string_interval_before_starting_a_thread() -> None:
    store = bw.CountingStore(bw.MemoryStore())
    reclaimer = bw.Reclaimer(store, NS)
    refused(
        lambda: reclaimer.start("60"),  # type: ignore[arg-type]
        TypeError,
        r"interval must be a number of seconds, got the str '60'",
        store,
    )
    assert reclaimer._thread is None


@pytest.mark.parametrize("interval", [-5, 0, 0.0])
def test_start_refuses_a_non_positive_interval_with_the_bound_it_checks(interval: float) -> None:
    """Before: -5 was refused as "must be >= 0 seconds", and then 0 as "must be > 0"."""
    reclaimer = bw.Reclaimer(bw.MemoryStore(), NS)
    with pytest.raises(ValueError, match=rf"interval must be > 0 seconds, got {interval}$"):
        reclaimer.start(interval)
    assert reclaimer._thread is None


def test_stop_refuses_a_string_timeout_and_leaves_the_thread_running() -> None:
    passes = threading.Semaphore(0)
    reclaimer = bw.Reclaimer(bw.MemoryStore(), NS, progress=lambda p: passes.release())
    reclaimer.start(3600)  # one pass (no namespace: it ends at once), then a long wait
    try:
        assert passes.acquire(timeout=5)
        thread = reclaimer._thread
        assert thread is not None
        # Before the fix the thread was told to stop and forgotten, then join() raised.
        with pytest.raises(TypeError, match=r"timeout must be a number of seconds, got the str"):
            reclaimer.stop("1")  # type: ignore[arg-type]
        assert reclaimer._thread is thread
        assert thread.is_alive()
    finally:
        reclaimer.stop(timeout=5)
    assert not thread.is_alive()


# -- retire_producers ------------------------------------------------------------------------


def later(days: float) -> float:
    return time.time() + days * DAY


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"idle_for": "7d"}, TypeError, r"idle_for must be a number of seconds, got the str '7d'"),
        ({"idle_for": True}, TypeError, r"idle_for must be a number of seconds, got the bool"),
        ({"idle_for": -1.0}, ValueError, r"idle_for must be > 0 seconds, got -1\.0"),
        ({"idle_for": 0}, ValueError, r"idle_for must be > 0 seconds, got 0"),
        ({"idle_for": float("inf")}, ValueError, r"idle_for must be a finite number of seconds"),
        ({"attempts": 2.5}, TypeError, r"attempts must be an integer, got the float 2\.5"),
        ({"attempts": "5"}, TypeError, r"attempts must be an integer, got the str '5'"),
        ({"attempts": 0}, ValueError, r"attempts must be >= 1, got 0"),
    ],
)
def test_bad_retire_arguments_are_refused_before_any_request(
    options: dict[str, object], error: type[Exception], match: str
) -> None:
    inner = bw.MemoryStore()
    publish(inner, 2)
    store = bw.CountingStore(inner)
    before = contents(inner)
    arguments: dict[str, Any] = {"idle_for": DAY, "wall_clock": lambda: later(2), **options}
    # Before the fix attempts=2.5 retired the idle id (nothing checked it) and "7d" failed
    # inside with "'>' not supported between instances of 'str' and 'int'".
    refused(lambda: bw.retire_producers(store, NS, **arguments), error, match, store)
    assert contents(inner) == before


@pytest.mark.parametrize(
    ("make", "option"),
    [
        (lambda store, **kw: bw.Reclaimer(store, "ns", **kw), "clock"),
        (lambda store, **kw: bw.Reclaimer(store, "ns", **kw), "sleep"),
        (lambda store, **kw: bw.Watermarks(store, "ns", **kw), "clock"),
        (lambda store, **kw: bw.Watermarks(store, "ns", **kw), "sleep"),
    ],
)
def test_a_time_function_that_cannot_be_called_is_refused_naming_it(make: Any, option: str) -> None:
    # Accepted before, it failed at the first pass or record() with a bare "'float' object is
    # not callable" (in a start() thread, a warning every pass).
    store = bw.MemoryStore()
    with pytest.raises(TypeError, match=rf"^{option} must be callable \(like time\.\w+\)"):
        make(store, **{option: 1.5})
    assert list(store.list()) == []  # refused before any request

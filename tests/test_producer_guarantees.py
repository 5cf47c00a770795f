"""Producer guarantees that planted one-line mutants of ``batchweave/_producer/`` broke unnoticed.

The exit hook (``_close_unclosed_at_exit`` / ``Producer._close_at_exit``) is called directly
here, in this process, with a deadline already passed: what it does with a pending TGB is then
decided at once, without waiting out ``EXIT_CLOSE_TIMEOUT``.
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time
import warnings
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import pytest
from fake_time import FakeTime
from test_misuse_producer import MESH, NS, fenced_holding_offset_1, payloads

import batchweave as bw
from batchweave._fork import current_pid
from batchweave._producer import _lifetime
from batchweave._store._memory import MemoryStore


class _HeldUploads(bw.StoreWrapper):
    """Data uploads wait for ``gate`` once ``hold`` is set, then fail as an outage would."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.hold = False
        self.gate = threading.Event()
        self.started = threading.Event()

    def put_parts(self, key: str, parts: Sequence[bytes | memoryview], **kwargs: Any) -> None:
        if self.hold and "/data/" in key:
            self.started.set()
            assert self.gate.wait(30), "test gate never opened"
            raise bw.StoreUnavailable("connection refused (injected outage)")
        super().put_parts(key, parts, **kwargs)


def _no_sleep(seconds: float) -> None:
    """The producer's ``sleep``: retries of the held upload do not wait."""


def test_the_exit_hook_names_the_offset_after_the_committed_one_and_close_raises_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The ERROR must name the resume_offset a restarted producer resumes from: the committed
    # offset + 1 (a mutant naming the committed offset itself went unnoticed, since the
    # subprocess test commits nothing). close() afterwards raises once, then is idempotent.
    store = _HeldUploads(MemoryStore())
    p = bw.Producer(store, NS, producer_id="p0", mesh=MESH, policy="naive", sleep=_no_sleep)
    p.append(payloads(0), offset=0)
    p.flush()
    store.hold = True
    p.append(payloads(1), offset=1)
    assert store.started.wait(10)
    with caplog.at_level(logging.ERROR, logger="batchweave.producer"):
        failure = p._close_at_exit(time.monotonic() - 1.0)  # the deadline has passed
    store.gate.set()
    assert isinstance(failure, TimeoutError)
    [error] = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "1 TGBs (offsets 1..1) are NOT committed" in error
    assert "resumes from its resume_offset (1) and publishes them" in error
    assert p.closed
    with pytest.raises(bw.ProducerError, match=r"1 TGBs \(offsets 1..1\) are NOT committed"):
        p.close()
    p.close()  # idempotent once the exit hook's failure was raised
    with bw.Producer(store, NS, producer_id="p0", mesh=MESH) as again:
        assert again.resume_offset == 1


class _FakeUnclosed:
    """A producer for ``_close_unclosed_at_exit``: records the deadline it was given."""

    def __init__(self, outcome: BaseException | None) -> None:
        self.outcome = outcome
        self.deadlines: list[float] = []

    def _close_at_exit(self, deadline: float) -> BaseException | None:
        self.deadlines.append(deadline)
        return self.outcome


def test_a_ctrl_c_in_the_exit_hook_stops_the_other_producers_without_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "A Ctrl-C here stops the rest without waiting": the producers after the interrupted one
    # get a deadline already passed, not what remains of EXIT_CLOSE_TIMEOUT.
    first = _FakeUnclosed(KeyboardInterrupt())
    second = _FakeUnclosed(None)
    monkeypatch.setattr(_lifetime, "_UNCLOSED", [first, second])
    _lifetime._close_unclosed_at_exit()
    [deadline] = first.deadlines
    assert deadline > time.monotonic()  # the first had the whole EXIT_CLOSE_TIMEOUT
    assert second.deadlines == [-math.inf]


def test_the_exit_hook_leaves_a_forked_copy_of_a_producer_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # In a fork()ed child the hook must not touch the parent's producer: closing its copy there
    # would fail at once and log an ERROR claiming the parent's pending TGBs are NOT committed.
    store = _HeldUploads(MemoryStore())
    store.hold = True
    p = bw.Producer(store, NS, producer_id="p0", mesh=MESH, policy="naive", sleep=_no_sleep)
    p.append(payloads(0), offset=0)
    assert store.started.wait(10)
    parent = current_pid()
    # As in a child:
    monkeypatch.setattr("batchweave._producer._client.current_pid", lambda: parent + 1)
    with caplog.at_level(logging.WARNING, logger="batchweave.producer"):
        assert p._close_at_exit(time.monotonic() + 10.0) is None
    monkeypatch.setattr("batchweave._producer._client.current_pid", lambda: parent)
    assert caplog.records == []
    assert not p.closed
    assert p.stats().pending == 1
    store.gate.set()
    p.abort()


def test_a_forked_copy_dropped_in_the_child_does_not_warn_nor_stop_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # __del__ of the child's copy must leave the parent's producer (state shared up to the fork)
    # alone and say nothing: the child never created or used it.
    p = bw.Producer(MemoryStore(), NS, producer_id="p0", mesh=MESH, policy="naive")
    parent = current_pid()
    monkeypatch.setattr("batchweave._producer._client.current_pid", lambda: parent + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        p.__del__()
    monkeypatch.setattr("batchweave._producer._client.current_pid", lambda: parent)
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []
    p.append(payloads(0), offset=0)  # still usable: not aborted, its uploads not shut down
    p.close()
    assert p.committed_offset == 0


def test_a_failed_producer_dropped_with_uncommitted_tgbs_is_freed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Nothing can commit a failed producer's TGBs: kept alive for the exit hook, as before
    # session 19, its payloads and upload threads stayed for the life of the process, one set
    # per failed producer a retry loop dropped. What it could not commit is named at ERROR
    # when it fails, and raised to the caller.
    store = MemoryStore()
    with caplog.at_level(logging.ERROR, logger="batchweave.producer"):
        old = fenced_holding_offset_1(store)
        with pytest.raises(bw.ProducerFenced):
            old.flush()
        old._committer.join(10)  # the commit thread ended (and logged), letting go of it
    assert not old._committer.is_alive()
    assert any("uncommitted: offsets 1..1" in r.getMessage() for r in caplog.records)
    assert old not in _lifetime._BUSY
    ref = weakref.ref(old)
    del old
    gc.collect()
    assert ref() is None


class _FailingReads(bw.StoreWrapper):
    """The next ``failures`` reads (GET, ranged GET, HEAD, LIST) fail transiently."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.failures = 0
        self._lock = threading.Lock()

    def _maybe_fail(self) -> None:
        with self._lock:
            if self.failures > 0:
                self.failures -= 1
                raise bw.TransientStoreError("503 Slow Down (injected)")

    def get(self, key: str) -> bytes:
        self._maybe_fail()
        return super().get(key)

    def get_range(self, key: str, rng: Any) -> bytes:
        self._maybe_fail()
        return super().get_range(key, rng)

    def head(self, key: str) -> Any:
        self._maybe_fail()
        return super().head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Any:
        self._maybe_fail()
        return super().list(prefix, start_after=start_after)


def test_the_commit_backoff_starts_again_after_a_successful_commit() -> None:
    # _commit_turn resets its count of consecutive failed turns on success: a transient error
    # an hour later backs off from attempt 1 again, not from where the last outage ended.
    fake = FakeTime()
    attempts: list[int] = []

    def backoff(attempt: int) -> float:
        attempts.append(attempt)
        return 0.1

    store = _FailingReads(MemoryStore())
    with bw.Producer(
        store,
        NS,
        producer_id="p0",
        mesh=MESH,
        policy="naive",
        backoff=backoff,
        **fake.producer_options(),  # type: ignore[arg-type]
    ) as p:
        p.append(payloads(0), offset=0)
        p.flush()
        for offset in (1, 2):
            store.failures = 1  # the commit's re-read of the latest manifest fails once
            p.append(payloads(offset), offset=offset)
            p.flush()
            assert p.committed_offset == offset
        assert p.stats().transient_errors == 2
    assert attempts == [1, 1]


class _DataUploadsFail(bw.StoreWrapper):
    """Data uploads wait for ``gate``, then fail transiently (every time)."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.gate = threading.Event()

    def put_parts(self, key: str, parts: Sequence[bytes | memoryview], **kwargs: Any) -> None:
        if "/data/" in key:
            assert self.gate.wait(30), "test gate never opened"
            raise bw.TransientStoreError("500 Internal Error (injected)")
        super().put_parts(key, parts, **kwargs)


def test_the_first_background_failure_is_raised_and_failed_uploads_release_their_bytes() -> None:
    # Two uploads fail one after the other: the caller sees the first (offset 0), which may
    # have caused the rest, not whichever failure came last; and each failed upload gives its
    # bytes back (stats().inflight_bytes counts only what still waits for upload).
    store = _DataUploadsFail(MemoryStore())
    p = bw.Producer(store, NS, producer_id="p0", mesh=MESH, upload_threads=1, max_retries=0)
    p.append(payloads(0), offset=0)
    p.append(payloads(1), offset=1)  # queued behind offset 0's upload
    store.gate.set()
    with p._cond:  # both uploads ended: each releases its bytes after storing its failure
        assert p._cond.wait_for(lambda: p._inflight_bytes == 0, timeout=10)
    assert p.stats().inflight_bytes == 0
    with pytest.raises(bw.ProducerError, match=r"offset 0\) failed 1 times"):
        p.flush()
    p.abort()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tail_limit", 0),
        ("upload_threads", 0),
        ("max_inflight_bytes", 0),
        ("tail_bytes_limit", 0),
        ("max_lag", -1),
        ("max_retries", -1),
        ("slice_table_limit", -1),
    ],
)
def test_a_count_below_its_minimum_is_refused_up_front(name: str, value: int) -> None:
    store = MemoryStore()
    kwargs: dict[str, Any] = {name: value}
    with pytest.raises(ValueError, match=f"{name} must be >= {value + 1}, got {value}"):
        bw.Producer(store, NS, producer_id="p0", mesh=MESH, **kwargs)
    assert list(store.list("")) == []


@pytest.mark.parametrize("name", ["max_lag", "max_retries", "slice_table_limit"])
def test_a_count_of_zero_is_taken_where_zero_is_allowed(name: str) -> None:
    # max_lag=0 (no step ahead of the reclamation boundary), max_retries=0 (no retry) and
    # slice_table_limit=0 are documented values, not mistakes.
    kwargs: dict[str, Any] = {name: 0}
    with bw.Producer(MemoryStore(), NS, producer_id="p0", mesh=MESH, **kwargs) as p:
        assert getattr(p, f"_{name}") == 0


def test_an_offset_appended_by_another_thread_during_encoding_is_refused() -> None:
    # append checks the offset, encodes outside the lock, then checks it again: a thread that
    # appended the same offset meanwhile wins, and the slower append raises instead of
    # publishing that offset a second time.
    started = threading.Event()
    gate = threading.Event()

    def slow_payloads() -> Iterable[bytes]:
        started.set()
        assert gate.wait(10), "test gate never opened"
        yield from payloads(1)

    outcome: list[BaseException | None] = []

    def slow_append() -> None:
        try:
            p.append(slow_payloads(), offset=1)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    with bw.Producer(MemoryStore(), NS, producer_id="p0", mesh=MESH, policy="naive") as p:
        slow = threading.Thread(target=slow_append)
        slow.start()
        assert started.wait(10)  # the slow append passed its first check and is encoding
        p.append(payloads(1), offset=1)
        gate.set()
        slow.join(10)
        [error] = outcome
        assert isinstance(error, bw.OffsetOrderError), error
        p.flush()
        assert p.stats().tgbs_published == 1


def test_abort_does_not_wait_out_the_commit_loops_backoff() -> None:
    # The commit loop sleeps its backoff in pieces and stops at the first piece after abort()
    # (which joins it): a 5 s backoff must not be slept to its end.
    backing_off = threading.Event()
    pausing = threading.Event()
    go = threading.Event()
    pauses: list[float] = []

    def backoff(attempt: int) -> float:
        backing_off.set()  # called by the commit loop just before it pauses
        return 5.0

    def sleep(seconds: float) -> None:
        if threading.current_thread().name.startswith("bw-commit-") and backing_off.is_set():
            if not pausing.is_set():
                pausing.set()
                assert go.wait(10), "test never let the backoff go on"
            pauses.append(seconds)

    store = _FailingReads(MemoryStore())
    p = bw.Producer(
        store, NS, producer_id="p0", mesh=MESH, policy="naive", backoff=backoff, sleep=sleep
    )
    p.append(payloads(0), offset=0)
    p.flush()
    store.failures = 1  # the next commit's re-read fails: the loop backs off for 5 s
    p.append(payloads(1), offset=1)
    assert pausing.wait(10)
    aborting = threading.Thread(target=p.abort)
    aborting.start()
    with p._cond:  # abort() set the flag and is joining the commit thread
        assert p._cond.wait_for(lambda: p._aborted, timeout=10)
    go.set()
    aborting.join(10)
    assert not aborting.is_alive()
    assert pauses == [0.25]  # one piece of _TIME_WAIT_CHUNK, not 5 s worth of them

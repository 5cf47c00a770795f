"""Producer misuse: exiting without close(), dropping one, fork(), repeated failures, bad types.

The exit and fork cases run ``tests/_misuse_producer_worker.py`` in a real interpreter, since
what is tested is how a process exits (or what a forked child sees).
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import traceback
import warnings
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import batchweave as bw
from batchweave._producer import _lifetime
from batchweave._store._memory import MemoryStore

MESH = bw.Mesh(dp=2, cp=1)
NS = "ns"
WORKER = Path(__file__).with_name("_misuse_producer_worker.py")


def payloads(offset: int) -> list[bytes]:
    return [f"{offset}/{i}".encode() for i in range(MESH.slices)]


def run_worker(
    mode: str, store_url: str, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    # A worker that hangs at exit is killed by the timeout (TimeoutExpired fails the test).
    return subprocess.run(
        [sys.executable, str(WORKER), mode, store_url],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def resume_offset(url: str) -> int:
    with bw.Producer(bw.open_store(url), NS, producer_id="p0", mesh=MESH) as p:
        return p.resume_offset


# ---------------------------------------------------------------------------------------------
# interpreter exit without close()


def test_a_script_exiting_without_close_commits_what_it_appended(tmp_path: Path) -> None:
    # The commit thread is a daemon: the process exited at once and silently, leaving all 5
    # appended TGBs uncommitted (a one-off job never learned; resume_offset stayed 0).
    url = f"file://{tmp_path}"
    done = run_worker("exit-without-close", url)
    assert done.returncode == 0, done.stderr
    assert "appended None" in done.stdout  # nothing was committed before the exit
    assert "producer 'p0' of namespace 'ns' was not closed when the interpreter" in done.stderr
    assert "committing its 5 appended but uncommitted TGBs (offsets 0..4)" in done.stderr
    assert "EXIT_CLOSE_TIMEOUT" in done.stderr
    assert resume_offset(url) == 5


def test_an_unclosed_producer_in_an_outage_lets_the_process_exit_and_names_the_loss(
    tmp_path: Path,
) -> None:
    # The upload pool's non-daemon thread retried through the outage for ever, and the
    # interpreter joins such threads before exiting: the crashed script never exited.
    url = f"file://{tmp_path}"
    done = run_worker("exit-during-outage", url, timeout=20.0)
    assert done.returncode == 1, done.stderr
    assert "RuntimeError: the script's own bug, after append" in done.stderr
    error = done.stderr[done.stderr.index("failed as the interpreter exited") :]
    assert "TimeoutError" in error
    assert "1 TGBs (offsets 0..0) are NOT committed" in error
    assert "producer_id 'p0' resumes from its resume_offset (0)" in error
    assert resume_offset(url) == 0


def test_a_close_registered_with_atexit_after_a_failed_exit_close_raises(tmp_path: Path) -> None:
    # The exit hook runs before atexit functions; when it could not commit (an outage), the
    # user's own atexit close() returned as if all were well.
    done = run_worker("atexit-close-during-outage", f"file://{tmp_path}", timeout=20.0)
    assert "atexit close: ProducerError: producer 'p0' was closed as the interpreter exited" in (
        done.stdout
    ), (done.stdout, done.stderr)
    assert "1 TGBs (offsets 0..0) are NOT committed" in done.stdout


# ---------------------------------------------------------------------------------------------
# a producer dropped without close()


class _GatedUploads(bw.StoreWrapper):
    """Data uploads wait for ``gate`` (``started`` is set when the first one arrives)."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.gate = threading.Event()
        self.started = threading.Event()

    def put_parts(self, key: str, parts: Sequence[bytes | memoryview], **kwargs: Any) -> None:
        if "/data/" in key:
            self.started.set()
            assert self.gate.wait(30), "test gate never opened"
        super().put_parts(key, parts, **kwargs)


class _NotifyingSet(set[Any]):
    """``_lifetime._BUSY``, setting ``emptied`` when the last producer in it leaves it."""

    def __init__(self) -> None:
        super().__init__()
        self.emptied = threading.Event()

    def discard(self, item: Any) -> None:
        if item in self:
            super().discard(item)
            if not self:
                self.emptied.set()


def _resource_warnings(caught: list[warnings.WarningMessage], pid: str) -> list[str]:
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, ResourceWarning) and f"producer {pid!r}" in str(w.message)
    ]


def test_a_dropped_producer_commits_what_it_holds_then_its_threads_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The commit thread held its producer for ever: every producer dropped without close()
    # kept its two threads (bw-commit-*, bw-upload-*) until the process ended.
    busy = _NotifyingSet()
    monkeypatch.setattr(_lifetime, "_BUSY", busy, raising=False)
    store = MemoryStore()
    gated = _GatedUploads(store)
    p = bw.Producer(gated, NS, producer_id="drop-0", mesh=MESH, policy="naive")
    p.append(payloads(0), offset=0)
    assert gated.started.wait(10)
    ours = [
        t
        for t in threading.enumerate()
        if t.name.startswith(("bw-commit-drop-0", "bw-upload-drop-0"))
    ]
    assert len(ours) == 2
    ref = weakref.ref(p)
    del p
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
    assert ref() is not None, "freed while it still held an uncommitted TGB"
    assert _resource_warnings(caught, "drop-0") == []
    # Freed by reference counting alone, with the cycle collector off: no reference cycle holds
    # it (its store wrapper once called back into it, and it waited for a gc.collect()).
    gc.disable()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            gated.gate.set()
            assert busy.emptied.wait(10), "never committed its TGB and let go of the producer"
            # The commit thread warns, then leaves _BUSY, then ends, letting go of the producer
            # (the warning's source keeps it now, so no weakref check).
            [message] = _resource_warnings(caught, "drop-0")
    finally:
        gc.enable()
    assert "unclosed producer 'drop-0' of namespace 'ns': call close()" in message
    for thread in ours:
        thread.join(10)
        assert not thread.is_alive(), thread.name
    with bw.Producer(store, NS, producer_id="drop-0", mesh=MESH) as again:
        assert again.resume_offset == 1


POLICIES = ["dac", "naive", "fixed10", "fixed100", "incr", "aimd"]


def _threads_of(pid: str) -> list[threading.Thread]:
    return [
        t
        for t in threading.enumerate()
        if t.name.startswith((f"bw-commit-{pid}", f"bw-upload-{pid}"))
    ]


def _drop_a_producer(store: MemoryStore, pid: str, policy: str, *, cycle: bool) -> threading.Thread:
    """Append 3 TGBs to a new producer, then drop it (in a reference cycle if ``cycle``)
    without close(); return its commit thread."""
    p = bw.Producer(store, NS, producer_id=pid, mesh=MESH, policy=policy)
    for offset in range(3):
        p.append(payloads(offset), offset=offset)
    if cycle:
        holder: list[Any] = [p]
        holder.append(holder)
    return p._committer


def _check_committed_then_freed(policy: str, *, cycle: bool) -> None:
    store = MemoryStore()
    pid = f"drop-{policy}-{cycle}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        commit = _drop_a_producer(store, pid, policy, cycle=cycle)
        gc.collect()
        commit.join(10)
        assert not commit.is_alive(), "the dropped producer never committed and let go"
    [message] = _resource_warnings(caught, pid)
    assert "not committed" not in message
    for thread in _threads_of(pid):
        thread.join(10)
        assert not thread.is_alive(), thread.name
    with bw.Producer(store, NS, producer_id=pid, mesh=MESH) as again:
        assert again.resume_offset == 3


@pytest.mark.parametrize("policy", POLICIES)
def test_a_dropped_producer_commits_fewer_tgbs_than_its_policy_counts_then_is_freed(
    policy: str,
) -> None:
    # A count-paced policy (fixed10, fixed100, incr, aimd) waited for more TGBs for ever: the
    # dropped producer committed nothing and kept its threads (no ResourceWarning) until the
    # interpreter's exit, its commit thread holding it while it waited on the policy.
    _check_committed_then_freed(policy, cycle=False)


@pytest.mark.parametrize("policy", ["dac", "fixed10"])
def test_a_producer_dropped_in_a_reference_cycle_commits_what_it_holds_then_is_freed(
    policy: str,
) -> None:
    # The cycle collector clears weak references (the commit thread's to its producer) before
    # it calls __del__: the thread must wait for __del__, which keeps the producer committing.
    _check_committed_then_freed(policy, cycle=True)


# ---------------------------------------------------------------------------------------------
# fork()


def test_a_producer_used_in_a_forked_child_raises_at_once_naming_both_processes(
    tmp_path: Path,
) -> None:
    # The child's copy has no threads: append returned, flush timed out after 10 s, and close()
    # never returned.
    done = run_worker("fork", f"file://{tmp_path}")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    results = report["results"]
    assert results is not None, "the child never reported (it hung)"
    assert set(results) == {"append", "flush", "stats", "close"}
    for name, (seconds, outcome) in results.items():
        assert outcome.startswith("ProducerError: producer 'p0' was created in process "), name
        assert f"process {report['parent']} and cannot be used in process {report['child']}" in (
            outcome
        )
        assert "Create the Producer in the child process, after forking" in outcome
        assert seconds < 1.0, (name, seconds)


# ---------------------------------------------------------------------------------------------
# a stored background failure, raised again and again


def fenced_holding_offset_1(store: bw.ObjectStore) -> bw.Producer:
    """Producer ``p0`` that committed offset 0, was fenced by a newer incarnation, then was
    given offset 1, which it can never commit (its commit loop stores ``ProducerFenced``)."""
    old = bw.Producer(store, NS, producer_id="p0", mesh=MESH, policy="naive")
    old.append(payloads(0), offset=0)
    old.flush()
    bw.Producer(store, NS, producer_id="p0", mesh=MESH).close()  # fences `old`
    old.append(payloads(1), offset=1)
    return old


def test_a_stored_failure_is_raised_with_its_own_traceback_each_time() -> None:
    # The same exception object was raised by every later call, and each raise added its
    # frames to the traceback: by the third call it held all three call sites (16 frames).
    old = fenced_holding_offset_1(MemoryStore())

    def first_call() -> None:
        old.flush()

    def second_call() -> None:
        old.flush()

    def third_call() -> None:
        old.append(payloads(2), offset=2)

    tracebacks = []
    for call in (first_call, second_call, third_call):
        with pytest.raises(bw.ProducerFenced) as info:
            call()
        tracebacks.append([frame.name for frame in traceback.extract_tb(info.value.__traceback__)])
    for call, names in zip((first_call, second_call, third_call), tracebacks, strict=True):
        assert [n for n in names if n.endswith("_call")] == [call.__name__], names
        assert "_adopt_locked" in names  # where the commit thread found the newer epoch
    assert len(tracebacks[0]) == len(tracebacks[1])
    old.abort()


# ---------------------------------------------------------------------------------------------
# arguments of the wrong type


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"max_lag": "3"}, TypeError, r"max_lag must be an integer, got the str '3'"),
        ({"max_lag": 2.5}, TypeError, "max_lag must be an integer, got the float 2.5"),
        ({"max_lag": True}, TypeError, "max_lag must be an integer, got the bool True"),
        ({"upload_threads": "4"}, TypeError, "upload_threads must be an integer"),
        ({"upload_threads": 2.0}, TypeError, "upload_threads must be an integer"),
        ({"max_inflight_bytes": 1.5e6 + 0.5}, TypeError, "max_inflight_bytes must be an integer"),
        ({"max_retries": 1.5}, TypeError, "max_retries must be an integer"),
        ({"slice_table_limit": "8"}, TypeError, "slice_table_limit must be an integer"),
        ({"tail_limit": "5"}, TypeError, "tail_limit must be an integer"),
        ({"tail_bytes_limit": 1.5}, TypeError, "tail_bytes_limit must be an integer"),
        ({"refresh_age": "1"}, TypeError, "refresh_age must be a number of seconds, got the str"),
        ({"active_horizon": float("nan")}, ValueError, "active_horizon must be >= 0 seconds"),
        ({"lag_log_interval": True}, TypeError, "lag_log_interval must be a number of seconds"),
        (
            {"backoff": 0.1},
            TypeError,
            r"backoff must be callable \(like lambda attempt: .*\), got the float 0.1",
        ),
        ({"sleep": None}, TypeError, "sleep must be callable"),
    ],
)
def test_count_and_seconds_arguments_of_the_wrong_type_are_refused_up_front(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    # "3" or 2.5 used to be taken and fail later, deep inside ("'<' not supported between
    # instances of 'str' and 'int'"), or never (max_lag=2.5 and upload_threads=2.0 ran).
    store = MemoryStore()
    with pytest.raises(error, match=match):
        bw.Producer(store, NS, producer_id="p0", mesh=MESH, **kwargs)
    assert list(store.list("")) == []


def test_numpy_integers_are_taken_as_plain_ints() -> None:
    with bw.Producer(
        MemoryStore(),
        NS,
        producer_id="p0",
        mesh=MESH,
        max_lag=np.int64(3),
        upload_threads=np.int32(2),
    ) as p:
        assert type(p._max_lag) is int
        p.append(payloads(0), offset=0)
        p.flush(timeout=np.int64(10))


def test_whole_float_sizes_and_infinite_timeouts_are_taken() -> None:
    # A size written 1e9 and a timeout of inf ("for ever") worked before the argument checks;
    # the first version of those checks refused both.
    with bw.Producer(
        MemoryStore(),
        NS,
        producer_id="p0",
        mesh=MESH,
        policy="naive",
        max_inflight_bytes=1e9,  # type: ignore[arg-type]
        lag_log_interval=float("inf"),
    ) as p:
        assert p._max_inflight == 10**9
        p.append(payloads(0), offset=0)
        p.flush(timeout=float("inf"))
        assert p.committed_offset == 0


@pytest.mark.parametrize(
    ("timeout", "error", "match"),
    [
        ("1", TypeError, "timeout must be a number of seconds, got the str '1'"),
        (True, TypeError, "timeout must be a number of seconds, got the bool True"),
        (float("nan"), ValueError, "timeout must be >= 0 seconds"),
        (-1.0, ValueError, "timeout must be >= 0 seconds"),
    ],
)
@pytest.mark.parametrize("method", ["flush", "seal"])
def test_a_flush_or_seal_timeout_of_the_wrong_type_is_refused_up_front(
    method: str, timeout: object, error: type[Exception], match: str
) -> None:
    # flush(timeout="1") failed with "unsupported operand type(s) for +: 'float' and 'str'";
    # NaN or True were taken (True as 1 s), and -1 timed out at once.
    with bw.Producer(MemoryStore(), NS, producer_id="p0", mesh=MESH, policy="naive") as p:
        p.append(payloads(0), offset=0)
        with pytest.raises(error, match=match):
            getattr(p, method)(timeout=timeout)
        p.flush()
        assert p.committed_offset == 0

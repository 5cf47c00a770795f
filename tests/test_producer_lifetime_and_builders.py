"""A producer's lifetime and the TGBs it accepts.

- The interpreter-exit hook leaves a producer to the live non-daemon thread whose ``with`` block
  holds it (run in a real interpreter: ``tests/_exit_thread_worker.py``).
- A failed producer dropped without ``close()`` is freed and its threads end.
- A ``TgbBuilder``'s settings are read-only, and ``append`` validates a TGB the caller built
  before registering it: one a manifest cannot record is refused there, the producer usable.
- A ``boundary=`` callable returning anything but an int step is a ``TypeError`` naming it.
"""

from __future__ import annotations

import gc
import logging
import subprocess
import sys
import threading
import time
import warnings
import weakref
from pathlib import Path

import pytest

import batchweave as bw
from batchweave._format._tgb import EncodedTgb
from batchweave._format._tgb_write import TgbBuilder, _pack_trailer
from batchweave._manifest._log import ManifestLog
from batchweave._producer import _lifetime
from batchweave._store._memory import MemoryStore

MESH = bw.Mesh(dp=2, cp=1)
NS = "ns"
WORKER = Path(__file__).with_name("_exit_thread_worker.py")
_JOIN = 10.0
"""Seconds a test waits for a thread to end (a bound on a failure, never a synchronisation)."""


def payloads(offset: int) -> list[bytes]:
    return [f"{offset}/{i}".encode() for i in range(MESH.slices)]


def committed_offsets(store: bw.ObjectStore, namespace: str, producer_id: str) -> list[int]:
    log = ManifestLog(store, namespace)
    latest = log.latest()
    return [
        d.offset
        for _, d in log.descriptors(latest, 0, latest.next_step)
        if d.producer_id == producer_id
    ]


# ---------------------------------------------------------------------------------------------
# the exit hook and a non-daemon thread's `with` block


def test_the_exit_waits_for_a_non_daemon_thread_appending_inside_its_with_block(
    tmp_path: Path,
) -> None:
    # The hook ran before the interpreter joins non-daemon threads and closed the worker's
    # producer under it: a WARNING told it to use `with` (it did), and its next append raised
    # ProducerError "is closed", so its offsets were never committed.
    count = 40
    url = f"file://{tmp_path}"
    done = _run_worker(url, count, "appends")
    assert done.returncode == 0, done.stderr
    assert "ProducerError" not in done.stderr, done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    assert "was not closed" not in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stdout.splitlines() == ["main returns", "worker done"]
    assert committed_offsets(bw.open_store(url), NS, "w") == list(range(count))


def _run_worker(url: str, count: int, mode: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(WORKER), url, NS, str(count), mode, *extra],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_an_idle_pool_thread_holding_a_with_block_is_closed_after_the_timeout(
    tmp_path: Path,
) -> None:
    # A ThreadPoolExecutor worker lives until concurrent.futures' exit hook, which runs after
    # BatchWeave's: waiting for it to close its producer hung the exit for ever.
    url = f"file://{tmp_path}"
    done = _run_worker(url, 3, "pool", "1.0")
    assert done.returncode == 0, done.stderr
    assert "neither appended nor published a TGB for 1 s" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert committed_offsets(bw.open_store(url), NS, "w") == [0, 1, 2]  # closed: committed


def test_a_with_thread_blocked_through_an_outage_does_not_hold_the_exit_for_ever(
    tmp_path: Path,
) -> None:
    # Its append blocks (max_inflight_bytes=1, every data PUT refused and retried): waited for
    # without a limit, the process never exited; closed after the timeout, the producer is
    # aborted, the blocked append raises and the thread ends.
    done = _run_worker(f"file://{tmp_path}", 10, "outage", "1.0")
    assert done.returncode == 0, done.stderr
    assert "neither appended nor published a TGB for 1 s" in done.stderr, done.stderr
    assert "worker ended with" in done.stdout, done.stdout


@pytest.fixture
def own_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """The exit hook's registries holding only this test's producers."""
    monkeypatch.setattr(_lifetime, "_UNCLOSED", weakref.WeakSet())
    monkeypatch.setattr(_lifetime, "_WITH_THREADS", weakref.WeakKeyDictionary())


def _hold_in_with(
    producer: bw.Producer, *, daemon: bool
) -> tuple[threading.Thread, threading.Event, threading.Event]:
    """A thread inside ``with producer``, leaving it once ``release`` is set."""
    inside, release = threading.Event(), threading.Event()

    def hold() -> None:
        with producer:
            inside.set()
            release.wait(_JOIN)

    thread = threading.Thread(target=hold, daemon=daemon)
    thread.start()
    assert inside.wait(_JOIN)
    return thread, inside, release


def test_the_exit_hook_waits_only_for_live_non_daemon_with_threads(own_registry: None) -> None:
    store = MemoryStore()
    held = bw.Producer(store, NS, producer_id="held", mesh=MESH, policy="naive")
    by_daemon = bw.Producer(store, NS, producer_id="daemon", mesh=MESH, policy="naive")
    mine = bw.Producer(store, NS, producer_id="mine", mesh=MESH, policy="naive")
    thread, _, release = _hold_in_with(held, daemon=False)
    daemon, _, daemon_release = _hold_in_with(by_daemon, daemon=True)

    def exiting() -> None:
        mine.__enter__()  # entered by the exiting thread itself: never waited for
        _lifetime._wait_for_with_threads()

    # The non-daemon thread is waited for: the hook sees it leave its block, closing `held`.
    waiter = threading.Thread(target=exiting)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # still waiting: `held` is its thread's
    assert not held.closed
    release.set()
    waiter.join(_JOIN)
    assert not waiter.is_alive()
    assert held.closed
    # Neither the daemon's producer nor the exiting thread's own was waited for: the hook
    # closes them as before.
    assert not by_daemon.closed
    assert not mine.closed
    assert _lifetime._owner(threading.current_thread(), []) is None
    _lifetime._close_unclosed_at_exit()
    assert by_daemon.closed
    assert mine.closed
    daemon_release.set()
    thread.join(_JOIN)
    daemon.join(_JOIN)


def test_a_nested_with_on_one_producer_is_tracked_per_block(own_registry: None) -> None:
    store = MemoryStore()
    p = bw.Producer(store, NS, producer_id="p", mesh=MESH, policy="naive")
    with p:
        with p:
            assert len(_lifetime._WITH_THREADS[p]) == 2
        assert p.closed  # the inner block closed it
        assert p not in _lifetime._WITH_THREADS or len(_lifetime._WITH_THREADS[p]) == 1
    assert p not in _lifetime._WITH_THREADS
    with p:  # entered again, closed: left as it was
        pass
    assert p not in _lifetime._WITH_THREADS


def test_a_with_thread_that_ended_is_not_waited_for(own_registry: None) -> None:
    # A generator suspended inside `with p:` in a thread that ended: nothing leaves the block.
    store = MemoryStore()
    p = bw.Producer(store, NS, producer_id="p", mesh=MESH, policy="naive")

    def gen() -> object:
        with p:
            yield

    suspended = gen()
    thread = threading.Thread(target=next, args=(suspended,))
    thread.start()
    thread.join(_JOIN)
    assert not thread.is_alive()
    assert _lifetime._WITH_THREADS[p] == [thread]
    _lifetime._wait_for_with_threads()  # returns at once
    p.close()


# ---------------------------------------------------------------------------------------------
# a failed producer dropped without close()


def _drop_a_failed_producer(
    store: bw.FaultInjectingStore, producer_id: str
) -> tuple[weakref.ref[bw.Producer], list[threading.Thread]]:
    p = bw.Producer(store, NS, producer_id=producer_id, mesh=MESH, max_retries=0)
    store.fail_next("put", bw.AccessDenied, key_prefix=f"{NS}/data/")
    p.append(payloads(0), offset=0)
    try:
        p.flush(_JOIN)
    except bw.ProducerError:
        pass
    else:
        raise AssertionError("the upload did not fail")
    threads = [p._committer, *p._uploads._threads]
    return weakref.ref(p), threads


def test_a_failed_producer_dropped_without_close_is_freed_and_its_threads_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # _fail kept a producer with uncommitted entries in _lifetime._BUSY: dropped, it was never
    # freed and its bw-upload-* threads lived for ever.
    # Not logged: pytest keeps the records, whose failure's traceback holds the producer.
    monkeypatch.setattr(logging.getLogger("batchweave.producer"), "disabled", True)
    store = bw.FaultInjectingStore(MemoryStore())
    dropped = [_drop_a_failed_producer(store, f"p{i}") for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
    deadline = time.monotonic() + _JOIN
    for ref, threads in dropped:
        assert ref() is None
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            assert not thread.is_alive(), thread.name


def test_a_failed_producer_still_alive_at_exit_is_named_by_the_exit_hook(
    own_registry: None, caplog: pytest.LogCaptureFixture
) -> None:
    # Discarded from _BUSY, it is still among the unclosed: the hook says what it lost.
    store = bw.FaultInjectingStore(MemoryStore())
    p = bw.Producer(store, NS, producer_id="p", mesh=MESH, max_retries=0)
    store.fail_next("put", bw.AccessDenied, key_prefix=f"{NS}/data/")
    p.append(payloads(0), offset=0)
    with pytest.raises(bw.ProducerError):
        p.flush(_JOIN)
    assert p not in _lifetime._BUSY
    _lifetime._close_unclosed_at_exit()
    assert p.closed
    assert any("offsets 0..0" in r.getMessage() for r in caplog.records if r.levelname == "ERROR")
    with pytest.raises(bw.ProducerError, match="NOT committed"):
        p.close()


# ---------------------------------------------------------------------------------------------
# TgbBuilder settings and TGBs validated by append


@pytest.mark.parametrize(
    ("attr", "value"),
    [
        ("codec", "nope"),
        ("codec", "arrow"),
        ("compression", "zstd"),
        ("checksum_algo", "xxh3"),
        ("mesh", bw.Mesh(dp=1)),
    ],
)
def test_a_builders_settings_are_read_only(attr: str, value: object) -> None:
    # Assigned after slices were set, they committed a step every consumer failed to read (or,
    # for an unknown codec, killed the producer in its upload thread).
    builder = TgbBuilder(MESH)
    builder.set_slice(0, 0, b"hello")
    before = getattr(builder, attr)
    with pytest.raises(AttributeError):
        setattr(builder, attr, value)
    assert getattr(builder, attr) == before
    builder.set_slice(1, 0, b"world")
    assert getattr(builder.build().footer, attr) == before


class _ForeignCodecBuilder(TgbBuilder):
    """A builder whose TGB's footer (bytes and object alike) names a codec no reader knows."""

    def build(self) -> EncodedTgb:
        tgb = super().build()
        footer = tgb.footer.model_copy(update={"codec": "nope"})
        footer_bytes = footer.model_dump_json().encode()
        trailer = _pack_trailer(footer_bytes, footer.format_version, footer.checksum_algo)
        return EncodedTgb(
            parts=(*tgb.parts[:-2], footer_bytes, trailer),
            footer=footer,
            footer_offset=tgb.footer_offset,
            footer_length=len(footer_bytes),
        )


def test_a_tgb_a_manifest_cannot_record_is_refused_by_append_and_the_producer_goes_on() -> None:
    # It was uploaded, then refused by descriptor validation in the upload thread: a pydantic
    # ValidationError stopped the whole producer.
    store = MemoryStore()
    with bw.Producer(store, NS, producer_id="a", mesh=MESH, policy="naive") as p:
        builder = _ForeignCodecBuilder(MESH)
        builder.set_slice(0, 0, b"x")
        builder.set_slice(1, 0, b"y")
        with pytest.raises(bw.FormatError, match="offset 0"):
            p.append(builder, offset=0)
        assert p.stats().pending == 0
        assert p.stats().inflight_bytes == 0
        assert list(store.list(f"{NS}/data/")) == []  # nothing uploaded
        p.append(payloads(0), offset=0)  # the same offset: it was never registered
        p.append(bw.encode_tgb(payloads(1), MESH), offset=1)
    assert committed_offsets(store, NS, "a") == [0, 1]
    with bw.Consumer(store, NS, mesh=MESH, dp_rank=0, timeout=5) as consumer:
        assert next(iter(consumer)) == (0, b"0/0")


# ---------------------------------------------------------------------------------------------
# boundary=


@pytest.mark.parametrize("value", [None, "3", True, 2.0])
def test_a_boundary_callable_returning_no_int_step_is_a_type_error_naming_it(
    value: object,
) -> None:
    # None gave "unsupported operand type(s) for -" from deep inside the lag gate; True was
    # taken as step 1.
    p = bw.Producer(
        MemoryStore(), NS, producer_id="a", mesh=MESH, max_lag=0, boundary=lambda: value
    )
    try:
        p.append(payloads(0), offset=0)  # nothing visible yet: the boundary is not read
        with pytest.raises(TypeError, match=r"boundary= .*must return an int step") as err:
            p.append(payloads(1), offset=1)
        assert type(value).__name__ in str(err.value)
    finally:
        p.abort()


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        ("\ud800", ValueError, "not valid Unicode"),
        (5, TypeError, "must map str to str"),
    ],
)
def test_metadata_changed_after_construction_is_checked_again_by_build(
    value: object, error: type[Exception], match: str
) -> None:
    # The metadata attribute stays mutable until build(); before session 19 a bad value there
    # escaped as a raw pydantic error from deep inside the footer's serialisation.
    builder = TgbBuilder(bw.Mesh(dp=1))
    builder.set_slice(0, 0, b"x")
    builder.metadata["k"] = value  # type: ignore[assignment]
    with pytest.raises(error, match=match):
        builder.build()
    builder.metadata["k"] = "fine"
    assert builder.build().footer.metadata == {"k": "fine"}


_RETIRED_OR_SEALED = """
import sys, time
import batchweave as bw
from batchweave._retire import retire_producers
from batchweave.cli._seal import seal_namespace

url, mode = sys.argv[1], sys.argv[2]
store = bw.open_store(url)
p = bw.Producer(store, "ns", mesh=bw.Mesh(dp=1), producer_id="p")
p.append([b"a"], offset=0)
p.flush()
if mode == "retire":
    retire_producers(store, "ns", idle_for=1e-9, wall_clock=lambda: time.time() + 10)
else:
    seal_namespace(store, "ns")
p.append([b"b"], offset=1)  # never committed, never closed: the exit hook says what to do
"""


@pytest.mark.parametrize(
    ("mode", "advice"),
    [
        ("retire", "producer_id 'p' was retired: a producer started with it begins a new stream"),
        ("seal", "Namespace 'ns' is sealed: no producer can publish them there"),
    ],
)
def test_the_exit_hook_gives_the_advice_that_fits_why_it_could_not_commit(
    tmp_path: Path, mode: str, advice: str
) -> None:
    # It always said a producer restarted with the same id resumes from resume_offset (1) and
    # publishes them: after a retire a restart starts a new stream at 0, and a sealed namespace
    # takes nothing.
    done = subprocess.run(
        [sys.executable, "-c", _RETIRED_OR_SEALED, f"file://{tmp_path}", mode],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "are NOT committed" in done.stderr, done.stderr
    assert advice in done.stderr, done.stderr
    assert "resumes from its resume_offset (1)" not in done.stderr, done.stderr


def test_close_from_another_thread_commits_what_a_with_block_appended(tmp_path: Path) -> None:
    # The worker's next append raises "is closing" (as documented); that exception left its
    # with block, whose __exit__ aborted the producer in the middle of close()'s drain: close()
    # raised "was aborted" and appends that had returned were never committed.
    store = bw.FaultInjectingStore(bw.open_store(f"file://{tmp_path}"), latency=0.002)
    enough = threading.Event()
    appended: list[int] = []
    holder: dict[str, object] = {}

    def work() -> None:
        try:
            with bw.Producer(store, NS, producer_id="p", mesh=bw.Mesh(dp=1)) as p:
                holder["producer"] = p
                for offset in range(1_000_000):
                    p.append([b"x" * 100], offset=offset)
                    appended.append(offset)
                    if offset == 50:
                        enough.set()
        except bw.ProducerError as exc:
            holder["error"] = exc

    worker = threading.Thread(target=work)
    worker.start()
    assert enough.wait(_JOIN)
    producer = holder["producer"]
    assert isinstance(producer, bw.Producer)
    producer.close()  # raised ProducerError "was aborted" before the fix
    worker.join(_JOIN)
    assert not worker.is_alive()
    assert "is closing" in str(holder["error"])
    assert committed_offsets(store, NS, "p") == appended

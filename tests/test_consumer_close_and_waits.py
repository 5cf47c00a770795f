"""The consumer at its edges: waiting at the head, close() racing next(), states, advice.

- A ``timeout`` holds however long each poll takes, and a timeout during a store outage blames
  the store, not the producers.
- ``close()`` from another thread (or a signal handler on the reading thread) while ``next()``
  reads inline, polls or starts read threads ends ``next()`` with ``ConsumerError``, starts no
  read thread afterwards and never deadlocks.
- A state refused by ``load_state_dict`` (negative anchor, reclaimed step) leaves the consumer
  where it was; a truncated object and a spent retry budget say what to do.

"Another thread" is simulated deterministically by doing what that thread would do from inside
a store call.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import pytest
from fake_time import FakeTime
from test_consumer import _object_of, budgeted, parse, payload, produce

from batchweave import (
    Consumer,
    ConsumerError,
    ConsumerTimeout,
    FormatError,
    MemoryStore,
    Mesh,
    NamespaceMismatch,
    Producer,
    StepReclaimed,
    StoreUnavailable,
)
from batchweave._manifest._log import Committed, ManifestLog
from batchweave._store._base import ByteRange, ObjectMeta

MESH = Mesh(dp=2)


class _Hooked(MemoryStore):
    """A memory store that runs ``on_manifest`` / ``on_data`` / ``on_list`` before manifest
    reads, TGB reads and listings."""

    def __init__(self) -> None:
        super().__init__()
        self.on_manifest: Callable[[str], None] | None = None
        self.on_data: Callable[[str], None] | None = None
        self.on_list: Callable[[str], None] | None = None

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        if self.on_manifest is not None and "/_manifests/" in key:
            self.on_manifest(key)
        if self.on_data is not None and "/data/" in key:
            self.on_data(key)
        return super().get_range(key, rng)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        if self.on_list is not None:
            self.on_list(prefix)
        return super().list(prefix, start_after=start_after)


def _publish(store: MemoryStore, offsets: range) -> None:
    with Producer(store, "run", producer_id="p0", mesh=MESH, policy="naive") as p:
        for o in offsets:
            p.append([payload(0, o, d, 0) for d in range(MESH.dp)], offset=o)


def _consumer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("batchweave-consumer")}


# -- waiting at the head of the stream ---------------------------------------------------------


@pytest.mark.parametrize("seconds", [3.0, 30.0])
@pytest.mark.parametrize("poll", ["slow", "unreachable"])
def test_timeout_holds_when_each_poll_takes_longer_than_the_poll_delay(
    poll: str, seconds: float
) -> None:
    """Before: the timeout was checked only before a poll *sleep*; a poll that itself took at
    least the poll delay (a store that answers slowly, or connection attempts that time out
    during an outage) skipped the sleep, and with it the check: ``timeout`` never fired."""
    store = _Hooked()
    produce(store, "run", MESH, tgbs=1, seal=False)
    fake = FakeTime()
    c = Consumer(
        store, "run", mesh=MESH, dp_rank=0, timeout=10.0, clock=fake.clock, sleep=fake.sleep
    )
    assert next(c)[0] == 0
    polls = 0

    def slow_poll(key: str) -> None:
        nonlocal polls
        polls += 1
        if polls > 100:
            raise RuntimeError(f"still polling after {100 * seconds} s of a 10 s timeout")
        fake.advance(seconds)  # each request takes longer than max_poll_interval (2 s)
        if poll == "unreachable":
            raise StoreUnavailable(f"{key}: connect timeout (injected)")

    store.on_manifest = slow_poll
    with pytest.raises(ConsumerTimeout, match=r"step 1 .*within 10.0 s"):
        next(c)
    # Late by at most the one poll that ran past the timeout. Before session 15 the poll
    # next() made before it began to wait did not count, and two could.
    assert 10.0 < fake.now <= 10.0 + seconds
    c.close()


def test_the_timeout_bounds_the_whole_next_opening_included() -> None:
    """Before: waiting for the namespace and then for its first step each had the whole
    ``timeout``; a namespace created at 9 s of a 10 s timeout let ``next()`` wait 19 s."""
    store = MemoryStore()
    fake = FakeTime()

    created: list[float] = []

    def create_late() -> None:
        if fake.now >= 9.0 and not created:
            created.append(fake.now)
            Producer(store, "run", producer_id="p0", mesh=MESH, policy="naive").close()

    fake.on_sleep = create_late
    c = Consumer(
        store, "run", mesh=MESH, dp_rank=0, timeout=10.0, clock=fake.clock, sleep=fake.sleep
    )
    with pytest.raises(ConsumerTimeout, match=r"step 0 .*within 10.0 s"):
        next(c)
    assert len(created) == 1
    assert created[0] < 10.0
    assert c.manifest_version is not None  # it opened, then waited for step 0
    assert 10.0 <= fake.now <= 10.0 + c.max_poll_interval
    c.close()


@pytest.mark.parametrize("waiting_for", ["step", "namespace"])
def test_a_timeout_during_an_outage_blames_the_store_not_the_producers(waiting_for: str) -> None:
    """Before: a consumer that timed out because the store was unreachable was told "Are the
    producers running?" (or that the namespace "was not created"): the wrong thing to check."""
    store = _Hooked()
    fake = FakeTime()
    c = Consumer(
        store, "run", mesh=MESH, dp_rank=0, timeout=5.0, clock=fake.clock, sleep=fake.sleep
    )
    if waiting_for == "step":
        produce(store, "run", MESH, tgbs=1, seal=False)
        assert next(c)[0] == 0

    def down(key: str) -> None:
        raise StoreUnavailable(f"{key}: connection refused (injected)")

    store.on_manifest = store.on_list = down
    with pytest.raises(ConsumerTimeout) as info:
        next(c)
    message = str(info.value)
    assert "unreachable" in message
    assert "producers running" not in message
    assert "was not created" not in message
    c.close()


# -- close() from another thread while next() reads --------------------------------------------


def test_close_while_next_reads_the_step_inline_raises_consumer_error() -> None:
    """Before: close() emptied the read window under the reading next(), whose bookkeeping
    then failed with ``IndexError: pop from an empty deque``."""
    store = _Hooked()
    produce(store, "run", MESH, tgbs=3)
    c = Consumer(store, "run", mesh=MESH, dp_rank=1, prefetch=0)
    assert next(c)[0] == 0
    store.on_data = lambda key: c.close()  # a watchdog closes the consumer during the read
    with pytest.raises(ConsumerError, match="closed while reading step 1"):
        next(c)
    assert c.state_dict()["step"] == 1  # step 1 never reached the loop
    store.on_data = None
    resumed = Consumer(store, "run", mesh=MESH, dp_rank=1)
    resumed.load_state_dict(c.state_dict())
    assert [parse(d)[1] for _, d in resumed] == [1, 2]
    resumed.close()


@pytest.mark.parametrize("opened", [False, True])
def test_open_and_load_state_dict_on_a_closed_consumer_are_refused(opened: bool) -> None:
    """Before: both read the manifest and succeeded, though the consumer reads nothing more
    (its next() said so). Now they say so too, without a request; state_dict() still works, to
    continue in a new consumer."""
    store = _Hooked()
    produce(store, "run", MESH, tgbs=3)
    c = Consumer(store, "run", mesh=MESH, dp_rank=0)
    if opened:
        assert next(c)[0] == 0
    state, version = c.state_dict(), c.manifest_version
    c.close()
    reads: list[str] = []
    store.on_manifest = reads.append
    store.on_list = reads.append
    with pytest.raises(ConsumerError, match=r"is closed; .*open\(\) on a closed consumer"):
        c.open()
    with pytest.raises(ConsumerError, match=r"load the state into it .*load_state_dict\(\)"):
        c.load_state_dict(state)
    with pytest.raises(ConsumerError, match="is closed; to continue, create a new Consumer"):
        next(c)
    assert reads == []
    assert c.manifest_version == version
    assert c.state_dict() == state
    store.on_manifest = store.on_list = None
    with Consumer(store, "run", mesh=MESH, dp_rank=0) as resumed:
        resumed.load_state_dict(c.state_dict())
        assert [s for s, _ in resumed] == list(range(state["step"], 3))


def test_close_while_next_polls_starts_no_read_threads_afterwards() -> None:
    """Before: a next() that was polling the manifest when close() ran went on to schedule the
    steps it found on a fresh pool, whose worker threads then outlived close()."""
    store = _Hooked()
    produce(store, "run", MESH, tgbs=1, seal=False)
    before = _consumer_threads()
    c = Consumer(
        store, "run", mesh=MESH, dp_rank=0, prefetch_min_latency=0, max_process_reads=1 << 20
    )
    assert next(c)[0] == 0
    _publish(store, range(1, 4))

    def close_once(key: str) -> None:
        store.on_manifest = None
        c.close()

    store.on_manifest = close_once  # close() lands while next() looks for steps 1 and later
    with contextlib.suppress(ConsumerError):
        next(c)  # may deliver the step it found, or say it was closed
    with pytest.raises(ConsumerError, match="closed"):
        next(c)
    assert c.stats.in_flight == 0
    for thread in _consumer_threads() - before:
        thread.join(10)
        assert not thread.is_alive(), f"{thread.name} outlived close()"


def test_close_while_next_polls_with_steps_read_ahead_raises_consumer_error() -> None:
    """Before: close() emptied the read window while next() went on filling it, and next()
    then failed its own consistency check (``AssertionError``) instead of saying it was
    closed."""
    store = _Hooked()
    produce(store, "run", MESH, tgbs=3, seal=False)
    c = Consumer(
        store, "run", mesh=MESH, dp_rank=0, prefetch_min_latency=0, ramp_every=1,
        max_process_reads=1 << 20, poll_interval=1e-9, max_poll_interval=1e-9,
    )  # fmt: skip
    assert [next(c)[0], next(c)[0]] == [0, 1]
    assert c.stats.in_flight == 1  # step 2 is read ahead
    _publish(store, range(3, 4))
    store.on_manifest = lambda key: c.close()  # lands in next()'s poll for step 3
    with pytest.raises(ConsumerError, match="closed while"):
        next(c)
    assert c.state_dict()["step"] == 2
    assert c.stats.in_flight == 0


# -- states ------------------------------------------------------------------------------------


def test_a_state_with_a_negative_anchor_step_is_a_consumer_error_and_changes_nothing() -> None:
    """Before: a negative ``anchor_step`` passed the state checks, was installed, and then
    failed as a :class:`NamespaceMismatch` (a malformed state is a ``ConsumerError``), leaving
    the consumer with the bad anchor."""
    store = MemoryStore()
    produce(store, "run", MESH, tgbs=4)
    c = Consumer(store, "run", mesh=MESH, dp_rank=0)
    assert next(c)[0] == 0
    state = {**c.state_dict(), "step": 2, "anchor_step": -1}
    with pytest.raises(ConsumerError, match="inconsistent") as info:
        c.load_state_dict(state)
    assert not isinstance(info.value, NamespaceMismatch)
    assert [s for s, _ in c] == [1, 2, 3]  # the consumer carries on as before
    c.close()


def test_a_state_refused_as_reclaimed_leaves_the_consumer_where_it_was() -> None:
    """Before: load_state_dict installed the state's step and anchor, then found the step
    reclaimed and raised, leaving the consumer stuck at the refused step (every next() raised
    StepReclaimed) instead of where it was."""
    store = MemoryStore()
    produce(store, "run", MESH, tgbs=6)
    old = Consumer(store, "run", mesh=MESH, dp_rank=0)
    assert next(old)[0] == 0
    stale = old.state_dict()  # step 1
    old.close()
    log = ManifestLog(store, "run")
    assert isinstance(log.commit(log.latest(), base_step=3), Committed)
    c = Consumer(store, "run", mesh=MESH, dp_rank=0, start_step=3)
    assert next(c)[0] == 3
    with pytest.raises(StepReclaimed, match="step 1 needs TGB step 1"):
        c.load_state_dict(stale)
    assert c.state_dict() == {**stale, "step": 4}
    assert [s for s, _ in c] == [4, 5]
    c.close()


# -- errors say what to do ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("slice_table_limit", "read"), [(0, "footer"), (32, "slice 1")], ids=["footer", "table"]
)
def test_a_truncated_object_says_what_to_do(slice_table_limit: int, read: str) -> None:
    """Before: the error named the step, object and slice (or footer) but gave no remedy."""
    store = MemoryStore()
    produce(store, "run", MESH, tgbs=2, size=64, slice_table_limit=slice_table_limit)
    key, _ = _object_of(store, "run", 1)
    store.put(key, store.get(key)[:100])
    c = Consumer(store, "run", mesh=MESH, dp_rank=1)
    assert next(c)[0] == 0
    with pytest.raises(FormatError) as info:
        next(c)
    message = str(info.value)
    assert message.startswith(f"step 1 (TGB step 1), object {key!r}, {read}")
    assert "truncated" in message
    assert message.endswith("restore it, or resume past this step")


def test_a_spent_retry_budget_says_what_to_do() -> None:
    """Before: the error named the step, object and slice but not that next() retries it."""
    c, store, _ = budgeted(MESH, dp_rank=0, retry_budget=1)
    store.fail_next("get_range", times=2, key_prefix="run/data/")
    with pytest.raises(ConsumerError, match=r"^step 0 .*budget \(1\) is spent") as info:
        next(c)
    assert "next() retries the step" in str(info.value)
    assert next(c)[0] == 0  # as the message says
    c.close()


# -- close() from a signal handler -------------------------------------------------------------


def test_close_from_a_signal_handler_while_next_starts_a_read_thread_does_not_hang(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # docs/consumer.md: close() may come from "a shutdown handler". A SIGTERM handler runs on
    # the main thread between bytecodes, also while that thread waits in Thread.start() for a
    # new read thread, inside Workers._spawn, which holds the workers' spawn lock: close() then
    # waited for that same lock (Workers.close) forever. Simulated deterministically: the
    # handler's close() runs on the reading thread from inside Thread.start().
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2), tgbs=8)
    c = Consumer(
        store,
        "run",
        mesh=Mesh(dp=2),
        dp_rank=0,
        prefetch_min_latency=0,
        ramp_every=1,
        max_process_reads=1 << 20,
    )
    real_start = threading.Thread.start
    handled = threading.Event()

    def start_with_signal(thread: threading.Thread) -> None:
        if thread.name.startswith("batchweave-consumer") and not handled.is_set():
            handled.set()
            c.close()  # the shutdown handler
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start_with_signal)
    outcome: list[object] = []

    def loop() -> None:
        try:
            outcome.extend(step for step, _ in c)
        except ConsumerError as exc:
            outcome.append(exc)

    reader = threading.Thread(target=loop, daemon=True)
    real_start(reader)
    reader.join(10)
    assert handled.is_set()
    assert not reader.is_alive(), "close() from the signal handler deadlocked next()"
    assert isinstance(outcome[-1], ConsumerError)
    assert c.state_dict()["step"] == len(outcome) - 1  # every step counted was delivered

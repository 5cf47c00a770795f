"""Object-store outages: producers and consumers wait them out, say so, and lose nothing.

``OutageStore`` plays the store going down (every request raises ``StoreUnavailable``, or a 503
``TransientStoreError``) and coming back. Tests flip it back up only after the client was seen
retrying a number of times (an event, not a sleep), then check the data arrived exactly once.
The SeaweedFS restart in ``tests/test_soak.py`` covers the same behaviour on a real server.
What clients log during an outage is rate-limited: a first warning, reminders every 30 s, and
one line when the store is reachable again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator

import pytest

import batchweave as bw
from batchweave import (
    AmbiguousWriteError,
    ByteRange,
    Consumer,
    ConsumerTimeout,
    MemoryStore,
    Mesh,
    ObjectMeta,
    ObjectStore,
    Producer,
    ProducerError,
    PutMode,
    StoreTimeout,
    StoreUnavailable,
    StoreWrapper,
    TransientStoreError,
)
from batchweave._format._tgb_write import encode_tgb
from batchweave._manifest._log import ManifestLog
from batchweave._outage import OutageLog

MESH = Mesh(dp=2, cp=1)
NS = "runs/outage"


class OutageStore(StoreWrapper):
    """A store that can be switched down (every request fails) and up again, thread-safely.

    ``failures`` counts requests refused while down; ``wait_failures(n)`` blocks until ``n``
    more have been refused, which is how a test knows the client is retrying.
    """

    def __init__(
        self, inner: ObjectStore, error: Callable[[str], Exception] = StoreUnavailable
    ) -> None:
        super().__init__(inner)
        self._error = error
        self._down = False
        self._only = ""
        self.failures = 0
        self._cond = threading.Condition()

    def down(self, only_prefix: str = "") -> None:
        with self._cond:
            self._down, self._only = True, only_prefix

    def up(self) -> None:
        with self._cond:
            self._down = False

    def wait_failures(self, n: int, timeout: float = 20.0) -> None:
        with self._cond:
            target = self.failures + n
            if not self._cond.wait_for(lambda: self.failures >= target, timeout):
                raise AssertionError(f"the client retried only {self.failures} times")

    def _gate(self, op: str, key: str) -> None:
        with self._cond:
            if self._down and key.startswith(self._only):
                self.failures += 1
                self._cond.notify_all()
                raise self._error(f"injected outage: {op} {key!r} refused")

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self._gate("put", key)
        self.inner.put(key, data, mode=mode)

    def get(self, key: str) -> bytes:
        self._gate("get", key)
        return self.inner.get(key)

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        self._gate("get_range", key)
        return self.inner.get_range(key, rng)

    def head(self, key: str) -> ObjectMeta:
        self._gate("head", key)
        return self.inner.head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self._gate("list", prefix)
        return self.inner.list(prefix, start_after=start_after)

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        self._gate("delete_many", keys[0] if keys else "")
        self.inner.delete_many(keys)


class Sleeps:
    """An injected sleep that records every delay and yields the CPU without really waiting."""

    def __init__(self) -> None:
        self.delays: list[float] = []
        self._lock = threading.Lock()

    def __call__(self, seconds: float) -> None:
        with self._lock:
            self.delays.append(seconds)
        time.sleep(0.001)


class BackgroundReader:
    """Iterates a consumer to its end on a thread of its own, keeping what it got or raised."""

    def __init__(self, consumer: Consumer) -> None:
        self.results: list[tuple[int, bytes]] = []
        self.errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, args=(consumer,))
        self._thread.start()

    def _run(self, consumer: Consumer) -> None:
        try:
            self.results.extend(consumer)
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.errors.append(exc)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


def payloads(offset: int) -> list[bytes]:
    return [f"{offset}/{i}".encode() * 64 for i in range(MESH.slices)]


def committed(store: ObjectStore, pid: str) -> list[int]:
    log = ManifestLog(store, NS)
    m = log.latest()
    steps = log.descriptors(m, m.base_step, m.next_step)
    return [d.offset for _, d in steps if d.producer_id == pid]


def test_producer_keeps_pending_tgbs_through_an_outage_and_append_blocks(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner = MemoryStore()
    store = OutageStore(inner)
    sleeps = Sleeps()
    size = encode_tgb(payloads(1), MESH).size  # every TGB here has this size
    p = Producer(
        store,
        NS,
        producer_id="p0",
        mesh=MESH,
        policy="naive",
        max_retries=2,  # far fewer than the outage's failures: an outage spends none of them
        max_inflight_bytes=2 * size,
        sleep=sleeps,
    )
    try:
        p.append(payloads(0), offset=0)
        p.flush()
        caplog.set_level(logging.INFO, logger="batchweave")
        store.down()
        p.append(payloads(1), offset=1)
        p.append(payloads(2), offset=2)
        blocked = threading.Thread(target=p.append, args=(payloads(3),), kwargs={"offset": 3})
        blocked.start()
        store.wait_failures(50)
        # Bounded memory: the third append waits for upload room instead of buffering.
        assert blocked.is_alive()
        assert p.stats().inflight_bytes == 2 * size
        assert committed(inner, "p0") == [0]
        store.up()
        blocked.join(10)
        assert not blocked.is_alive()
        p.close()
    finally:
        store.up()
        p.abort()
    assert committed(inner, "p0") == [0, 1, 2, 3]
    text = caplog.text
    assert "producer 'p0': the object store is unreachable while uploading" in text
    assert "reachable again" in text
    # one line when the outage starts, not one per retry
    assert text.count("is unreachable while") == 1
    assert max(sleeps.delays) <= 5.0  # capped backoff


def test_producer_commits_retry_through_a_503_outage_of_the_manifests(
    caplog: pytest.LogCaptureFixture,
) -> None:
    inner = MemoryStore()
    store = OutageStore(inner, error=TransientStoreError)
    p = Producer(
        store, NS, producer_id="p0", mesh=MESH, policy="naive", max_retries=1, sleep=Sleeps()
    )
    store.down(only_prefix=f"{NS}/_manifests/")
    for offset in range(3):
        p.append(payloads(offset), offset=offset)
    store.wait_failures(30)
    assert committed(inner, "p0") == []
    store.up()
    p.flush(timeout=20)
    p.close()
    assert committed(inner, "p0") == [0, 1, 2]
    assert "committing failed" in caplog.text


def test_producer_starts_once_an_outage_at_startup_ends() -> None:
    inner = MemoryStore()
    store = OutageStore(inner)
    store.down()
    made: list[Producer] = []
    starter = threading.Thread(
        target=lambda: made.append(
            Producer(store, NS, producer_id="p0", mesh=MESH, max_retries=1, sleep=Sleeps())
        )
    )
    starter.start()
    store.wait_failures(20)
    assert starter.is_alive()
    assert not made
    store.up()
    starter.join(10)
    assert made
    assert made[0].epoch == 1  # the version of its epoch commit: one start, not several
    made[0].close()


def _produce(store: ObjectStore, tgbs: int, *, seal: bool) -> None:
    with Producer(store, NS, producer_id="p0", mesh=MESH, policy="naive") as p:
        for offset in range(tgbs):
            p.append(payloads(offset), offset=offset)
        if seal:
            p.seal()


def hung(message: str) -> Exception:
    """What a store that accepts connections but never answers raises for ``message``'s request:
    a timed-out (ambiguous) write for a PUT, ``StoreTimeout`` for anything else."""
    if message.startswith("injected outage: put "):
        error = AmbiguousWriteError(f"{message}: no answer within read_timeout=3 s")
        error.timed_out = True
        return error
    return StoreTimeout(f"{message}: no answer within read_timeout=3 s")


def test_producer_waits_out_a_hung_store_like_an_unreachable_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: each pending upload spent its max_retries on the read timeouts, logging a warning
    # per attempt, and the producer died ("upload ... failed 3 times") though the store came back.
    inner = MemoryStore()
    store = OutageStore(inner, error=hung)
    p = Producer(
        store, NS, producer_id="p0", mesh=MESH, policy="naive", max_retries=2, sleep=Sleeps()
    )
    try:
        p.append(payloads(0), offset=0)
        p.flush()
        caplog.set_level(logging.INFO, logger="batchweave")
        store.down()
        for offset in range(1, 5):
            p.append(payloads(offset), offset=offset)
        store.wait_failures(60)
        assert committed(inner, "p0") == [0]
        store.up()
        p.close()
    finally:
        store.up()
        p.abort()
    assert committed(inner, "p0") == [0, 1, 2, 3, 4]
    text = caplog.text
    assert text.count("producer 'p0': the object store is unreachable while") == 1
    assert "reachable again" in text
    assert "failed (attempt" not in text  # no line per retry


def test_producer_starts_once_a_hung_store_answers_again() -> None:
    inner = MemoryStore()
    store = OutageStore(inner, error=hung)
    store.down()
    made: list[Producer] = []
    errors: list[BaseException] = []

    def start() -> None:
        try:
            made.append(
                Producer(store, NS, producer_id="p0", mesh=MESH, max_retries=1, sleep=Sleeps())
            )
        except BaseException as exc:  # reported below
            errors.append(exc)

    starter = threading.Thread(target=start)
    starter.start()
    store.wait_failures(20)
    store.up()
    starter.join(10)
    assert not errors, errors
    assert made
    assert made[0].epoch == 1  # nothing landed while hung: one epoch commit
    made[0].close()


class LandsThenTimesOut(StoreWrapper):
    """Writes the first ``n`` PUTs under ``prefix``, then raises a timed-out ambiguous write, as a
    server that stores the object and hangs before answering."""

    def __init__(self, inner: ObjectStore, prefix: str, n: int) -> None:
        super().__init__(inner)
        self.prefix, self.n = prefix, n

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.inner.put(key, data, mode=mode)
        if self.n and key.startswith(self.prefix):
            self.n -= 1
            error = AmbiguousWriteError(f"put {key!r}: no answer within read_timeout=3 s")
            error.timed_out = True
            raise error


@pytest.mark.parametrize(("what", "landed"), [("data", 3), ("_manifests", 2)])
def test_a_timed_out_write_that_landed_is_published_exactly_once(what: str, landed: int) -> None:
    # Counting a hung store as an outage must not change how an ambiguous write is resolved: an
    # upload is simply sent again, a commit is read back.
    inner = MemoryStore()
    Producer(inner, NS, producer_id="p0", mesh=MESH).close()  # the namespace and epoch 1
    store = LandsThenTimesOut(inner, f"{NS}/{what}/", landed)  # uploads; epoch + a commit
    with Producer(
        store, NS, producer_id="p0", mesh=MESH, policy="naive", max_retries=0, sleep=Sleeps()
    ) as p:
        for offset in range(3):
            p.append(payloads(offset), offset=offset)
    assert store.n == 0
    assert committed(inner, "p0") == [0, 1, 2]


def test_an_upload_that_keeps_failing_says_what_is_uncommitted_and_how_to_resume() -> None:
    inner = MemoryStore()
    store = OutageStore(inner, error=TransientStoreError)  # a reachable store answering 503
    p = Producer(
        store, NS, producer_id="p0", mesh=MESH, policy="naive", max_retries=1, sleep=Sleeps()
    )
    try:
        p.append(payloads(0), offset=0)
        p.flush()
        store.down(only_prefix=f"{NS}/data/")
        p.append(payloads(1), offset=1)
        with pytest.raises(ProducerError) as caught:
            p.flush(timeout=20)
    finally:
        store.up()
        p.abort()
    message = str(caught.value)
    assert "(offset 1) failed 2 times (max_retries=1)" in message
    assert "TransientStoreError: injected outage" in message
    assert "uncommitted: offsets 1..1" in message
    assert "producer_id 'p0': it resumes from resume_offset (1)" in message


@pytest.mark.parametrize("where", ["slice reads", "manifest polling"])
def test_consumer_waits_out_an_outage_and_resumes(
    where: str, caplog: pytest.LogCaptureFixture
) -> None:
    inner = MemoryStore()
    _produce(inner, 3, seal=False)
    store = OutageStore(inner)
    c = Consumer(
        store,
        NS,
        mesh=MESH,
        dp_rank=1,
        prefetch=0,
        retry_budget=1,  # an outage must not spend it
        poll_interval=0.005,
        max_poll_interval=0.01,
        sleep=Sleeps(),
    )
    got = [next(c) for _ in range(2 if where == "slice reads" else 3)]
    caplog.set_level(logging.INFO, logger="batchweave")
    store.down()
    reader = BackgroundReader(c)
    store.wait_failures(40)
    assert reader.is_alive()
    assert not reader.errors
    store.up()
    with Producer(inner, NS, producer_id="p0", mesh=MESH, policy="naive") as p:
        p.append(payloads(3), offset=3)
        p.seal()
    reader.join(10)
    assert not reader.errors, reader.errors
    assert [s for s, _ in got + reader.results] == [0, 1, 2, 3]
    assert [d for _, d in got + reader.results] == [payloads(o)[1] for o in range(4)]
    assert "consumer dp_rank=1 cp_rank=0: the object store is unreachable" in caplog.text
    assert "reachable again" in caplog.text


def test_consumer_timeout_still_bounds_the_wait_during_an_outage() -> None:
    inner = MemoryStore()
    _produce(inner, 1, seal=False)
    store = OutageStore(inner)
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    c = Consumer(store, NS, mesh=MESH, dp_rank=0, timeout=5.0, clock=lambda: now[0], sleep=sleep)
    assert next(c)[0] == 0
    store.down()
    with pytest.raises(ConsumerTimeout, match="step 1"):
        next(c)
    assert store.failures > 0
    assert 5.0 <= now[0] < 10.0


def test_a_consumer_outage_longer_than_a_thousand_retries_is_still_waited_out() -> None:
    # Each retry waits at most max_retry_backoff, so a half-hour outage means over a thousand
    # retries; the exponential backoff must stay capped rather than overflow.
    inner = MemoryStore()
    _produce(inner, 2, seal=True)
    store = OutageStore(inner)
    sleeps = Sleeps()
    c = Consumer(store, NS, mesh=MESH, dp_rank=0, prefetch=0, retry_budget=1, sleep=sleeps)
    first = next(c)
    store.down(only_prefix=f"{NS}/data/")
    reader = BackgroundReader(c)
    store.wait_failures(1100, timeout=60.0)
    store.up()
    reader.join(10)
    assert not reader.errors, reader.errors
    assert [s for s, _ in [first, *reader.results]] == [0, 1]
    assert max(sleeps.delays) <= c.max_retry_backoff


# -- rate-limited outage logging ---------------------------------------------------------------


def test_outage_log_rate_limits_reminders_and_reports_recovery_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    log = OutageLog(logging.getLogger("batchweave.test"), "producer 'p0'", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="batchweave.test")
    for _ in range(20):  # 100 s of failures, one every 5 s
        log.failed("committing", bw.StoreUnavailable("down"))
        now[0] += 5.0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 4  # at 0, 30, 60 and 90 s
    assert "unreachable while committing" in warnings[0]
    assert "still unreachable after 30 s (7 failed requests)" in warnings[1]
    assert log.down
    log.recovered()
    log.recovered()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [
        "producer 'p0': the object store is reachable again after 100.0 s (20 failed requests); "
        "resuming"
    ]
    assert not log.down
    log.failed("uploading", bw.StoreUnavailable("down again"))  # a new outage: a new first line
    assert "unreachable while uploading" in caplog.records[-1].getMessage()


def test_a_flapping_store_is_reported_once_an_interval_not_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: every request that failed after one that succeeded started a new outage: a store
    # refusing every second request logged a warning and an info line per request.
    now = [0.0]
    log = OutageLog(logging.getLogger("batchweave.test"), "consumer", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="batchweave.test")
    for _ in range(1000):  # 100 s: a refused request, then one answered, every 0.1 s
        log.failed("reading", bw.StoreUnavailable("refused"))
        now[0] += 0.05
        log.recovered()
        now[0] += 0.05
    lines = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert "unreachable while reading" in lines[0][1]
    assert "reachable again after 0.1 s (1 failed requests)" in lines[1][1]
    # then at most a start and its end an interval (at 30, 60 and 90 s), the first saying how
    # often the store failed meanwhile
    assert len(lines) <= 2 + 2 * 3
    counted = 0
    for index, (level, line) in enumerate(lines):
        if level == logging.WARNING:
            found = re.search(
                r"unreachable (\d+) times briefly in the last 30 s \((\d+) failed", line
            )
            assert (found is not None) == (index > 0), line
            if found:
                assert found[1] == found[2]
                counted += int(found[1])
        else:
            assert "reachable again after" in line
            assert "(1 failed requests)" in line
            counted += 1
    assert 1000 - 300 <= counted <= 1000  # every failure told, but for the last interval's
    assert not log.down


def test_an_outage_starting_just_after_another_is_reported_once_an_interval_has_passed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = OutageLog(logging.getLogger("batchweave.test"), "producer 'p0'", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="batchweave.test")
    log.failed("committing", bw.StoreUnavailable("down"))
    now[0] += 1.0
    log.recovered()  # a short outage: reported at once, the first of its kind
    now[0] += 1.0
    log.failed("committing", bw.StoreUnavailable("down"))  # a blip: counted, not logged
    log.recovered()
    assert len(caplog.records) == 2
    for _ in range(20):  # then a real outage of 100 s, a failure every 5 s
        log.failed("uploading", bw.StoreUnavailable("down"))
        assert log.down
        now[0] += 5.0
    log.recovered()
    lines = [r.getMessage() for r in caplog.records[2:]]
    # its start once 30 s passed since the last start logged, with what happened meanwhile
    assert lines[0].startswith(
        "producer 'p0': the object store is unreachable while uploading (StoreUnavailable: "
        "down) for 30 s (7 failed requests); waiting for it to come back"
    )
    assert lines[0].endswith(
        "it fails intermittently: unreachable 1 times briefly in the last 32 s (1 failed "
        "requests, not logged one by one)"
    )
    assert [line.split(":")[1] for line in lines[1:]] == [
        " the object store is still unreachable after 60 s (13 failed requests); still "
        "waiting while uploading",
        " the object store is still unreachable after 90 s (19 failed requests); still "
        "waiting while uploading",
        " the object store is reachable again after 100.0 s (20 failed requests); resuming",
    ]


class EverySecondReadRefused(StoreWrapper):
    """Refuses every second TGB read (one of two endpoints behind a load balancer is down)."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.reads = 0

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        if "/data/" in key:
            self.reads += 1
            if self.reads % 2:
                raise StoreUnavailable("connection refused (injected)")
        return self.inner.get_range(key, rng)


def test_a_consumer_on_a_flapping_store_logs_a_few_lines_not_two_per_step(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before: 200 warnings and 200 info lines for 200 steps.
    inner = MemoryStore()
    with Producer(inner, NS, producer_id="p0", mesh=Mesh(dp=1)) as producer:
        for offset in range(200):
            producer.append([b"x" * 100], offset=offset)
        producer.seal()
    store = EverySecondReadRefused(inner)
    c = Consumer(store, NS, mesh=Mesh(dp=1), dp_rank=0, retry_backoff=1e-4, max_retry_backoff=1e-4)
    with caplog.at_level(logging.INFO, logger="batchweave"), c:
        assert sum(1 for _ in c) == 200
    assert store.reads >= 400
    lines = [r.getMessage() for r in caplog.records if "object store" in r.getMessage()]
    assert 2 <= len(lines) <= 6, lines  # at most two an interval of 30 s


class OneKeyTimesOut(StoreWrapper):
    """Every PUT of data objects larger than ``limit`` bytes gets no answer (an object too large
    for the read timeout), while every other request is answered."""

    def __init__(self, inner: ObjectStore, limit: int) -> None:
        super().__init__(inner)
        self.limit = limit
        self.timeouts = 0

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        if "/data/" in key and memoryview(data).nbytes > self.limit:
            self.timeouts += 1
            error = AmbiguousWriteError(f"put {key!r}: no answer within read_timeout=3 s")
            error.timed_out = True
            raise error
        self.inner.put(key, data, mode=mode)


def test_an_upload_that_always_times_out_while_the_store_answers_spends_max_retries(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Review of the hung-store change: a PUT timing out every time while the store answered a
    HEAD was counted as an outage, retried thousands of times a second for ever, and logged as
    "unreachable", then "reachable again"."""
    inner = MemoryStore()
    store = OneKeyTimesOut(inner, limit=4000)
    p = Producer(
        store, NS, producer_id="p0", mesh=MESH, policy="naive", max_retries=2, sleep=Sleeps()
    )
    caplog.set_level(logging.INFO, logger="batchweave")
    try:
        p.append(payloads(0), offset=0)
        p.flush()
        p.append([b"x" * 5000] * len(payloads(1)), offset=1)
        with pytest.raises(ProducerError, match=r"\(offset 1\) failed 3 times \(max_retries=2\)"):
            p.flush(timeout=20)
    finally:
        p.abort()
    assert store.timeouts == 3
    assert committed(inner, "p0") == [0]
    assert "unreachable" not in caplog.text
    assert "failed (attempt 1, AmbiguousWriteError" in caplog.text  # a line naming the key

"""A consumer on a store that accepts connections but never answers (a hung server, a wrong port).

Its requests fail with read timeouts, which both S3 stores raise as ``StoreTimeout`` (a
``TransientStoreError``; boto3's caused by botocore's ``ReadTimeoutError``). For a
consumer waiting for the store that is an outage like a refused connection: it logs a WARNING,
waits it out (bounded by ``timeout`` only), and a timeout blames the store, never the namespace
or the producers. Each request "takes" ``REQUEST`` seconds of fake time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

import botocore.exceptions
import pytest
from fake_time import FakeTime
from test_consumer import produce

from batchweave import (
    AmbiguousWriteError,
    Consumer,
    ConsumerTimeout,
    MemoryStore,
    Mesh,
    StoreTimeout,
    StoreUnavailable,
    TransientStoreError,
)
from batchweave._outage import no_answer
from batchweave._store._base import ByteRange, ObjectMeta

MESH = Mesh(dp=1)
REQUEST = 3.0
"""Seconds a request to the hung store takes to fail (its read_timeout)."""


def boto3_timeout(key: str) -> StoreTimeout:
    """What the boto3 backend raises for a read timeout."""
    cause = botocore.exceptions.ReadTimeoutError(endpoint_url="http://127.0.0.1:9/bkt")
    error = StoreTimeout(
        f"get {key!r}: http://127.0.0.1:9 accepted the connection but did not answer within "
        "read_timeout=3 s (an overloaded or hung server, or not an S3 server on that port)"
    )
    error.__cause__ = cause
    return error


def obstore_timeout(key: str) -> StoreTimeout:
    """What the obstore backend raises for a read timeout (no cause to look at)."""
    return StoreTimeout(
        f"get {key!r}: http://127.0.0.1:9 accepted the connection but did not answer within "
        "read_timeout=3 s (an overloaded or hung server, or not an S3 server on that port)"
    )


def _timed_out_write() -> AmbiguousWriteError:
    error = AmbiguousWriteError("put 'k': did not answer within read_timeout=3 s")
    error.timed_out = True
    return error


def _caused_by(cause: BaseException) -> TransientStoreError:
    error = TransientStoreError(f"get 'k' failed transiently: {cause}")
    error.__cause__ = cause
    return error


STYLES = {"boto3": boto3_timeout, "obstore": obstore_timeout}


class _Hung(MemoryStore):
    """A memory store whose next ``hung`` requests (all of them: -1) take ``seconds`` of fake
    time and fail with ``error(key)``; ``only`` limits that to keys containing it."""

    def __init__(self, fake: FakeTime, error: Callable[[str], Exception]) -> None:
        super().__init__()
        self.fake = fake
        self.error = error
        self.hung = 0
        self.seconds = REQUEST
        self.only = ""
        self.failed = 0

    def _maybe_hang(self, key: str) -> None:
        if self.hung and self.only in key:
            self.hung -= 1
            self.failed += 1
            self.fake.advance(self.seconds)
            raise self.error(key)

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        self._maybe_hang(key)
        return super().get_range(key, rng)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self._maybe_hang(prefix)
        return super().list(prefix, start_after=start_after)


def _consumer(store: _Hung, **kw: object) -> Consumer:
    return Consumer(
        store,
        "run",
        mesh=MESH,
        dp_rank=0,
        clock=store.fake.clock,
        sleep=store.fake.sleep,
        **kw,  # type: ignore[arg-type]
    )


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "batchweave.consumer" and r.levelno == logging.WARNING
    ]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (boto3_timeout("k"), True),
        (obstore_timeout("k"), True),
        (_timed_out_write(), True),
        (AmbiguousWriteError("put 'k': 503 SlowDown; the write may have landed"), False),
        # Typed, not guessed: an untyped error is no "no answer", whatever its cause or words.
        (_caused_by(TimeoutError("timed out")), False),
        (TransientStoreError("get 'k': http://h did not answer within read_timeout=3 s"), False),
        (TransientStoreError("get 'k': 503 SlowDown"), False),
        (TransientStoreError("injected transient failure: get_range 'k'"), False),
    ],
    ids=[
        "boto3",
        "obstore",
        "write",
        "write-5xx",
        "untyped-timeout",
        "untyped-words",
        "5xx",
        "injected",
    ],
)
def test_no_answer_tells_read_timeouts_from_answered_errors(
    error: Exception, expected: bool
) -> None:
    assert no_answer(error) is expected


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("how", ["next", "open-no-wait"])
def test_a_hung_store_is_not_blamed_on_the_namespace(
    style: str, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: ``ConsumerTimeout: namespace ... was not created within 5.0 s ...; start a
    producer or check the namespace name`` and no log line, though no request got an answer."""
    caplog.set_level(logging.INFO, logger="batchweave")
    fake = FakeTime()
    store = _Hung(fake, STYLES[style])
    store.hung = -1
    c = _consumer(store, timeout=5.0)
    with pytest.raises(ConsumerTimeout) as info:
        next(c) if how == "next" else c.open(wait=False)
    message = str(info.value)
    assert "could not be opened within 5.0 s" in message
    assert "did not answer" in message
    assert "was not created" not in message
    assert "start a producer" not in message
    # No request is started once the timeout has passed: late by at most the one in flight.
    assert fake.now <= 5.0 + REQUEST
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "unreachable while opening" in warnings[0]
    c.close()


def test_a_timeout_overrun_by_a_slow_request_says_how_long_it_took() -> None:
    """``timeout`` cannot cut a request short: the error says the wait took longer, and why."""
    fake = FakeTime()
    store = _Hung(fake, boto3_timeout)
    store.hung, store.seconds = -1, 12.0
    c = _consumer(store, timeout=5.0)
    with pytest.raises(ConsumerTimeout, match=r"within 5.0 s \(after 12.0 s: timeout cannot"):
        next(c)
    assert store.failed == 1  # no second request after the deadline
    c.close()


@pytest.mark.parametrize("style", STYLES)
def test_a_store_that_stops_answering_at_the_head_is_blamed_not_the_producers(
    style: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: "Are the producers running? ..." after polls that all timed out."""
    caplog.set_level(logging.INFO, logger="batchweave")
    fake = FakeTime()
    store = _Hung(fake, STYLES[style])
    produce(store, "run", MESH, tgbs=1, seal=False)
    c = _consumer(store, timeout=5.0)
    assert next(c)[0] == 0
    store.hung = -1
    with pytest.raises(ConsumerTimeout) as info:
        next(c)
    message = str(info.value)
    assert "step 1 " in message
    assert "did not answer" in message
    assert "producers running" not in message
    assert any("unreachable while waiting for step 1" in w for w in _warnings(caplog))
    c.close()


@pytest.mark.parametrize("style", STYLES)
def test_without_timeout_a_hung_store_is_waited_out_with_warnings(
    style: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: silence, then ``ConsumerError: cannot read the manifest: 9 consecutive failures``
    (the retry budget) although a refused connection is waited out for as long as it lasts."""
    caplog.set_level(logging.INFO, logger="batchweave")
    fake = FakeTime()
    store = _Hung(fake, STYLES[style])
    produce(store, "run", MESH, tgbs=2)
    store.hung = 30  # 90 s without an answer, far past retry_budget=8
    c = _consumer(store, retry_budget=8)
    assert [s for s, _ in c] == [0, 1]
    assert store.failed == 30
    warnings = _warnings(caplog)
    assert "unreachable while opening" in warnings[0]
    assert any("still unreachable" in w for w in warnings[1:])  # the 30 s reminders
    assert "reachable again" in caplog.text


def test_a_step_read_that_gets_no_answer_logs_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Before: retried at DEBUG only; a step read from a hung store said nothing at WARNING."""
    caplog.set_level(logging.INFO, logger="batchweave")
    fake = FakeTime()
    store = _Hung(fake, boto3_timeout)
    produce(store, "run", MESH, tgbs=1)
    c = _consumer(store, prefetch=0)
    c.open()
    store.hung, store.only = 2, "/data/"
    assert [s for s, _ in c] == [0]
    assert store.failed == 2
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    assert "unreachable while reading step 0" in warnings[0]
    assert "reachable again" in caplog.text


def test_a_refused_connection_still_reads_as_unreachable() -> None:
    fake = FakeTime()
    store = _Hung(fake, lambda key: StoreUnavailable(f"{key}: connection refused (injected)"))
    store.hung = -1
    c = _consumer(store, timeout=5.0)
    with pytest.raises(ConsumerTimeout, match=r"could not be opened .*unreachable"):
        next(c)
    c.close()

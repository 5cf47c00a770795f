"""Store-layer guarantees that planted one-line mutants broke without any test noticing.

Each test pins one promise of ``docs/store.md`` or a docstring in ``batchweave._store`` /
``batchweave._outage``: the PUT "may have landed" rule for a ``500`` (not only ``503``), a
``429`` with an unlisted code being transient, an outage's failure count restarting with the
next outage, and ranges on a server that ignores the ``Range`` header.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.config import Config
from botocore.response import StreamingBody
from botocore.stub import Stubber
from test_store_parity import (
    FAST,
    Action,
    Request,
    reply,
    s3_error,
    same_error,
    scripted,
    store_at,
)

import batchweave as bw
from batchweave import (
    AmbiguousWriteError,
    CountingStore,
    FaultInjectingStore,
    MemoryStore,
    ObjectExists,
    PutMode,
    S3Store,
    StoreError,
    StoreWrapper,
    TransientStoreError,
)
from batchweave._outage import OutageLog, no_answer
from batchweave._store._obstore import ObstoreS3Store
from batchweave._store._open import probe_conditional_writes
from batchweave.testing import free_port

KEYS: dict[str, Any] = {"access_key_id": "AKIDGAPS", "secret_access_key": "SECRETgaps-123"}


def _stubbed_client() -> Any:
    return boto3.client(
        "s3",
        region_name="us-east-1",
        endpoint_url=f"http://127.0.0.1:{free_port()}",  # never reached: the Stubber answers
        aws_access_key_id="AKIAEXAMPLEACCESSKEY",
        aws_secret_access_key="example-secret-value",
        config=Config(retries={"mode": "standard", "total_max_attempts": 1}),
    )


@pytest.fixture
def stubbed() -> Iterator[tuple[S3Store, Stubber]]:
    store = S3Store("unit-bucket", "pre", client=_stubbed_client())
    with Stubber(store.client) as stubber:
        yield store, stubber
        stubber.assert_no_pending_responses()


# -- outage logging ---------------------------------------------------------------------------


def test_a_second_outage_counts_its_own_failed_requests(caplog: pytest.LogCaptureFixture) -> None:
    # OutageLog.recovered "ends the outage": the next outage's reminder and recovery lines
    # count that outage's failures only, not every failure since the client started.
    now = [0.0]
    log = OutageLog(logging.getLogger("batchweave.test.gaps"), "rank 0", clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="batchweave.test.gaps")
    for _ in range(5):
        log.failed("reading", bw.StoreUnavailable("down"))
    log.recovered()
    caplog.clear()
    log.failed("reading", bw.StoreUnavailable("down again"))
    now[0] += 30.0
    log.failed("reading", bw.StoreUnavailable("still down"))
    log.recovered()
    messages = [r.getMessage() for r in caplog.records]
    # The second start came within the rate limit of the first (a flapping store), so it is
    # logged once it lasted an interval, then with its own count.
    assert len(messages) == 2, messages
    assert "unreachable while reading" in messages[0], messages
    assert "for 30 s (2 failed requests)" in messages[0], messages
    assert "reachable again after 30.0 s (2 failed requests)" in messages[1], messages


# -- error classification (docs/store.md's error mapping) -------------------------------------


@pytest.mark.parametrize(
    ("method", "call"),
    [
        ("get_object", lambda s: s.get("k")),
        ("head_object", lambda s: s.head("k")),
        ("list_objects_v2", lambda s: list(s.list())),
        ("delete_objects", lambda s: s.delete_many(["k"])),
    ],
)
def test_a_429_is_transient_whatever_its_code(
    stubbed: tuple[S3Store, Stubber], method: str, call: Any
) -> None:
    # "429 ... is TransientStoreError": by status, also with a code not in THROTTLED_CODES
    # (servers name it differently); otherwise a reader would give up on a throttled store.
    store, stubber = stubbed
    stubber.add_client_error(method, service_error_code="RateExceeded", http_status_code=429)
    with pytest.raises(StoreError) as info:
        call(store)
    assert type(info.value) is TransientStoreError, info.value


def test_a_refusal_after_a_500_attempt_is_ambiguous(aws_env: pytest.MonkeyPatch) -> None:
    # docs/store.md: an attempt "may have landed if it got a 5xx"; a 500 is one (the parity
    # suite only scripts a 503). A 429 to the retry must then not read as "nothing stored".
    def handler(request: Request) -> Action:
        if request.attempt == 1:
            return s3_error("500 Internal Server Error", "InternalError")
        return s3_error("429 Too Many Requests", "SlowDown")

    assert same_error(handler, "put", max_attempts=2) is bw.AmbiguousWriteError


# -- ranges -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rng", "expected"),
    [
        (bw.Bounded(2, 5), b"234"),
        (bw.Bounded(0, 10), b"0123456789"),
        (bw.Bounded(9, 10), b"9"),
        (bw.Bounded(7, 50), b"789"),
        (bw.Offset(8), b"89"),
    ],
)
def test_a_server_ignoring_range_gives_exactly_the_range(
    stubbed: tuple[S3Store, Stubber], rng: bw.ByteRange, expected: bytes
) -> None:
    # A 200 with the whole object and no Content-Range: S3Store reads only as far as the range
    # reaches and slices, which must still be [start, end) exactly, the last byte included.
    store, stubber = stubbed
    data = b"0123456789"
    stubber.add_response("get_object", {"Body": StreamingBody(io.BytesIO(data), len(data))})
    assert store.get_range("k", rng) == expected


# -- the conditional-write probe --------------------------------------------------------------


@pytest.mark.parametrize("client", ["boto3", "obstore"])
def test_the_probe_sends_a_request_that_got_no_answer_once(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # ensure_conditional_writes: the probe "retries no request that got none", so a hung
    # endpoint fails after one probe_timeout, not probe_attempts of them plus backoff.
    with scripted(lambda r: ("silent", b"")) as server:
        with pytest.raises(bw.StoreUnavailable, match=r"did not answer within 0\.2 s"):
            bw.open_store(
                "s3://bucket/p",
                s3_client=client,
                endpoint_url=server.url,
                region="us-east-1",
                max_attempts=3,
                probe_timeout=0.2,
                **KEYS,
            )
        assert server.requests == 1


# -- the obstore backend's own PUT retries ----------------------------------------------------


def _obstore_at(url: str, naps: list[float], max_attempts: int) -> ObstoreS3Store:
    return ObstoreS3Store(
        "bucket",
        "p",
        endpoint_url=url,
        max_attempts=max_attempts,
        sleep=naps.append,
        **KEYS,
        **FAST,
    )


def test_obstore_does_not_retry_a_create_that_got_no_answer(aws_env: pytest.MonkeyPatch) -> None:
    # _put_attempt_failed: a timeout is retried "only for an overwrite (a create is not
    # idempotent)". The create stays ambiguous (read it back), never a silent second send.
    def handler(request: Request) -> Action:
        if request.attempt == 1:
            return ("silent", b"")
        return reply("200 OK", b"", {"ETag": '"abc"'})

    naps: list[float] = []
    with scripted(handler) as server, _obstore_at(server.url, naps, 3) as store:
        with pytest.raises(bw.AmbiguousWriteError) as info:
            store.put_if_absent("k", b"hello")
        assert no_answer(info.value)
        assert server.requests == 1
        assert naps == []


def test_obstore_remembers_an_earlier_5xx_across_later_refusals(
    aws_env: pytest.MonkeyPatch,
) -> None:
    # docs/store.md: a PUT is ambiguous "if an earlier attempt may have" landed and the last got
    # a 4xx. The 503 of attempt 1 may have stored it; a 429 in between does not undo that.
    def handler(request: Request) -> Action:
        if request.attempt == 1:
            return s3_error("503 Slow Down", "SlowDown")
        return s3_error("429 Too Many Requests", "SlowDown")

    naps: list[float] = []
    with scripted(handler) as server, _obstore_at(server.url, naps, 3) as store:
        with pytest.raises(StoreError) as info:
            store.put("k", b"hello")
        assert type(info.value) is bw.AmbiguousWriteError, info.value
        assert server.requests == 3


def test_obstore_an_empty_listing_whose_check_fails_transiently_stays_transient(
    aws_env: pytest.MonkeyPatch,
) -> None:
    # _check_empty_listing: a transient failure of the confirming HEAD is "no verdict on the
    # listing" (a consumer polling a throttled store retries); only an answer S3 would not give
    # makes the listing "not S3's", a plain StoreError that nobody retries.
    empty = (
        b"<?xml version='1.0'?><ListBucketResult><Name>bucket</Name><Prefix>p/</Prefix>"
        b"<KeyCount>0</KeyCount><MaxKeys>1000</MaxKeys><IsTruncated>false</IsTruncated>"
        b"</ListBucketResult>"
    )

    def handler(request: Request) -> Action:
        if request.method == "HEAD":
            return s3_error("503 Slow Down", "SlowDown")
        return reply("200 OK", empty)

    naps: list[float] = []
    with scripted(handler) as server, _obstore_at(server.url, naps, 1) as store:
        with pytest.raises(StoreError) as info:
            list(store.list("runs/"))
        assert type(info.value) is TransientStoreError, info.value
        assert server.requests == 2  # the listing, then the HEAD that confirms it


# -- credentials in messages ------------------------------------------------------------------


def test_url_credentials_quoted_by_the_server_are_masked(
    stubbed: tuple[S3Store, Stubber],
) -> None:
    # S3Location._scrub masks "the user:password@ of any URL in a text" that a client or
    # server quotes (a proxy URL in a message), not only the store's own secrets.
    store, stubber = stubbed
    stubber.add_client_error(
        "get_object",
        service_error_code="InternalError",
        service_message="upstream http://bob:hunter2-proxy-pw@proxy.internal:3128/ failed",
        http_status_code=500,
    )
    with pytest.raises(TransientStoreError) as info:
        store.get("k")
    assert "hunter2-proxy-pw" not in str(info.value)
    assert "http://***@proxy.internal:3128/" in str(info.value)


# -- wrappers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("keys", "batches"), [(1, 1), (999, 1), (1000, 1), (1001, 2), (2000, 2)])
def test_counted_delete_batches_are_ceil_of_keys_over_1000(keys: int, batches: int) -> None:
    # StoreCounts: deletes counts DeleteObjects requests (1,000 keys per request): 1,000 keys
    # are one request, not two.
    store = CountingStore(MemoryStore())
    store.delete_many(f"k{i}" for i in range(keys))
    assert store.snapshot().deletes == batches
    assert store.snapshot().deleted_keys == keys


def test_a_scripted_landed_create_of_a_taken_key_raises_the_scripted_error() -> None:
    # fail_next(landed=True): the call reaches inner "and the error is raised afterwards", also
    # when that create loses to an existing object (a lost response hides who won).
    inner = MemoryStore()
    inner.put("taken", b"old")
    store = FaultInjectingStore(inner)
    store.fail_next("put", landed=True)
    with pytest.raises(AmbiguousWriteError):
        store.put_if_absent("taken", b"new")
    assert inner.get("taken") == b"old"


def test_scripted_faults_come_before_random_ones() -> None:
    # "Scripted faults (fail_next) run first": a call that takes a scripted fault does not also
    # roll a random one, so a test's script is what the call raises.
    store = FaultInjectingStore(MemoryStore(), transient_error_rate=1.0)
    store.fail_next("put")
    with pytest.raises(AmbiguousWriteError):
        store.put("k", b"x")
    assert store.injected == {"scripted_put": 1}


# -- the conditional-write probe, resolving an ambiguous create --------------------------------


def test_an_ambiguous_probe_create_that_did_not_land_stays_ambiguous() -> None:
    # _read_back_probe: "if the probe is simply absent, the ambiguity stands". Going on would
    # create the key with the second create, which succeeds, and blame the store for ignoring
    # conditional writes it enforces.
    store = FaultInjectingStore(MemoryStore())
    store.fail_next("put")  # the first create is lost on the way (nothing landed)
    with pytest.raises(StoreError) as info:
        probe_conditional_writes(store, "_batchweave/probe-gap", delete=True)
    assert type(info.value) is AmbiguousWriteError, info.value


@pytest.mark.parametrize(
    ("options", "read", "connect", "attempts"),
    [
        ({"read_timeout": 0.3, "probe_timeout": 10.0}, 0.3, 5.0, 3),
        ({"connect_timeout": 0.2, "probe_timeout": 10.0}, 10.0, 0.2, 3),
        ({"max_attempts": 1, "probe_timeout": 2.0}, 2.0, 2.0, 1),
        ({"max_attempts": 9, "probe_timeout": 1.0, "connect_timeout": 4.0}, 1.0, 1.0, 3),
    ],
)
def test_the_probe_never_waits_or_retries_more_than_the_data_path(
    aws_env: pytest.MonkeyPatch,
    options: dict[str, Any],
    read: float,
    connect: float,
    attempts: int,
) -> None:
    # ClientOptions: the probe waits "probe_timeout, or read_timeout if less", connects within
    # at most that, and makes at most min(max_attempts, PROBE_ATTEMPTS) attempts per request.
    url = f"http://127.0.0.1:{free_port()}"
    boto = S3Store("bucket", "p", endpoint_url=url, **KEYS, **options)
    view = boto._probe_view()
    assert isinstance(view, S3Store)
    config: Any = view.client.meta.config
    assert (config.read_timeout, config.connect_timeout) == (read, connect)
    assert config.retries["total_max_attempts"] == attempts
    assert view._answer_within == read
    view.close()
    boto.close()
    obs = ObstoreS3Store("bucket", "p", endpoint_url=url, **KEYS, **options)
    obs_view = obs._probe_view()
    assert isinstance(obs_view, ObstoreS3Store)
    assert obs_view._answer_within == read
    assert obs_view._write_attempts == attempts


class _SwallowsSecondCreate(StoreWrapper):
    """Answers a create of a taken key with success, keeping the old bytes (no 412)."""

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        with contextlib.suppress(ObjectExists):
            self.inner.put(key, data, mode=mode)


def test_a_second_create_that_succeeds_but_stores_nothing_is_no_object_store() -> None:
    # _refuse_a_non_store: the store must give back what the second create wrote; one that gives
    # back the first bytes did not store it either, and "upgrade for If-None-Match" is the
    # wrong advice (it is not an object store's behaviour at all).
    store = _SwallowsSecondCreate(MemoryStore())
    with pytest.raises(StoreError, match="does not behave like an object store") as info:
        probe_conditional_writes(store, "_batchweave/probe-gap", delete=True)
    assert type(info.value) is StoreError


class _CreateLandsThenExists(StoreWrapper):
    """The first create lands, then reports ObjectExists (its retry met its own object)."""

    first = True

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.inner.put(key, data, mode=mode)
        if self.first and mode is PutMode.CREATE:
            self.first = False
            raise ObjectExists(f"{key}: 412 to the retry of an attempt that landed")


def test_a_probe_whose_first_create_met_its_own_object_goes_on() -> None:
    # ObjectExists to the first create does not prove somebody else won (_s3's module note):
    # the probe has its object, and the second create is refused as it must be.
    inner = MemoryStore()
    probe_conditional_writes(_CreateLandsThenExists(inner), "_batchweave/probe-gap", delete=True)
    assert list(inner.list()) == []  # and deleted afterwards


def test_a_malformed_url_error_does_not_echo_its_credentials() -> None:
    # open_store: "messages never echo credentials", also when urlsplit itself refuses the
    # netloc (a character that NFKC-normalizes to '/'), whose message quotes the netloc.
    url = "s3://AKIDEXAMPLE:very\uff0fsecret-value@bucket/prefix"
    with pytest.raises(bw.InvalidStoreURL) as info:
        bw.open_store(url, verify_conditional_writes=False)
    assert "secret-value" not in str(info.value)
    assert "AKIDEXAMPLE" not in str(info.value)


def test_a_suffix_of_zero_bytes_is_refused() -> None:
    # Suffix: "the last length bytes"; "suffix length must be positive" (S3 has no empty suffix
    # range: "bytes=-0" is not satisfiable there, while other backends would return b"").
    with pytest.raises(ValueError, match="suffix length must be positive"):
        bw.Suffix(0)


@pytest.mark.parametrize("client", ["boto3", "obstore"])
def test_a_delete_in_a_missing_bucket_is_no_success(
    aws_env: pytest.MonkeyPatch, client: str
) -> None:
    # delete_many ignores missing keys, not a missing bucket: a reclaimer pass must not report
    # a store URL naming no bucket as "deleted" (docs/store.md: NoSuchBucket is InvalidStoreURL).
    missing = lambda r: s3_error("404 Not Found", "NoSuchBucket")  # noqa: E731
    with (
        scripted(missing) as server,
        store_at(server.url, client, max_attempts=1) as store,
        pytest.raises(bw.InvalidStoreURL, match="does not exist"),
    ):
        store.delete_many(["a", "b"])

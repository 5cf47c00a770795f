"""Adversarial review of the producer, manifest and lifecycle side (session 9).

Each test reproduces a bug found in review (it failed before its fix):

- a segment merge prepared after a commit and swapped in by a much later commit could already
  have been deleted by the reclaimer (``_manifest/_log.py``: ``PREPARED_MERGE_MAX_AGE``);
- ``max_lag`` with a count-paced policy deadlocked: the TGBs that block ``append`` were never
  committed (``_producer.py``: ``_next_work``);
- a watermark released between the reclaimer's LIST and GET let the boundary jump over the
  checkpoint recorded just before the release (``_watermarks.py``: ``live``);
- an ``append`` racing ``close()`` could return normally and never be committed
  (``_producer.py``: ``_check_usable_locked``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from fake_time import FakeTime
from manifest_helpers import descriptor, grow

from batchweave import (
    MemoryStore,
    Mesh,
    ObjectNotFound,
    ObjectStore,
    Producer,
    ProducerError,
    PutMode,
    Reclaimer,
    StoreWrapper,
    TransientStoreError,
    Watermarks,
)
from batchweave._manifest import Committed, ManifestLog
from batchweave._manifest._log import PREPARED_MERGE_MAX_AGE
from batchweave._store._base import ObjectMeta

MESH = Mesh(dp=8, cp=1)
PMESH = Mesh(dp=2, cp=1)
NS = "runs/review-s9"
GRACE = 600.0


class _Wall:
    """One wall clock for the store's ``last_modified``, the log and the reclaimer."""

    def __init__(self) -> None:
        self.now = 1.7e9

    def __call__(self) -> float:
        return self.now


def test_a_stale_prepared_merge_the_reclaimer_deleted_is_never_swapped_in() -> None:
    # A producer prepares a level merge after a commit, then commits nothing for longer than
    # 2 x grace (a slow source, or append blocked by max_lag while checkpointing stalls). The
    # reclaimer deletes the merged segment as an unreferenced orphan. The producer's next commit
    # must not swap that deleted segment in for the live ones: the new version would list steps
    # whose descriptors no longer exist anywhere.
    wall = _Wall()
    store = MemoryStore(clock=wall)
    log = ManifestLog(store, NS, clock=wall, tail_limit=2, merge_fanout=2, deferred_merges=True)
    head = grow(log, log.create_or_open(MESH), 4)
    assert [r.count for r in head.segments] == [2, 2]
    assert log.prepare_merge(head) > 0  # the merge of both, waiting for the next commit

    wall.now += 3 * GRACE
    report = Reclaimer(store, NS, grace=GRACE, clock=wall).run_once()
    assert report.segments_deleted == 1  # the prepared merge: referenced by no version

    result = log.commit(head, append=[descriptor("p", 4)])
    assert isinstance(result, Committed)
    fresh = ManifestLog(store, NS)
    latest = fresh.latest()
    assert [d.offset for _, d in fresh.descriptors(latest, 0, latest.next_step)] == list(range(5))


def test_a_prepared_merge_is_swapped_in_within_its_age_limit_and_dropped_after() -> None:
    wall = _Wall()
    store = MemoryStore(clock=wall)
    log = ManifestLog(store, NS, clock=wall, tail_limit=2, merge_fanout=2, deferred_merges=True)
    head = grow(log, log.create_or_open(MESH), 4)
    log.prepare_merge(head)
    wall.now += PREPARED_MERGE_MAX_AGE / 2
    head = grow(log, head, 1)
    assert [r.count for r in head.segments] == [4]  # swapped in

    head = grow(log, head, 3)  # two more rolls: a merge of all three is due
    assert [r.count for r in head.segments] == [4, 2, 2]
    assert log.prepare_merge(head) > 0
    wall.now += PREPARED_MERGE_MAX_AGE + 1
    head = grow(log, head, 1)
    assert [r.count for r in head.segments] == [4, 2, 2]  # too old: left unreferenced
    assert [d.offset for _, d in log.descriptors(head, 0, head.next_step)] == list(range(9))


# -- max_lag with a count-paced policy ---------------------------------------------------------


class _ManifestPuts(StoreWrapper):
    """Sets ``landed`` whenever a manifest version is created."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.landed = threading.Event()

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        super().put(key, data, mode=mode)
        if "/_manifests/" in key:
            self.landed.set()


def _payloads(offset: int) -> list[bytes]:
    return [f"{offset}/{i}".encode() for i in range(PMESH.slices)]


def test_max_lag_commits_what_it_counts_when_a_count_policy_holds_it_back() -> None:
    # max_lag counts this producer's uncommitted TGBs as visible. With a count-paced policy
    # (fixed10) and max_lag below its count, the TGBs that block append were never committed:
    # no consumer could read them, so no checkpoint could move the boundary: a deadlock.
    store = _ManifestPuts(MemoryStore())
    fake = FakeTime(1000.0)
    tick = threading.Event()
    boundary = {"step": 0}

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        tick.wait(0.005)  # the blocked append re-checks with backoff; keep it from spinning

    p = Producer(
        store,
        NS,
        producer_id="p0",
        mesh=PMESH,
        policy="fixed10",
        max_lag=3,
        boundary=lambda: boundary["step"],
        clock=fake.clock,
        wall_clock=fake.wall,
        sleep=sleep,
    )
    try:
        for off in range(4):  # 0 + 3 pending <= max_lag when offset 3 is appended
            p.append(_payloads(off), offset=off)
        blocked = threading.Thread(target=p.append, args=(_payloads(4),), kwargs={"offset": 4})
        blocked.start()
        # Blocked by its own pending TGBs, the producer must publish them so consumers can
        # reach a checkpoint: a manifest with the four steps appears.
        log = ManifestLog(store, NS)
        while True:
            store.landed.clear()
            if log.latest().next_step == 4:
                break
            assert store.landed.wait(10), "pending TGBs never committed while append was blocked"
        assert blocked.is_alive()
        boundary["step"] = 4  # the consumers checkpointed past them
        blocked.join(10)
        assert not blocked.is_alive()
    finally:
        p.close()
    log = ManifestLog(store, NS)
    m = log.latest()
    assert [d.offset for _, d in log.descriptors(m, 0, m.next_step)] == [0, 1, 2, 3, 4]


# -- watermarks released while the reclaimer lists them -----------------------------------------


class _CheckpointDuringList(StoreWrapper):
    """Runs ``between`` once, right before the first GET of ``key`` (after the LIST saw it)."""

    def __init__(self, inner: ObjectStore, key: str, between: Callable[[], None]) -> None:
        super().__init__(inner)
        self._key = key
        self._between: Callable[[], None] | None = between

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        # One page, fetched whole, as S3 answers a LIST (the memory store's is a live view).
        return iter(list(super().list(prefix, start_after=start_after)))

    def get(self, key: str) -> bytes:
        if key == self._key and self._between is not None:
            between, self._between = self._between, None
            between()
        return super().get(key)


def test_a_watermark_released_during_the_listing_never_lets_the_boundary_jump() -> None:
    # Two readers share a namespace (training scope "train-", evaluation scope "eval-"). The
    # reclaimer LISTs the watermarks; before it GETs train-100, training records train-200
    # (keep_last=1 releases train-100 right after). Skipping the vanished train-100 made the
    # boundary eval-500's step: the reclaimer then cut steps 200..499, which train-200 needs.
    wall = _Wall()
    inner = MemoryStore(clock=wall)
    log = ManifestLog(inner, NS, clock=wall)
    head = log.create_or_open(MESH)
    result = log.commit(head, append=[descriptor("p", i) for i in range(600)])
    assert isinstance(result, Committed)
    train = Watermarks(inner, NS, keep_last=1, scope="train-", clock=wall)
    train.record("train-100", 100)
    Watermarks(inner, NS, scope="eval-", clock=wall).record("eval-500", 500)

    store = _CheckpointDuringList(
        inner, train.key("train-100"), lambda: train.record("train-200", 200)
    )
    report = Reclaimer(store, NS, grace=GRACE, clock=wall).run_once()
    assert report.boundary == 200
    assert report.base_step_after == 200
    assert [m.checkpoint_id for m in Watermarks(inner, NS).live()] == ["train-200", "eval-500"]


class _EveryWatermarkVanishes(StoreWrapper):
    """Lists watermarks that are always gone by the time they are read."""

    def get(self, key: str) -> bytes:
        if "/_watermarks/" in key:
            raise ObjectNotFound(f"no object {key!r}")
        return super().get(key)


def test_watermarks_that_keep_vanishing_are_a_retryable_error_not_boundary_zero() -> None:
    inner = MemoryStore()
    Watermarks(inner, NS).record("ckpt-1", 7, version=0)
    pauses: list[float] = []
    with pytest.raises(TransientStoreError, match="could not be listed consistently"):
        Watermarks(_EveryWatermarkVanishes(inner), NS, sleep=pauses.append).boundary()
    assert len(pauses) == 9  # between the 10 listings, never a real wait in a test


# -- append racing close() ----------------------------------------------------------------------


def test_an_append_racing_close_is_committed_or_refused_never_silently_dropped() -> None:
    # close() drains what was appended when it began, then the commit thread ends (nothing left
    # to commit and closing). An append from another thread that lands after that drain, before
    # close() marks the producer closed, used to return normally, although no thread would ever
    # commit it: close() then returned without error and the TGB was lost.
    store = MemoryStore()
    fake = FakeTime(1000.0)
    p = Producer(
        store,
        NS,
        producer_id="p0",
        mesh=PMESH,
        policy="naive",
        clock=fake.clock,
        wall_clock=fake.wall,
        sleep=fake.sleep,
    )
    p.append(_payloads(0), offset=0)
    outcome: list[BaseException | None] = []
    shutdown = p._shutdown

    def late_append_then_shutdown(*, abort: bool) -> None:
        # What another thread's append() sees right after close()'s drain: the commit thread has
        # finished (nothing left to commit), the producer is not yet marked closed.
        p._committer.join(10)
        assert not p._committer.is_alive()
        try:
            p.append(_payloads(1), offset=1)
            outcome.append(None)
        except ProducerError as exc:
            outcome.append(exc)
        shutdown(abort=abort)

    p._shutdown = late_append_then_shutdown  # type: ignore[method-assign]
    p.close()
    log = ManifestLog(store, NS)
    m = log.latest()
    committed = [d.offset for _, d in log.descriptors(m, 0, m.next_step)]
    assert len(outcome) == 1
    refused = isinstance(outcome[0], ProducerError)
    assert refused or committed == [0, 1], (
        f"append returned normally during close() but committed offsets are {committed}"
    )
    assert committed[0] == 0

"""Watermarks: record, release, keep-last-K, the boundary, and refusing corrupt objects.

Also a LIST that lags a DELETE (an eventually consistent listing naming a released watermark):
``Watermarks.live()`` retakes it after growing, capped pauses (its injectable ``sleep``, or the
reclaimer's) and, when it gives up, names the namespace and what to do. Watermarks that keep
vanishing between LIST and GET are a retryable error, never a boundary of zero. Readers sharing
a namespace use scopes: one reader's ``keep_last`` never releases another's watermarks.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fake_time import FakeTime
from manifest_helpers import commit_empty
from pydantic import BaseModel

import batchweave as bw
import batchweave._metrics
from batchweave import (
    MemoryStore,
    ObjectNotFound,
    StoreWrapper,
    TransientStoreError,
    Watermarks,
    _watermarks,
)
from batchweave._manifest import ManifestLog, manifest_key
from batchweave._manifest._codec import encode_object
from batchweave._store._base import ObjectMeta

NS = "runs/wm"


@pytest.fixture
def store() -> bw.MemoryStore:
    return bw.MemoryStore("watermarks")


def test_no_watermark_means_boundary_zero(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    assert marks.live() == []
    assert marks.boundary() == 0


def test_record_release_and_boundary(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS, clock=lambda: 123.0)
    recorded = marks.record("ckpt-100", 100, version=7)
    marks.record("ckpt-200", 200, version=9)
    assert recorded == bw.Watermark(
        checkpoint_id="ckpt-100", step=100, version=7, recorded_at=123.0
    )
    assert [m.checkpoint_id for m in marks.live()] == ["ckpt-100", "ckpt-200"]
    assert marks.boundary() == 100
    assert marks.get("ckpt-200") is not None
    assert store.head(f"{NS}/_watermarks/ckpt-100.json").size > 0

    marks.release("ckpt-100")
    marks.release("ckpt-100")  # idempotent
    assert marks.boundary() == 200
    assert marks.get("ckpt-100") is None
    marks.release("ckpt-200")
    assert marks.boundary() == 0


def test_recording_again_replaces(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    marks.record("latest", 10, version=1)
    marks.record("latest", 30, version=2)
    assert [(m.step, m.version) for m in marks.live()] == [(30, 2)]


def test_keep_last_releases_lowest_steps(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS, keep_last=2)
    for step in (10, 20, 30, 40):
        marks.record(f"ckpt-{step}", step, version=step)
    assert [m.step for m in marks.live()] == [30, 40]
    assert marks.boundary() == 30


def test_keep_last_keeps_the_new_watermark_even_after_a_rollback(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS, keep_last=1)
    marks.record("ckpt-50", 50, version=5)
    # Training rolled back to an earlier checkpoint and checkpointed again at a lower step.
    marks.record("ckpt-40b", 40, version=6)
    assert [m.checkpoint_id for m in marks.live()] == ["ckpt-40b"]


def test_keep_last_keeps_the_resumed_runs_checkpoints_after_a_rollback(
    store: bw.MemoryStore,
) -> None:
    # Before: the K-1 others kept were those of the highest steps, so the abandoned run's
    # ckpt-20 kept its slot and the resumed run's ckpt-13 was released (then reclaimed).
    ticks = iter(range(1, 100))
    marks = bw.Watermarks(store, NS, keep_last=2, clock=lambda: float(next(ticks)))
    marks.record("ckpt-10", 10, version=1)
    marks.record("ckpt-20", 20, version=2)
    marks.record("ckpt-10", 10, version=3)  # rolled back to ckpt-10, re-recorded on resume
    marks.record("ckpt-13", 13, version=4)
    assert [m.checkpoint_id for m in marks.live()] == ["ckpt-10", "ckpt-13"]
    marks.record("ckpt-16", 16, version=5)
    assert [m.checkpoint_id for m in marks.live()] == ["ckpt-13", "ckpt-16"]
    assert marks.boundary() == 13


def _ticking_store() -> bw.MemoryStore:
    """A store whose clock (``last_modified``) advances one second per write, as one S3 does."""
    ticks = iter(range(1_800_000_000, 1_800_001_000))
    return bw.MemoryStore("watermarks", clock=lambda: float(next(ticks)))


def test_keep_last_orders_by_the_stores_clock_not_the_recorders() -> None:
    # Before: ordered by recorded_at, a trainer resumed on a host 10 min behind released its
    # newest checkpoints and kept ckpt-10 for ever: the boundary (and max_lag producers) stalled.
    store = _ticking_store()
    host_a = bw.Watermarks(store, NS, keep_last=2, clock=lambda: 1_800_000_000.0)
    host_a.record("ckpt-10", 10, version=1)
    host_a.record("ckpt-20", 20, version=2)
    host_b = bw.Watermarks(store, NS, keep_last=2, clock=lambda: 1_800_000_000.0 - 600)
    host_b.record("ckpt-20", 20, version=3)  # re-recorded on resume, as the docs advise
    for step in (30, 40, 50):
        host_b.record(f"ckpt-{step}", step, version=step)
    assert [m.checkpoint_id for m in host_b.live()] == ["ckpt-40", "ckpt-50"]
    assert host_b.boundary() == 40


def test_keep_last_rollback_on_a_host_whose_clock_is_ahead() -> None:
    # The abandoned run was recorded by a host 1 h *behind*; the resumed one re-records ckpt-10
    # (the newest by the store's clock) and its successor: the abandoned ckpt-20 goes first.
    store = _ticking_store()
    old = bw.Watermarks(store, NS, keep_last=2, clock=lambda: 1_800_000_000.0)
    old.record("ckpt-10", 10, version=1)
    old.record("ckpt-20", 20, version=2)
    resumed = bw.Watermarks(store, NS, keep_last=2, clock=lambda: 1_800_000_000.0 - 3600)
    resumed.record("ckpt-10", 10, version=3)
    resumed.record("ckpt-13", 13, version=4)
    assert [m.checkpoint_id for m in resumed.live()] == ["ckpt-10", "ckpt-13"]


def test_keep_last_breaks_ties_of_last_modified_by_recorded_at_then_id() -> None:
    # A store whose clock has coarse resolution (S3's LastModified is whole seconds) stamps
    # several watermarks alike: recorded_at decides, then the id.
    store = bw.MemoryStore("watermarks", clock=lambda: 1_800_000_000.0)
    ticks = iter([5.0, 7.0, 7.0, 9.0])
    marks = bw.Watermarks(store, NS, keep_last=2, clock=lambda: next(ticks))
    for name in ("ckpt-a", "ckpt-c", "ckpt-b", "ckpt-d"):
        marks.record(name, 1, version=1)
    # ckpt-d (new) is kept, and of the others ckpt-c: recorded_at 7, like ckpt-b, higher id.
    assert sorted(m.checkpoint_id for m in marks.live()) == ["ckpt-c", "ckpt-d"]


def test_keep_last_keeps_the_newest_of_watermarks_restored_from_a_copy() -> None:
    """Before: ordered by last_modified first, watermarks copied back in reverse key order
    (a restore, ``aws s3 sync``) made keep_last release ck-300, the newest earlier checkpoint."""
    now = [1_800_000_000.0]
    source = bw.MemoryStore(clock=lambda: now[0])
    marks = bw.Watermarks(source, NS, keep_last=3, clock=lambda: now[0])
    for version, step in enumerate((100, 200, 300), start=3):
        now[0] += 60
        marks.record(f"ck-{step}", step, version=version)
    restored = bw.MemoryStore(clock=lambda: now[0])
    for meta in sorted(source.list(f"{NS}/_watermarks/"), key=lambda m: m.key, reverse=True):
        now[0] += 1
        restored.put(meta.key, source.get(meta.key))
    again = bw.Watermarks(restored, NS, keep_last=3, clock=lambda: now[0])
    again.record("ck-400", 400, version=9)
    assert [m.checkpoint_id for m in again.live()] == ["ck-200", "ck-300", "ck-400"]


def test_keep_last_breaks_full_ties_by_step_not_by_the_ids_text() -> None:
    """Before: with version, last_modified and recorded_at alike, "ck-900" (sorting after
    "ck-1000" as text) was kept over ck-1000."""
    store = bw.MemoryStore(clock=lambda: 1_800_000_000.0)
    marks = bw.Watermarks(store, NS, keep_last=2, clock=lambda: 1_800_000_000.0)
    for step in (900, 1000, 1100):
        marks.record(f"ck-{step}", step, version=1)
    assert [m.checkpoint_id for m in marks.live()] == ["ck-1000", "ck-1100"]


def test_keep_last_on_a_file_store_uses_the_files_mtime(tmp_path: Path) -> None:
    store = bw.FileStore(tmp_path, fsync=False)
    behind = iter([2000.0, 1000.0, 500.0])  # each recorder's clock further behind
    marks = bw.Watermarks(store, NS, keep_last=2, clock=lambda: next(behind))
    for step in (10, 20, 30):
        marks.record(f"ckpt-{step}", step, version=step)
        # Distinct mtimes however coarse the file system's: set them, as the writes would.
        key = tmp_path / NS / "_watermarks" / f"ckpt-{step}.json"
        os.utime(key, (1_800_000_000 + step, 1_800_000_000 + step))
    assert [m.checkpoint_id for m in marks.live()] == ["ckpt-20", "ckpt-30"]


def test_version_defaults_to_latest_manifest(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    assert marks.record("before-namespace", 0).version == 0
    log = ManifestLog(store, NS)
    base = log.create_or_open(bw.Mesh(dp=1, cp=1))
    log.commit(base, base_step=None)
    assert marks.record("after", 0).version == 1


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "-x", "a b", "x" * 201, "ä"])
def test_unsafe_checkpoint_ids_are_refused(store: bw.MemoryStore, bad: str) -> None:
    marks = bw.Watermarks(store, NS)
    with pytest.raises(ValueError, match="safe key segment"):
        marks.record(bad, 1)
    assert list(store.list(f"{NS}/")) == []


def test_bad_arguments(store: bw.MemoryStore) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        bw.Watermarks(store, NS, keep_last=0)
    with pytest.raises(ValueError, match="step"):
        bw.Watermarks(store, NS).record("c", -1)
    with pytest.raises(TypeError, match="step must be an integer"):
        bw.Watermarks(store, NS).record("c", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an integer"):
        bw.Watermarks(store, NS).record("c", True)
    assert list(store.list(f"{NS}/")) == []


@pytest.mark.parametrize(
    ("version", "error"),
    [(-1, ValueError), (True, TypeError), (False, TypeError), (2.0, TypeError), ("3", TypeError)],
)
def test_a_bad_version_is_refused_as_clearly_as_a_bad_step(
    store: bw.MemoryStore, version: object, error: type[Exception]
) -> None:
    # version=-1 used to escape as a raw pydantic ValidationError, and version=True was stored
    # as version 1.
    with pytest.raises(error, match="version must be") as info:
        bw.Watermarks(store, NS).record("c", 5, version=version)  # type: ignore[arg-type]
    assert "pydantic" not in type(info.value).__module__
    assert list(store.list(f"{NS}/")) == []
    mark = bw.Watermarks(store, NS).record("c", 5, version=np.int64(3))  # type: ignore[arg-type]
    assert type(mark.version) is int
    assert mark.version == 3


def test_numpy_steps_are_recorded_as_plain_ints(store: bw.MemoryStore) -> None:
    # A training loop's step counter is often a NumPy integer; the watermark must still be
    # plain JSON that every reader decodes.
    marks = bw.Watermarks(store, NS)
    mark = marks.record("ckpt-7", np.int64(7), version=0)
    assert type(mark.step) is int
    assert [(m.checkpoint_id, m.step) for m in marks.live()] == [("ckpt-7", 7)]


@pytest.mark.parametrize(
    ("mangle", "error", "match"),
    [
        (lambda b: b[:-3], bw.FormatError, "truncated"),
        (lambda b: b.replace(b'"step":5', b'"step":6'), bw.ChecksumMismatch, "checksum"),
        (lambda b: b'{"step": 5}', bw.FormatError, "not a BatchWeave"),
    ],
)
def test_corrupt_watermark_is_an_error_naming_the_key(
    store: bw.MemoryStore, mangle: object, error: type[Exception], match: str
) -> None:
    marks = bw.Watermarks(store, NS)
    marks.record("good", 50, version=1)
    marks.record("ckpt-5", 5, version=1)
    key = f"{NS}/_watermarks/ckpt-5.json"
    assert callable(mangle)
    store.put(key, mangle(store.get(key)))
    with pytest.raises(error, match=match) as info:
        marks.boundary()
    assert key in str(info.value)
    assert "reclaimed" in str(info.value)


def test_future_format_asks_for_an_upgrade(store: bw.MemoryStore) -> None:
    from batchweave._manifest._codec import encode_object

    class Future(bw.Watermark):
        pass

    data = encode_object(
        "batchweave-watermark",
        Future(format=2, checkpoint_id="c", step=1, version=0),
    )
    store.put(f"{NS}/_watermarks/c.json", data)
    with pytest.raises(bw.UnsupportedFormatVersion, match="upgrade"):
        bw.Watermarks(store, NS).live()


def test_a_newer_releases_watermark_is_never_to_be_deleted_or_re_recorded(
    store: bw.MemoryStore,
) -> None:
    """It is a live checkpoint's, intact: deleting or re-recording it (the advice for a corrupt
    one, which this one got too) dropped that checkpoint's protection."""
    data = encode_object(
        "batchweave-watermark",
        bw.Watermark(checkpoint_id="c", step=1, version=0).model_copy(update={"format": 2}),
    )
    store.put(f"{NS}/_watermarks/c.json", data)
    for read in (bw.Watermarks(store, NS).live, lambda: bw.Watermarks(store, NS).get("c")):
        with pytest.raises(bw.UnsupportedFormatVersion) as info:
            read()
        message = str(info.value)
        assert "upgrade" in message
        assert "live checkpoint" in message
        assert "delete" not in message
        assert "re-record" not in message


def test_survey_lists_readable_watermarks_beside_every_unreadable_one(
    store: bw.MemoryStore,
) -> None:
    marks = bw.Watermarks(store, NS)
    for cid, step in (("a-bad", 2), ("eval-3", 3), ("train-8", 8), ("z-bad", 9)):
        marks.record(cid, step, version=0)
    for cid in ("z-bad", "a-bad"):
        store.put(marks.key(cid), store.get(marks.key(cid))[:-4])
    readable, unreadable = marks._survey()
    assert [(m.checkpoint_id, m.step) for m in readable] == [("eval-3", 3), ("train-8", 8)]
    assert [key for key, _ in unreadable] == [marks.key("a-bad"), marks.key("z-bad")]
    assert all(isinstance(exc, bw.FormatError) for _, exc in unreadable)
    with pytest.raises(bw.FormatError):  # live() still refuses: the boundary is unknown
        marks.live()


def test_a_watermark_copied_under_another_name_is_refused(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    marks.record("ckpt-1", 1, version=0)
    store.put(f"{NS}/_watermarks/ckpt-2.json", store.get(f"{NS}/_watermarks/ckpt-1.json"))
    with pytest.raises(bw.FormatError, match=r"ckpt-2\.json"):
        marks.live()


def test_other_files_under_the_prefix_are_ignored(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    marks.record("ckpt-3", 3, version=0)
    store.put(f"{NS}/_watermarks/README.txt", b"operators notes")
    assert marks.boundary() == 3


class _LooseWatermark(BaseModel):
    """A watermark as a hand-written tool might store it: the step as a string."""

    format: int = 1
    checkpoint_id: str
    step: str
    version: int
    recorded_at: float = 0.0


def test_a_watermark_whose_step_is_not_an_integer_is_refused(store: bw.MemoryStore) -> None:
    # A validly enveloped watermark with "step": "5" was coerced to 5; a value nothing in
    # BatchWeave writes is refused as manifests are, naming the key and the field.
    key = f"{NS}/_watermarks/ckpt-5.json"
    loose = _LooseWatermark(checkpoint_id="ckpt-5", step="5", version=1)
    store.put(key, encode_object(_watermarks._MAGIC, loose))
    with pytest.raises(bw.FormatError, match="step") as info:
        bw.Watermarks(store, NS).boundary()
    assert key in str(info.value)


# -- listings that lag a delete ----------------------------------------------------------------


class LaggingList(bw.StoreWrapper):
    """A store whose LIST still names ``stale`` (already deleted) for its next ``lags`` calls,
    like an eventually consistent listing that lags a DELETE."""

    def __init__(self, inner: bw.ObjectStore, stale: str, lags: int) -> None:
        super().__init__(inner)
        self.stale = stale
        self.lags = lags
        self.lists = 0

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self.lists += 1
        metas = list(self.inner.list(prefix, start_after=start_after))
        if self.lags > 0 and self.stale.startswith(prefix):
            self.lags -= 1
            metas.append(ObjectMeta(key=self.stale, size=10, last_modified=0.0))
            metas.sort(key=lambda m: m.key)
        return iter(metas)


def lagging(lags: int) -> tuple[LaggingList, bw.Watermarks, FakeTime]:
    inner = bw.MemoryStore()
    bw.Watermarks(inner, NS).record("ckpt-2", step=2, version=0)
    bw.Watermarks(inner, NS).record("ckpt-1", step=1, version=0)
    bw.Watermarks(inner, NS).release("ckpt-1")
    store = LaggingList(inner, f"{NS}/_watermarks/ckpt-1.json", lags)
    fake = FakeTime()
    return store, bw.Watermarks(store, NS, sleep=fake.sleep), fake


def test_a_lagging_listing_is_retaken_after_growing_pauses() -> None:
    store, marks, fake = lagging(3)
    assert [m.checkpoint_id for m in marks.live()] == ["ckpt-2"]
    assert store.lists == 5  # three stale listings, then a good one and its confirming one
    assert fake.sleeps == [0.05, 0.1, 0.2]


def test_a_listing_that_keeps_lagging_fails_naming_the_namespace_and_what_to_do() -> None:
    store, marks, fake = lagging(100)
    with pytest.raises(bw.TransientStoreError) as info:
        marks.live()
    assert store.lists == 10
    # capped exponential: about 5.5 s in all, never a busy loop
    assert fake.sleeps == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0, 1.0]
    message = str(info.value)
    assert f"{store.url}/{NS}" in message
    assert "ckpt-1.json" in message
    assert "10 listings over 5.5 s" in message
    assert "LIST lags its DELETEs" in message
    assert "retry" in message


def test_the_reclaimer_paces_watermark_listings_with_its_own_sleep() -> None:
    store, _, _ = lagging(2)
    fake = FakeTime()
    report = bw.Reclaimer(store, NS, grace=100.0, sleep=fake.sleep).run_once()
    assert report.watermarks == 1
    assert fake.sleeps == [0.05, 0.1]


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


class RacingList(StoreWrapper):
    """A LIST of the watermarks (the first only) during which ``during`` runs, answered as
    ``FileStore.list`` answers it: the keys there when it began (its directory read), less those
    gone when it came to them (its stat of each). It skips a key deleted while it ran and misses
    one created while it ran, deterministically."""

    def __init__(self, inner: bw.ObjectStore, during: Callable[[], None]) -> None:
        super().__init__(inner)
        self.during: Callable[[], None] | None = during
        self.lists = 0

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self.lists += 1
        began = [m.key for m in self.inner.list(prefix, start_after=start_after)]
        if self.during is not None and "/_watermarks/" in prefix:
            during, self.during = self.during, None
            during()
        now = {m.key: m for m in self.inner.list(prefix, start_after=start_after)}
        return iter([now[key] for key in began if key in now])


def test_a_listing_missing_a_successor_and_its_released_predecessor_keeps_the_boundary() -> None:
    # Reader a- always holds a checkpoint of step 5: while a LIST runs it records a-2 and then
    # releases a-1. The listing lacks both (FileStore's did, 76 of 21,000 live() calls under
    # load), and the boundary jumped to reader b-'s step 1500: a reclaimer cut step 5.
    inner = MemoryStore()
    a = Watermarks(inner, NS, scope="a-")
    a.record("a-1", 5, version=0)
    Watermarks(inner, NS, scope="b-").record("b-1", 1500, version=0)

    def checkpoint() -> None:
        a.record("a-2", 5, version=0)
        a.release("a-1")

    store = RacingList(inner, checkpoint)
    marks = Watermarks(store, NS, sleep=lambda _: pytest.fail("nothing vanished"))
    assert [(m.checkpoint_id, m.step) for m in marks.live()] == [("a-2", 5), ("b-1", 1500)]
    # The racing listing, the one adding a-2, and one adding nothing: they settled.
    assert store.lists == 3
    assert marks.boundary() == 5
    assert store.lists == 5  # a quiet namespace costs one confirming LIST


class _NewWatermarkPerList(StoreWrapper):
    """Every LIST of the watermarks first finds a new one recorded (a reader checkpointing
    faster than the watermarks can be listed)."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.lists = 0

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self.lists += 1
        Watermarks(self.inner, NS).record(f"w-{self.lists}", 5, version=0)
        return super().list(prefix, start_after=start_after)


def test_watermarks_that_never_settle_are_a_retryable_error_naming_why() -> None:
    store = _NewWatermarkPerList(MemoryStore())
    pauses: list[float] = []
    with pytest.raises(TransientStoreError) as info:
        Watermarks(store, NS, sleep=pauses.append).live()
    assert store.lists == 10 * 4  # each of 10 listings: its LIST and 3 more adding a watermark
    assert len(pauses) == 9
    message = str(info.value)
    assert f"{store.url}/{NS}: the watermarks could not be listed consistently" in message
    assert "3 LISTs after the first each named new watermarks (last: " in message
    assert "w-40.json" in message


# -- several readers sharing a namespace -------------------------------------------------------


def test_keep_last_of_one_reader_never_releases_another_readers_watermarks() -> None:
    store = bw.MemoryStore("readers")
    train = bw.Watermarks(store, NS, keep_last=2, scope="train-")
    evaluation = bw.Watermarks(store, NS, scope="eval-")
    evaluation.record("eval-start", 0, version=0)
    evaluation.record("eval-50", 50, version=3)
    for step in (100, 110, 120, 130):
        train.record(f"train-{step}", step, version=5)
    live = [(m.checkpoint_id, m.step) for m in bw.Watermarks(store, NS).live()]
    # The training job's keep_last kept its own two newest and never touched the evaluator's.
    assert live == [("eval-start", 0), ("eval-50", 50), ("train-120", 120), ("train-130", 130)]
    assert train.boundary() == 0


def test_keep_last_reads_only_the_watermarks_of_its_scope() -> None:
    # record(keep_last=...) read every watermark of the namespace to order its own scope's
    # (23 GETs for 3 in scope), and another reader's damaged watermark made it raise after its
    # PUT, leaving its old watermarks unreleased. The boundary still reads them all.
    inner = bw.MemoryStore("scopes")
    evaluation = bw.Watermarks(inner, NS, scope="eval-")
    for i in range(20):
        evaluation.record(f"eval-{i}", i, version=0)
    inner.put(evaluation.key("eval-damaged"), b"not a watermark")
    store = bw.CountingStore(inner)
    train = bw.Watermarks(store, NS, keep_last=2, scope="train-")
    train.record("train-1", 1, version=0)
    train.record("train-2", 2, version=0)
    before = store.snapshot()
    train.record("train-3", 3, version=0)
    used = store.snapshot() - before
    assert (used.puts, used.lists, used.gets, used.deletes) == (1, 1, 3, 1), used
    assert [train.get(f"train-{i}") is not None for i in (1, 2, 3)] == [False, True, True]
    with pytest.raises(bw.FormatError, match="eval-damaged"):
        train.boundary()  # the boundary still reads every reader's watermarks


def test_a_scoped_reader_refuses_checkpoint_ids_outside_its_scope() -> None:
    store = bw.MemoryStore("scope")
    train = bw.Watermarks(store, NS, keep_last=1, scope="train-")
    with pytest.raises(ValueError, match="outside this reader's scope 'train-'"):
        train.record("eval-10", 10, version=0)
    assert list(store.list(f"{NS}/")) == []
    with pytest.raises(ValueError, match="safe key segment"):
        bw.Watermarks(store, NS, scope="a/b")
    assert "scope='train-'" in repr(train)


def test_a_scope_that_could_cover_another_readers_ids_is_refused() -> None:
    """``scope="rank-1"`` is a prefix of ``rank-10-...``: its keep_last released the live
    watermark of the reader with scope ``rank-10``, and the reclaimer deleted the steps that
    reader's checkpoint resumes at."""
    store = bw.MemoryStore("scope-prefix")
    with pytest.raises(ValueError, match=r"scope 'rank-1' must end with one of .*scope='rank-1-'"):
        bw.Watermarks(store, NS, keep_last=1, scope="rank-1")
    ten = bw.Watermarks(store, NS, keep_last=1, scope="rank-10-")
    one = bw.Watermarks(store, NS, keep_last=1, scope="rank-1-")
    ten.record("rank-10-step-5", 5, version=0)
    for step in (10, 20, 30):
        one.record(f"rank-1-step-{step}", step, version=0)
    with pytest.raises(ValueError, match="outside this reader's scope 'rank-1-'"):
        one.record("rank-10-step-40", 40, version=0)
    live = [(m.checkpoint_id, m.step) for m in bw.Watermarks(store, NS).live()]
    assert live == [("rank-10-step-5", 5), ("rank-1-step-30", 30)]
    for end in "-_.=+":
        bw.Watermarks(store, NS, scope=f"job{end}")


class _Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("versions", [10, 300])
def test_recording_without_a_version_costs_the_same_however_many_versions_are_kept(
    versions: int,
) -> None:
    # The checkpoint hook of a WeaveLoader passes no version: each record then looks up the
    # latest one. Only the first lookup may list the versions; later ones start from the last
    # version found, so a long run's checkpoints do not list the whole retained history.
    clock = _Clock()
    inner = bw.MemoryStore("watermarks", clock=clock)
    log = ManifestLog(inner, NS, clock=clock)
    head = commit_empty(log, log.create_or_open(bw.Mesh(dp=1, cp=1)), versions)
    store = bw.CountingStore(inner)
    marks = bw.Watermarks(store, NS, clock=clock)
    assert marks.record("ckpt-0", 0).version == head.version
    for i, new in enumerate((1, 1, 5, 0), start=1):
        head = commit_empty(log, head, new)
        clock.now += 30.0
        before = store.snapshot()
        assert marks.record(f"ckpt-{i}", i).version == head.version
        used = store.snapshot() - before
        assert used.listed <= new, (used, new)
        # LIST after the known version, read the newest (or the known one again, confirming
        # it is still there), the PUT
        assert used.requests <= 3, used


def test_recording_finds_the_newest_version_after_the_known_one_was_reclaimed() -> None:
    clock = _Clock()
    store = bw.MemoryStore("watermarks", clock=clock)
    log = ManifestLog(store, NS, clock=clock)
    head = commit_empty(log, log.create_or_open(bw.Mesh(dp=1, cp=1)), 5)
    marks = bw.Watermarks(store, NS, clock=clock)
    assert marks.record("a", 0).version == 5
    head = commit_empty(log, head, 3)  # versions 6..8
    clock.now += 600.0
    # The reclaimer deletes versions oldest first and never the newest: 5 and its successor go.
    store.delete_many([f"{NS}/{manifest_key(v)}" for v in range(8)])
    assert marks.record("b", 0).version == 8
    head = commit_empty(log, head, 2)  # versions 9..10, then every older one reclaimed
    clock.now += 600.0
    store.delete_many([f"{NS}/{manifest_key(v)}" for v in range(10)])
    assert marks.record("c", 0).version == 10
    assert marks.record("d", 0).version == 10  # current: no going back


def test_recording_after_the_namespace_was_re_created_looks_it_up_afresh() -> None:
    clock = _Clock()
    store = bw.MemoryStore("watermarks", clock=clock)
    log = ManifestLog(store, NS, clock=clock)
    commit_empty(log, log.create_or_open(bw.Mesh(dp=1, cp=1)), 1)
    marks = bw.Watermarks(store, NS, clock=clock)
    assert marks.record("a", 0).version == 1
    store.delete_many([m.key for m in store.list(f"{NS}/")])
    again = ManifestLog(store, NS, clock=clock)
    commit_empty(again, again.create_or_open(bw.Mesh(dp=1, cp=1)), 2)  # another namespace id
    assert marks.record("b", 0).version == 2


@pytest.mark.parametrize("age", [0.0, 120.0], ids=["young", "old"])
def test_recording_after_the_namespace_was_re_created_with_fewer_versions_finds_its_latest(
    age: float,
) -> None:
    # Nothing is listed after the version found before, which is gone: the new namespace's
    # latest is recorded, however old that version (a minute decided before).
    clock = _Clock()
    store = bw.MemoryStore("watermarks", clock=clock)
    log = ManifestLog(store, NS, clock=clock)
    commit_empty(log, log.create_or_open(bw.Mesh(dp=1, cp=1)), 10)
    marks = bw.Watermarks(store, NS, clock=clock)
    assert marks.record("a", 5).version == 10
    store.delete_many([m.key for m in store.list(f"{NS}/")])
    again = ManifestLog(store, NS, clock=clock)
    commit_empty(again, again.create_or_open(bw.Mesh(dp=1, cp=1)), 3)  # another namespace id
    clock.now += age
    assert marks.record("b", 2).version == 3
    assert marks.record("c", 2).version == 3
    commit_empty(again, again.latest(), 1)
    assert marks.record("d", 2).version == 4


def test_recording_after_the_namespace_was_deleted_and_created_again_later() -> None:
    clock = _Clock()
    store = bw.MemoryStore("watermarks", clock=clock)
    log = ManifestLog(store, NS, clock=clock)
    commit_empty(log, log.create_or_open(bw.Mesh(dp=1, cp=1)), 4)
    marks = bw.Watermarks(store, NS, clock=clock)
    assert marks.record("a", 0).version == 4
    store.delete_many([m.key for m in store.list(f"{NS}/")])
    assert marks.record("b", 0).version == 0  # no namespace: version 0, as before it exists
    again = ManifestLog(store, NS, clock=clock)
    commit_empty(again, again.create_or_open(bw.Mesh(dp=1, cp=1)), 2)
    assert marks.record("c", 0).version == 2


def test_watermarks_pickle_after_recording(tmp_path: object) -> None:
    import pickle
    from pathlib import Path

    store = bw.FileStore(Path(str(tmp_path)) / "root", fsync=False)
    log = ManifestLog(store, NS)
    commit_empty(log, log.create_or_open(bw.Mesh(dp=1, cp=1)), 2)
    marks = bw.Watermarks(store, NS, keep_last=3)
    assert marks.record("a", 0).version == 2
    copy = pickle.loads(pickle.dumps(marks))  # a spawned process gets its own lookup
    assert copy.record("b", 1).version == 2
    assert copy.keep_last == 3


# -- a non-finite recorded_at --------------------------------------------------------------------


def _with_recorded_at(store: bw.MemoryStore, key: str, value: float) -> None:
    """Rewrite the watermark at ``key`` with ``recorded_at = value``, its checksum valid (as
    Python's json writes it: ``Infinity``, ``NaN``), as a hand-written tool might."""
    from batchweave._manifest._codec import body_checksum

    data = store.get(key)
    body = json.loads(data[data.index(b"\n") + 1 :])
    body["recorded_at"] = value
    raw = json.dumps(body, separators=(",", ":")).encode()
    head = f"{_watermarks._MAGIC} crc32c={body_checksum(raw):08x} length={len(raw)}\n"
    store.put(key, head.encode() + raw)


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
def test_a_watermark_recorded_at_a_non_finite_time_is_damage(
    store: bw.MemoryStore, value: float
) -> None:
    """It was accepted, and `batchweave inspect --json` then printed "age_seconds": -Infinity,
    which is no JSON. Refused like any damaged watermark, naming the key and the field: the
    boundary is unknown, so reclaim deletes nothing, and inspect lists it as unreadable."""
    from batchweave.cli._inspect import gather_inspection

    with bw.Producer(store, NS, producer_id="p", mesh=bw.Mesh(dp=1)) as producer:
        producer.append([b"x"], offset=0)
    marks = bw.Watermarks(store, NS)
    marks.record("good", 0)
    marks.record("c1", 0)
    _with_recorded_at(store, marks.key("c1"), value)
    with pytest.raises(bw.FormatError, match="recorded_at") as info:
        marks.live()
    assert marks.key("c1") in str(info.value)
    before = {meta.key for meta in store.list(f"{NS}/")}
    with pytest.raises(bw.FormatError, match="recorded_at"):
        bw.Reclaimer(store, NS, grace=0).run_once()
    assert {meta.key for meta in store.list(f"{NS}/")} == before  # nothing reclaimed
    data = gather_inspection(store, NS)
    json.dumps(data, allow_nan=False)  # strict JSON: no Infinity, no NaN
    assert [m["checkpoint_id"] for m in data["watermarks"]] == ["good"]
    assert [bad["key"] for bad in data["unreadable_watermarks"]] == [marks.key("c1")]
    assert data["boundary"] is None

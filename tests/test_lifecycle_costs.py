"""What a reclaimer pass costs in a long run, and that the cheaper lookup stays safe.

A pass lists ``_manifests/`` once (after its cut, to decide what to delete); the latest version
it commits the cut on is found from the previous pass's latest by listing only the versions
after it. So a namespace retaining thousands of versions is not listed twice per pass. That
lookup trusts no clock: a pass whose previous latest (and its successor) were deleted meanwhile,
with the clock stepped back so that version looks young, still sees every step committed since.
When nothing is listed after it, the previous latest is read back (one GET) before the pass
uses it: a prefix deleted and re-created meanwhile stops the pass before it commits or deletes
anything, whether the new namespace has fewer, as many or more versions. Nor does a pass read
again the segments it read before (the manifest log's cache of decoded segments is bounded).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _reclaimer_worker import FakeClock, Writer
from manifest_helpers import commit_empty

import batchweave as bw
from batchweave import MemoryStore, StoreWrapper
from batchweave._manifest import ManifestLog, manifest_key
from batchweave._store._base import ObjectMeta

NS = "runs/costs"
MESH = bw.Mesh(dp=1, cp=1)
GRACE = 150.0


class ManifestListings(StoreWrapper):
    """Counts the keys listed under ``_manifests/``, whoever lists them."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.listed = 0

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        for meta in self.inner.list(prefix, start_after=start_after):
            if "/_manifests/" in meta.key:
                self.listed += 1
            yield meta


def test_a_pass_lists_the_retained_versions_once_not_twice() -> None:
    clock = FakeClock()
    inner = MemoryStore("costs", clock=clock)
    log = ManifestLog(inner, NS, clock=clock)
    head = commit_empty(log, log.create_or_open(MESH), 300)
    # A watermark at version 0: every version is retained, as under a long checkpoint interval.
    bw.Watermarks(inner, NS, clock=clock).record("keep", 0, version=0)
    store = ManifestListings(inner)
    reclaimer = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)

    reclaimer.run_once()  # the first pass may find the latest version with a LIST of its own
    for new in (0, 1, 40):
        head = commit_empty(log, head, new)
        clock.advance(30)
        store.listed = 0
        report = reclaimer.run_once()
        assert report.latest_version == head.version
        assert report.manifests_deleted == 0
        retained = head.version + 1
        # one listing of every retained version, plus the versions since the previous pass
        assert store.listed <= retained + new, (store.listed, retained, new)


def test_a_pass_after_its_previous_latest_was_reclaimed_sees_every_newer_step() -> None:
    clock = FakeClock()
    store = MemoryStore("costs", clock=clock)
    writer = Writer(store, NS, MESH, clock=clock)
    writer.publish(1)
    writer.publish(1)  # version 2, steps 0..1
    reclaimer = bw.Reclaimer(store, NS, grace=5.0, clock=clock, sleep=lambda _: None)
    assert reclaimer.run_once().latest_version == 2
    for _ in range(3):
        writer.publish(1)  # versions 3..5, steps 2..4
    newest = writer.base.version
    # Another reclaimer (its clock ahead) deleted versions up to 3, oldest first; this one's
    # clock says version 2 is 30 s old, young enough that a missing successor would be trusted
    # by a probe. TGBs are 30 s old: beyond this reclaimer's grace of 5 s.
    store.delete_many([f"{NS}/{manifest_key(v)}" for v in range(4)])
    clock.advance(30)
    keys = {m.key for m in store.list(f"{NS}/data/")}

    report = reclaimer.run_once()
    assert report.latest_version == newest
    assert report.orphans_deleted == 0
    assert {m.key for m in store.list(f"{NS}/data/")} == keys  # steps 2..4 are referenced
    with bw.Consumer(store, NS, mesh=MESH, dp_rank=0, start_step=0, timeout=0) as consumer:
        assert [next(consumer)[0] for _ in range(5)] == [0, 1, 2, 3, 4]


def test_a_pass_after_the_namespace_was_deleted_reports_it_missing() -> None:
    clock = FakeClock()
    store = MemoryStore("costs", clock=clock)
    Writer(store, NS, MESH, clock=clock).publish(2)
    reclaimer = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)
    assert reclaimer.run_once().latest_version == 1
    store.delete_many([m.key for m in store.list(f"{NS}/")])
    report = reclaimer.run_once()
    assert (report.latest_version, report.objects_deleted) == (-1, 0)
    assert reclaimer.run_once().latest_version == -1


@pytest.mark.parametrize("new_versions", [3, 10, 14], ids=["fewer", "as-many", "more"])
@pytest.mark.parametrize("watermark", [False, True], ids=["no-watermark", "watermark"])
def test_a_pass_after_the_namespace_was_re_created_commits_and_deletes_nothing(
    new_versions: int, watermark: bool
) -> None:
    clock = FakeClock()
    store = MemoryStore("costs", clock=clock)
    old = Writer(store, NS, MESH, clock=clock)
    for _ in range(10):
        old.publish(1)  # versions 0..10
    reclaimer = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)
    assert reclaimer.run_once().latest_version == 10
    # The operator deletes the prefix and the job starts afresh (another namespace id).
    store.delete_many([m.key for m in store.list(f"{NS}/")])
    new = Writer(store, NS, MESH, producer_id="n0", clock=clock)
    for _ in range(new_versions):
        new.publish(1)
    if watermark:  # a cut to commit: it must not land on the old manifest either
        bw.Watermarks(store, NS, clock=clock).record("ckpt", 2, version=new.base.version)
    clock.advance(10 * GRACE)  # every new object is far older than the grace
    keys = sorted(m.key for m in store.list(f"{NS}/"))

    with pytest.raises(bw.NamespaceMismatch, match="re-created"):
        reclaimer.run_once()
    assert sorted(m.key for m in store.list(f"{NS}/")) == keys  # nothing committed or deleted
    with bw.Consumer(store, NS, mesh=MESH, dp_rank=0, start_step=0, timeout=0) as consumer:
        assert [next(consumer)[0] for _ in range(new_versions)] == list(range(new_versions))
    # A new reclaimer (the operator's restart) serves the new namespace.
    fresh = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)
    assert fresh.run_once().latest_version == new.base.version + int(watermark)


class SegmentReads(StoreWrapper):
    """Counts the reads of each segment object."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.reads: dict[str, int] = {}

    def get_range(self, key: str, byte_range: object) -> bytes:  # type: ignore[override]
        if "/_segments/" in key:
            self.reads[key] = self.reads.get(key, 0) + 1
        return self.inner.get_range(key, byte_range)  # type: ignore[arg-type]


def test_a_pass_reads_only_the_segments_added_since_the_previous_pass() -> None:
    # A retained window longer than the log's bound on cached descriptors (small sizes stand
    # in for the defaults: 8 descriptors a segment, 100 steps retained).
    clock = FakeClock()
    inner = MemoryStore("costs", clock=clock)
    sizes = {"tail_limit": 4, "max_segment_tgbs": 8}
    writer = Writer(inner, NS, MESH, clock=clock)
    writer.log = ManifestLog(inner, NS, clock=clock, monotonic=clock, **sizes)
    writer.base = writer.log.latest()
    for _ in range(100):
        writer.publish(1)
    marks = bw.Watermarks(inner, NS, clock=clock)
    marks.record("keep", 0, version=0)  # everything retained
    store = SegmentReads(inner)
    log = ManifestLog(store, NS, clock=clock, **sizes)
    reclaimer = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None, log=log)
    reclaimer.run_once()
    before = writer.base
    for _ in range(12):  # tails roll and segments merge on the way
        writer.publish(1)
        clock.advance(30)
        store.reads.clear()
        report = reclaimer.run_once()
        assert (report.tgbs_deleted, report.orphans_deleted) == (0, 0)  # segments merged away go
        added = {log.key(ref.key) for ref in writer.base.segments} - {
            log.key(ref.key) for ref in before.segments
        }
        assert set(store.reads) <= added, (store.reads, added)
        assert all(n == 1 for n in store.reads.values()), store.reads
        before = writer.base

    # A cut inside a segment: the steps below it go, every step from it stays readable.
    marks.record("keep", 50, version=writer.base.version)
    keys = {m.key for m in inner.list(f"{NS}/data/")}
    report = reclaimer.run_once()
    assert (report.base_step_after, report.tgbs_deleted, report.orphans_deleted) == (50, 50, 0)
    assert len({m.key for m in inner.list(f"{NS}/data/")}) == len(keys) - 50
    with bw.Consumer(inner, NS, mesh=MESH, dp_rank=0, start_step=50, timeout=0) as consumer:
        assert [next(consumer)[0] for _ in range(62)] == list(range(50, 112))

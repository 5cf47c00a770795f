"""What a reclaimer pass costs in a long run, and that the cheaper lookup stays safe.

A pass lists ``_manifests/`` once (after its cut, to decide what to delete); the latest version
it commits the cut on is found from the previous pass's latest by listing only the versions
after it. So a namespace retaining thousands of versions is not listed twice per pass. That
lookup trusts no clock: a pass whose previous latest (and its successor) were deleted meanwhile,
with the clock stepped back so that version looks young, still sees every step committed since.
"""

from __future__ import annotations

from collections.abc import Iterator

from _reclaimer_worker import FakeClock, Writer

import batchweave as bw
from batchweave import MemoryStore, StoreWrapper
from batchweave._manifest import Committed, Manifest, ManifestLog, manifest_key
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


def commit_empty(log: ManifestLog, head: Manifest, count: int) -> Manifest:
    for _ in range(count):
        result = log.commit(head)
        assert isinstance(result, Committed)
        head = result.manifest
    return head


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

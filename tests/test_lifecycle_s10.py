"""Operator-facing gaps in the lifecycle layer.

- A reclaim pass (mostly LIST and 1,000-key batch deletes) ran for minutes with no output: the
  reclaimer now reports :class:`batchweave.ReclaimProgress` and ``batchweave reclaim`` shows it.
- ``Watermarks.live()`` retook a stale listing up to 10 times without pausing: it now backs
  off (injectable ``sleep``) and names the namespace and what to do when it gives up.
- The metrics collector read another class's private ``_closed``: producers and consumers now
  have a public ``closed`` property.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
from _reclaimer_worker import FakeClock, Writer
from click.testing import CliRunner
from fake_time import FakeTime
from prometheus_client import CollectorRegistry

import batchweave as bw
import batchweave._metrics
from batchweave._store._base import ObjectMeta
from batchweave.cli._app import cli
from batchweave.cli._reclaim import ProgressLines, describe_progress

NS = "runs/s10"
GRACE = 100.0
MESH = bw.Mesh(dp=2, cp=1)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> bw.MemoryStore:
    return bw.MemoryStore("s10", clock=clock)


def reclaimable(store: bw.ObjectStore, clock: FakeClock, steps: int, boundary: int) -> Writer:
    """``steps`` committed TGBs, a watermark at ``boundary``, two orphans past the grace."""
    writer = Writer(store, NS, MESH)
    writer.publish(steps)
    writer.orphan()
    writer.orphan()
    bw.Watermarks(store, NS).record("ckpt", step=boundary)
    clock.advance(2 * GRACE + 1)
    return writer


# -- reclaim progress ----------------------------------------------------------------------------


def test_a_pass_reports_each_phase_and_every_delete_batch(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    reclaimable(store, clock, steps=10, boundary=9)
    seen: list[bw.ReclaimProgress] = []
    reclaimer = bw.Reclaimer(
        store,
        NS,
        grace=GRACE,
        clock=clock,
        sleep=lambda _: None,
        delete_batch=4,
        progress=seen.append,
    )
    report = reclaimer.run_once()
    assert report.tgbs_deleted == 9
    assert report.orphans_deleted == 2

    phases = list(dict.fromkeys(p.phase for p in seen))
    for earlier, later in [
        ("reading watermarks", "committing base_step"),
        ("committing base_step", "listing _manifests/"),
        ("listing _manifests/", "listing data/"),
        ("listing data/", "deleting TGBs"),
        ("deleting TGBs", "deleting orphans"),
        ("deleting orphans", "listing _segments/"),
    ]:
        assert phases.index(earlier) < phases.index(later), phases
    assert phases[-1] == "done"
    # one report as the phase begins, then one per delete request of at most 4 keys
    tgbs = [(p.phase_done, p.phase_total) for p in seen if p.phase == "deleting TGBs"]
    assert tgbs == [(0, 9), (4, 9), (8, 9), (9, 9)]
    assert all(p.phase_total is None for p in seen if p.phase.startswith("listing"))
    # running totals only grow, and the last report is the report's totals
    for before, after in itertools.pairwise(seen):
        assert after.keys_listed >= before.keys_listed
        assert after.objects_deleted >= before.objects_deleted
        assert after.bytes_deleted >= before.bytes_deleted
    last = seen[-1]
    assert last.objects_deleted == report.objects_deleted
    assert last.bytes_deleted == report.bytes_deleted > 0
    assert last.keys_listed == report.keys_listed
    # data/ held 10 TGBs and 2 orphans; _manifests/ at least the versions written
    assert report.keys_listed >= 12 + report.latest_version + 1


def test_a_long_listing_reports_every_thousand_keys(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    Writer(store, NS, MESH).publish(1)
    for i in range(2500):  # not BatchWeave's names: listed, never deleted
        store.put(f"{NS}/data/other-tool/{i:05d}.bin", b"x")
    listed: list[int] = []

    def progress(p: bw.ReclaimProgress) -> None:
        if p.phase == "listing data/":
            listed.append(p.keys_listed)

    bw.Reclaimer(
        store, NS, grace=GRACE, clock=clock, sleep=lambda _: None, progress=progress
    ).run_once()
    before = listed[0]  # keys of _manifests/ listed earlier in the pass
    assert [n for n in listed[1:] if n % 1000 == 0] == [
        n for n in range(1000, before + 2501, 1000) if n > before
    ]
    assert listed[-1] == before + 2501
    assert len(list(store.list(f"{NS}/data/other-tool/"))) == 2500


def test_a_progress_callback_that_raises_stops_the_pass_and_the_next_finishes(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    reclaimable(store, clock, steps=6, boundary=6)

    def interrupt(p: bw.ReclaimProgress) -> None:
        if p.phase == "deleting TGBs" and p.phase_done >= 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bw.Reclaimer(
            store,
            NS,
            grace=GRACE,
            clock=clock,
            sleep=lambda _: None,
            delete_batch=2,
            progress=interrupt,
        ).run_once()
    assert len(list(store.list(f"{NS}/data/"))) == 6 + 2 - 2
    report = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None).run_once()
    assert list(store.list(f"{NS}/data/")) == []
    assert report.base_step_after == 6


class RefuseOne(bw.StoreWrapper):
    def __init__(self, inner: bw.ObjectStore, refused: str) -> None:
        super().__init__(inner)
        self.refused = refused

    def delete_many(self, keys: Iterable[str]) -> None:
        names = list(keys)
        if self.refused in names:
            raise bw.AccessDenied(f"{self.refused}: access denied")
        super().delete_many(names)


def reclaimer_refusing_one_tgb(
    store: bw.MemoryStore, clock: FakeClock, progress: Callable[[bw.ReclaimProgress], None]
) -> bw.Reclaimer:
    """Five reclaimable steps, in a store that refuses to delete the first TGB object."""
    reclaimable(store, clock, steps=5, boundary=5)
    locked = sorted(m.key for m in store.list(f"{NS}/data/w0/"))[0]
    return bw.Reclaimer(
        RefuseOne(store, locked),
        NS,
        grace=GRACE,
        clock=clock,
        sleep=lambda _: None,
        progress=progress,
    )


def test_a_refused_key_counts_as_handled_but_not_deleted(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    seen: list[bw.ReclaimProgress] = []
    reclaimer = reclaimer_refusing_one_tgb(store, clock, seen.append)
    with pytest.raises(bw.AccessDenied, match="refused to delete 1 objects"):
        reclaimer.run_once()
    tgbs = [p for p in seen if p.phase == "deleting TGBs"]
    assert (tgbs[-1].phase_done, tgbs[-1].phase_total) == (5, 5)
    assert seen[-1].phase == "done"  # reported before the pass raises
    assert reclaimer.last_report is not None
    assert reclaimer.last_report.tgbs_deleted == 4
    assert seen[-1].objects_deleted == reclaimer.last_report.objects_deleted


def test_a_callback_failing_at_the_end_does_not_hide_the_refused_keys(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    def display(progress: bw.ReclaimProgress) -> None:
        if progress.phase == "done":
            raise RuntimeError("the terminal went away")

    reclaimer = reclaimer_refusing_one_tgb(store, clock, display)
    with pytest.raises(bw.AccessDenied, match="refused to delete 1 objects"):
        reclaimer.run_once()


def test_a_pass_ends_with_an_info_summary_and_a_no_op_pass_only_at_debug(
    store: bw.MemoryStore, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    reclaimable(store, clock, steps=4, boundary=3)
    caplog.set_level(logging.DEBUG, logger="batchweave.lifecycle")
    reclaimer = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)
    report = reclaimer.run_once()
    done = [r for r in caplog.records if "reclaim pass done" in r.getMessage()]
    assert [r.levelno for r in done] == [logging.INFO]
    message = done[0].getMessage()
    assert f"{store.url}/{NS}" in message
    assert "base_step 0 -> 3" in message
    assert f"listed {report.keys_listed} keys" in message
    assert f"{report.bytes_deleted} bytes" in message

    caplog.clear()
    reclaimer.run_once()  # nothing left to do: routine for a background thread
    done = [r for r in caplog.records if "reclaim pass done" in r.getMessage()]
    assert [r.levelno for r in done] == [logging.DEBUG]


# -- the reclaim command ---------------------------------------------------------------------------


def file_store(tmp_path: Path) -> Path:
    root = tmp_path / "store"
    root.mkdir()
    store = bw.open_store(root.as_uri())
    writer = Writer(store, NS, MESH)
    writer.publish(6)
    bw.Watermarks(store, NS).record("ckpt", step=4)
    return root


def test_the_command_prints_progress_lines_when_asked_and_keeps_json_clean(
    tmp_path: Path,
) -> None:
    root = file_store(tmp_path)
    result = CliRunner().invoke(
        cli, ["reclaim", str(root), NS, "--grace", "0", "--json", "--progress"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["tgbs_deleted"] == 4
    lines = result.stderr.splitlines()
    assert any(line.startswith("reclaiming: listing data/:") for line in lines), lines
    assert any(line.startswith("reclaiming: deleting TGBs:") for line in lines), lines
    assert lines[-1].startswith("reclaiming: done: ")
    assert f"{report['objects_deleted']} objects deleted" in lines[-1]
    assert f"{report['keys_listed']} keys listed" in lines[-1]


def test_the_command_is_silent_off_a_terminal_by_default_and_says_how_long_it_took(
    tmp_path: Path,
) -> None:
    root = file_store(tmp_path)
    quiet = CliRunner().invoke(cli, ["reclaim", str(root), NS, "--grace", "0"])
    assert quiet.exit_code == 0, quiet.output
    assert quiet.stderr == ""
    assert "took" in quiet.stdout


def test_the_command_shows_a_live_line_on_a_terminal(tmp_path: Path) -> None:
    from test_cli_operator_review import run_on_terminal

    root = file_store(tmp_path)
    status, stdout, terminal = run_on_terminal("reclaim", str(root), NS, "--grace", "0")
    assert status == 0, (stdout, terminal)
    assert "reclaiming" in terminal
    assert "reclaiming" not in stdout
    assert "TGB objects" in stdout


def test_progress_lines_come_at_each_phase_and_at_most_every_interval() -> None:
    fake = FakeTime()
    printed: list[str] = []
    lines = ProgressLines(printed.append, clock=fake.clock, interval=10.0)

    def at(phase: str, deleted: int) -> None:
        lines(bw.ReclaimProgress(phase, keys_listed=5, objects_deleted=deleted, bytes_deleted=0))

    at("listing data/", 0)
    fake.advance(3)
    at("listing data/", 0)  # same phase, 3 s later: dropped
    at("deleting TGBs", 0)  # a new phase: printed
    fake.advance(9.9)
    at("deleting TGBs", 1000)
    fake.advance(0.1)
    at("deleting TGBs", 2000)  # 10 s since the last line
    at("done", 2000)
    assert [line.split(":")[1].strip() for line in printed] == [
        "listing data/",
        "deleting TGBs",
        "deleting TGBs",
        "done",
    ]
    assert "2,000 objects deleted" in printed[2]


def test_describe_progress_names_the_share_of_a_deleting_phase() -> None:
    text = describe_progress(
        bw.ReclaimProgress(
            "deleting TGBs",
            keys_listed=12_345,
            objects_deleted=3000,
            bytes_deleted=3 << 30,
            phase_done=2000,
            phase_total=9000,
        )
    )
    assert text == (
        "deleting TGBs: 12,345 keys listed, 3,000 objects deleted (3.0 GiB), "
        "2,000 of 9,000 in this phase"
    )


# -- watermark listings that lag ---------------------------------------------------------------


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
    assert store.lists == 4
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
    report = bw.Reclaimer(store, NS, grace=GRACE, sleep=fake.sleep).run_once()
    assert report.watermarks == 1
    assert fake.sleeps == [0.05, 0.1]


# -- metrics use public state only ------------------------------------------------------------


def test_producers_and_consumers_say_whether_they_are_closed() -> None:
    store = bw.MemoryStore()
    producer = bw.Producer(store, "ns", producer_id="p0", mesh=bw.Mesh(dp=1))
    assert producer.closed is False
    producer.append([b"x"], offset=0)
    producer.close()
    assert producer.closed is True
    consumer = bw.Consumer(store, "ns", mesh=bw.Mesh(dp=1), dp_rank=0, timeout=0)
    assert consumer.closed is False
    consumer.close()
    assert consumer.closed is True


def test_the_collector_prefers_the_open_producer_without_private_attributes() -> None:
    assert "_closed" not in inspect.getsource(batchweave._metrics)
    registry = CollectorRegistry()
    store = bw.MemoryStore()
    closed = bw.Producer(store, "ns", producer_id="p0", mesh=bw.Mesh(dp=1))
    closed.close()
    live = bw.Producer(store, "ns", producer_id="p0", mesh=bw.Mesh(dp=1))
    try:
        bw.track_metrics(live, registry=registry)
        bw.track_metrics(closed, registry=registry)  # tracked last, but closed: not exported
        live.append([b"x"], offset=0)
        live.flush()
        labels = {"namespace": "ns", "producer_id": "p0"}
        assert registry.get_sample_value("batchweave_tgbs_published_total", labels) == 1.0
    finally:
        live.close()

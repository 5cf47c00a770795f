"""Lifecycle and CLI bugs found by a bug hunt; each test fails on the code before its fix.

- ``checkpoint_hook`` failed on rank 0 alone (the other ranks returned ``None`` and would wait
  at the next collective for ever) for an id outside ``Watermarks(scope=...)``, a malformed
  ``state`` and a ``state`` of another namespace.
- ``checkpoint_hook`` compared namespace names only: a staging consumer recorded its steps in
  prod's watermarks (same namespace name, another store) and prod's reclaimer then deleted steps
  prod's trainer needed.
- ``batchweave inspect`` failed outright on a time outside ``datetime``'s range (a watermark or a
  producer commit written with a clock in ms or ns).
- One damaged *old* manifest version made every ``batchweave reclaim`` pass fail with
  ``ChecksumMismatch``, deleting nothing, run after run.
- A damaged *newest* version made ``reclaim``, ``inspect``, ``seal`` and ``retire`` print only
  "...; the object is corrupt", with no next step.
- One damaged segment lying entirely below the committed cut (needed by no reader) made every
  reclaim pass fail with ``ChecksumMismatch`` after committing its cut: nothing was deleted
  again. A damaged segment the latest version lists still stops the pass, now saying so.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest
from _reclaimer_worker import FakeClock, Writer, expected_slice
from click.testing import CliRunner
from manifest_helpers import body, envelope

import batchweave as bw
from batchweave import ChecksumMismatch, ConsumerError, FormatError, NamespaceMismatch
from batchweave._manifest import ManifestLog, manifest_key
from batchweave.cli._app import cli

NS = "runs/hook"
MESH = bw.Mesh(dp=2, cp=1)
ONE = bw.Mesh(dp=1, cp=1)
GRACE = 150.0


class Clock:
    """Wall-clock seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0

    def __call__(self) -> float:
        return self.now


def publish(store: bw.ObjectStore, namespace: str, steps: int, mesh: bw.Mesh = MESH) -> None:
    with bw.Producer(store, namespace, producer_id="p", mesh=mesh) as producer:
        for offset in range(steps):
            producer.append([b"%d" % offset] * mesh.slices, offset=offset)


def consumer_at(store: bw.ObjectStore, namespace: str, rank: int, steps: int = 1) -> bw.Consumer:
    consumer = bw.Consumer(store, namespace, mesh=MESH, dp_rank=rank, cp_rank=0, timeout=0)
    for _ in range(steps):
        next(consumer)
    return consumer


def contents(store: bw.ObjectStore, namespace: str) -> dict[str, bytes]:
    return {meta.key: store.get(meta.key) for meta in store.list(f"{namespace}/")}


# -- checkpoint_hook: the same error on every rank ------------------------------------------------


def _other_state(store: bw.ObjectStore) -> dict[str, Any]:
    with consumer_at(store, "runs/other", 0) as other:
        return other.state_dict()


def _copy_state(store: bw.ObjectStore) -> dict[str, Any]:
    """The state of a consumer of a copy of ``NS`` under another prefix: the same namespace id."""
    for meta in list(store.list(f"{NS}/")):
        store.put(f"{NS}-copy/" + meta.key.removeprefix(f"{NS}/"), store.get(meta.key))
    with consumer_at(store, f"{NS}-copy", 0) as copy:
        return copy.state_dict()


_CASES: dict[str, tuple[type[Exception], str, Callable[[bw.ObjectStore], Any]]] = {
    # name: (error, match, (store -> (watermarks scope, checkpoint id, state)))
    "id outside the scope": (
        ValueError,
        r"checkpoint_id 'step-1' is outside this reader's scope 'train-'",
        lambda store: ("train-", "step-1", None),
    ),
    "malformed state": (
        ConsumerError,
        r"not a BatchWeave consumer state",
        lambda store: (None, "step-1", {"step": "garbage"}),
    ),
    "state of another namespace": (
        NamespaceMismatch,
        r"state belongs to namespace 'runs/other'",
        lambda store: (None, "step-1", _other_state(store)),
    ),
    # Before: the ids agree, so rank 0 recorded a watermark from the copy's state in NS.
    "state of a copy of the namespace": (
        NamespaceMismatch,
        rf"reads namespace '{NS}' .*state belongs to namespace '{NS}-copy'.*"
        rf"state\[\"namespace\"\] = '{NS}'",
        lambda store: (None, "step-1", _copy_state(store)),
    ),
}


@pytest.mark.parametrize("case", sorted(_CASES))
def test_the_hook_fails_on_every_rank_when_rank_0_would_fail(case: str) -> None:
    # Before the fix: rank 0 raised ValueError / ConsumerError / NamespaceMismatch, rank 1
    # returned None (and would have waited at the next collective for rank 0 for ever).
    inner = bw.MemoryStore()
    for ns in (NS, "runs/other"):
        publish(inner, ns, 4)
    error, match, make = _CASES[case]
    scope, checkpoint_id, state = make(inner)
    store = bw.CountingStore(inner)
    marks = bw.Watermarks(store, NS, scope=scope)
    for rank in (0, 1):
        with consumer_at(store, NS, rank) as consumer:
            before = store.snapshot()
            with pytest.raises(error, match=match):
                bw.checkpoint_hook(consumer, marks, checkpoint_id, state=state, rank=rank)
            if rank:
                assert (store.snapshot() - before).requests == 0  # no extra request off rank 0
    assert marks.live() == []


def test_the_hook_takes_a_copy_state_renamed_on_purpose_or_one_without_a_name() -> None:
    # What load_state_dict accepts: a state renamed to the namespace it is used in (the
    # namespace was moved), and one from before states recorded their namespace's name.
    store = bw.MemoryStore()
    publish(store, NS, 4)
    state = _copy_state(store)
    marks = bw.Watermarks(store, NS)
    with consumer_at(store, NS, 0) as consumer:
        bw.checkpoint_hook(consumer, marks, "moved", state={**state, "namespace": NS}, rank=0)
        legacy = {k: v for k, v in state.items() if k != "namespace"}
        bw.checkpoint_hook(consumer, marks, "legacy", state=legacy, rank=0)
    assert sorted((m.checkpoint_id, m.step) for m in marks.live()) == [("legacy", 1), ("moved", 1)]


def test_a_matching_state_and_scoped_id_still_record_on_rank_0_only() -> None:
    store = bw.MemoryStore()
    publish(store, NS, 4)
    marks = bw.Watermarks(store, NS, scope="train-")
    for rank in (1, 0):
        with consumer_at(store, NS, rank, steps=2) as consumer:
            state = consumer.state_dict()
            got = bw.checkpoint_hook(consumer, marks, "train-2", state=state, rank=rank)
        assert (got is None) == (rank == 1)
    assert [(m.checkpoint_id, m.step) for m in marks.live()] == [("train-2", 2)]


# -- checkpoint_hook: a same-named namespace in another store -----------------------------------


def test_the_hook_refuses_a_consumer_of_a_same_named_namespace_in_another_store() -> None:
    # Before the fix: staging's step 8 was recorded in prod's watermarks (releasing prod's own
    # with keep_last=1), and prod's reclaimer deleted the steps prod's trainer resumes at.
    prod, staging = bw.MemoryStore("prod"), bw.MemoryStore("staging")
    for store in (prod, staging):
        publish(store, NS, 10, ONE)
    marks = bw.Watermarks(prod, NS, keep_last=1)
    marks.record("step-000002", 2)
    before = contents(prod, NS)
    with bw.Consumer(staging, NS, mesh=ONE, dp_rank=0, cp_rank=0, timeout=0) as consumer:
        for _ in range(8):
            next(consumer)
        prod_id = ManifestLog(prod, NS).latest().namespace_id
        with pytest.raises(NamespaceMismatch) as caught:
            bw.checkpoint_hook(consumer, marks, "step-000008", rank=0)
        message = str(caught.value)
        for part in ("memory://staging", "memory://prod", consumer.namespace_id, prod_id):
            assert part is not None
            assert part in message
    assert contents(prod, NS) == before
    assert [(m.checkpoint_id, m.step) for m in marks.live()] == [("step-000002", 2)]


def test_the_namespace_id_is_looked_up_once_and_a_recreated_namespace_is_accepted() -> None:
    store = bw.CountingStore(bw.MemoryStore())
    publish(store, NS, 6)
    marks = bw.Watermarks(store, NS)
    with consumer_at(store, NS, 0, steps=2) as consumer:
        assert bw.checkpoint_hook(consumer, marks, "c-1", rank=0) is not None
        next(consumer)
        before = store.snapshot()
        for _ in range(3):
            assert bw.checkpoint_hook(consumer, marks, "c-2", rank=0) is not None
        spent = store.snapshot() - before
        assert spent.requests == spent.puts == 3  # the watermarks alone: the id is cached
    # The prefix deleted and the namespace created again (another id): found afresh, accepted.
    store.delete_many([meta.key for meta in store.list(f"{NS}/")])
    publish(store, NS, 4)
    with consumer_at(store, NS, 0) as consumer:
        assert bw.checkpoint_hook(consumer, marks, "c-3", rank=0) is not None


# -- inspect: times out of datetime's range --------------------------------------------------------


@pytest.mark.parametrize("recorded_at", [1.7e12, 1.7e18, 1e300])  # ms, ns, absurd
def test_inspect_shows_a_watermark_time_out_of_range_as_a_flagged_number(
    tmp_path: Path, recorded_at: float
) -> None:
    # Before the fix: exit 2 "year 58876 is out of range", "[Errno 75] Value too large", or an
    # OverflowError traceback (exit 1); nothing of the namespace was shown.
    store = bw.open_store(tmp_path.as_uri())
    publish(store, NS, 2, ONE)
    bw.Watermarks(store, NS, clock=lambda: recorded_at).record("ckpt-1", 1)
    runner = CliRunner()
    result = runner.invoke(cli, ["inspect", str(tmp_path), NS, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    (mark,) = data["watermarks"]
    assert mark["recorded_at"] == recorded_at  # still a number in the JSON
    assert isinstance(mark["age_seconds"], float)
    assert mark["age_seconds"] < 0
    assert data["next_step"] == 2
    assert data["boundary"] == 1
    result = runner.invoke(
        cli, ["inspect", str(tmp_path), NS], catch_exceptions=False, env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert f"{recorded_at!r} (clock skew?)" in result.output
    assert "storage by prefix" in result.output


def test_inspect_shows_a_producer_commit_time_in_ms_as_a_flagged_number(tmp_path: Path) -> None:
    store = bw.open_store(tmp_path.as_uri())
    millis = 1_700_000_000_000.0
    with bw.Producer(store, NS, producer_id="p", mesh=ONE, wall_clock=lambda: millis) as producer:
        producer.append([b"x"], offset=0)
    runner = CliRunner()
    result = runner.invoke(cli, ["inspect", str(tmp_path), NS, "--json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["producers"][0]["last_commit_at"] == millis
    assert data["created_at"] == millis
    result = runner.invoke(
        cli, ["inspect", str(tmp_path), NS], catch_exceptions=False, env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert f"{millis!r} (clock skew?)" in result.output
    assert "watermarks" in result.output
    assert "storage by prefix" in result.output


# -- reclaim: a damaged old manifest version -------------------------------------------------------


def damage(store: bw.ObjectStore, namespace: str, version: int) -> str:
    """Flip bytes in the middle of manifest ``version`` (bit rot); its key."""
    key = f"{namespace}/{manifest_key(version)}"
    data = bytearray(store.get(key))
    data[len(data) // 2 : len(data) // 2 + 3] = b"\xff\xff\xff"
    store.put(key, bytes(data))
    return key


def versions(store: bw.ObjectStore, namespace: str) -> list[int]:
    return sorted(
        int(m.key.rsplit("/", 1)[-1][:20]) for m in store.list(f"{namespace}/_manifests/")
    )


def test_a_damaged_old_version_does_not_stop_reclaiming(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before the fix every fresh pass (each `batchweave reclaim`) failed with ChecksumMismatch
    # finding the version a crashed pass's cut was committed on, and deleted nothing.
    clock = Clock()
    store = bw.MemoryStore(clock=clock)
    with bw.Producer(store, NS, producer_id="p", mesh=ONE, wall_clock=clock) as producer:
        for offset in range(40):
            producer.append([b"x" * 10], offset=offset)
            producer.flush()  # one version per step
    marks = bw.Watermarks(store, NS, clock=clock)
    marks.record("c1", 10, version=0)  # version 0: every manifest version is kept
    bw.Reclaimer(store, NS, grace=GRACE, clock=clock).run_once()
    marks.record("c1", 20, version=0)
    log = ManifestLog(store, NS, clock=clock)
    log.commit(log.latest(), base_step=20)  # a crashed pass: cut committed, nothing deleted
    stored = versions(store, NS)
    victim = damage(store, NS, stored[len(stored) // 2 - 1])
    with caplog.at_level(logging.WARNING, logger="batchweave.lifecycle"):
        report = bw.Reclaimer(store, NS, grace=GRACE, clock=clock).run_once()
    assert report.damaged_versions == 1
    assert report.tgbs_deleted == 10  # steps 10..19, below the committed cut
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(victim in w and "batchweave verify" in w for w in warnings), warnings
    assert len(list(store.list(f"{NS}/data/"))) == 20
    with bw.Consumer(store, NS, mesh=ONE, dp_rank=0, start_step=20, timeout=0) as consumer:
        assert [next(consumer)[0] for _ in range(20)] == list(range(20, 40))
    # and again, as the next `batchweave reclaim` would
    assert bw.Reclaimer(store, NS, grace=GRACE, clock=clock).run_once().damaged_versions == 1


def test_a_damaged_settled_version_keeps_segments_but_older_versions_go() -> None:
    # Before the fix the pass failed with ChecksumMismatch reading the version that was latest
    # metadata_grace ago, so no old version (the damaged one included, later) was ever deleted.
    clock = Clock()
    store = bw.MemoryStore(clock=clock)
    with bw.Producer(store, NS, producer_id="p", mesh=ONE, wall_clock=clock) as producer:
        for offset in range(12):
            producer.append([b"x"], offset=offset)
            producer.flush()
        settled = versions(store, NS)[-1]
        victim = damage(store, NS, settled)
        clock.now += 10 * GRACE
        producer.append([b"x"], offset=12)  # a newer latest; the damaged one settled before it
    bw.Watermarks(store, NS, clock=clock).record("c1", 0)  # at the latest version
    segments = {m.key for m in store.list(f"{NS}/_segments/")}
    report = bw.Reclaimer(store, NS, grace=GRACE, clock=clock).run_once()
    assert report.damaged_versions == 1
    assert report.manifests_deleted == settled  # every version below the damaged one
    assert versions(store, NS) == [settled, settled + 1]
    assert report.segments_deleted == 0  # what readers of the damaged version hold is unknown
    assert {m.key for m in store.list(f"{NS}/_segments/")} == segments
    assert victim in {m.key for m in store.list(f"{NS}/_manifests/")}


def test_a_damaged_newest_version_still_stops_the_pass_naming_it() -> None:
    clock = Clock()
    store = bw.MemoryStore(clock=clock)
    publish(store, NS, 6, ONE)
    bw.Watermarks(store, NS, clock=clock).record("c1", 3)
    key = damage(store, NS, versions(store, NS)[-1])
    before = contents(store, NS)
    with pytest.raises(FormatError, match=r"the newest manifest version cannot be read") as caught:
        bw.Reclaimer(store, NS, grace=GRACE, clock=clock).run_once()
    assert key in str(caught.value)
    assert "batchweave verify" in str(caught.value)
    assert contents(store, NS) == before


# -- reclaim: a damaged segment ----------------------------------------------------------------


def segmented(store: bw.MemoryStore, clock: FakeClock) -> Writer:
    """Steps 0..11 in three segments (0..3, 4..7, 8..11) and an inline tail, one orphan."""
    writer = Writer(store, NS, MESH, clock=clock)
    writer.log = ManifestLog(store, NS, tail_limit=3, clock=clock, monotonic=clock)
    for _ in range(6):
        writer.publish(2)
    writer.orphan()
    starts = [(ref.first_step, ref.end_step) for ref in ManifestLog(store, NS).latest().segments]
    assert starts == [(0, 4), (4, 8), (8, 12)]
    return writer


def damage_segment(store: bw.ObjectStore, index: int) -> str:
    """Flip a byte of segment ``index`` of the latest version (bit rot); its key."""
    ref = ManifestLog(store, NS).latest().segments[index]
    key = f"{NS}/{ref.key}"
    data = bytearray(store.get(key))
    data[-5] ^= 0xFF
    store.put(key, bytes(data))
    return key


def tgb_steps(store: bw.ObjectStore) -> list[int]:
    """Steps (offsets) whose TGB object is still stored; orphans count as 10**9 and above."""
    return sorted(int(m.key.rsplit("/", 1)[-1][:20]) for m in store.list(f"{NS}/data/"))


def test_a_damaged_segment_below_the_cut_does_not_stop_reclaiming(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Before the fix every pass (a fresh Reclaimer too) committed its cut, then failed with
    # ChecksumMismatch reading the segment of steps 0..3 to find their TGBs: no TGB, orphan,
    # segment or manifest was ever deleted again.
    clock = FakeClock()
    store = bw.MemoryStore(clock=clock)
    segmented(store, clock)
    victim = damage_segment(store, 0)
    bw.Watermarks(store, NS, clock=clock).record("c1", 6)
    reclaimer = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)
    with caplog.at_level(logging.WARNING, logger="batchweave.lifecycle"):
        report = reclaimer.run_once()
    assert report.base_step_after == 6
    assert report.damaged_segments == 1
    assert report.damaged_versions == 0
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(victim in w and "batchweave verify" in w for w in warnings), warnings
    # Steps 4 and 5 (a readable segment) go at once; the damaged segment's steps 0..3 are left
    # to the orphan rule, so they wait for the grace like an orphan.
    assert report.tgbs_deleted == 2
    assert tgb_steps(store)[:5] == [0, 1, 2, 3, 6]
    clock.advance(GRACE + 1)
    report = reclaimer.run_once()
    assert report.orphans_deleted == 5  # steps 0..3 and the upload never committed
    assert tgb_steps(store) == list(range(6, 12))
    clock.advance(10 * GRACE)  # the segment rule: unlisted by every version readers may hold
    for _ in range(2):
        report = bw.Reclaimer(store, NS, grace=GRACE, clock=clock).run_once()
    assert victim not in {m.key for m in store.list(f"{NS}/_segments/")}
    # Nothing the watermark needs went: every step from it on reads back, checksums verified.
    for rank in range(MESH.dp):
        with bw.Consumer(
            store, NS, mesh=MESH, dp_rank=rank, cp_rank=0, start_step=6, timeout=0
        ) as consumer:
            got = [next(consumer) for _ in range(6)]
        assert [step for step, _ in got] == list(range(6, 12))
        assert [data for _, data in got] == [expected_slice("w0", s, rank) for s in range(6, 12)]


def test_a_damaged_segment_the_latest_version_lists_stops_the_pass_saying_what_to_do() -> None:
    # It still stops the pass (its objects would look unreferenced), but the raw error said only
    # "...; the object is corrupt": not that nothing was deleted, nor what to do.
    clock = FakeClock()
    store = bw.MemoryStore(clock=clock)
    segmented(store, clock)
    victim = damage_segment(store, 1)  # steps 4..7, above the cut
    bw.Watermarks(store, NS, clock=clock).record("c1", 2)
    clock.advance(10 * GRACE)
    data = {m.key for m in store.list(f"{NS}/data/")}
    segments = {m.key for m in store.list(f"{NS}/_segments/")}
    reclaimer = bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)
    with pytest.raises(ChecksumMismatch) as caught:
        reclaimer.run_once()
    message = str(caught.value)
    assert isinstance(caught.value.__cause__, ChecksumMismatch)
    assert victim in message
    assert "the latest" in message
    assert "TGB steps 4..7" in message
    assert "This pass deletes nothing" in message
    assert f"batchweave verify {store.url} {NS}" in message
    assert "backup" in message
    assert {m.key for m in store.list(f"{NS}/data/")} == data
    assert {m.key for m in store.list(f"{NS}/_segments/")} == segments


@pytest.mark.parametrize("reading", [float("nan"), float("inf"), None, True])
def test_a_watermark_clock_that_is_not_finite_seconds_is_refused_before_anything_is_written(
    reading: Any,
) -> None:
    # JSON has no nan or inf: the watermark was written with recorded_at null, and every reclaim
    # pass then stopped on an object it could not decode.
    store = bw.MemoryStore()
    publish(store, NS, 2)
    marks = bw.Watermarks(store, NS, clock=lambda: reading)
    before = contents(store, NS)
    with pytest.raises(ValueError, match=r"clock returned .* finite wall-clock seconds"):
        marks.record("step-1", 1)
    assert contents(store, NS) == before
    assert bw.Watermarks(store, NS).live() == []


def test_the_reclaim_command_shows_skipped_damaged_versions(tmp_path: Path) -> None:
    store = bw.FileStore(tmp_path)
    with bw.Producer(store, NS, producer_id="p", mesh=ONE) as producer:
        for offset in range(40):
            producer.append([b"x" * 10], offset=offset)
            producer.flush()  # one version per step
    marks = bw.Watermarks(store, NS)
    marks.record("c1", 10, version=0)  # version 0: every manifest version is kept
    bw.Reclaimer(store, NS).run_once()
    marks.record("c1", 20, version=0)
    log = ManifestLog(store, NS)
    log.commit(log.latest(), base_step=20)  # a crashed pass: cut committed, nothing deleted
    stored = versions(store, NS)
    damage(store, NS, stored[len(stored) // 2 - 1])
    result = CliRunner().invoke(cli, ["reclaim", str(tmp_path), NS])
    assert result.exit_code == 0, result.output
    assert "damaged versions" in result.output
    assert "1 skipped" in result.output
    assert "batchweave verify" in result.output


def test_the_reclaim_command_shows_skipped_damaged_segments(tmp_path: Path) -> None:
    store = bw.FileStore(tmp_path)
    with bw.Producer(store, NS, producer_id="p", mesh=ONE, tail_limit=3) as producer:
        for offset in range(12):
            producer.append([b"x" * 10], offset=offset)
            producer.flush()
    segments = ManifestLog(store, NS).latest().segments
    assert len(segments) >= 2, "the run must have rolled segments"
    damage_segment(store, 0)
    bw.Watermarks(store, NS).record("c1", segments[0].end_step)
    result = CliRunner().invoke(cli, ["reclaim", str(tmp_path), NS])
    assert result.exit_code == 0, result.output
    assert "damaged segments" in result.output
    assert "1 skipped" in result.output


@pytest.mark.parametrize(
    "command", [["reclaim"], ["inspect"], ["seal"], ["retire"], ["retire", "--dry-run"]]
)
def test_every_command_says_what_to_do_about_a_damaged_newest_version(
    tmp_path: Path, command: list[str]
) -> None:
    # Before the fix each printed only "ChecksumMismatch: ...manifest checksum mismatch ...; the
    # object is corrupt": their first read of the namespace raised before anything added advice.
    store = bw.FileStore(tmp_path)
    publish(store, NS, 4, ONE)
    key = damage(store, NS, versions(store, NS)[-1])
    before = contents(store, NS)
    result = CliRunner().invoke(cli, [command[0], str(tmp_path), NS, *command[1:]])
    assert result.exit_code == 2, result.output
    line = " ".join(result.output.split())
    assert line.startswith("batchweave: error: ChecksumMismatch: "), line
    assert key in line
    assert f"run `batchweave verify {store.url} {NS}`" in line
    assert "restore that manifest version from a backup, or continue in a new namespace" in line
    assert contents(store, NS) == before


def test_advice_is_added_once_and_never_to_a_newer_releases_manifest(tmp_path: Path) -> None:
    store = bw.FileStore(tmp_path)
    publish(store, NS, 4, ONE)
    bw.Watermarks(store, NS).record("c1", 2)
    damage(store, NS, versions(store, NS)[-1])
    from batchweave.cli._common import manifest_advice  # new with the fix

    ctx = click.Context(cli)
    # The reclaimer's own advice is not repeated.
    with pytest.raises(FormatError) as caught:
        bw.Reclaimer(store, NS).run_once()
    line = f"ChecksumMismatch: {caught.value}"
    assert manifest_advice(ctx, caught.value, line) == line
    newer = bw.UnsupportedFormatVersion(
        f"{NS}/{manifest_key(3)}: manifest format 9 was written by a newer BatchWeave; upgrade"
    )
    assert manifest_advice(ctx, newer, str(newer)) == str(newer)
    other = FormatError(f"{NS}/data/p/1/x.tgb: the object is corrupt")
    assert manifest_advice(ctx, other, str(other)) == str(other)


def test_a_reader_wrapping_the_consumer_state_in_its_own_is_still_accepted() -> None:
    # checkpoint_hook takes any reader with resume_tgb_step and manifest_version; the every-rank
    # state check is for BatchWeave's own readers, whose states are consumer states. It refused
    # a wrapper whose state holds the consumer's under a key of its own.
    store = bw.MemoryStore()
    publish(store, NS, 4, ONE)

    class Wrapper:
        def __init__(self, consumer: bw.Consumer) -> None:
            self.inner = consumer
            self.namespace = consumer.namespace

        @property
        def manifest_version(self) -> int | None:
            return self.inner.manifest_version

        def state_dict(self) -> dict[str, Any]:
            return {"consumer": self.inner.state_dict(), "epoch": 3}

        def resume_tgb_step(self, state: dict[str, Any] | None = None) -> int:
            return self.inner.resume_tgb_step(None if state is None else state["consumer"])

    consumer = bw.Consumer(store, NS, mesh=ONE, dp_rank=0, cp_rank=0, timeout=0)
    next(consumer)
    wrapper = Wrapper(consumer)
    marks = bw.Watermarks(store, NS)
    state = wrapper.state_dict()
    assert bw.checkpoint_hook(wrapper, marks, "ckpt-1", state=state, rank=1) is None
    mark = bw.checkpoint_hook(wrapper, marks, "ckpt-1", state=state, rank=0)
    assert mark is not None
    assert mark.step == 1


def test_a_newest_version_written_by_a_newer_batchweave_says_upgrade_not_restore(
    tmp_path: Path,
) -> None:
    # The damaged-version handling caught UnsupportedFormatVersion with the other FormatErrors
    # and told the operator to restore a healthy object from a backup.
    store = bw.FileStore(tmp_path)
    publish(store, NS, 3, ONE)
    newest = ManifestLog(store, NS).latest()
    doc = json.loads(body(store.get(f"{NS}/{manifest_key(newest.version)}")))
    doc.update(format=99, version=newest.version + 1, parent=newest.version, commit_id="f" * 32)
    data = envelope(json.dumps(doc, separators=(",", ":")).encode())
    store.put_if_absent(f"{NS}/{manifest_key(newest.version + 1)}", data)
    with pytest.raises(bw.UnsupportedFormatVersion) as caught:
        bw.Reclaimer(store, NS).run_once()
    assert "upgrade batchweave" in str(caught.value)
    assert "backup" not in str(caught.value)


# -- a watermark of a history that went back (an older backup of _manifests/ restored) ------------


def test_a_watermark_past_the_restored_history_stops_the_pass_instead_of_cutting() -> None:
    """Before: the cut was capped at ``next_step`` (and later, once producers re-grew the history,
    set to the stale watermark): steps nobody read were deleted."""
    store = bw.MemoryStore()
    publish(store, NS, 3, ONE)
    backup = {k: v for k, v in contents(store, NS).items() if "/_manifests/" in k}
    with bw.Producer(store, NS, producer_id="p", mesh=ONE) as producer:
        for offset in range(producer.resume_offset, 6):
            producer.append([b"%d" % offset], offset=offset)
    with bw.Consumer(store, NS, mesh=ONE, dp_rank=0, cp_rank=0, timeout=0) as consumer:
        for _ in range(5):
            next(consumer)
        mark = bw.checkpoint_hook(consumer, bw.Watermarks(store, NS), "ck-5")
    assert mark is not None
    assert mark.step == 5
    store.delete_many([k for k in contents(store, NS) if "/_manifests/" in k])
    for key, data in backup.items():
        store.put(key, data)
    before = contents(store, NS)
    reclaimer = bw.Reclaimer(store, NS, grace=0.0)
    with pytest.raises(FormatError) as info:
        reclaimer.run_once()
    message = str(info.value)
    for said in ("'ck-5'", "step 5", "below 3", "went back", ".release('ck-5')", "restore"):
        assert said in message
    assert contents(store, NS) == before  # nothing committed, nothing deleted
    bw.Watermarks(store, NS).release("ck-5")  # the advice: a checkpoint of the lost history
    assert reclaimer.run_once().base_step_after == 0


def test_a_watermark_at_the_head_of_the_history_still_cuts_there() -> None:
    store = bw.MemoryStore()
    publish(store, NS, 4, ONE)
    bw.Watermarks(store, NS).record("ck-4", 4)
    assert bw.Reclaimer(store, NS, grace=0.0).run_once().base_step_after == 4

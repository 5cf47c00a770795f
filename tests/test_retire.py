"""Retiring producer ids: manifests forget ids whose streams are over, and nothing is lost.

The interleavings with running producers (zombies, crashes, ambiguous writes) are in the state
machine of ``test_producer_invariants.py``; these tests pin down the API, the CLI and the size
of the manifests.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from manifest_helpers import descriptor

import batchweave as bw
from batchweave._manifest import manifest_key
from batchweave._manifest._codec import encode_manifest
from batchweave._manifest._log import Committed, ManifestLog
from batchweave._manifest._models import ProducerState
from batchweave._retire import _decide
from batchweave.cli._verify import verify_namespace

MESH = bw.Mesh(dp=2, cp=1)
NS = "retire"
DAY = 86400.0


def publish(store: bw.ObjectStore, producer_id: str, offsets: range) -> None:
    with bw.Producer(store, NS, producer_id=producer_id, mesh=MESH) as producer:
        for offset in offsets:
            producer.append([b"%d" % offset, b"x"], offset=offset)


def later(days: float) -> float:
    """A wall clock ``days`` from now, as retire_producers sees it."""
    import time

    return time.time() + days * DAY


def steps(store: bw.ObjectStore) -> list[tuple[str, int]]:
    log = ManifestLog(store, NS)
    latest = log.latest()
    return [(d.producer_id, d.offset) for _, d in log.descriptors(latest, 0, latest.next_step)]


# -- the commit ---------------------------------------------------------------------------------


def test_a_retiring_commit_drops_the_states_and_keeps_every_step() -> None:
    log = ManifestLog(bw.MemoryStore(), NS)
    m0 = log.create_or_open(MESH)
    m1 = log.commit(m0, append=[descriptor("a", 0), descriptor("b", 0), descriptor("a", 1)])
    assert isinstance(m1, Committed)
    m2 = log.commit(m1.manifest, retire=["a", "never-started"])
    assert isinstance(m2, Committed)
    assert set(m2.manifest.producers) == {"b"}
    assert m2.manifest.next_step == 3
    assert [d.producer_id for _, d in log.descriptors(m2.manifest, 0, 3)] == ["a", "b", "a"]


def test_a_commit_cannot_retire_an_id_it_appends_or_updates() -> None:
    log = ManifestLog(bw.MemoryStore(), NS)
    m0 = log.create_or_open(MESH)
    with pytest.raises(ValueError, match=r"cannot retire producer id\(s\) \['a'\]"):
        log.commit(m0, append=[descriptor("a", 0)], retire=["a"])
    state = ProducerState(epoch=0, last_version=1)
    with pytest.raises(ValueError, match=r"\['b'\]"):
        log.commit(m0, producers={"b": state}, retire=["b"])
    with pytest.raises(TypeError, match="not the string 'ab'"):
        log.commit(m0, retire="ab")
    assert log.latest().version == 0


# -- retire_producers ---------------------------------------------------------------------------


def test_only_ids_idle_for_long_enough_are_retired() -> None:
    store = bw.MemoryStore()
    publish(store, "old", range(3))
    publish(store, "new", range(2))
    old_state = ManifestLog(store, NS).latest().producers["old"]
    # "old" last committed 2 days before the clock below, "new" 1 day before.
    clock = old_state.last_commit_at + 2 * DAY
    log = ManifestLog(store, NS)
    latest = log.latest()
    newer = {
        "new": latest.producers["new"].model_copy(update={"last_commit_at": clock - DAY}),
    }
    assert isinstance(log.commit(latest, producers=newer), Committed)

    report = bw.retire_producers(store, NS, idle_for=1.5 * DAY, wall_clock=lambda: clock)
    assert report.retired == ("old",)
    assert report.active == ("new",)
    assert report.remaining == 1
    latest = ManifestLog(store, NS).latest()
    assert report.version == latest.version
    assert set(latest.producers) == {"new"}
    assert steps(store) == [("old", 0), ("old", 1), ("old", 2), ("new", 0), ("new", 1)]


def test_dry_run_reports_without_committing_and_named_ids_limit_the_choice() -> None:
    store = bw.MemoryStore()
    for pid in ("a", "b", "c"):
        publish(store, pid, range(1))
    version = ManifestLog(store, NS).latest().version

    dry = bw.retire_producers(
        store, NS, idle_for=DAY, producer_ids=["a", "zz"], dry_run=True, wall_clock=lambda: later(2)
    )
    assert (dry.retired, dry.unknown, dry.version, dry.remaining) == (("a",), ("zz",), None, 2)
    assert dry.dry_run
    assert ManifestLog(store, NS).latest().version == version

    done = bw.retire_producers(
        store, NS, idle_for=DAY, producer_ids=["a", "b"], wall_clock=lambda: later(2)
    )
    assert done.retired == ("a", "b")
    assert set(ManifestLog(store, NS).latest().producers) == {"c"}


def test_bad_arguments_are_refused_before_anything_is_read() -> None:
    store = bw.MemoryStore()
    with pytest.raises(ValueError, match="idle_for must be > 0 seconds"):
        bw.retire_producers(store, NS, idle_for=0)
    with pytest.raises(TypeError, match=r"write \['prep-1'\]"):
        bw.retire_producers(store, NS, idle_for=DAY, producer_ids="prep-1")
    with pytest.raises(TypeError, match="producer ids are strings"):
        bw.retire_producers(store, NS, idle_for=DAY, producer_ids=[7])  # type: ignore[list-item]
    with pytest.raises(bw.NamespaceNotFound):
        bw.retire_producers(store, NS, idle_for=DAY)


def test_a_store_failing_every_commit_is_named_not_taken_for_lost_races() -> None:
    """Every PUT of the retiring commit fails with a 503 and no other writer exists: the error
    says the store failed the attempts (naming its error, chained as the cause), where it said
    "after 3 lost races"; a later success retires as usual."""
    store = bw.MemoryStore()
    publish(store, "old", range(2))
    faulty = bw.FaultInjectingStore(store)
    injected = bw.TransientStoreError("injected 503")
    faulty.fail_next("put", lambda *_: injected, times=3, key_prefix=f"{NS}/_manifests/")
    with pytest.raises(bw.TransientStoreError) as info:
        bw.retire_producers(
            faulty, NS, idle_for=DAY, wall_clock=lambda: later(2), attempts=3, sleep=lambda _: None
        )
    message = str(info.value)
    assert "in 3 attempts: the store failed 3 of them" in message
    assert "TransientStoreError: injected 503" in message
    assert "lost race" not in message
    assert info.value.__cause__ is injected
    report = bw.retire_producers(faulty, NS, idle_for=DAY, wall_clock=lambda: later(2))
    assert report.retired == ("old",)


def test_a_commit_landing_first_keeps_its_producer() -> None:
    """The id commits between retire's read and its conditional PUT: it is active again."""
    store = bw.MemoryStore()
    publish(store, "a", range(1))
    log = ManifestLog(store, NS)
    before = log.latest().producers["a"]
    now = before.last_commit_at + 100.0
    calls = []

    def clock() -> float:
        if not calls:  # retire has read the manifest, where "a" is idle: "a" commits again
            fresh = before.model_copy(update={"last_commit_at": now - 5.0})
            assert isinstance(log.commit(log.latest(), producers={"a": fresh}), Committed)
        calls.append(1)
        return now

    report = bw.retire_producers(store, NS, idle_for=60.0, wall_clock=clock, sleep=lambda _: None)
    assert report.retired == ()
    assert report.active == ("a",)
    assert report.version is None
    assert len(calls) == 2  # re-checked on the winner
    assert "a" in log.latest().producers


@contextlib.contextmanager
def _retired_while_running(store: bw.ObjectStore) -> Iterator[tuple[bw.Producer, bw.RetireReport]]:
    """Producer ``pod-7`` commits offset 0, then its id is retired (two days later) while it
    runs: the producer and the retire's report; the producer is aborted on the way out."""
    producer = bw.Producer(store, NS, producer_id="pod-7", mesh=MESH)
    try:
        producer.append([b"0", b"x"], offset=0)
        producer.flush(timeout=30)
        yield producer, bw.retire_producers(store, NS, idle_for=DAY, wall_clock=lambda: later(2))
    finally:
        producer.abort()


def test_a_running_producer_of_a_retired_id_stops_and_says_where_to_resume() -> None:
    store = bw.MemoryStore()
    with _retired_while_running(store) as (zombie, report):
        assert report.retired == ("pod-7",)
        zombie.append([b"1", b"x"], offset=1)
        with pytest.raises(bw.ProducerRetired) as info:
            zombie.flush(timeout=30)
    message = str(info.value)
    assert f"manifest version {report.version} no longer lists it" in message
    assert "uncommitted: offsets 1..1" in message
    assert "resume the source after 0" in message
    assert isinstance(info.value, bw.ProducerFenced)
    assert steps(store) == [("pod-7", 0)]

    # A producer started later under the id begins a new stream.
    with bw.Producer(store, NS, producer_id="pod-7", mesh=MESH) as again:
        assert again.epoch > 0  # above every epoch the id had: see the next test
        assert again.resume_offset == 0


class _RetireBeforeTheEpochCommit(bw.StoreWrapper):
    """Retires ``pod-7`` (two days idle) right before the first manifest PUT through it: the
    retirement lands between a starting producer's read and its epoch commit."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.report: bw.RetireReport | None = None

    def put(self, key: str, data: bytes, *, mode: bw.PutMode = bw.PutMode.OVERWRITE) -> None:
        if mode is bw.PutMode.CREATE and "/_manifests/" in key and self.report is None:
            self.report = bw.retire_producers(
                self.inner, NS, idle_for=DAY, wall_clock=lambda: later(2)
            )
        super().put(key, data, mode=mode)


@pytest.mark.parametrize("committed", [range(3), range(0)])
def test_a_restart_that_loses_to_a_retirement_stops_instead_of_starting_over(
    committed: range,
) -> None:
    # The restart read version v (offsets 0..2 committed), the retirement took v + 1, and the
    # restart rebased on it: it used to start a new stream at resume_offset 0, and the source
    # republished offsets 0..2.
    store = bw.MemoryStore()
    if committed:
        publish(store, "pod-7", committed)
    else:
        bw.Producer(store, NS, producer_id="pod-7", mesh=MESH).close()
    racing = _RetireBeforeTheEpochCommit(store)
    with pytest.raises(bw.ProducerRetired) as info:
        bw.Producer(racing, NS, producer_id="pod-7", mesh=MESH)
    assert racing.report is not None
    assert racing.report.retired == ("pod-7",)
    message = str(info.value)
    assert f"version {racing.report.version} no longer does" in message
    assert "this start committed nothing" in message
    if committed:
        assert "resume the source after 2" in message
    else:
        assert "committed nothing, so starting it again" in message
    latest = ManifestLog(store, NS).latest()
    assert "pod-7" not in latest.producers  # the retirement stands; nothing was committed
    assert steps(store) == [("pod-7", offset) for offset in committed]
    # Started again, the id begins a new stream, as the message says.
    with bw.Producer(store, NS, producer_id="pod-7", mesh=MESH) as again:
        assert again.resume_offset == 0


def test_retiring_churned_ids_shrinks_the_manifest_back() -> None:
    """Every id ever started stays in every manifest until it is retired."""
    store = bw.MemoryStore()
    publish(store, "steady", range(1))
    first = len(encode_manifest(ManifestLog(store, NS).latest()))
    log = ManifestLog(store, NS)
    latest = log.latest()
    churned = {
        f"pod-{i:04d}": ProducerState(epoch=0, offset=None, last_version=latest.version + 1)
        for i in range(300)
    }
    grown = log.commit(latest, producers=churned)
    assert isinstance(grown, Committed)
    assert len(encode_manifest(grown.manifest)) > first + 300 * 50

    report = bw.retire_producers(store, NS, idle_for=DAY, wall_clock=lambda: later(2))
    assert len(report.retired) == 301
    assert len(encode_manifest(ManifestLog(store, NS).latest())) <= first


# -- CLI ----------------------------------------------------------------------------------------


def run(*args: str, check: int = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == check, (proc.returncode, proc.stdout, proc.stderr)
    return proc


def test_cli_retire_dry_run_ids_and_json(tmp_path: Path) -> None:
    store = bw.open_store(tmp_path.as_uri())
    publish(store, "prep-0", range(2))
    publish(store, "prep-1", range(2))

    # Both committed just now: an hour leaves room for a slow CLI start on a loaded machine.
    dry = run("retire", str(tmp_path), NS, "--idle-for", "1h", "--dry-run")
    assert "would retire 0 producer id(s), 2 remain" in dry.stdout
    assert "kept (active): prep-0, prep-1" in dry.stdout

    by_id = json.loads(
        run("retire", str(tmp_path), NS, "--idle-for", "0.001s", "--id", "prep-1", "--json").stdout
    )
    assert by_id["retired"] == ["prep-1"]
    assert by_id["remaining"] == 1
    assert set(ManifestLog(store, NS).latest().producers) == {"prep-0"}

    bad = run("retire", str(tmp_path), NS, "--idle-for", "soon", check=2)
    assert "'soon' is not a duration; write e.g. 90s, 30m, 12h or 7d" in bad.stderr


def test_cli_inspect_suggests_retiring_ids_idle_for_a_week(tmp_path: Path) -> None:
    store = bw.open_store(tmp_path.as_uri())
    publish(store, "prep-0", range(1))
    publish(store, "pod-old", range(1))
    assert "have not committed" not in run("inspect", str(tmp_path), NS).stdout

    log = ManifestLog(store, NS)
    latest = log.latest()
    state = latest.producers["pod-old"]
    aged = {"pod-old": state.model_copy(update={"last_commit_at": later(-8)})}
    assert isinstance(log.commit(latest, producers=aged), Committed)
    out = " ".join(run("inspect", str(tmp_path), NS).stdout.split())
    assert "1 producer id(s) have not committed for 7 days or more" in out
    assert f"batchweave retire {store.url} {NS} --dry-run" in out


def test_cli_verify_and_inspect_account_for_retired_ids(tmp_path: Path) -> None:
    store = bw.open_store(tmp_path.as_uri())
    publish(store, "pod-a", range(3))
    publish(store, "pod-b", range(2))
    bw.retire_producers(
        store, NS, idle_for=DAY, producer_ids=["pod-a"], wall_clock=lambda: later(2)
    )

    report = json.loads(run("verify", str(tmp_path), NS, "--json").stdout)
    assert report["ok"], report["problems"]
    assert report["retired"] == ["pod-a"]
    assert report["producers"] == {"pod-a": 3, "pod-b": 2}
    assert "pod-a: 3 live steps (retired id)" in run("verify", str(tmp_path), NS).stdout

    data = json.loads(run("inspect", str(tmp_path), NS, "--json").stdout)
    rows = {p["producer_id"]: p for p in data["producers"]}
    assert rows["pod-a"]["retired"]
    assert rows["pod-a"]["live_steps"] == 3
    assert not rows["pod-b"]["retired"]
    assert rows["pod-b"]["live_steps"] == 2
    assert sum(p["live_steps"] for p in data["producers"]) == data["live_steps"]


def retire_and_start_again(store: bw.ObjectStore, streams: list[range]) -> None:
    """``pod-a`` and ``pod-b`` publish 0..9; then ``pod-a`` is retired and started again (a new
    stream, resume offset 0) for each range of ``streams``."""
    publish(store, "pod-a", range(10))
    publish(store, "pod-b", range(10))
    for offsets in streams:
        retired = bw.retire_producers(
            store, NS, idle_for=DAY, producer_ids=["pod-a"], wall_clock=lambda: later(2)
        )
        assert retired.retired == ("pod-a",)
        with bw.Producer(store, NS, producer_id="pod-a", mesh=MESH) as producer:
            assert producer.resume_offset == 0
            for offset in offsets:
                producer.append([b"new %d" % offset, b"x"], offset=offset)


@pytest.mark.parametrize(
    "streams",
    [[range(3)], [range(0)], [range(3), range(2)], [range(12)]],
    ids=["new-stream", "new-stream-empty", "two-new-streams", "new-stream-past-the-old"],
)
def test_verify_passes_an_id_retired_and_started_again(streams: list[range]) -> None:
    """A new stream under a retired id (documented: no resume offset) is no damage: its offsets
    are checked within the stream, and only its own against the committed offset. verify
    reported 13 problems ("offset 3 is above its committed offset 2", "appears twice")."""
    store = bw.MemoryStore()
    retire_and_start_again(store, streams)
    report = verify_namespace(store, NS)
    assert report.problems == []
    assert report.notes == []
    assert report.ok
    assert report.producers == {"pod-a": 10 + sum(len(r) for r in streams), "pod-b": 10}
    assert report.retired == []


def test_verify_still_finds_an_offset_twice_within_the_new_stream() -> None:
    store = bw.MemoryStore()
    retire_and_start_again(store, [range(3)])
    log = ManifestLog(store, NS)
    latest = log.latest()
    assert not latest.segments  # all in the tail: the hand-made version appends to it
    again = latest.tail[-2]  # pod-a offset 1 of the new stream, committed a second time
    assert (again.producer_id, again.offset) == ("pod-a", 1)
    version = latest.version + 1
    damaged = latest.model_copy(
        update={
            "version": version,
            "parent": latest.version,
            "commit_id": "e" * 32,
            "tail": (*latest.tail, again),
        }
    )
    store.put_if_absent(log.key(manifest_key(version)), encode_manifest(damaged))
    step = latest.next_step
    report = verify_namespace(store, NS)
    assert report.problems == [
        f"step {step}: pod-a offset 1 appears twice",
        f"step {step}: pod-a offset 1 does not follow offset 2 of an earlier step",
    ]


def test_verify_after_the_retirement_was_reclaimed_skips_what_it_cannot_tell(
    tmp_path: Path,
) -> None:
    """The manifest versions that show the retirement are reclaimed (below the oldest
    watermark's version) while the old stream's steps are still live: the steps cannot be told
    apart into streams, so their exactly-once check is skipped and named in ``notes``, and the
    namespace is not reported damaged (exit 0)."""
    store = bw.open_store(tmp_path.as_uri())
    retire_and_start_again(store, [range(3)])
    log = ManifestLog(store, NS)
    latest = log.latest()
    reclaimed = [log.key(manifest_key(v)) for v in log.versions() if v < latest.version]
    store.delete_many(reclaimed)

    report = verify_namespace(store, NS)
    assert report.problems == []
    assert report.ok
    [note] = report.notes
    assert note.startswith("pod-a: the exactly-once check of ")
    assert "reclaimed" in note
    cli = json.loads(run("verify", str(tmp_path), NS, "--json").stdout)
    assert (cli["ok"], cli["problems"], cli["notes"]) == (True, [], [note])
    assert "OK" in run("verify", str(tmp_path), NS).stdout


def test_a_process_of_the_old_stream_is_fenced_when_the_id_starts_again() -> None:
    """Retire, start the id again, and only then let the old process try to commit."""
    store = bw.MemoryStore()
    with (
        _retired_while_running(store) as (old, _),
        bw.Producer(store, NS, producer_id="pod-7", mesh=MESH) as new,
    ):
        assert new.epoch > old.epoch
        assert new.resume_offset == 0
        new.append([b"n0", b"x"], offset=0)
        new.flush(timeout=30)
        old.append([b"1", b"x"], offset=1)
        with pytest.raises(bw.ProducerFenced):
            old.flush(timeout=30)
        new.append([b"n1", b"x"], offset=1)
    assert steps(store) == [("pod-7", 0), ("pod-7", 0), ("pod-7", 1)]
    state = ManifestLog(store, NS).latest().producers["pod-7"]
    assert (state.epoch, state.offset) == (new.epoch, 1)


class _CountingId(str):
    """A producer id that counts the comparisons made with it."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountingId.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_sorting_many_ids_takes_a_few_comparisons_each() -> None:
    # Before: every candidate was looked up in the tuple of idle ids, a scan each (quadratic:
    # 20,000 ids took seconds).
    store = bw.MemoryStore()
    log = ManifestLog(store, NS)
    head = log.create_or_open(MESH)
    n = 400
    states = {
        f"pod-{i:04d}": ProducerState(
            epoch=1, offset=None, last_version=1, last_commit_at=0.0 if i % 2 else later(0)
        )
        for i in range(n)
    }
    result = log.commit(head, producers=states)
    assert isinstance(result, Committed)
    named = tuple(_CountingId(pid) for pid in states)
    _CountingId.compared = 0
    decision = _decide(result.manifest, named, later(-1))
    assert len(decision.idle) == len(decision.active) == n // 2
    assert decision.unknown == ()
    assert _CountingId.compared <= 4 * n, _CountingId.compared

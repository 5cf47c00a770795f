"""The manifest log: namespace creation, version discovery and the one-attempt commit."""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from manifest_helpers import CountingStore, FaultyPutStore, descriptor, grow, landed_then

from batchweave import (
    AmbiguousWriteError,
    ConcurrentWriteConflict,
    FormatError,
    InvalidKey,
    MemoryStore,
    Mesh,
    NamespaceError,
    NamespaceMismatch,
    NamespaceNotFound,
    NamespaceSealed,
    ObjectExists,
    ObjectMeta,
    ObjectNotFound,
    ObjectStore,
    OffsetOrderError,
    Producer,
    ProducerFenced,
    PutMode,
    StepReclaimed,
    StoreWrapper,
    TransientStoreError,
)
from batchweave._manifest import (
    Committed,
    Conflict,
    Manifest,
    ManifestLog,
    ProducerState,
    TgbDescriptor,
    _codec,
    active_producers,
    manifest_key,
)
from batchweave._manifest._codec import forget_decoded
from batchweave._manifest._log import LISTED_TRUST_SECONDS, PROBE_TRUST_SECONDS
from batchweave._store._file import FileStore

MESH = Mesh(dp=4, cp=2)
NS = "runs/job-42"


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "memory":
        yield MemoryStore()
    else:
        with FileStore(tmp_path / "store", fsync=False) as fs:
            yield fs


def _commit(log: ManifestLog, base: Manifest, *descs: TgbDescriptor) -> Manifest:
    result = log.commit(base, append=descs)
    assert isinstance(result, Committed), result
    return result.manifest


# -- namespace creation ----------------------------------------------------------------------


def test_concurrent_creation_agrees_on_one_namespace(store: ObjectStore) -> None:
    barrier = threading.Barrier(16)
    ids: list[str] = []
    errors: list[BaseException] = []

    def create() -> None:
        try:
            barrier.wait()
            ids.append(ManifestLog(store, NS).create_or_open(MESH).namespace_id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(ids) == 16
    assert len(set(ids)) == 1
    assert list(ManifestLog(store, NS).versions()) == [0]


class _ListLagsBehindWrites(StoreWrapper):
    """A store whose LIST does not show the keys written through it (yet), as SeaweedFS's
    listing lags behind its writes; GET and HEAD see them at once."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.unlisted: set[str] = set()

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        super().put(key, data, mode=mode)
        self.unlisted.add(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        listed = super().list(prefix, start_after=start_after)
        return (meta for meta in listed if meta.key not in self.unlisted)


def test_creation_opens_the_version_0_a_lagging_listing_does_not_show_yet(
    store: ObjectStore,
) -> None:
    """Before: each creator below raised NamespaceNotFound right after version 0 was written,
    because it then looked the newest version up with a LIST that did not show it yet."""
    lagging = _ListLagsBehindWrites(store)
    created = ManifestLog(lagging, NS).create_or_open(MESH)  # wrote version 0
    assert created.version == 0
    # A second creator finds no version listed, tries version 0 and finds it taken.
    assert ManifestLog(lagging, NS).create_or_open(MESH) == created
    head = grow(ManifestLog(lagging, NS), created, 3)
    opened = ManifestLog(lagging, NS).create_or_open(MESH)  # probed forward from version 0
    assert opened.namespace_id == head.namespace_id
    assert opened.version >= 1  # as far as a probe and the lagging LIST after it reach


def test_an_ambiguous_creation_is_read_back_without_a_lagging_listing(
    store: ObjectStore,
) -> None:
    calls: list[str] = []

    def fault(key: str) -> tuple[bool, Exception | None]:
        calls.append(key)
        return True, AmbiguousWriteError("timeout creating version 0") if len(calls) == 1 else None

    lagging = _ListLagsBehindWrites(store)
    manifest = ManifestLog(FaultyPutStore(lagging, fault), NS).create_or_open(MESH)
    assert manifest.version == 0
    assert len(calls) == 1  # read back, not sent again
    assert ManifestLog(store, NS).latest() == manifest


def test_a_producer_creates_a_namespace_on_a_store_whose_listing_lags(store: ObjectStore) -> None:
    lagging = _ListLagsBehindWrites(store)
    with Producer(lagging, NS, producer_id="p", mesh=Mesh(dp=1), policy="naive") as p:
        p.append([b"x"], offset=0)
    assert ManifestLog(store, NS).latest().next_step == 1


def test_open_checks_the_mesh(store: ObjectStore) -> None:
    ManifestLog(store, NS).create_or_open(MESH)
    with pytest.raises(NamespaceMismatch) as err:
        ManifestLog(store, NS).create_or_open(Mesh(dp=8, cp=1))
    assert "dp=4, cp=2" in str(err.value)
    assert "dp=8, cp=1" in str(err.value)
    assert ManifestLog(store, NS).create_or_open(MESH).mesh == MESH
    assert ManifestLog(store, NS).create_or_open().mesh == MESH


def test_missing_namespace_without_mesh(store: ObjectStore) -> None:
    with pytest.raises(NamespaceNotFound, match="mesh=") as err:
        ManifestLog(store, NS).create_or_open()
    assert NS in str(err.value)
    assert list(store.list("")) == []


def test_foreign_prefix_is_refused(store: ObjectStore) -> None:
    store.put(f"{NS}/part-0000.parquet", b"PAR1")
    with pytest.raises(NamespaceMismatch, match=r"part-0000\.parquet"):
        ManifestLog(store, NS).create_or_open(MESH)
    assert list(ManifestLog(store, NS).versions()) == []


def test_batchweave_objects_and_sibling_prefixes_are_not_foreign(store: ObjectStore) -> None:
    store.put(f"{NS}-old/notes.txt", b"sibling prefix, not ours to judge")
    store.put(f"{NS}/data/p/0/0-x.tgb", b"orphan upload of an earlier attempt")
    manifest = ManifestLog(store, NS).create_or_open(MESH)
    assert manifest.version == 0
    assert manifest.next_step == 0


@pytest.mark.parametrize("bad", ["", "/abs", "trailing/", "a//b", "a/../b"])
def test_namespace_names_are_validated(bad: str) -> None:
    with pytest.raises((InvalidKey, ValueError)):
        ManifestLog(MemoryStore(), bad)


def test_key_layout() -> None:
    log = ManifestLog(MemoryStore(), NS)
    assert log.key("x/y") == f"{NS}/x/y"
    assert manifest_key(42) == "_manifests/00000000000000000042.manifest"


# -- reading and discovery -------------------------------------------------------------------


def test_read_missing_version_names_key_and_version(store: ObjectStore) -> None:
    log = ManifestLog(store, NS)
    log.create_or_open(MESH)
    with pytest.raises(ObjectNotFound) as err:
        log.read(5)
    assert "version 5" in str(err.value)
    assert log.key(manifest_key(5)) in str(err.value)


def test_latest_costs_one_get_when_current_and_a_list_when_behind(store: ObjectStore) -> None:
    counting = CountingStore(store)
    log = ManifestLog(counting, NS)
    m0 = log.create_or_open(MESH)
    head = m0
    for i in range(6):
        head = _commit(log, head, descriptor("p", i))

    counting.reset()
    assert log.latest(head) is head
    assert counting.calls == {"get": 1}

    counting.reset()
    assert log.latest(m0) == head
    assert counting.calls == {"get": 2, "list": 1}
    assert counting.gets == [log.key(manifest_key(1)), log.key(manifest_key(6))]

    counting.reset()
    one_behind = log.read(5)
    counting.reset()
    assert log.latest(one_behind) == head
    assert counting.calls == {"get": 1, "list": 1}

    counting.reset()
    assert ManifestLog(counting, NS).latest() == head
    assert counting.calls == {"get": 1, "list": 1}


def test_latest_never_lists_data(store: ObjectStore) -> None:
    seen: list[str] = []

    class Spy(CountingStore):
        def list(self, prefix: str = "", *, start_after: str | None = None):  # type: ignore[no-untyped-def]
            seen.append(prefix)
            return super().list(prefix, start_after=start_after)

    for i in range(3):
        store.put(f"{NS}/data/p/0/{i}-x.tgb", b"payload")
    log = ManifestLog(Spy(store), NS)
    m = log.create_or_open(MESH)
    seen.clear()
    m1 = _commit(log, m, descriptor("p", 0))
    log.latest(m)
    log.latest(m1)
    log.latest()
    assert seen
    assert all(p == log.key("_manifests/") for p in seen)


def test_latest_after_old_versions_were_reclaimed(store: ObjectStore) -> None:
    log = ManifestLog(store, NS)
    head = log.create_or_open(MESH)
    for i in range(5):
        head = _commit(log, head, descriptor("p", i))
    store.delete_many([log.key(manifest_key(v)) for v in range(3)])
    assert list(log.versions()) == [3, 4, 5]
    assert ManifestLog(store, NS).latest() == head
    assert ManifestLog(store, NS).create_or_open(MESH) == head


def test_a_version_from_a_clock_far_ahead_is_not_trusted_to_be_the_latest(
    store: ObjectStore,
) -> None:
    now = 1_000_000.0
    ahead = ManifestLog(store, NS, clock=lambda: now + 7200)  # a committer 2 h ahead
    known = _commit(ahead, ahead.create_or_open(MESH), descriptor("fast", 0))
    log = ManifestLog(store, NS, clock=lambda: now)
    head = known
    for i in range(3):
        head = _commit(log, head, descriptor("slow", i))
    # Reclamation took the successor of the version a reader holds.
    store.delete_many([log.key(manifest_key(v)) for v in range(known.version + 2)])
    reader = ManifestLog(store, NS, clock=lambda: now + 1)
    # Before: "known is 7,199 s in the future, so young", and the reader stalled on it.
    assert reader.latest(known) == head


def test_recreated_prefix_is_detected(store: ObjectStore) -> None:
    log = ManifestLog(store, NS)
    first = log.create_or_open(MESH)
    store.delete_many([log.key(manifest_key(0))])
    ManifestLog(store, NS).create_or_open(MESH)
    with pytest.raises(NamespaceMismatch, match="re-created"):
        log.latest()
    assert first.version == 0


# -- commit ----------------------------------------------------------------------------------


def test_commit_appends_dense_steps_and_tracks_producers(store: ObjectStore) -> None:
    now = [100.0]
    log = ManifestLog(store, NS, clock=lambda: now[0], monotonic=lambda: now[0])
    m0 = log.create_or_open(MESH)
    now[0] = 101.0
    m1 = _commit(log, m0, descriptor("a", 3), descriptor("b", 7), descriptor("a", 4))
    assert (m1.version, m1.parent, m1.next_step) == (1, 0, 3)
    assert m1.commit_id != m0.commit_id
    assert m1.created_at == 101.0
    assert m1.producers["a"] == ProducerState(epoch=0, offset=4, last_version=1, last_commit_at=101)
    assert m1.producers["b"].offset == 7
    assert [log.descriptor(m1, s).offset for s in range(3)] == [3, 7, 4]
    assert log.read(1) == m1


def test_commit_replaces_listed_producer_states(store: ObjectStore) -> None:
    log = ManifestLog(store, NS)
    m0 = log.create_or_open(MESH)
    bumped = ProducerState(epoch=3, offset=None, last_version=1, last_commit_at=5.0)
    m1 = log.commit(m0, producers={"a": bumped})
    assert isinstance(m1, Committed)
    assert m1.manifest.producers == {"a": bumped}
    with pytest.raises(ProducerFenced, match="epoch 2"):
        log.commit(m1.manifest, append=[descriptor("a", 0, epoch=2)])
    m2 = _commit(log, m1.manifest, descriptor("a", 0, epoch=3))
    assert m2.producers["a"].epoch == 3
    assert m2.producers["a"].offset == 0


def test_commit_refuses_repeated_or_reordered_offsets(store: ObjectStore) -> None:
    log = ManifestLog(store, NS)
    m1 = _commit(log, log.create_or_open(MESH), descriptor("a", 5))
    with pytest.raises(OffsetOrderError, match="offset 5"):
        log.commit(m1, append=[descriptor("a", 5)])
    with pytest.raises(OffsetOrderError):
        log.commit(m1, append=[descriptor("a", 9), descriptor("a", 8)])
    assert list(log.versions()) == [0, 1]


def test_sealed_namespace_refuses_appends_but_allows_reclamation(store: ObjectStore) -> None:
    log = ManifestLog(store, NS)
    m1 = _commit(log, log.create_or_open(MESH), descriptor("a", 0), descriptor("a", 1))
    sealed = log.commit(m1, seal=True)
    assert isinstance(sealed, Committed)
    assert sealed.manifest.sealed
    with pytest.raises(NamespaceSealed, match=r"sealed at version 2 \(steps 0\.\.1\)"):
        log.commit(sealed.manifest, append=[descriptor("a", 2)])
    cut = log.commit(sealed.manifest, base_step=1)
    assert isinstance(cut, Committed)
    assert cut.manifest.sealed
    assert cut.manifest.base_step == 1


def test_a_namespace_sealed_before_any_step_says_it_has_none(store: ObjectStore) -> None:
    log = ManifestLog(store, NS)
    sealed = log.commit(log.create_or_open(MESH), seal=True)
    assert isinstance(sealed, Committed)
    # Before: "(steps 0..-1)".
    with pytest.raises(NamespaceSealed, match=r"sealed at version 1 \(no steps\)"):
        log.commit(sealed.manifest, append=[descriptor("a", 0)])


def test_lost_race_reports_the_winner(store: ObjectStore) -> None:
    log = ManifestLog(store, NS)
    m0 = log.create_or_open(MESH)
    winner = _commit(log, m0, descriptor("a", 0))
    result = ManifestLog(store, NS).commit(m0, append=[descriptor("b", 0)])
    assert result == Conflict(winner)
    assert log.latest() == winner


class _Clients:
    """Two clients of one namespace sharing one fake clock (wall and monotonic): ``mine`` reads
    through ``mine_store`` (a CountingStore, say), ``other`` through the store itself."""

    def __init__(self, store: ObjectStore, mine_store: ObjectStore | None = None) -> None:
        self.now = 1000.0
        self.mine = ManifestLog(mine_store or store, NS, clock=self._clock, monotonic=self._clock)
        self.other = ManifestLog(store, NS, clock=self._clock, monotonic=self._clock)

    def _clock(self) -> float:
        return self.now


def test_a_base_listed_as_the_newest_just_now_is_not_checked_again(store: ObjectStore) -> None:
    # A contended producer's attempt: latest() finds newer versions and lists them, then
    # commit(). A LIST that shows nothing after the base proves its successor was not reclaimed
    # (the newest is never deleted), so the commit needs no HEAD in its fragile window.
    counting = CountingStore(store)
    clients = _Clients(store, counting)
    mine, other = clients.mine, clients.other
    base = mine.create_or_open(MESH)
    _commit(other, other.latest(), descriptor("b", 0))
    listed = mine.latest(base)  # behind: probe, then LIST
    counting.reset()
    assert isinstance(mine.commit(listed, append=[descriptor("a", 0)]), Committed)
    assert (counting.calls["head"], counting.calls["put"]) == (0, 1)


def test_a_base_vouched_for_otherwise_is_checked(store: ObjectStore) -> None:
    counting = CountingStore(store)
    clients = _Clients(store, counting)
    log, other = clients.mine, clients.other
    mine = _commit(log, log.create_or_open(MESH), descriptor("a", 0))
    # Its own commit, and then a probe that found no successor: with a short reclaimer grace
    # the successor may have been reclaimed along with the base, so the HEAD still decides.
    counting.reset()
    mine = _commit(log, mine, descriptor("a", 1))
    assert counting.calls["head"] == 1
    probed = log.latest(mine)
    counting.reset()
    mine = _commit(log, probed, descriptor("a", 2))
    assert counting.calls["head"] == 1
    # Listed as the newest, but longer ago than the check it replaces would have taken.
    _commit(other, other.latest(), descriptor("b", 0))
    listed = log.latest(mine)
    clients.now += LISTED_TRUST_SECONDS
    counting.reset()
    _commit(log, listed, descriptor("a", 9))
    assert counting.calls["head"] == 1


def _reclaimed_down_to(store: ObjectStore, log: ManifestLog, head: Manifest) -> None:
    """What a reclaimer with a short grace leaves after a pause: ``head`` alone."""
    store.delete_many([log.key(manifest_key(v)) for v in range(head.version)])


def _refused_without_writing(log: ManifestLog, base: Manifest, head: Manifest) -> None:
    """A commit on ``base`` is refused (its parent is gone) and no version name is re-created."""
    assert log.commit(base, append=[descriptor("a", 1000)]) == Conflict(None)
    assert list(log.versions()) == [head.version]


def test_a_probe_that_missed_a_reclaimed_successor_does_not_skip_the_parent_check(
    store: ObjectStore,
) -> None:
    # A reclaimer with a short grace (the demo's 5 s) deleted the base and its successor while
    # this client held the base: the probe finds no successor, and the base is still young, so
    # latest() returns it. Only the HEAD can tell; skipping it would re-create version 2.
    clients = _Clients(store)
    log, other = clients.mine, clients.other
    held = _commit(log, log.create_or_open(MESH), descriptor("a", 0))
    head = other.latest()
    for offset in range(3):
        head = _commit(other, head, descriptor("b", offset))
    clients.now += 6
    _reclaimed_down_to(store, log, head)
    assert log.latest(held) is held  # fooled: young, and its successor is gone
    _refused_without_writing(log, held, head)


def test_a_base_listed_before_a_pause_longer_than_a_short_grace_is_checked(
    store: ObjectStore,
) -> None:
    # Listed as the newest, then the process pauses for longer than the demo's 5 s grace while
    # others commit and a reclaimer deletes the base and its successor: the listing no longer
    # vouches for anything, and the HEAD refuses to re-create version 2.
    clients = _Clients(store)
    log, other = clients.mine, clients.other
    _commit(other, log.create_or_open(MESH), descriptor("b", 0))
    listed = log.latest(log.read(0))  # behind: listed
    head = other.latest()
    for offset in range(1, 3):
        head = _commit(other, head, descriptor("b", offset))
    clients.now += 6
    _reclaimed_down_to(store, log, head)
    _refused_without_writing(log, listed, head)


def test_a_base_whose_prefix_was_deleted_is_not_written_after(store: ObjectStore) -> None:
    # An old base: latest() lists after it and finds nothing, because an operator deleted the
    # namespace meanwhile. Listing after a version does not show the version itself, so
    # latest() reads it back (NamespaceNotFound: nothing is left), and the commit still HEADs
    # it, and writes nothing into the emptied prefix.
    clients = _Clients(store)
    log = clients.mine
    held = _commit(log, log.create_or_open(MESH), descriptor("a", 0))
    store.delete_many([m.key for m in store.list(f"{NS}/")])
    clients.now += PROBE_TRUST_SECONDS + 1
    with pytest.raises(NamespaceNotFound):
        log.latest(held)
    assert log.commit(held, append=[descriptor("a", 1)]) == Conflict(None)
    assert list(store.list(f"{NS}/")) == []


def test_a_client_waiting_at_the_head_notices_an_older_copy_restored_over_it(
    store: ObjectStore,
) -> None:
    # Before: latest(seen) probed the missing seen.version + 1, listed nothing after it and
    # returned ``seen`` without reading it back, so a consumer waiting at the head of a
    # namespace restored from an older backup (versions 4 and 5 gone) waited forever.
    clients = _Clients(store)
    log = clients.mine
    seen = grow(log, log.create_or_open(MESH), 5)
    store.delete_many([log.key(manifest_key(v)) for v in (4, 5)])
    assert log.latest(seen) is seen  # young: the probe alone is trusted, as before
    clients.now += PROBE_TRUST_SECONDS + 1
    with pytest.raises(FormatError, match=r"version 5, the newest this client saw .* is gone"):
        log.latest(seen)
    with pytest.raises(FormatError, match="newest version left is 3"):
        log.latest(seen)  # and again at every later poll, never the older version
    assert list(log.versions()) == [0, 1, 2, 3]


def test_waiting_at_an_old_head_reads_it_back_once_per_trust_interval_not_per_poll(
    store: ObjectStore,
) -> None:
    # The read-back costs one GET per PROBE_TRUST_SECONDS, not one per poll: a young head is
    # one GET (the probe) per poll, an old one a GET and a LIST, as before.
    counting = CountingStore(store)
    clients = _Clients(store, counting)
    log = clients.mine
    head = grow(log, log.create_or_open(MESH), 2)
    counting.reset()
    for _ in range(5):
        clients.now += 1
        assert log.latest(head) is head
    assert (counting.calls["get"], counting.calls["list"]) == (5, 0)
    clients.now += PROBE_TRUST_SECONDS
    counting.reset()
    assert log.latest(head) is head  # probe, LIST, read-back
    assert (counting.calls["get"], counting.calls["list"]) == (2, 1)
    counting.reset()
    polls = 20
    for _ in range(polls):
        clients.now += (PROBE_TRUST_SECONDS - 1) / polls
        assert log.latest(head) is head
    assert (counting.calls["get"], counting.calls["list"]) == (polls, polls)
    clients.now += 1
    counting.reset()
    assert log.latest(head) is head  # a trust interval later: read back again
    assert (counting.calls["get"], counting.calls["list"]) == (2, 1)


def test_a_wall_clock_stepped_back_does_not_stretch_the_trust_in_a_listing(
    store: ObjectStore,
) -> None:
    # As above, but during the pause NTP stepped the wall clock back: the interval the listing
    # is trusted for is timed on the monotonic clock, which only moves forward.
    wall, mono = [1000.0], [50.0]
    log = ManifestLog(store, NS, clock=lambda: wall[0], monotonic=lambda: mono[0])
    other = ManifestLog(store, NS, clock=lambda: wall[0])
    _commit(other, log.create_or_open(MESH), descriptor("b", 0))
    listed = log.latest(log.read(0))  # behind: listed
    head = other.latest()
    for offset in range(1, 3):
        head = _commit(other, head, descriptor("b", offset))
    mono[0] += 6
    wall[0] -= 1
    _reclaimed_down_to(store, log, head)
    _refused_without_writing(log, listed, head)


def test_reclaimed_parent_is_a_conflict_without_writing(store: ObjectStore) -> None:
    counting = CountingStore(store)
    log = ManifestLog(counting, NS)
    stale = _commit(log, log.create_or_open(MESH), descriptor("a", 0))
    head = stale
    for i in range(1, 5):
        head = _commit(log, head, descriptor("a", i))
    # The reclaimer deleted old versions, including the stale writer's base and the name it
    # would write next: re-creating version 2 would fork history, so it must not even try.
    store.delete_many([log.key(manifest_key(v)) for v in range(4)])
    counting.reset()
    assert log.commit(stale, append=[descriptor("b", 0)]) == Conflict(None)
    assert counting.calls["put"] == 0
    assert list(log.versions()) == [4, 5]
    assert log.latest(stale) == head  # not fooled by the missing successor of the stale base


def test_base_step_cuts_reclaimed_steps(store: ObjectStore) -> None:
    log = ManifestLog(store, NS, tail_limit=4)
    head = log.create_or_open(MESH)
    for i in range(10):
        head = _commit(log, head, descriptor("a", i))
    result = log.commit(head, base_step=6)
    assert isinstance(result, Committed)
    cut = result.manifest
    assert cut.base_step == 6
    assert all(ref.end_step > 6 for ref in cut.segments)
    assert [s for s, _ in log.descriptors(cut, 6, 10)] == [6, 7, 8, 9]
    with pytest.raises(StepReclaimed, match=r"step 5 was reclaimed \(base_step 6"):
        log.descriptor(cut, 5)
    with pytest.raises(IndexError, match="step 10 is not committed"):
        log.descriptor(cut, 10)
    lower = log.commit(cut, base_step=2)
    assert isinstance(lower, Committed)
    assert lower.manifest.base_step == 6  # the boundary never moves back
    with pytest.raises(ValueError, match="beyond the committed steps"):
        log.commit(cut, base_step=11)


@pytest.mark.parametrize("base_step", [0, 3])
def test_a_negative_step_is_out_of_range_not_reclaimed(store: ObjectStore, base_step: int) -> None:
    # Step -1 used to be "step -1 was reclaimed (... resume from a later checkpoint)", advice
    # that only hides the caller's bug; with nothing reclaimed it would have read tail[-1].
    log = ManifestLog(store, NS, tail_limit=4)
    head = log.create_or_open(MESH)
    for i in range(6):
        head = _commit(log, head, descriptor("a", i))
    result = log.commit(head, base_step=base_step)
    assert isinstance(result, Committed)
    head = result.manifest
    for step in (-1, -6, -(10**12)):
        with pytest.raises(IndexError, match=f"step {step} is negative") as info:
            log.descriptor(head, step)
        assert not isinstance(info.value, StepReclaimed)
        with pytest.raises(IndexError, match="is negative"):
            list(log.descriptors(head, step, 5))
    assert [s for s, _ in log.descriptors(head, base_step, 6)] == list(range(base_step, 6))


def test_active_producers() -> None:
    m = Manifest(
        namespace_id="n",
        mesh=MESH,
        version=3,
        commit_id="c",
        producers={
            "a": ProducerState(epoch=0, last_version=1, last_commit_at=100.0),
            "b": ProducerState(epoch=0, last_version=2, last_commit_at=95.0),
            "c": ProducerState(epoch=0, last_version=3, last_commit_at=10.0),
        },
    )
    assert active_producers(m, now=100.0, horizon=10.0) == 2
    assert active_producers(m, now=100.0, horizon=1000.0) == 3
    assert active_producers(m, now=1000.0, horizon=1.0) == 1
    assert active_producers(m.model_copy(update={"producers": {}}), 0.0, 1.0) == 1


# -- ambiguous outcomes ----------------------------------------------------------------------


def _faulty_once(
    store: ObjectStore, outcome: tuple[bool, Exception | None]
) -> tuple[FaultyPutStore, list[str]]:
    calls: list[str] = []

    def fault(key: str) -> tuple[bool, Exception | None]:
        calls.append(key)
        if "_manifests/" in key and not key.endswith(manifest_key(0)) and len(calls) == 2:
            return outcome
        return True, None

    return FaultyPutStore(store, fault), calls


@pytest.mark.parametrize("error", [AmbiguousWriteError, ObjectExists])
def test_landed_write_reported_as_failure_is_ours(store: ObjectStore, error: type) -> None:
    faulty, calls = _faulty_once(store, landed_then(error))
    log = ManifestLog(faulty, NS)
    m0 = log.create_or_open(MESH)
    result = log.commit(m0, append=[descriptor("a", 0)])
    assert isinstance(result, Committed)
    assert list(log.versions()) == [0, 1]
    assert log.read(1) == result.manifest
    assert len(calls) == 2  # no duplicate version was written


def test_ambiguous_write_that_did_not_land_is_resent(store: ObjectStore) -> None:
    faulty, calls = _faulty_once(store, (False, AmbiguousWriteError("timeout")))
    log = ManifestLog(faulty, NS)
    result = log.commit(log.create_or_open(MESH), append=[descriptor("a", 0)])
    assert isinstance(result, Committed)
    assert calls[1:] == [log.key(manifest_key(1))] * 2
    assert log.read(1) == result.manifest


def test_ambiguous_write_lost_to_another_writer_is_a_conflict(store: ObjectStore) -> None:
    log = ManifestLog(store, NS)
    m0 = log.create_or_open(MESH)
    other = ManifestLog(store, NS)

    def fault(key: str) -> tuple[bool, Exception | None]:
        other_result = other.commit(m0, append=[descriptor("b", 0)])
        assert isinstance(other_result, Committed)
        return False, AmbiguousWriteError("reset after body sent")

    result = ManifestLog(FaultyPutStore(store, fault), NS).commit(m0, append=[descriptor("a", 0)])
    assert isinstance(result, Conflict)
    assert result.winner is not None
    assert result.winner.producers.keys() == {"b"}


def test_never_resolved_ambiguity_is_bounded(store: ObjectStore) -> None:
    calls: list[str] = []

    def fault(key: str) -> tuple[bool, Exception | None]:
        calls.append(key)
        return False, AmbiguousWriteError("timeout")

    m0 = ManifestLog(store, NS).create_or_open(MESH)
    log = ManifestLog(FaultyPutStore(store, fault), NS)
    assert log.commit(m0, append=[descriptor("a", 0)]) == Conflict(None)
    assert 2 <= len(calls) <= 5
    assert list(log.versions()) == [0]


@pytest.mark.parametrize(
    "error", [ConcurrentWriteConflict("409"), TransientStoreError("503 slow down")]
)
def test_409_and_transient_errors_are_unknown_conflicts(
    store: ObjectStore, error: Exception
) -> None:
    m0 = ManifestLog(store, NS).create_or_open(MESH)
    log = ManifestLog(FaultyPutStore(store, lambda key: (False, error)), NS)
    assert log.commit(m0, append=[descriptor("a", 0)]) == Conflict(None)
    assert list(log.versions()) == [0]


# -- the commit race -------------------------------------------------------------------------


def test_concurrent_producers_lose_nothing_and_duplicate_nothing(store: ObjectStore) -> None:
    producers, per_producer = 16, 20
    barrier = threading.Barrier(producers)
    errors: list[BaseException] = []
    conflicts: list[int] = []
    ManifestLog(store, NS).create_or_open(MESH)

    def produce(pid: str, seed: int) -> None:
        rng = random.Random(seed)
        log = ManifestLog(store, NS, tail_limit=8)
        try:
            barrier.wait()
            base = log.latest()
            # Every producer holds the same base before anyone commits: at least 15 of the 16
            # first attempts lose, however the threads are scheduled (on a fast store one
            # thread could otherwise finish before the next one starts, and nothing would race).
            barrier.wait()
            offsets = list(range(per_producer))
            pending: list[TgbDescriptor] = []
            while offsets or pending:
                take = rng.randint(1, 3)
                pending += [descriptor(pid, o) for o in offsets[:take]]
                del offsets[:take]
                while True:
                    result = log.commit(base, append=pending)
                    if isinstance(result, Committed):
                        base, pending = result.manifest, []
                        break
                    conflicts.append(1)
                    base = result.winner or log.latest(base)
                    done = base.producers.get(pid)
                    if done is not None and done.offset is not None:
                        pending = [d for d in pending if d.offset > done.offset]
                    if not pending:
                        break
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=produce, args=(f"p{i:02d}", i)) for i in range(producers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(conflicts) >= producers - 1  # the race really happened

    reader = ManifestLog(store, NS)
    final = reader.latest()
    assert final.next_step == producers * per_producer
    mapping = [(d.producer_id, d.offset) for _, d in reader.descriptors(final, 0, final.next_step)]
    assert sorted(mapping) == sorted(
        (f"p{i:02d}", o) for i in range(producers) for o in range(per_producer)
    )
    for pid in {p for p, _ in mapping}:
        offsets = [o for p, o in mapping if p == pid]
        assert offsets == sorted(offsets)
    assert list(reader.versions()) == list(range(final.version + 1))
    for version in range(final.version + 1):
        m = reader.read(version)
        assert m.parent == (version - 1 if version else None)
        prefix = [(d.producer_id, d.offset) for _, d in reader.descriptors(m, 0, m.next_step)]
        assert prefix == mapping[: m.next_step]


@pytest.mark.parametrize("land", [True, False])
def test_ambiguous_namespace_creation_is_resolved(store: ObjectStore, land: bool) -> None:
    calls: list[str] = []

    def fault(key: str) -> tuple[bool, Exception | None]:
        calls.append(key)
        if len(calls) == 1:
            return land, AmbiguousWriteError("timeout creating version 0")
        return True, None

    manifest = ManifestLog(FaultyPutStore(store, fault), NS).create_or_open(MESH)
    assert manifest.version == 0
    assert len(calls) == (1 if land else 2)
    assert ManifestLog(store, NS).latest() == manifest


def test_failed_segment_write_is_an_unknown_conflict(store: ObjectStore) -> None:
    class FailingSegments(CountingStore):
        def put(
            self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE
        ) -> None:
            if "/_segments/" in key:
                raise TransientStoreError(f"503 writing {key}")
            super().put(key, data, mode=mode)

    log = ManifestLog(FailingSegments(store), NS, tail_limit=2)
    m1 = _commit(log, log.create_or_open(MESH), descriptor("a", 0))
    assert log.commit(m1, append=[descriptor("a", 1)]) == Conflict(None)
    assert list(log.versions()) == [0, 1]


# -- a fresh log notes its identity atomically -------------------------------------------------
# A client notes the first namespace id and mesh it reads under one lock: a thread whose first
# read landed between two separate stores saw the id but a mesh of ``None`` and refused a
# healthy namespace as ``NamespaceMismatch`` ("mesh (None)").


def test_a_first_read_racing_another_threads_first_read_is_not_a_mesh_mismatch() -> None:
    store = MemoryStore()
    m0 = ManifestLog(store, NS).create_or_open(MESH)
    outcome: list[BaseException | None] = []
    threads: list[threading.Thread] = []

    def other_first_read(log: ManifestLog) -> None:
        try:
            log.latest()
        except BaseException as exc:
            outcome.append(exc)
        else:
            outcome.append(None)

    class Paused(ManifestLog):
        """Lets another thread's first read run right after the namespace id is noted."""

        def __setattr__(self, name: str, value: object) -> None:
            super().__setattr__(name, value)
            if name == "_namespace_id" and value is not None and not threads:
                threads.append(threading.Thread(target=other_first_read, args=(self,)))
                threads[0].start()
                threads[0].join(0.2)  # with the identity noted under a lock it waits for us

    log = Paused(store, NS)
    assert log.latest() == m0
    threads[0].join(5)
    assert outcome == [None], outcome


def test_a_reader_takes_the_shared_tail_from_the_version_it_read_before(
    store: ObjectStore,
) -> None:
    writer = ManifestLog(store, NS)
    head = grow(writer, writer.create_or_open(MESH), 3)
    forget_decoded()  # the reader decodes what it reads, as another process would
    reader = ManifestLog(store, NS)
    before = reader.latest()
    grow(writer, head, 2)
    forget_decoded()
    after = reader.latest(before)
    assert after.version == before.version + 2
    assert after.tail[:3] == before.tail
    assert all(a is b for a, b in zip(after.tail, before.tail, strict=False))
    assert after.tail[3:] == tuple(descriptor("p", step) for step in (3, 4))


# -- size bounds on writes -------------------------------------------------------------------


def test_a_manifest_over_the_read_limit_is_refused_before_the_put(
    store: ObjectStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: 52,000 producer ids with long sources made a 67 MB manifest that committed, after
    # which every latest() said it "was replaced by something other than BatchWeave".
    log = ManifestLog(store, NS)
    head = _commit(log, log.create_or_open(MESH), descriptor("p", 0))
    limit = 20_000
    monkeypatch.setattr(_codec, "MAX_MANIFEST_BYTES", limit)
    states = {
        f"pod-{i:04d}": ProducerState(
            epoch=1, offset=None, last_version=1, last_commit_at=0.0, source="lance:" + "s" * 200
        )
        for i in range(100)
    }
    with pytest.raises(NamespaceError, match="batchweave retire") as caught:
        log.commit(head, producers=states)
    message = str(caught.value)
    assert f"more than the {limit} bytes every reader accepts" in message
    assert "101 producer ids" in message
    assert "nothing was written" in message
    fresh = ManifestLog(store, NS)
    assert fresh.latest().version == head.version  # still readable; nothing after it
    assert list(fresh.versions()) == [0, 1]
    # Under the limit, the same kind of commit goes through.
    smaller = dict(list(states.items())[:10])
    assert isinstance(log.commit(head, producers=smaller), Committed)
    assert ManifestLog(store, NS).latest().version == head.version + 1

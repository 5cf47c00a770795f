"""Clocks that lie: a producer's wall clock stepped back or standing still, or running ahead.

A segment no version references yet (a prepared merge, a roll kept for a retry) may be
referenced only while the reclaimer cannot have deleted it; its age is judged on the log's
monotonic clock as well as its wall clock, so a wall clock stepped back (NTP) or frozen cannot
make an old one look fresh. A reader trusts a missing ``v+1`` only for a version it first saw
less than ``PROBE_TRUST_SECONDS`` ago on its monotonic clock, whatever the committer's clock
wrote into ``created_at``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from manifest_helpers import CountingStore, FaultyPutStore, descriptor, grow

from batchweave import MemoryStore, Mesh, Reclaimer, TransientStoreError
from batchweave._manifest import Committed, Conflict, ManifestLog, manifest_key
from batchweave._manifest._log import PROBE_TRUST_SECONDS
from batchweave._manifest._models import Manifest

MESH = Mesh(dp=8, cp=1)
NS = "runs/clocks"
GRACE = 600.0
HOUR = 3600.0


class _Host:
    """Real time (the store's ``last_modified`` and the reclaimer's clock), and a producer
    host's two clocks: its monotonic clock follows real time, its wall clock is off by
    ``wall_offset`` or, with ``wall_frozen``, stands still."""

    def __init__(self) -> None:
        self.real = 1.7e9
        self.wall_offset = 0.0
        self.wall_frozen: float | None = None

    def store_clock(self) -> float:
        return self.real

    def monotonic(self) -> float:
        return self.real - 1.7e9

    def wall(self) -> float:
        if self.wall_frozen is not None:
            return self.wall_frozen
        return self.real + self.wall_offset


def _wall_goes_wrong(host: _Host, how: str, elapsed: float) -> None:
    """Let ``elapsed`` seconds of real time pass, with the producer's wall clock going wrong."""
    if how == "stands still":
        host.wall_frozen = host.wall()
    host.real += elapsed
    if how == "steps back":
        host.wall_offset -= elapsed  # NTP stepped it back by about the real time passed


def _readable(store: MemoryStore) -> list[int]:
    """The producer offsets a fresh reader reads from the latest version (every segment read)."""
    reader = ManifestLog(store, NS)
    latest = reader.latest()
    return [d.offset for _, d in reader.descriptors(latest, 0, latest.next_step)]


def _producer_log(
    store: MemoryStore, host: _Host, monotonic: Callable[[], float] | None = None
) -> ManifestLog:
    """A producer's log: level merges prepared outside the commit, on ``host``'s clocks."""
    return ManifestLog(
        store,
        NS,
        clock=host.wall,
        monotonic=monotonic or host.monotonic,
        tail_limit=2,
        merge_fanout=2,
        deferred_merges=True,
    )


@pytest.mark.parametrize("how", ["stands still", "steps back"])
def test_a_prepared_merge_hours_old_is_dropped_whatever_the_wall_clock_says(how: str) -> None:
    # Before: the merge's age was the producer's wall clock minus its wall clock at the write.
    # Frozen, or stepped back by the hours passed, it called a merge written hours ago fresh:
    # the reclaimer (store clock) deleted it as an orphan, the next commit swapped it in anyway,
    # and every reader of those steps failed with "segment ... is missing".
    host = _Host()
    store = MemoryStore(clock=host.store_clock)
    log = _producer_log(store, host)
    head = grow(log, log.create_or_open(MESH), 4)
    assert [r.count for r in head.segments] == [2, 2]
    assert log.prepare_merge(head) > 0

    _wall_goes_wrong(host, how, 3 * HOUR)
    assert Reclaimer(store, NS, grace=GRACE, clock=host.store_clock).run_once().segments_deleted

    result = log.commit(head, append=[descriptor("p", 4)])
    assert isinstance(result, Committed)
    assert [r.count for r in result.manifest.segments] == [2, 2]  # dropped, not swapped in
    assert _readable(store) == list(range(5))


@pytest.mark.parametrize("how", ["stands still", "steps back"])
def test_a_prepared_merge_is_refreshed_by_the_monotonic_clock(how: str) -> None:
    # A producer committing seldom writes its merge again once it is half its age limit old;
    # a frozen or stepped-back wall clock must not stop that, nor keep the stale copy.
    host = _Host()
    store = MemoryStore(clock=host.store_clock)
    log = _producer_log(store, host)
    head = grow(log, log.create_or_open(MESH), 4)
    assert log.prepare_merge(head) > 0
    _wall_goes_wrong(host, how, 3 * GRACE)
    assert log.refresh_prepared_merge() > 0  # before: "fresh", nothing written
    assert Reclaimer(store, NS, grace=GRACE, clock=host.store_clock).run_once().segments_deleted
    result = log.commit(head, append=[descriptor("p", 4)])
    assert isinstance(result, Committed)
    assert [r.count for r in result.manifest.segments] == [4]  # the fresh copy
    assert _readable(store) == list(range(5))


def test_a_suspended_host_drops_its_prepared_merge_by_the_wall_clock() -> None:
    # Linux's monotonic clock stops while the host is suspended; the wall clock does not.
    host = _Host()
    store = MemoryStore(clock=host.store_clock)
    mono = [0.0]
    log = _producer_log(store, host, lambda: mono[0])
    head = grow(log, log.create_or_open(MESH), 4)
    assert log.prepare_merge(head) > 0
    host.real += 3 * HOUR  # asleep: the monotonic clock stood still
    assert Reclaimer(store, NS, grace=GRACE, clock=host.store_clock).run_once().segments_deleted
    assert isinstance(log.commit(head, append=[descriptor("p", 4)]), Committed)
    assert _readable(store) == list(range(5))


def test_a_retry_does_not_reuse_a_segment_rolled_hours_ago_under_a_frozen_wall_clock() -> None:
    # A commit whose manifest PUT failed reuses the segment its attempt rolled, but only while
    # no reclaimer can have deleted it: timed on the monotonic clock, not the frozen wall clock.
    host = _Host()
    store = MemoryStore(clock=host.store_clock)
    refused = [True]

    def fault(key: str) -> tuple[bool, Exception | None]:
        if refused[0] and "/_manifests/" in key:
            return False, TransientStoreError(f"{key}: 503 SlowDown (injected)")
        return True, None

    log = ManifestLog(
        FaultyPutStore(store, fault), NS, clock=host.wall, monotonic=host.monotonic, tail_limit=4
    )
    refused[0] = False
    head = log.create_or_open(MESH)
    refused[0] = True
    pending = [descriptor("p", offset) for offset in range(6)]
    assert isinstance(log.commit(head, append=pending), Conflict)  # rolled, then refused
    _wall_goes_wrong(host, "stands still", 3 * HOUR)
    assert Reclaimer(store, NS, grace=GRACE, clock=host.store_clock).run_once().segments_deleted
    refused[0] = False
    assert isinstance(log.commit(head, append=pending), Committed)
    assert _readable(store) == list(range(6))


# -- trusting a missing successor ---------------------------------------------------------------


def _commit(log: ManifestLog, head: Manifest, offset: int) -> Manifest:
    result = log.commit(head, append=[descriptor("p", offset)])
    assert isinstance(result, Committed)
    return result.manifest


def test_a_producer_clock_hours_ahead_cannot_make_a_reader_trust_a_reclaimed_successor() -> None:
    # Before: a reader that held version 1 for an hour found its created_at (the producer's
    # clock, an hour ahead) within PROBE_TRUST_SECONDS of its own clock, trusted the missing
    # (reclaimed) version 2, and saw no new step while version 3 held two of them.
    host = _Host()
    store = MemoryStore(clock=host.store_clock)
    producer = ManifestLog(store, NS, clock=lambda: host.real + HOUR)
    reader = ManifestLog(store, NS, clock=host.store_clock, monotonic=host.monotonic)
    held = _commit(producer, producer.create_or_open(MESH), 0)
    assert reader.latest() == held
    head = _commit(producer, _commit(producer, held, 1), 2)
    host.real += HOUR  # a long evaluation; the reclaimer deletes versions 0..2 meanwhile
    store.delete_many([reader.key(manifest_key(v)) for v in range(3)])
    assert reader.latest(held) == head


def test_trust_in_a_probe_ends_a_trust_interval_after_the_reader_first_saw_the_version() -> None:
    counting = CountingStore(MemoryStore())
    mono = [0.0]
    wall = [1.7e9]
    producer = ManifestLog(counting, NS, clock=lambda: wall[0] + HOUR)  # far ahead
    reader = ManifestLog(counting, NS, clock=lambda: wall[0], monotonic=lambda: mono[0])
    head = _commit(producer, producer.create_or_open(MESH), 0)
    wall[0] += HOUR  # the producer's created_at now matches the reader's clock
    assert reader.latest() == head  # first seen now
    counting.reset()
    mono[0] += PROBE_TRUST_SECONDS - 1
    assert reader.latest(head) is head  # trusted: one GET
    assert (counting.calls["get"], counting.calls["list"]) == (1, 0)
    mono[0] += 1
    counting.reset()
    assert reader.latest(head) is head  # no longer: a LIST confirms it
    assert counting.calls["list"] == 1


def test_a_reader_polling_at_the_head_stays_at_one_get_per_poll() -> None:
    # The steady state: a consumer at the head sees new versions as they come, each first seen
    # on its own clock, and a poll that finds nothing new costs the probe alone.
    counting = CountingStore(MemoryStore())
    now = [1.7e9]
    producer = ManifestLog(counting, NS, clock=lambda: now[0])
    reader = ManifestLog(counting, NS, clock=lambda: now[0], monotonic=lambda: now[0])
    head = producer.create_or_open(MESH)
    known = reader.latest()
    for offset in range(30):  # ten minutes: a commit every 20 s, a poll every 5 s
        head = _commit(producer, head, offset)
        for poll in range(4):
            counting.reset()
            known = reader.latest(known)
            assert known == head
            if poll:
                assert (counting.calls["get"], counting.calls["list"]) == (1, 0)
            now[0] += 5

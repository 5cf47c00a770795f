"""The per-rank consumer: agreement, exact slices, waiting, sealing, errors, read accounting."""

from __future__ import annotations

import itertools
import mmap
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fake_time import FakeTime

from batchweave import (
    ByteRange,
    ChecksumMismatch,
    Consumer,
    ConsumerError,
    ConsumerTimeout,
    CountingStore,
    FaultInjectingStore,
    FileStore,
    FormatError,
    MemoryStore,
    Mesh,
    NamespaceMismatch,
    ObjectNotFound,
    ObjectStore,
    Producer,
    read_footer,
)
from batchweave._consumer._reader import _runs
from batchweave._format._checksum import CHECKSUM_ALGOS, ChecksumAlgo
from batchweave._format._tgb import TRAILER_SIZE, TgbFooter
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import SliceTable

MIB = 1 << 20


# ---------------------------------------------------------------------------------------------
# helpers


class DataCountingStore(CountingStore):
    """Counts everything but manifest version reads, which are ranged reads too (bounded by the
    manifest size limit): these tests budget the requests and bytes of the data path."""

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        if "/_manifests/" in key:
            return self.inner.get_range(key, rng)
        return super().get_range(key, rng)


def payload(producer: int, offset: int, d: int, c: int, size: int = 0) -> bytes:
    """A slice that says where it belongs, optionally padded to ``size`` bytes."""
    return f"{producer}:{offset}:{d}:{c};".encode().ljust(size, b".")


def take(consumer: Iterable[tuple[int, Any]], n: int | None = None) -> list[tuple[int, Any]]:
    """Iterate like a training loop and stop after ``n`` steps (all with ``None``); the
    iterator stays live and is never asked for a step beyond the ``n``-th."""
    return list(itertools.islice(consumer, n))


def parse(data: bytes) -> tuple[int, int, int, int]:
    p, o, d, c = data.split(b";", 1)[0].split(b":")
    return int(p), int(o), int(d), int(c)


def in_threads(count: int, work: Callable[[int], None]) -> list[BaseException]:
    """Run ``work(i)`` for ``i`` in ``range(count)`` on as many threads; what they raised."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def produce(
    store: ObjectStore,
    namespace: str,
    mesh: Mesh,
    *,
    producers: int = 1,
    tgbs: int = 4,
    size: int = 0,
    seal: bool = True,
    start: threading.Event | None = None,
    slice_table_limit: int = 32,
    checksum_algo: ChecksumAlgo = "crc32c",
) -> None:
    """``producers`` concurrent producers each publish ``tgbs`` TGBs (offsets 0..tgbs-1).

    ``slice_table_limit=0`` keeps slice tables out of the manifest (consumers read footers).
    """

    def run(i: int) -> None:
        if start is not None:
            start.wait()
        with Producer(
            store,
            namespace,
            producer_id=f"p{i}",
            mesh=mesh,
            policy="naive",
            slice_table_limit=slice_table_limit,
            checksum_algo=checksum_algo,
        ) as p:
            for offset in range(tgbs):
                slices = [
                    payload(i, offset, d, c, size) for d in range(mesh.dp) for c in range(mesh.cp)
                ]
                p.append(slices, offset=offset)

    errors = in_threads(producers, run)
    assert not errors, errors
    if seal:
        with Producer(store, namespace, producer_id="p0", mesh=mesh, policy="naive") as p:
            p.seal()


def consume(store: ObjectStore, namespace: str, mesh: Mesh, **kw: Any) -> list[tuple[int, Any]]:
    with Consumer(store, namespace, mesh=mesh, **kw) as c:
        return list(c)


def budgeted(
    mesh: Mesh, *, dp_rank: int, retry_budget: int, stored: Mesh | None = None
) -> tuple[Consumer, FaultInjectingStore, FakeTime]:
    """A consumer of ``run`` (2 TGBs produced for ``stored``, by default ``mesh``) reading
    inline (``prefetch=0``) through a fault injector, with ``retry_budget`` and a fake clock."""
    inner = MemoryStore()
    produce(inner, "run", stored or mesh, tgbs=2)
    store = FaultInjectingStore(inner)
    fake = FakeTime()
    c = Consumer(
        store,
        "run",
        mesh=mesh,
        dp_rank=dp_rank,
        prefetch=0,
        retry_budget=retry_budget,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    return c, store, fake


# ---------------------------------------------------------------------------------------------
# agreement and exact slices


def test_32_ranks_agree_on_steps_and_read_their_own_slice(store: ObjectStore) -> None:
    """dp=4, cp=2, tp=2, pp=2 as 32 threads, started before 3 concurrent producers."""
    mesh = Mesh(dp=4, cp=2)
    world, producers, tgbs = 32, 3, 5
    results: dict[int, list[tuple[int, bytes]]] = {}
    errors: list[BaseException] = []
    start = threading.Event()

    def rank(r: int) -> None:
        try:
            with Consumer(
                store,
                "run",
                mesh=mesh,
                tp=2,
                pp=2,
                environ={"RANK": str(r), "WORLD_SIZE": str(world)},
                prefetch=2,
                max_workers=2,
                poll_interval=0.002,
                max_poll_interval=0.02,
                timeout=60,
            ) as c:
                results[r] = list(c)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    start.set()
    produce(store, "run", mesh, producers=producers, tgbs=tgbs, start=start)
    for t in threads:
        t.join()
    assert not errors, errors

    log = ManifestLog(store, "run")
    manifest = log.latest()
    steps = producers * tgbs
    assert manifest.next_step == steps
    for r, got in results.items():
        assert [s for s, _ in got] == list(range(steps)), r
        tp, cp, dp = r % 2, (r // 2) % 2, (r // 4) % 4
        for step, data in got:
            desc = log.descriptor(manifest, step)
            # the TGB the manifest assigns to this step, and exactly this rank's slice of it
            assert parse(data) == (int(desc.producer_id[1:]), desc.offset, dp, cp), (r, tp, step)
    # TP/PP peers deliver identical data; every produced TGB appears once, in offset order
    for r in range(world):
        assert results[r] == results[2 * ((r // 2) % 8)]  # the tp=0, pp=0 peer
    first = [parse(d)[:2] for _, d in results[0]]
    assert sorted(first) == [(p, o) for p in range(producers) for o in range(tgbs)]
    for p in range(producers):
        assert [o for q, o in first if q == p] == list(range(tgbs))


@pytest.mark.parametrize(
    ("dp", "cp"), [(8, 2), (2, 2), (4, 1), (2, 1)], ids=["dp4to8", "dp4to2", "cp2to1", "both"]
)
def test_resharded_consumers_cover_every_slice_once(dp: int, cp: int) -> None:
    store = MemoryStore()
    stored = Mesh(dp=4, cp=2)
    produce(store, "run", stored, tgbs=8)
    consumer_mesh = Mesh(dp=dp, cp=cp)
    seen: Counter[tuple[int, int, int]] = Counter()
    lengths = set()
    for d in range(dp):
        for c in range(cp):
            got = consume(store, "run", consumer_mesh, dp_rank=d, cp_rank=c)
            lengths.add(len(got))
            for _step, data in got:
                chunks = data if isinstance(data, list) else [data]
                assert len(chunks) == 2 // cp
                decoded = [parse(x) for x in chunks]
                # chunks of one rank belong to one replica of one TGB, in chunk order
                assert [x[3] for x in decoded] == list(range(c * (2 // cp), (c + 1) * (2 // cp)))
                assert len({x[:3] for x in decoded}) == 1
                seen.update((o, dd, cc) for _, o, dd, cc in decoded)
    assert lengths == {8 * 4 // dp}
    assert seen == Counter((o, d, c) for o in range(8) for d in range(4) for c in range(2))


# ---------------------------------------------------------------------------------------------
# waiting, sealing, timeouts


def test_consumer_started_before_producers_waits_then_receives_everything() -> None:
    store = MemoryStore()
    mesh = Mesh(dp=2, cp=2)
    producer: list[Producer] = []

    def create() -> None:
        producer.append(Producer(store, "live", producer_id="p0", mesh=mesh, policy="naive"))
        append(0)
        append(1)

    def append(offset: int) -> None:
        p = producer[0]
        p.append([payload(0, offset, d, c) for d in range(2) for c in range(2)], offset=offset)
        p.flush()

    script: list[Callable[[], None]] = [
        lambda: None,
        create,
        lambda: None,
        lambda: None,
        lambda: None,
        lambda: append(2),
        lambda: producer[0].seal(),
    ]
    fake = FakeTime(on_sleep=lambda: script.pop(0)() if script else None)
    c = Consumer(
        store,
        "live",
        mesh=mesh,
        dp_rank=1,
        cp_rank=0,
        clock=fake.clock,
        sleep=fake.sleep,
        poll_interval=0.01,
        max_poll_interval=0.04,
    )
    got = list(c)
    producer[0].close()
    assert [(s, parse(d)) for s, d in got] == [(s, (0, s, 1, 0)) for s in range(3)]
    assert not script  # the consumer polled through every producer action
    assert min(fake.sleeps) == 0.01
    assert max(fake.sleeps) == 0.04  # backoff doubled up to the cap while nothing arrived
    # the fake clock only moves in sleep, and every sleep happened inside next(): all stall
    assert c.stats.stall_seconds == pytest.approx(sum(fake.sleeps))
    assert c.stats.manifest_refreshes >= 4


def test_sealed_stream_ends_iteration_and_stays_ended() -> None:
    store = MemoryStore()
    mesh = Mesh(dp=2)
    produce(store, "run", mesh, tgbs=3)
    c = Consumer(store, "run", mesh=mesh, dp_rank=0)
    assert [s for s, _ in c] == [0, 1, 2]
    with pytest.raises(StopIteration):
        next(c)
    assert c.stats.steps == 3


def test_partial_last_step_is_not_delivered_by_any_rank() -> None:
    """DP doubled over an odd number of TGBs: the last TGB alone is not a complete step."""
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2), tgbs=3)
    for r in range(4):
        assert [s for s, _ in consume(store, "run", Mesh(dp=4), dp_rank=r)] == [0]


def test_timeout_names_the_step_waited_for() -> None:
    store = MemoryStore()
    mesh = Mesh(dp=2)
    produce(store, "run", mesh, tgbs=2, seal=False)
    fake = FakeTime()
    c = Consumer(
        store, "run", mesh=mesh, dp_rank=1, timeout=1.0, clock=fake.clock, sleep=fake.sleep
    )
    assert [s for s, _ in (next(c), next(c))] == [0, 1]
    with pytest.raises(ConsumerTimeout, match=r"step 2 .*within 1.0 s"):
        next(c)
    assert fake.now == pytest.approx(1.0)


def test_timeout_waiting_for_the_namespace() -> None:
    fake = FakeTime()
    c = Consumer(
        MemoryStore(),
        "nothing",
        mesh=Mesh(dp=1),
        dp_rank=0,
        timeout=0.5,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    with pytest.raises(ConsumerTimeout, match=r"'nothing'.*not created within 0.5 s"):
        next(c)


# ---------------------------------------------------------------------------------------------
# errors


def _object_of(store: ObjectStore, namespace: str, step: int) -> tuple[str, Any]:
    log = ManifestLog(store, namespace)
    ref = log.descriptor(log.latest(), step).objects[0]
    key = log.key(ref.key)
    footer = read_footer(
        store, key, footer_offset=ref.footer_offset, footer_length=ref.footer_length
    )
    return key, footer


@pytest.mark.parametrize("slice_table_limit", [32, 0], ids=["slice-table", "footer"])
@pytest.mark.parametrize("algo", CHECKSUM_ALGOS)
def test_corrupt_slice_is_detected_naming_step_object_slice_and_algorithm(
    algo: ChecksumAlgo, slice_table_limit: int
) -> None:
    store = MemoryStore()
    mesh = Mesh(dp=2, cp=2)
    produce(
        store, "run", mesh, tgbs=3, size=64, slice_table_limit=slice_table_limit, checksum_algo=algo
    )
    key, footer = _object_of(store, "run", 1)
    data = bytearray(store.get(key))
    data[footer.slices[2].offset + 10] ^= 0x01  # slice (1, 0)
    store.put(key, bytes(data))

    c = Consumer(store, "run", mesh=mesh, dp_rank=1, cp_rank=0)
    assert next(c)[0] == 0
    with pytest.raises(ChecksumMismatch) as info:
        next(c)
    message = str(info.value)
    assert "step 1" in message
    assert key in message
    assert "slice 2" in message
    assert algo in message
    # other ranks are unaffected: their slices are intact
    assert len(consume(store, "run", mesh, dp_rank=0, cp_rank=0)) == 3


@pytest.mark.parametrize(
    ("slice_table_limit", "detected_by"),
    [(0, r"step 1 .*footer.*manifest recorded"), (32, r"step 1 .*slice 0 is corrupt")],
    ids=["footer-check", "slice-table-check"],
)
def test_replaced_object_is_detected(slice_table_limit: int, detected_by: str) -> None:
    store = MemoryStore()
    mesh = Mesh(dp=2)
    produce(store, "run", mesh, tgbs=2, size=32, slice_table_limit=slice_table_limit)
    key0, _ = _object_of(store, "run", 0)
    key1, _ = _object_of(store, "run", 1)
    store.put(key1, store.get(key0))  # a valid TGB, but not the one committed at step 1
    with pytest.raises(ChecksumMismatch, match=detected_by):
        consume(store, "run", mesh, dp_rank=0)


def test_transient_errors_are_retried_with_backoff() -> None:
    inner = MemoryStore()
    mesh = Mesh(dp=2)
    produce(inner, "run", mesh, tgbs=2)
    store = FaultInjectingStore(inner)
    store.fail_next("get_range", times=3)
    fake = FakeTime()
    c = Consumer(store, "run", mesh=mesh, dp_rank=1, clock=fake.clock, sleep=fake.sleep)
    assert [parse(d) for _, d in c] == [(0, 0, 1, 0), (0, 1, 1, 0)]
    assert c.stats.retries == 3
    assert fake.sleeps == [0.05, 0.1, 0.2]


def _segmented(store: ObjectStore, tgbs: int, then: Callable[[int], object] = id) -> None:
    """One producer appends ``tgbs`` TGBs (dp=1) with a tail of 2, committing each before the
    next (``then(offset)`` runs after each commit): segments roll and merge, deterministically."""
    with Producer(
        store, "run", producer_id="p0", mesh=Mesh(dp=1), policy="naive", tail_limit=2
    ) as p:
        for offset in range(tgbs):
            p.append([payload(0, offset, 0, 0)], offset=offset)
            p.flush()
            then(offset)


def test_a_deleted_segment_is_named_and_called_damage() -> None:
    """Before: "step 0 (TGB step 0): the object is gone ... resume from a later checkpoint": no
    key, and the wrong advice, since no consumer can read any step the segment lists."""
    store = MemoryStore()
    _segmented(store, 12)
    log = ManifestLog(store, "run")
    ref = log.latest().segments[0]
    store.delete_many([log.key(ref.key)])
    with pytest.raises(ConsumerError) as info:
        consume(store, "run", Mesh(dp=1), dp_rank=0)
    message = str(info.value)
    assert message.startswith("step 0 (TGB step 0): segment ")
    assert repr(log.key(ref.key)) in message
    assert f"TGB steps {ref.first_step}..{ref.end_step - 1}" in message
    assert "batchweave verify" in message
    assert "later checkpoint" not in message
    assert isinstance(info.value.__cause__, ObjectNotFound)


def test_a_segment_merged_away_under_a_consumer_far_behind_is_read_from_the_latest_version() -> (
    None
):
    """A consumer reading a backlog holds the manifest version it opened; a merge replaces its
    segments and the reclaimer deletes them once they are old. Before, such a step failed with
    "the object is gone"; now the consumer reads the step through the latest version."""
    store = MemoryStore()
    c = Consumer(store, "run", mesh=Mesh(dp=1), dp_rank=0, prefetch=0)
    log = ManifestLog(store, "run")
    # opened on a version with segments of 2 TGBs, which later ones merge into one of 16
    _segmented(store, 24, then=lambda offset: c.open() if offset == 5 else None)
    old = {ref.key for ref in log.read(c.manifest_version or 0).segments}
    merged_away = old - {ref.key for ref in log.latest().segments}
    assert merged_away  # a merge replaced them
    store.delete_many([log.key(key) for key in merged_away])  # what the reclaimer does later
    assert [parse(d)[1] for _, d in take(c, 24)] == list(range(24))
    c.close()


@pytest.mark.parametrize("prefetch", [0, 4])
def test_a_consumer_adopts_the_latest_version_its_merged_away_fallback_read(prefetch: int) -> None:
    """The fallback above reads the latest version; the consumer keeps it, as a refresh would,
    so the steps after the first merged-away one read through it. Before, every such step paid
    a 404 GET of its segment and a latest() (GET and LIST) and the old version was kept: a
    consumer catching up thousands of steps paid that on each. Read-ahead steps scheduled with
    the old version use the adopted one without asking for the latest again."""
    inner = MemoryStore()
    store = CountingStore(inner)
    c = Consumer(store, "run", mesh=Mesh(dp=1), dp_rank=0, prefetch=prefetch)
    log = ManifestLog(inner, "run")
    _segmented(inner, 24, then=lambda offset: c.open() if offset == 5 else None)
    opened = log.read(c.manifest_version or 0)
    latest = log.latest()
    merged_away = {ref.key for ref in opened.segments} - {ref.key for ref in latest.segments}
    steps = sum(r.count for r in opened.segments if r.key in merged_away)
    assert steps >= 4  # several steps are read through merged-away segments
    inner.delete_many([log.key(key) for key in merged_away])
    before, refreshes = store.snapshot(), c.stats.manifest_refreshes
    assert [parse(d)[1] for _, d in take(c, 24)] == list(range(24))
    assert c.manifest_version == latest.version  # adopted
    assert store.snapshot().lists - before.lists == 1  # one latest() for all these steps
    assert c.stats.manifest_refreshes - refreshes == 1
    c.close()


def test_exhausted_retry_budget_names_step_object_and_slice() -> None:
    # DP halved: step 1 reads TGB 0 again, so its footer is cached and the failing read is the
    # slice itself
    c, store, fake = budgeted(Mesh(dp=1), dp_rank=0, retry_budget=2, stored=Mesh(dp=2))
    assert next(c)[0] == 0
    store.fail_next("get_range", times=3)
    with pytest.raises(
        ConsumerError, match=r"step 1 \(TGB step 0\), object '.*', slice 1.*budget \(2\)"
    ):
        next(c)
    assert len(fake.sleeps) == 2
    # the failed step is retried from scratch by the next call
    assert parse(next(c)[1]) == (0, 0, 1, 0)


def test_incompatible_consumer_cp_is_a_clear_error() -> None:
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2, cp=2), tgbs=1)
    with pytest.raises(NamespaceMismatch, match="must divide the stored cp=2"):
        consume(store, "run", Mesh(dp=2, cp=4), dp_rank=0, cp_rank=0)


def test_rank_coordinates_are_checked() -> None:
    with pytest.raises(ValueError, match="outside mesh"):
        Consumer(MemoryStore(), "x", mesh=Mesh(dp=2, cp=2), dp_rank=2, cp_rank=0)
    with pytest.raises(ValueError, match="give both dp_rank and cp_rank"):
        Consumer(MemoryStore(), "x", mesh=Mesh(dp=2, cp=2), dp_rank=1)
    with pytest.raises(ValueError, match="WORLD_SIZE is not set"):
        Consumer(MemoryStore(), "x", mesh=Mesh(dp=2, cp=2), environ={"RANK": "0"})


# ---------------------------------------------------------------------------------------------
# read accounting


def _footer_bytes(store: ObjectStore, namespace: str, tgbs: int) -> int:
    log = ManifestLog(store, namespace)
    m = log.latest()
    return sum(log.descriptor(m, t).objects[0].footer_length + TRAILER_SIZE for t in range(tgbs))


@pytest.mark.parametrize(
    ("consumer_mesh", "rank", "steps", "reads_per_step"),
    [
        (Mesh(dp=2, cp=2), (1, 1), 4, 1),  # identity
        (Mesh(dp=1, cp=2), (0, 1), 8, 1),  # DP halved: each footer serves two steps
        (Mesh(dp=2, cp=1), (1, 0), 4, 1),  # CP halved: two adjacent chunks in one read
    ],
    ids=["identity", "dp-halved", "cp-halved"],
)
def test_one_request_per_slice_once_the_footer_is_cached(
    consumer_mesh: Mesh, rank: tuple[int, int], steps: int, reads_per_step: int
) -> None:
    inner = MemoryStore()
    produce(inner, "run", Mesh(dp=2, cp=2), tgbs=4, size=MIB, slice_table_limit=0)
    store = DataCountingStore(inner)
    before = store.snapshot()
    c = Consumer(store, "run", mesh=consumer_mesh, dp_rank=rank[0], cp_rank=rank[1])
    got = list(c)
    counts = store.snapshot() - before
    stats = c.stats
    chunks = 2 // consumer_mesh.cp
    assert len(got) == steps
    assert stats.footer_reads == 4  # one exact range read per TGB object, ever
    assert stats.footer_cache_hits == steps - 4
    assert counts.range_gets == 4 + steps * reads_per_step
    assert stats.requests == counts.range_gets
    delivered = steps * chunks * MIB
    expected_read = delivered + _footer_bytes(inner, "run", 4)
    assert stats.bytes_delivered == delivered
    assert counts.range_bytes == stats.bytes_read == expected_read
    assert stats.read_amplification == pytest.approx(expected_read / delivered)
    assert stats.read_amplification <= 1.02


@pytest.mark.parametrize(
    ("consumer_mesh", "rank", "steps"),
    [(Mesh(dp=2, cp=2), (1, 1), 4), (Mesh(dp=1, cp=2), (0, 1), 8), (Mesh(dp=2, cp=1), (1, 0), 4)],
    ids=["identity", "dp-halved", "cp-halved"],
)
def test_one_request_per_step_with_a_slice_table(
    consumer_mesh: Mesh, rank: tuple[int, int], steps: int
) -> None:
    inner = MemoryStore()
    produce(inner, "run", Mesh(dp=2, cp=2), tgbs=4, size=MIB)
    m = ManifestLog(inner, "run").latest()
    assert all(ref.slices is not None for ref in m.tail[0].objects)
    store = DataCountingStore(inner)
    before = store.snapshot()
    c = Consumer(store, "run", mesh=consumer_mesh, dp_rank=rank[0], cp_rank=rank[1])
    got = list(c)
    counts = store.snapshot() - before
    delivered = steps * (2 // consumer_mesh.cp) * MIB
    assert len(got) == steps
    assert c.stats.footer_reads == 0
    assert counts.range_gets == c.stats.requests == steps  # no footer: one read per step
    assert counts.range_bytes == c.stats.bytes_read == c.stats.bytes_delivered == delivered


def test_a_large_mesh_keeps_its_slice_table_out_of_the_manifest() -> None:
    store = MemoryStore()
    produce(store, "run", Mesh(dp=4, cp=2), tgbs=1, slice_table_limit=7)
    ref = ManifestLog(store, "run").latest().tail[0].objects[0]
    assert ref.slice_count == 8
    assert ref.slices is None
    got = consume(store, "run", Mesh(dp=4, cp=2), dp_rank=3, cp_rank=1)
    assert [d for _, d in got] == [payload(0, 0, 3, 1, 0)]


def test_large_slices_are_split_into_parallel_parts() -> None:
    inner = MemoryStore()
    size = 100 * 1024
    produce(inner, "run", Mesh(dp=2), tgbs=3, size=size)
    store = DataCountingStore(inner)
    c = Consumer(
        store, "run", mesh=Mesh(dp=2), dp_rank=1, split_threshold=64 * 1024, part_size=32 * 1024
    )
    got = list(c)
    assert [d for _, d in got] == [payload(0, o, 1, 0, size) for o in range(3)]
    parts = -(-size // (32 * 1024))
    assert store.snapshot().range_gets == 3 * parts  # the manifest's slice table: no footers
    assert c.stats.bytes_delivered == 3 * size


def test_tensor_slices_decode_from_split_reads() -> None:
    store = MemoryStore()
    mesh = Mesh(dp=2)
    with Producer(store, "t", producer_id="p", mesh=mesh, policy="naive", codec="tensors") as p:
        for o in range(2):
            p.append(
                [{"x": np.full((64, 64), o * 10 + d, dtype=np.float32)} for d in range(2)],
                offset=o,
            )
        p.seal()
    got = consume(store, "t", mesh, dp_rank=1, split_threshold=4096, part_size=4096)
    assert [float(d["x"].sum()) for _, d in got] == [1 * 4096.0, 11 * 4096.0]


def test_flaky_store_still_delivers_every_step_exactly() -> None:
    """30% of all requests (manifest and data) fail transiently; the stream is unchanged."""
    inner = MemoryStore()
    mesh = Mesh(dp=2, cp=2)
    produce(inner, "run", mesh, producers=2, tgbs=5, seal=True)
    reference = consume(inner, "run", mesh, dp_rank=1, cp_rank=1)
    store = FaultInjectingStore(inner, seed=7, transient_error_rate=0.3)
    fake = FakeTime()
    c = Consumer(
        store,
        "run",
        mesh=mesh,
        dp_rank=1,
        cp_rank=1,
        retry_budget=50,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    assert list(c) == reference
    assert c.stats.retries == store.injected["transient"] > 0


def test_strided_consumers_split_the_steps_of_one_rank() -> None:
    """stride=3 readers starting at 0, 1, 2 together deliver exactly the rank's sequence."""
    store = MemoryStore()
    mesh = Mesh(dp=2, cp=2)
    produce(store, "run", mesh, tgbs=10)
    reference = consume(store, "run", mesh, dp_rank=0, cp_rank=1)
    parts = [
        consume(store, "run", mesh, dp_rank=0, cp_rank=1, start_step=w, stride=3, prefetch=2)
        for w in range(3)
    ]
    assert [[s for s, _ in part] for part in parts] == [[0, 3, 6, 9], [1, 4, 7], [2, 5, 8]]
    assert sorted(item for part in parts for item in part) == reference


@pytest.mark.parametrize(
    ("slice_table_limit", "read"), [(0, "footer"), (32, "slice 1")], ids=["footer", "table"]
)
def test_truncated_object_is_a_format_error_naming_step_and_object(
    slice_table_limit: int, read: str
) -> None:
    store = MemoryStore()
    mesh = Mesh(dp=2)
    produce(store, "run", mesh, tgbs=2, size=64, slice_table_limit=slice_table_limit)
    key, _ = _object_of(store, "run", 1)
    store.put(key, store.get(key)[:100])
    c = Consumer(store, "run", mesh=mesh, dp_rank=1)
    assert next(c)[0] == 0
    with pytest.raises(FormatError, match=rf"step 1 .*{key}.*{read}.*truncated"):
        next(c)


def test_large_slices_on_files_are_mapped_not_copied(tmp_path: Path) -> None:
    inner = FileStore(tmp_path, fsync=False)
    mesh = Mesh(dp=2)
    size = 2 * MIB
    with Producer(inner, "run", producer_id="p", mesh=mesh, codec="tensors") as p:
        for o in range(3):
            p.append(
                [{"x": np.full(size // 8, 10 * o + d, dtype=np.int64)} for d in range(2)],
                offset=o,
            )
        p.seal()
    store = DataCountingStore(inner)
    c = Consumer(
        store,
        "run",
        mesh=mesh,
        dp_rank=1,
        map_threshold=MIB,
        split_threshold=MIB,
        part_size=MIB // 2,
    )
    got = [data for _, data in c]
    assert [int(d["x"][0]) for d in got] == [1, 11, 21]
    assert all(d["x"].size == size // 8 for d in got)
    assert not got[0]["x"].flags.writeable  # a view of the read-only mapping
    assert store.snapshot().range_gets == c.stats.requests == 3  # one mapping per step, no parts
    victim, _ = _object_of(inner, "run", 2)
    inner.put(victim, inner.get(victim)[: size // 2])  # a shorter object behind step 2
    c2 = Consumer(inner, "run", mesh=mesh, dp_rank=1, map_threshold=MIB)
    assert next(c2)[0] == 0
    next(c2)
    with pytest.raises(FormatError, match=rf"step 2 .*{victim}.*truncated"):
        next(c2)
    # Below the threshold the same slices are copied into fresh (writable) buffers.
    c3 = Consumer(inner, "run", mesh=mesh, dp_rank=1)
    copied = [next(c3)[1], next(c3)[1]]  # step 2 is truncated
    assert [int(d["x"][0]) for d in copied] == [1, 11]
    assert isinstance(_buffer_owner(got[0]["x"]), mmap.mmap)
    assert isinstance(_buffer_owner(copied[0]["x"]), bytes)


@pytest.mark.parametrize("slice_table_limit", [32, 0])
def test_tensor_slices_after_the_first_decode_aligned_in_one_read_per_object(
    tmp_path: Path, slice_table_limit: int
) -> None:
    # Before: slices were stored back to back, so a float64 array in a slice after an odd-length
    # one sat at address mod 8 = 3, both for a consumer with a smaller cp reading several
    # slices with one range read and for a slice mapped from its file. The tensors codec pads
    # each slice to a multiple of 64 bytes: still back to back, so still one read per object.
    inner = FileStore(tmp_path, fsync=False)
    mesh = Mesh(dp=2, cp=2)
    odd = {"m": np.ones(3, np.bool_)}  # 3 bytes of tensor data: an odd-length slice before
    with Producer(
        inner,
        "run",
        producer_id="p",
        mesh=mesh,
        policy="naive",
        codec="tensors",
        slice_table_limit=slice_table_limit,
    ) as p:
        for o in range(2):
            x = {"x": np.arange(3, dtype=np.float64) + o, "c": np.ones(2, np.complex128)}
            p.append([odd, x, odd, x], offset=o)
        p.seal()
    _, footer = _object_of(inner, "run", 0)
    assert [e.offset % 64 for e in footer.slices] == [0, 0, 0, 0]
    assert _runs(footer, 0, [0, 1, 2, 3]) == [list(enumerate(footer.slices))]

    def check(x: dict[str, np.ndarray], o: int) -> None:
        assert x["x"].tolist() == [o, o + 1, o + 2]
        for arr in x.values():
            assert arr.flags.aligned, (arr.dtype, arr.ctypes.data % 64)

    store = DataCountingStore(inner)
    got = consume(store, "run", Mesh(dp=2, cp=1), dp_rank=1, prefetch=0)  # slices 2 and 3
    for o, (step, (first, second)) in enumerate(got):
        assert step == o
        assert first["m"].tolist() == [True] * 3
        check(second, o)
    footer_reads = 0 if slice_table_limit else 2
    assert store.snapshot().range_gets == 2 + footer_reads  # one range read per step
    mapped = consume(inner, "run", mesh, dp_rank=1, cp_rank=1, map_threshold=1)
    for o, (_, x) in enumerate(mapped):
        assert isinstance(_buffer_owner(x["x"]), mmap.mmap)  # a view of the mapped object
        check(x, o)


def _buffer_owner(array: np.ndarray) -> object:
    """The object whose memory ``array`` views (through any chain of views)."""
    base = array.base
    while isinstance(base, np.ndarray):
        base = base.base
    while isinstance(base, memoryview):
        base = base.obj
    return base


# ---------------------------------------------------------------------------------------------
# per-step bookkeeping


def test_failed_range_reads_count_as_requests_but_not_as_bytes() -> None:
    inner = MemoryStore()
    mesh = Mesh(dp=2)
    produce(inner, "run", mesh, tgbs=3, size=1000)
    counting = DataCountingStore(inner)  # sees only the reads that reached the store
    store = FaultInjectingStore(counting)
    store.fail_next("get_range", times=2, key_prefix="run/data/")
    fake = FakeTime()
    c = Consumer(store, "run", mesh=mesh, dp_rank=1, clock=fake.clock, sleep=fake.sleep)
    assert len(list(c)) == 3
    counts = counting.snapshot()
    assert c.stats.retries == 2
    assert c.stats.requests == counts.range_gets + 2
    assert c.stats.bytes_read == counts.range_bytes == c.stats.bytes_delivered


def test_stall_time_counts_calls_that_deliver_and_calls_that_fail() -> None:
    # The fake clock moves only in sleep, and every sleep here is a retry inside next().
    c, store, fake = budgeted(Mesh(dp=2), dp_rank=1, retry_budget=1)
    assert next(c)[0] == 0
    store.fail_next("get_range", times=2)
    with pytest.raises(ConsumerError, match="budget"):
        next(c)  # one backoff, then the budget is spent
    assert c.stats.steps == 1
    assert c.stats.stall_seconds == pytest.approx(0.05)
    store.fail_next("get_range", times=1)
    assert next(c)[0] == 1  # one backoff, then delivered
    assert c.stats.steps == 2
    assert c.stats.stall_seconds == pytest.approx(0.1) == pytest.approx(sum(fake.sleeps))


def test_slices_stored_back_to_back_are_read_in_one_run_from_footer_or_table() -> None:
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2, cp=2), tgbs=1)
    _, footer = _object_of(store, "run", 0)
    table = SliceTable.from_footer(footer)
    assert table is not None

    def spans(layout: SliceTable | TgbFooter, first: int, indices: list[int]) -> Any:
        return [
            [(i, e.offset, e.length, e.uncompressed_length, e.checksum) for i, e in run]
            for run in _runs(layout, first, indices)
        ]

    e = footer.slices
    whole = [[(i, e[i].offset, e[i].length, e[i].length, e[i].checksum) for i in range(4)]]
    assert spans(footer, 0, [0, 1, 2, 3]) == spans(table, 0, [0, 1, 2, 3]) == whole
    # a gap splits the reads; indices are numbered within the TGB, from the object's first slice
    assert spans(table, 0, [0, 2, 3]) == [whole[0][:1], whole[0][2:]]
    assert spans(footer, 10, [11, 12]) == [[(10 + i, *rest) for i, *rest in whole[0][1:3]]]

"""Guarantees that planted one-line mutants broke without any test noticing (misc. modules).

Each test pins one promise of the membership history (``batchweave._history``), producer
retirement, the mesh, sample ids, the slice codecs, the manifest codec, the metrics and
``batchweave check``; the docstrings name the promise and the mutant it catches.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import zstandard
from manifest_helpers import one_object_per_chunk
from prometheus_client import CollectorRegistry

import batchweave as bw
import batchweave._format._codecs as codecs
import batchweave._metrics as bw_metrics
from batchweave import FormatError, MemoryStore, Mesh, ObjectMeta
from batchweave._format._checksum import checksum
from batchweave._format._codecs import CODECS, decompress, first_overlap
from batchweave._format._sample_ids import parse_sample_ids
from batchweave._format._tgb_write import encode_tgb
from batchweave._history import (
    iter_membership,
    membership_batches,
    read_object_footer,
    write_parquet,
)
from batchweave._manifest._codec import (
    _RecentlyDecoded,
    decode_manifest,
    encode_manifest,
    forget_decoded,
)
from batchweave._manifest._log import Committed, ManifestLog
from batchweave._manifest._models import TgbObjectRef
from batchweave._mesh import MAX_DEGREE
from batchweave.cli._check import check_store

NS = "gaps"
DAY = 86400.0


def _publish(store: bw.ObjectStore, offsets: range, producer_id: str = "p") -> None:
    with bw.Producer(store, NS, producer_id=producer_id, mesh=Mesh(dp=2)) as producer:
        for offset in offsets:
            producer.append([b"%d" % offset, b"x"], offset=offset)


def _first_ref(store: bw.ObjectStore) -> tuple[str, TgbObjectRef]:
    log = ManifestLog(store, NS)
    latest = log.latest()
    (_, desc), *_ = log.descriptors(latest, latest.base_step, latest.next_step)
    ref = desc.objects[0]
    return log.key(ref.key), ref


# -- the membership history: read_object_footer checks the object against the manifest ---------


def test_a_footer_is_refused_when_the_manifest_records_another_object_size() -> None:
    """Mutant ``end != ref.size`` -> ``end > ref.size``: a manifest recording more bytes than
    footer plus trailer end at (bytes appended, a replaced object) passed."""
    store = MemoryStore()
    _publish(store, range(1))
    key, ref = _first_ref(store)
    for size in (ref.size + 1, ref.size - 1):
        with pytest.raises(FormatError, match=f"records size {size} but footer and trailer"):
            read_object_footer(store, key, ref.model_copy(update={"size": size}))
    assert len(read_object_footer(store, key, ref).slices) == 2


def test_a_footer_whose_checksum_differs_from_the_manifest_is_refused() -> None:
    """Mutant: the ``footer_checksum`` comparison dropped. The manifest's checksum is what ties
    an object to the commit that published it (a replaced, self-consistent object passes every
    other check)."""
    store = MemoryStore()
    _publish(store, range(1))
    key, ref = _first_ref(store)
    wrong = ref.model_copy(update={"footer_checksum": ref.footer_checksum ^ 1})
    with pytest.raises(bw.ChecksumMismatch, match="differs from the manifest's"):
        read_object_footer(store, key, wrong)


def test_a_footer_is_refused_when_the_manifest_places_it_elsewhere() -> None:
    """Mutant: the ``payload_length != footer_offset`` check dropped. A manifest that starts the
    footer ``k`` bytes early (its length and checksum made to match the bytes there) passed."""
    store = MemoryStore()
    _publish(store, range(1))
    key, ref = _first_ref(store)
    algo = read_object_footer(store, key, ref).checksum_algo
    k = 1
    start = ref.footer_offset - k
    data = store.get(key)
    footer_bytes = data[start : start + ref.footer_length + k]
    shifted = ref.model_copy(
        update={
            "footer_offset": start,
            "footer_length": ref.footer_length + k,
            "footer_checksum": checksum(footer_bytes, algo),
            "slices": None,
        }
    )
    with pytest.raises(FormatError, match=r"the footer follows .* payload bytes, the manifest"):
        read_object_footer(store, key, shifted)


def test_a_footer_is_refused_when_the_manifest_records_another_slice_count() -> None:
    """Mutant: the ``len(footer.slices) != ref.slice_count`` check dropped."""
    store = MemoryStore()
    _publish(store, range(1))
    key, ref = _first_ref(store)
    wrong = ref.model_copy(update={"slice_count": 1, "slices": None})
    with pytest.raises(FormatError, match="records 1 slices, the footer 2"):
        read_object_footer(store, key, wrong)


def test_a_missing_object_at_or_above_base_step_is_damage_not_a_reclamation() -> None:
    """Mutant ``step < base`` -> ``step <= base``: an object missing at ``base_step`` itself
    (deleted outside BatchWeave; no pass moved ``base_step``) was reported as reclaimed during
    the export, telling the operator to simply export again."""
    store = MemoryStore()
    _publish(store, range(3))
    key, _ = _first_ref(store)
    store.delete_many([key])
    with pytest.raises(bw.ObjectNotFound) as info:
        list(iter_membership(store, NS))
    assert not isinstance(info.value, bw.StepReclaimed)


def test_rows_of_a_step_in_several_objects_name_each_slice_by_its_position() -> None:
    """Mutant ``divmod(ref.first_slice + j, cp)`` -> ``divmod(j, cp)``: a TGB may be several
    objects (``TgbObjectRef.first_slice``); the second object's slice was exported as (0, 0)."""
    store = MemoryStore()
    log = ManifestLog(store, NS)
    base = log.create_or_open(Mesh(dp=1, cp=2))
    desc = one_object_per_chunk(log, 0, [b"chunk 0", b"chunk 1"])
    refs = desc.objects
    assert isinstance(log.commit(base, append=[desc]), Committed)
    rows = list(iter_membership(store, NS))
    assert [(r.dp, r.cp, r.key) for r in rows] == [(0, 0, refs[0].key), (0, 1, refs[1].key)]


def test_membership_batches_hold_at_most_batch_rows_rows() -> None:
    """Mutant ``len(buffer) >= batch_rows`` -> ``>``: batches held ``batch_rows + 1`` rows."""
    store = MemoryStore()
    _publish(store, range(3))  # 6 rows
    sizes = [batch.num_rows for batch in membership_batches(store, NS, batch_rows=2)]
    assert sizes == [2, 2, 2]


def test_progress_counts_the_steps_being_read() -> None:
    """Mutant: ``total`` one above the number of steps; ``progress(done, total)`` never
    reached ``total`` (a bar stuck short of 100 %)."""
    store = MemoryStore()
    _publish(store, range(3))
    calls: list[tuple[int, int]] = []
    list(
        iter_membership(
            store, NS, start=1, progress=lambda done, total: calls.append((done, total))
        )
    )
    assert calls == [(1, 2), (2, 2)]


def test_an_empty_history_is_written_as_an_empty_parquet_file(tmp_path: Path) -> None:
    """Mutant: the rename skipped when no row was read; ``write_parquet`` must leave the file
    it returns a row count for, and no ``.partial-`` file."""
    store = MemoryStore()
    _publish(store, range(0))
    path = tmp_path / "history.parquet"
    assert write_parquet(store, NS, str(path)) == 0
    assert pq.read_table(path).num_rows == 0
    assert [p.name for p in tmp_path.iterdir()] == ["history.parquet"]


# -- retire_producers ---------------------------------------------------------------------------


def _aged(store: bw.ObjectStore, producer_id: str, last_commit_at: float) -> None:
    log = ManifestLog(store, NS)
    latest = log.latest()
    state = latest.producers[producer_id].model_copy(update={"last_commit_at": last_commit_at})
    assert isinstance(log.commit(latest, producers={producer_id: state}), Committed)


def test_an_id_idle_for_exactly_idle_for_seconds_is_retired() -> None:
    """Mutant ``last_commit_at <= idle_before`` -> ``<``: "ids whose last commit is
    ``idle_for`` seconds old *or older*"."""
    store = MemoryStore()
    _publish(store, range(1))
    _aged(store, "p", 1_700_000_000.0)
    report = bw.retire_producers(store, NS, idle_for=DAY, wall_clock=lambda: 1_700_000_000.0 + DAY)
    assert report.retired == ("p",)
    assert "p" not in ManifestLog(store, NS).latest().producers


def test_an_id_named_twice_is_retired_and_reported_once() -> None:
    """Mutant: ``producer_ids`` not deduplicated; ``--id a --id a`` reported ``a`` twice."""
    store = MemoryStore()
    _publish(store, range(1), "a")
    _publish(store, range(1), "b")
    report = bw.retire_producers(
        store, NS, idle_for=DAY, producer_ids=["a", "a", "zz", "zz"], wall_clock=lambda: 4e9
    )
    assert (report.retired, report.unknown, report.remaining) == (("a",), ("zz",), 1)


# -- Mesh ---------------------------------------------------------------------------------------


def test_a_degree_of_max_degree_is_accepted_and_one_more_refused() -> None:
    """Mutant ``degree <= MAX_DEGREE`` -> ``<``: the documented largest degree was refused."""
    assert Mesh(dp=MAX_DEGREE).dp == MAX_DEGREE
    assert Mesh(dp=1, cp=MAX_DEGREE).cp == MAX_DEGREE
    with pytest.raises(ValueError, match=f"Mesh dp must be <= {MAX_DEGREE}"):
        Mesh(dp=MAX_DEGREE + 1)


def test_slice_index_takes_integers_only_and_returns_a_plain_int() -> None:
    """Mutant: the ``as_int`` conversion skipped: ``True`` was read as rank 1 and a NumPy rank
    gave a NumPy index (which survives no JSON or strict model)."""
    mesh = Mesh(dp=2, cp=2)
    index = mesh.slice_index(np.int64(1), np.int32(1))
    assert (index, type(index)) == (3, int)
    with pytest.raises(TypeError, match="dp_rank must be an integer, got the bool True"):
        mesh.slice_index(True, 0)


# -- sample ids ---------------------------------------------------------------------------------


def test_booleans_are_no_sample_ids() -> None:
    """Mutant: ``_is_id`` accepts ``bool``: ``true`` would be exported as the id ``"True"``."""
    with pytest.raises(ValueError, match="entry 0 must be a list of sample ids"):
        parse_sample_ids("[[true]]", 1)
    assert parse_sample_ids('[[1, "a", 2.5]]', 1) == [("1", "a", "2.5")]


# -- tensor and raw codecs, zstd ----------------------------------------------------------------


def test_a_tensor_header_longer_than_the_slice_after_its_prefix_is_refused() -> None:
    """Mutant ``min(size - 8, ...)`` -> ``min(size, ...)``: a header length reaching past the
    slice's end (by up to 8 bytes) was read short and accepted."""
    header = json.dumps({"tensors": []}).encode()
    blob = (len(header) + 4).to_bytes(8, "little") + header  # claims 4 bytes the slice lacks
    with pytest.raises(FormatError, match="exceeds"):
        CODECS["tensors"].decode(blob)


def test_tensors_overlapping_by_one_byte_are_refused() -> None:
    """Mutant ``start < end`` -> ``start < end - 1`` in ``first_overlap``."""
    header = {
        "tensors": [
            {"name": "a", "dtype": "int64", "shape": [1], "offset": 256},
            {"name": "b", "dtype": "int64", "shape": [1], "offset": 263},
        ]
    }
    raw = json.dumps(header).encode()
    blob = len(raw).to_bytes(8, "little") + raw + bytes(300)
    with pytest.raises(FormatError, match="'a' and 'b' overlap"):
        CODECS["tensors"].decode(blob)
    assert first_overlap([(0, 8, "a"), (7, 9, "b")]) == ("a", "b")
    assert first_overlap([(0, 8, "a"), (8, 9, "b")]) is None


def test_a_streamed_zstd_slice_longer_than_recorded_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mutant: the streaming decompressor reads ``uncompressed_length`` bytes, not one more,
    so a frame without a content size that holds more data than the footer records was cut
    short silently instead of refused (above ``_ONE_SHOT_LIMIT``; lowered here)."""
    monkeypatch.setattr(codecs, "_ONE_SHOT_LIMIT", 16)
    data = bytes(range(256)) * 4
    unframed = zstandard.ZstdCompressor(write_content_size=False).compress(data)
    assert decompress(unframed, "zstd", len(data)) == data
    with pytest.raises(FormatError, match=f"decompressed to {len(data) - 5 + 1} bytes"):
        decompress(unframed, "zstd", len(data) - 5)


def test_a_strided_memoryview_is_stored_as_its_elements_in_order() -> None:
    """Mutant: ``_raw_encode`` returns a non-contiguous view as it is."""
    view = memoryview(bytes(range(10)))[::2]
    encoded = encode_tgb([view], Mesh(dp=1))
    stored = b"".join(bytes(part) for part in encoded.parts)
    entry = encoded.footer.slices[0]
    assert stored[entry.offset : entry.offset + entry.length] == bytes(view)


# -- the manifest codec -------------------------------------------------------------------------


def test_a_manifest_body_longer_than_its_header_says_is_refused() -> None:
    """Mutant ``len(body) != length`` -> ``<``: a body with bytes past the recorded length (a
    checksum computed over all of them) decoded, although the header's length is wrong."""
    store = MemoryStore()
    _publish(store, range(1))
    log = ManifestLog(store, NS)
    data = encode_manifest(log.latest())
    body = data[data.index(b"\n") + 1 :] + b" "  # trailing whitespace: still valid JSON
    lying = f"batchweave-manifest crc32c={checksum(body, 'crc32c'):08x} length={len(body) - 1}\n"
    forget_decoded()
    with pytest.raises(FormatError, match="longer than its header says"):
        decode_manifest(lying.encode() + body, key="runs/x/_manifests/0.manifest")


def test_an_object_with_more_descriptors_than_the_bound_does_not_evict_the_cache() -> None:
    """Mutant: the size check on entry dropped; an object "not kept" for its descriptors was
    put anyway and evicted every cached manifest before being evicted itself."""
    cache = _RecentlyDecoded(entries=8, max_bytes=1 << 20, max_tgbs=10)
    kept, huge = object(), object()
    cache.put("a", b"a", kept, tgbs=3)
    cache.put("big", b"big", huge, tgbs=11)
    assert cache.get("a", b"a") is kept
    assert cache.get("big", b"big") is None
    assert cache.cached_tgbs == 3


# -- metrics ------------------------------------------------------------------------------------


class _Switchable(bw.StoreWrapper):
    """A store whose listings fail while ``down`` is set (an outage between two passes)."""

    down = False

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        if self.down:
            raise bw.StoreUnavailable("down")
        return super().list(prefix, start_after=start_after)


def test_a_pass_failing_before_it_deletes_does_not_count_the_previous_pass_again(
    registry: CollectorRegistry,
) -> None:
    """Mutant ``partial is not before`` dropped: a pass failing before it reported anything
    counted the previous pass's deletions a second time."""
    store = _Switchable(MemoryStore())
    _publish(store, range(4))
    bw.Watermarks(store, NS).record("c", step=3)
    reclaimer = bw.track_metrics(bw.Reclaimer(store, NS, grace=0), registry=registry)
    assert reclaimer.run_once().tgbs_deleted == 3
    store.down = True
    with pytest.raises(bw.StoreUnavailable):
        reclaimer.run_once()
    get = registry.get_sample_value
    assert get("batchweave_reclaim_errors_total", {"namespace": NS}) == 1
    assert get("batchweave_reclaimed_objects_total", {"namespace": NS, "kind": "tgb"}) == 3
    assert get("batchweave_reclaim_passes_total", {"namespace": NS}) == 1


def test_registries_get_their_own_metrics_and_are_freed_after_use() -> None:
    """Before: ``metrics()`` kept every registry it was given in a table for ever (a process
    using a registry per job or test never freed any); with ``id(registry)`` as the key, a new
    registry at a collected one's address could also be handed its metric objects."""
    refs = []
    for _ in range(3):
        registry = CollectorRegistry()
        found = bw_metrics.metrics(registry)
        assert found.registry is registry
        assert bw_metrics.metrics(registry) is found
        reclaimer = bw.track_metrics(bw.Reclaimer(bw.MemoryStore(), NS), registry=registry)
        reclaimer.run_once()
        assert registry.get_sample_value("batchweave_reclaim_passes_total", {"namespace": NS}) == 1
        refs.append(weakref.ref(registry))
        del registry, found, reclaimer
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


# -- batchweave check ---------------------------------------------------------------------------


class _RaceStore(bw.StoreWrapper):
    """Misbehaves only on the race check's creates (keys with ``/race/``), as ``how`` says."""

    def __init__(self, inner: bw.ObjectStore, how: str) -> None:
        super().__init__(inner)
        self.how = how

    def put(
        self, key: str, data: bytes | memoryview, *, mode: bw.PutMode = bw.PutMode.OVERWRITE
    ) -> None:
        if mode is not bw.PutMode.CREATE or "/race/" not in key:
            return super().put(key, data, mode=mode)
        if self.how == "ambiguous":  # every create times out, whether it landed or not
            with contextlib.suppress(bw.ObjectExists):
                super().put(key, data, mode=mode)
            raise bw.AmbiguousWriteError("timed out")
        if self.how == "replaces":  # a losing create replaces the object, then says it exists
            try:
                super().put(key, data, mode=mode)
            except bw.ObjectExists:
                super().put(key, data)
                raise
            return None
        if self.how == "nobody":  # the object lands, every writer is told it lost
            with contextlib.suppress(bw.ObjectExists):
                super().put(key, data, mode=mode)
            raise bw.ObjectExists(key)
        raise AssertionError(self.how)


def _race_row(how: str) -> tuple[bool, str]:
    report = check_store(_RaceStore(MemoryStore(), how), requests=1, race_threads=3, race_rounds=1)
    row = next(c for c in report.checks if c.name == "concurrent create race")
    return row.ok, row.detail


def test_creates_that_all_answer_ambiguously_pass_when_one_object_landed() -> None:
    """Mutant: every ambiguous create counted as a winner; the race check then failed a store
    whose creates merely timed out (the object read back decides, as for commits)."""
    ok, detail = _race_row("ambiguous")
    assert ok, detail


def test_a_losing_create_that_replaced_the_object_fails_the_race_check() -> None:
    """Mutant: the ``stored != winners[0]`` check dropped; one create won but the object
    holds a loser's bytes."""
    ok, detail = _race_row("replaces")
    assert not ok
    assert "holds another writer's bytes" in detail


def test_a_race_that_nobody_won_fails_the_race_check() -> None:
    """Mutant ``len(winners) != 1`` -> ``> 1``: no winner at all passed (or crashed)."""
    ok, detail = _race_row("nobody")
    assert not ok
    assert "0 of 3 concurrent creates of one key succeeded" in detail


class _LostDuringLatency(bw.StoreWrapper):
    """The endpoint becomes unreachable once the latency measurements start."""

    def put(
        self, key: str, data: bytes | memoryview, *, mode: bw.PutMode = bw.PutMode.OVERWRITE
    ) -> None:
        if "/latency/" in key:
            raise bw.StoreUnavailable("endpoint unreachable")
        return super().put(key, data, mode=mode)


def test_an_endpoint_lost_during_the_latency_measurements_is_raised() -> None:
    """Mutant: ``_time`` reports ``StoreUnavailable`` as a failed latency row; check_store
    documents that it raises it (naming the prefix left behind), not a report."""
    with pytest.raises(bw.StoreUnavailable, match="objects of this check may remain under"):
        check_store(_LostDuringLatency(MemoryStore()), requests=1, race_threads=2, race_rounds=1)


class _CannotWrite(bw.StoreWrapper):
    """Credentials that can read and list but not write; counts the listing and deletes."""

    def __init__(self, inner: bw.ObjectStore) -> None:
        super().__init__(inner)
        self.cleanup_calls = 0

    def put(
        self, key: str, data: bytes | memoryview, *, mode: bw.PutMode = bw.PutMode.OVERWRITE
    ) -> None:
        raise bw.AccessDenied(f"PUT {key}: access denied")

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self.cleanup_calls += 1
        return super().list(prefix, start_after=start_after)

    def delete_many(self, keys: Iterable[str]) -> None:
        self.cleanup_calls += 1
        super().delete_many(keys)


def test_credentials_that_cannot_write_are_raised_without_a_cleanup() -> None:
    """Mutant: the cleanup ran after a store error before the first create landed ("there is
    nothing to remove"): more requests with credentials that fail, and a spurious warning."""
    store = _CannotWrite(MemoryStore())
    with pytest.raises(bw.AccessDenied):
        check_store(store, requests=1, race_threads=2, race_rounds=1)
    assert store.cleanup_calls == 0


class _LyingReads(bw.StoreWrapper):
    """``get_range_into`` fills the right count of zeros; listings report size 0."""

    def __init__(self, inner: bw.ObjectStore, lie: str) -> None:
        super().__init__(inner)
        self.lie = lie

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        count = super().get_range_into(key, start, buffer)
        if self.lie == "range_into":
            buffer[:count] = bytes(count)
        return count

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        for meta in super().list(prefix, start_after=start_after):
            yield dataclasses.replace(meta, size=0) if self.lie == "list_sizes" else meta


@pytest.mark.parametrize(
    ("lie", "row", "says"),
    [
        ("range_into", "get_range_into", "filled 4,096 bytes, not the 4,096 expected"),
        ("list_sizes", "list order and start_after", "reported wrong sizes"),
    ],
)
def test_a_store_returning_wrong_bytes_or_sizes_fails_the_check(
    lie: str, row: str, says: str
) -> None:
    """Mutants: ``get_range_into``'s bytes not compared (only its count), and the listed sizes
    not compared: BatchWeave reads large slices into buffers and sizes objects from listings."""
    report = check_store(_LyingReads(MemoryStore(), lie), requests=1, race_threads=2, race_rounds=1)
    result = next(c for c in report.checks if c.name == row)
    assert not result.ok
    assert says in result.detail
    assert row in [c.name for c in report.failed]


class _KeepsLatencyObjects(bw.StoreWrapper):
    """Deletes of the latency objects are acknowledged but do nothing."""

    def delete_many(self, keys: Iterable[str]) -> None:
        super().delete_many([k for k in keys if "/latency/" not in k])


def test_objects_still_listed_after_the_cleanup_fail_the_cleanup_row() -> None:
    """Mutant: the listing after the cleanup not looked at; the check said it removed
    everything while objects stayed under the scratch prefix."""
    report = check_store(
        _KeepsLatencyObjects(MemoryStore()), requests=2, race_threads=2, race_rounds=1
    )
    cleanup = report.checks[-1]
    assert cleanup.name == "cleanup"
    assert not cleanup.ok
    assert "objects are still listed under" in cleanup.detail


def test_a_clock_that_does_not_move_gives_no_dac_estimate() -> None:
    """Mutant: the ``probe + put <= 0`` guard dropped; a zero fragile window divided by zero."""
    report = check_store(
        MemoryStore(), requests=2, clock=lambda: 0.0, race_threads=2, race_rounds=1
    )
    assert report.ok
    assert report.dac is None


def test_zero_requests_per_measurement_are_refused() -> None:
    """Mutant ``requests < 1`` -> ``< 0``: zero requests gave NaN percentiles."""
    with pytest.raises(ValueError, match="requests must be at least 1, got 0"):
        check_store(MemoryStore(), requests=0)

"""Guarantees of the read side that mutation testing found unchecked.

Each test pins one promise of a docstring that a planted one-line change broke while every other
test still passed. The reclaimer caps its cut at the committed steps, leaves other tools' files
alone, deletes the TGBs below a crashed pass's cut at once, retries refused deletions on its next
pass, keeps unreferenced segments for twice the metadata grace, never deletes a manifest version
while an older one survives, and stops at once on an unreachable store. A consumer refuses a
reclaimed step when its state is loaded, gives manifest reads ``retry_budget`` retries, refuses a
state whose step is no whole number, does not count a step interrupted before it reached the caller
and splits only reads of at least ``split_threshold`` bytes; ``gather`` raises a failure only once
every job has finished. A TGB footer's empty slices must lie in the payload, and a trailer claiming
one byte more than precedes it is "truncated". The file store confines keys to its root (not to
every path that merely begins with the root's name), maps empty objects and refuses a negative read
start as a caller's mistake; a hand-built ``EncodedTgb`` whose footer offset disagrees with its
footer is refused.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from _reclaimer_worker import FakeClock, RefuseOne, Writer
from fake_time import FakeTime
from test_consumer import payload, produce

import batchweave as bw
from batchweave import (
    ByteRange,
    Consumer,
    FileStore,
    FormatError,
    InvalidKey,
    MemoryStore,
    ObjectStore,
    StoreWrapper,
    Suffix,
    TransientStoreError,
    encode_tgb,
)
from batchweave._consumer._prefetch import Workers, gather
from batchweave._format._tgb import EncodedTgb
from batchweave._format._tgb_read import parse_footer
from batchweave._format._tgb_write import _pack_trailer
from batchweave._manifest import Committed, ManifestLog, manifest_key
from batchweave._store._base import ObjectMeta

NS = "runs/gaps"
GRACE = 150.0
MESH = bw.Mesh(dp=2, cp=1)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(clock: FakeClock) -> bw.MemoryStore:
    return bw.MemoryStore("gaps", clock=clock)


def reclaimer(store: bw.ObjectStore, clock: FakeClock) -> bw.Reclaimer:
    return bw.Reclaimer(store, NS, grace=GRACE, clock=clock, sleep=lambda _: None)


def data_keys(store: bw.ObjectStore) -> set[str]:
    return {m.key for m in store.list(f"{NS}/data/")}


def tgb_key(store: bw.ObjectStore, step: int) -> str:
    """The store key of the (only) object of TGB ``step``."""
    log = ManifestLog(store, NS)
    return log.key(log.descriptor(log.latest(), step).objects[0].key)


# -- reclaimer -------------------------------------------------------------------------------


def test_a_watermark_past_the_committed_steps_cuts_at_the_head(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    # "Commit base_step = boundary (capped at the committed steps)": a checkpoint that resumes
    # beyond what producers committed so far must not make the pass fail or cut past the head.
    Writer(store, NS, MESH).publish(5)
    bw.Watermarks(store, NS).record("ahead", 9)
    report = reclaimer(store, clock).run_once()
    assert (report.boundary, report.base_step_after) == (9, 5)
    assert report.tgbs_deleted == 5
    latest = ManifestLog(store, NS).latest()
    assert (latest.base_step, latest.next_step) == (5, 5)


def test_files_of_another_tool_are_never_deleted_however_old(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    # "objects not named the way BatchWeave names its own (another tool's files) are left
    # alone", however long ago they were written; a crashed producer's upload is not.
    writer = Writer(store, NS, MESH)
    writer.publish(2)
    foreign = [f"{NS}/data/other-tool/notes.bin", f"{NS}/data/w0/0/not-a-tgb.tgb"]
    for key in foreign:
        store.put(key, b"not ours")
    orphan = writer.orphan()
    clock.advance(10 * GRACE)
    report = reclaimer(store, clock).run_once()
    assert report.orphans_deleted == 1
    assert orphan not in data_keys(store)
    assert set(foreign) <= data_keys(store)


def test_a_crashed_pass_cut_is_finished_at_once_when_versions_followed_it(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    # A pass killed between committing base_step and deleting: the next pass finds the TGBs
    # below the cut "in the newest surviving version below the cut", even when producers
    # committed more versions (with the same base_step) since, and deletes them at once
    # rather than leaving them to the orphan rule, which waits for the grace period.
    writer = Writer(store, NS, MESH)
    for _ in range(5):
        writer.publish(2)
    bw.Watermarks(store, NS).record("ckpt", 6)
    log = ManifestLog(store, NS)
    cut = log.commit(log.latest(), base_step=6)  # the crashed pass got this far
    assert isinstance(cut, Committed)
    writer.publish(1)  # a producer commits on top of the cut
    below = {tgb_key(store, step) for step in range(6, 11)}
    assert len(data_keys(store)) == 11

    report = reclaimer(store, clock).run_once()  # a fresh reclaimer, no time passed
    assert report.tgbs_deleted == 6
    assert report.orphans_deleted == 0
    assert data_keys(store) == below


def test_a_refused_tgb_deletion_is_retried_by_the_next_pass(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    # "Fix the permissions (or object lock) on those keys; the next pass retries them": the
    # TGB is found below the cut again, not left to the orphan rule and its grace period.
    writer = Writer(store, NS, MESH)
    for _ in range(4):
        writer.publish(2)
        clock.advance(1)
    locked = tgb_key(store, 3)
    bw.Watermarks(store, NS).record("ckpt", 6)
    refusing = RefuseOne(store, locked)
    passes = reclaimer(refusing, clock)
    with pytest.raises(bw.AccessDenied, match="refused to delete 1 objects"):
        passes.run_once()
    assert locked in data_keys(store)
    assert passes.last_report is not None
    assert passes.last_report.tgbs_deleted == 5

    refusing.refused = ""  # the lock was lifted
    clock.advance(1)
    report = passes.run_once()
    assert report.tgbs_deleted == 1
    assert report.orphans_deleted == 0
    assert locked not in data_keys(store)


def test_unreferenced_segments_are_kept_for_twice_the_metadata_grace(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    # Step 5 of a pass: segments referenced by neither the latest version nor the one settled
    # metadata_grace ago go only once "older than 2 * metadata_grace" (young segments whose
    # last reference was dropped a grace ago must stay).
    writer = Writer(store, NS, MESH)
    writer.log = ManifestLog(store, NS, tail_limit=4)  # segments roll early
    for _ in range(12):
        writer.publish(2)
        clock.advance(1)
    bw.Watermarks(store, NS).record("ckpt", 20)
    passes = reclaimer(store, clock)
    first = passes.run_once()  # commits the cut: nothing has settled yet
    assert (first.base_step_after, first.segments_deleted) == (20, 0)
    cut = ManifestLog(store, NS).latest()
    unreferenced = {m.key for m in store.list(f"{NS}/_segments/")} - {
        f"{NS}/{ref.key}" for ref in cut.segments
    }
    assert unreferenced

    clock.advance(passes.metadata_grace + 1)  # the cut settled; segments under 2 x grace old
    assert passes.run_once().segments_deleted == 0
    clock.advance(passes.metadata_grace)
    assert passes.run_once().segments_deleted == len(unreferenced)


def test_a_refused_manifest_deletion_keeps_every_newer_version(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    # "never delete a newer version while an older one survives": the survivors must stay a
    # suffix of history, so one version the store refuses to delete stops the deletions.
    writer = Writer(store, NS, MESH)
    for _ in range(10):
        writer.publish(2)
        clock.advance(1)
    bw.Watermarks(store, NS).record("ckpt", 8, version=4)
    clock.advance(GRACE + 1)
    refusing = RefuseOne(store, f"{NS}/{manifest_key(1)}")
    with pytest.raises(bw.AccessDenied, match="refused to delete 1 objects"):
        reclaimer(refusing, clock).run_once()
    versions = list(ManifestLog(store, NS).versions())
    assert versions[:3] == [1, 2, 3]
    assert 0 not in versions


class UnreachableOnDelete(StoreWrapper):
    """Every delete request fails as if the store were unreachable; counts the requests."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.deletes = 0

    def delete_many(self, keys: Iterable[str]) -> None:
        self.deletes += 1
        raise bw.StoreUnavailable("injected: connection refused")


def test_an_unreachable_store_stops_a_reclaimer_pass_at_once(
    store: bw.MemoryStore, clock: FakeClock
) -> None:
    # "An unreachable or failing store (StoreUnavailable, TransientStoreError) stops the pass
    # at once": no key-by-key retries of the batch, as for keys the store refuses.
    writer = Writer(store, NS, MESH)
    writer.publish(4)
    bw.Watermarks(store, NS).record("ckpt", 4)
    unreachable = UnreachableOnDelete(store)
    with pytest.raises(bw.StoreUnavailable):
        reclaimer(unreachable, clock).run_once()
    assert unreachable.deletes == 1
    assert len(data_keys(store)) == 4


# -- consumer --------------------------------------------------------------------------------


class ManifestFaults(StoreWrapper):
    """Raises ``error()`` on the next ``failures`` reads or listings of manifest versions."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.failures = 0
        self.error: type[BaseException] = TransientStoreError

    def _maybe_fail(self, key: str) -> None:
        if "/_manifests/" in key and self.failures > 0:
            self.failures -= 1
            raise self.error(f"injected failure reading {key}")

    def get(self, key: str) -> bytes:
        self._maybe_fail(key)
        return super().get(key)

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        self._maybe_fail(key)
        return super().get_range(key, rng)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self._maybe_fail(prefix + "/")
        return super().list(prefix, start_after=start_after)


def test_loading_a_state_whose_step_was_reclaimed_is_refused_at_once() -> None:
    # load_state_dict checks "that the step was not reclaimed (StepReclaimed)": step 3 reads
    # TGB step 3, one below base_step 4.
    store = MemoryStore()
    Writer(store, NS, bw.Mesh(dp=1)).publish(8)
    log = ManifestLog(store, NS)
    assert isinstance(log.commit(log.latest(), base_step=4), Committed)
    with Consumer(store, NS, mesh=bw.Mesh(dp=1), dp_rank=0, start_step=5, timeout=0) as source:
        source.open()
        state = source.state_dict()
    state["step"] = 3
    with Consumer(store, NS, mesh=bw.Mesh(dp=1), dp_rank=0, timeout=0) as consumer:
        with pytest.raises(bw.StepReclaimed, match="set the step of the state you loaded to 4"):
            consumer.load_state_dict(state)
        assert consumer.step == 0  # a refused state changes nothing
    late = Consumer(store, NS, mesh=bw.Mesh(dp=1), dp_rank=0, start_step=3, timeout=0)
    with late, pytest.raises(bw.StepReclaimed, match="can still read is step 4"):
        next(late)


@pytest.mark.parametrize("step", [2.5, "2.5"])
def test_a_state_whose_step_is_no_whole_number_is_refused(step: object) -> None:
    # "int() alone would resume a state whose step is 2.5 at step 2": refused, not rounded.
    # (A float or string holding a whole number, as a JSON round trip may give, is taken.)
    inner = MemoryStore()
    produce(inner, "run", bw.Mesh(dp=1), tgbs=4)
    with Consumer(inner, "run", mesh=bw.Mesh(dp=1), dp_rank=0) as consumer:
        state = consumer.state_dict()
        with pytest.raises(bw.ConsumerError, match="not a BatchWeave consumer state"):
            consumer.load_state_dict({**state, "step": step})
        assert consumer.step == 0
        consumer.load_state_dict({**state, "step": 2.0})
        assert next(consumer)[0] == 2


@pytest.mark.parametrize(("failures", "opens"), [(2, True), (3, False)])
def test_a_manifest_read_gets_retry_budget_retries(failures: int, opens: bool) -> None:
    # "Transient store errors are retried ..., at most retry_budget times": with a budget of 2,
    # two failed manifest reads in a row are retried, a third is not.
    inner = MemoryStore()
    produce(inner, "run", bw.Mesh(dp=1), tgbs=2)
    store = ManifestFaults(inner)
    store.failures = failures
    fake = FakeTime()
    with Consumer(
        store,
        "run",
        mesh=bw.Mesh(dp=1),
        dp_rank=0,
        retry_budget=2,
        clock=fake.clock,
        sleep=fake.sleep,
    ) as consumer:
        if opens:
            assert [step for step, _ in consumer] == [0, 1]
        else:
            with pytest.raises(bw.ConsumerError, match="3 consecutive failures"):
                consumer.open()


def test_a_step_interrupted_while_reading_ahead_is_not_counted_as_delivered() -> None:
    # Ctrl-C while the consumer polls for the next version, after reading step 1 but before
    # returning it: state_dict() must still hold step 1, and the next call delivers it.
    inner = MemoryStore()
    produce(inner, "run", bw.Mesh(dp=1), tgbs=2, seal=False)
    store = ManifestFaults(inner)
    store.error = KeyboardInterrupt
    fake = FakeTime()
    with Consumer(
        store,
        "run",
        mesh=bw.Mesh(dp=1),
        dp_rank=0,
        prefetch_min_latency=0.0,
        clock=fake.clock,
        sleep=fake.sleep,
    ) as consumer:
        assert next(consumer)[0] == 0
        store.failures = 1  # the poll for a version after step 1 is interrupted
        with pytest.raises(KeyboardInterrupt):
            next(consumer)
        assert consumer.state_dict()["step"] == 1
        assert next(consumer)[0] == 1


def test_reads_below_the_split_threshold_are_one_range_read() -> None:
    # "reads of at least split_threshold bytes are split into part_size range reads": smaller
    # ones are not, however small part_size is.
    inner = MemoryStore()
    size = 4096
    produce(inner, "run", bw.Mesh(dp=1), tgbs=3, size=size)
    with Consumer(
        inner,
        "run",
        mesh=bw.Mesh(dp=1),
        dp_rank=0,
        part_size=512,
        split_threshold=size + 1,
    ) as consumer:
        got = list(consumer)
        assert [d for _, d in got] == [payload(0, o, 0, 0, size) for o in range(3)]
        assert consumer.stats.requests == 3  # the manifest's slice table: no footer reads


def test_gather_raises_a_failure_only_after_every_job_finished() -> None:
    # "The first failure is raised after every job has finished, so no job still writes into
    # a buffer its caller has given up on."
    workers = Workers(2, name="gaps")
    second_started = threading.Event()
    release = threading.Event()
    returned = threading.Event()
    order: list[str] = []

    def first() -> None:
        second_started.wait()  # the caller runs this one; a worker has claimed the second
        raise RuntimeError("first failed")

    def second() -> None:
        second_started.set()
        release.wait()
        order.append("second finished")

    errors: list[BaseException] = []

    def call() -> None:
        try:
            gather(workers, [first, second])
        except RuntimeError as exc:
            errors.append(exc)
        order.append("gather returned")
        returned.set()

    caller = threading.Thread(target=call)
    caller.start()
    assert second_started.wait(10)
    # Not a synchronisation: gather must not return while the second job runs, so this wait
    # only times out; a gather that returned early is seen here.
    assert not returned.wait(0.2)
    release.set()
    caller.join(10)
    workers.close()
    assert order == ["second finished", "gather returned"]
    assert [str(e) for e in errors] == ["first failed"]


# -- TGB footer ------------------------------------------------------------------------------


def test_an_empty_slice_placed_past_the_payload_is_rejected() -> None:
    # Every slice lies within [0, payload_length), empty ones too; the fast footer path must
    # refuse what the full validation refuses.
    enc = encode_tgb([b"", b"abc"], bw.Mesh(dp=2))
    doc = json.loads(enc.footer.model_dump_json())
    doc["slices"][0]["offset"] = doc["payload_length"] + 5
    raw = json.dumps(doc).encode()
    blob = enc.data[: enc.footer_offset] + raw + _pack_trailer(raw, 1, "crc32c")
    with pytest.raises(FormatError, match=r"slice \(0, 0\) spans .* past the"):
        parse_footer(blob, key="k.tgb")


def test_a_trailer_claiming_one_byte_more_than_precedes_it_is_truncated() -> None:
    # The object is diagnosed as truncated, not as a corrupt footer (ChecksumMismatch).
    enc = encode_tgb([b"abc"], bw.Mesh(dp=1))
    footer = bytes(enc.footer_bytes)
    claimed = _pack_trailer(footer + b" ", 1, "crc32c")  # a footer one byte longer
    with pytest.raises(FormatError, match="is truncated") as info:
        parse_footer(footer + claimed, key="k.tgb")
    assert not isinstance(info.value, bw.ChecksumMismatch)


def test_an_encoded_tgb_whose_footer_offset_disagrees_with_its_footer_is_refused() -> None:
    # "parts that disagree with the footer would commit a step no consumer can read": the
    # footer offset is checked on its own, not only through the total size.
    enc = encode_tgb([b"abc", b"defg"], bw.Mesh(dp=2))
    with pytest.raises(ValueError, match="inconsistent EncodedTgb"):
        EncodedTgb(
            parts=enc.parts,
            footer=enc.footer,
            footer_offset=enc.footer_offset - 1,
            footer_length=enc.footer_length,
        )


# -- file store ------------------------------------------------------------------------------


@pytest.mark.parametrize("proc_fd", [True, False], ids=["proc-fd", "realpath"])
def test_a_symlink_to_a_sibling_sharing_the_root_name_is_outside(
    tmp_path: Path, proc_fd: bool
) -> None:
    # Keys are confined to the root directory, not to every path that begins with its name:
    # /x/root-evil/secret is outside /x/root.
    root = tmp_path / "root"
    sibling = tmp_path / "root-evil"
    sibling.mkdir()
    (sibling / "secret").write_bytes(b"do not read")
    store = FileStore(root)
    store._proc_fd = proc_fd and store._proc_fd
    (root / "link").symlink_to(sibling, target_is_directory=True)
    (root / "alias").symlink_to(sibling / "secret")
    buffer = memoryview(bytearray(4))
    for call in (
        lambda: store.get("link/secret"),
        lambda: store.get("alias"),
        lambda: store.get_range("alias", Suffix(2)),
        lambda: store.get_range_into("alias", 0, buffer),
        lambda: store.head("alias"),
        lambda: store.put("link/new", b"x"),
        lambda: store.delete_many(["link/secret"]),
    ):
        with pytest.raises(InvalidKey, match="outside the root"):
            call()
    assert sorted(p.name for p in sibling.iterdir()) == ["secret"]
    assert bytes(buffer) == bytes(4)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_a_negative_read_start_is_a_value_error_on_every_store(tmp_path: Path, kind: str) -> None:
    # A caller's mistake, not a store failure: every backend answers it alike.
    target: ObjectStore = (
        MemoryStore() if kind == "memory" else FileStore(tmp_path / "root", fsync=False)
    )
    target.put("k", b"0123456789")
    buffer = memoryview(bytearray(4))
    with pytest.raises(ValueError, match="-1") as info:
        target.get_range_into("k", -1, buffer)
    assert not isinstance(info.value, bw.StoreError)
    assert bytes(buffer) == bytes(4)


def test_an_empty_object_maps_to_an_empty_view(tmp_path: Path) -> None:
    # map_range "clamps the range to the object like get_range", also for an empty object.
    store = FileStore(tmp_path / "root", fsync=False)
    store.put("empty", b"")
    store.put("data", b"0123456789")
    for key, start, end in (("empty", 0, 0), ("empty", 0, 8), ("data", 10, 20), ("data", 4, 4)):
        view = store.map_range(key, start, end)
        assert view is not None
        assert bytes(view) == b""
    view = store.map_range("data", 8, 100)
    assert view is not None
    assert bytes(view) == b"89"

"""Unit tests of the Producer client on in-memory stores, with injected clocks and sleeps.

Among them two liveness rules: ``max_lag`` with a count-paced policy commits the TGBs it is
blocked on (else no consumer could read them and no checkpoint move the boundary), and an
``append`` racing ``close()`` is committed or refused, never returned from and then dropped.
"""

from __future__ import annotations

import errno
import itertools
import logging
import math
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import pytest
from fake_time import FakeTime
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchweave as bw
from batchweave import (
    AccessDenied,
    Mesh,
    NamespaceMismatch,
    NamespaceSealed,
    ObjectStore,
    OffsetOrderError,
    Producer,
    ProducerError,
    ProducerFenced,
    PutMode,
    StoreWrapper,
    TransientStoreError,
)
from batchweave._format import CHECKSUM_ALGOS, ChecksumAlgo
from batchweave._format._tgb import EncodedTgb
from batchweave._format._tgb_read import read_footer, read_slice
from batchweave._format._tgb_write import TgbBuilder, encode_tgb
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import Manifest, TgbDescriptor
from batchweave._policy import PolicyWrapper
from batchweave._producer._lag import LAG_WARN_AFTER, LAG_WARN_LONG
from batchweave._producer._tgbs import Entry as _Entry
from batchweave._store._memory import MemoryStore
from batchweave._store._wrappers import FaultInjectingStore
from batchweave._watermarks import Watermarks

MESH = Mesh(dp=2, cp=2)
NS = "runs/unit"


def payloads(offset: int, size: int = 16) -> list[bytes]:
    return [bytes([offset % 251]) * size + f"{offset}/{i}".encode() for i in range(MESH.slices)]


def make(store: ObjectStore, pid: str = "p0", **kw: object) -> Producer:
    fake = kw.pop("fake", None) or FakeTime(1000.0)
    assert isinstance(fake, FakeTime)
    opts: dict[str, object] = {
        "policy": "naive",
        "clock": fake.clock,
        "wall_clock": fake.wall,
        "sleep": fake.sleep,
    }
    opts.update(kw)
    return Producer(store, NS, producer_id=pid, mesh=MESH, **opts)  # type: ignore[arg-type]


def latest(store: ObjectStore) -> tuple[ManifestLog, Manifest]:
    log = ManifestLog(store, NS)
    return log, log.latest()


def committed_offsets(store: ObjectStore, pid: str) -> list[int]:
    log, m = latest(store)
    return [
        d.offset for _, d in log.descriptors(m, m.base_step, m.next_step) if d.producer_id == pid
    ]


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore()


# ---------------------------------------------------------------------------------------------
# start, resume_offset, data round trip


def test_first_start_creates_namespace_and_resumes_at_zero(store: MemoryStore) -> None:
    with make(store) as p:
        assert p.resume_offset == 0
        # A new id's epoch is the version of its epoch commit (the namespace is version 0).
        assert p.epoch == 1
        assert p.committed_offset is None
    _, m = latest(store)
    assert m.mesh == MESH
    assert m.producers["p0"].epoch == 1
    assert m.producers["p0"].offset is None


def test_appended_tgbs_are_committed_in_offset_order_and_readable(store: MemoryStore) -> None:
    with make(store) as p:
        for off in (3, 7, 8, 20):
            p.append(payloads(off), offset=off)
        p.flush()
        assert p.committed_offset == 20
        stats = p.stats()
    assert stats.tgbs_published == 4
    assert stats.pending == 0
    assert stats.inflight_bytes == 0
    assert stats.commits >= 1
    log, m = latest(store)
    descs = [d for _, d in log.descriptors(m, 0, m.next_step)]
    assert [d.offset for d in descs] == [3, 7, 8, 20]
    assert all(d.epoch == 1 and d.producer_id == "p0" for d in descs)
    d = descs[1]
    ref = d.objects[0]
    key = log.key(ref.key)
    assert ref.key.startswith("data/p0/1/00000000000000000007-")
    assert ref.key.endswith(".tgb")
    footer = read_footer(
        store, key, footer_offset=ref.footer_offset, footer_length=ref.footer_length
    )
    assert read_slice(store, key, footer, (1, 0)) == payloads(7)[2]
    assert d.bytes == store.head(key).size
    assert d.samples == MESH.slices


def test_buffers_reused_after_append_do_not_change_what_is_published(store: MemoryStore) -> None:
    buffers = [bytearray(payloads(0)[i]) for i in range(MESH.slices)]
    with make(store, policy="fixed10") as p:
        for off in range(3):
            for i, buf in enumerate(buffers):
                buf[:] = payloads(off)[i]  # one set of buffers, refilled for every batch
            p.append(buffers, offset=off)
        p.flush()
    log, m = latest(store)
    for step, d in log.descriptors(m, 0, m.next_step):
        key = log.key(d.objects[0].key)
        footer = read_footer(store, key)
        got = [read_slice(store, key, footer, i) for i in range(MESH.slices)]
        assert got == payloads(d.offset), f"step {step}"


def test_restart_resumes_after_committed_offset_and_bumps_epoch(store: MemoryStore) -> None:
    with make(store) as p:
        for off in range(5):
            p.append(payloads(off), offset=off)
    with make(store) as p2:
        assert p2.epoch == 2
        assert p2.resume_offset == 5
        assert p2.committed_offset == 4
        for off in range(p2.resume_offset, 8):
            p2.append(payloads(off), offset=off)
    assert committed_offsets(store, "p0") == list(range(8))
    _, m = latest(store)
    assert m.producers["p0"].epoch == 2


def test_encoded_tgb_and_builder_are_accepted(store: MemoryStore) -> None:
    builder = TgbBuilder(MESH, metadata={"src": "b"})
    for d in range(MESH.dp):
        for c in range(MESH.cp):
            builder.set_slice(d, c, f"{d}{c}".encode(), sample_count=3)
    with make(store) as p:
        p.append(encode_tgb(payloads(0), MESH), offset=0)
        p.append(builder, offset=1)
        with pytest.raises(ValueError, match="mesh"):
            p.append(encode_tgb([b"x"], Mesh(dp=1)), offset=2)
    log, m = latest(store)
    assert [d.samples for _, d in log.descriptors(m, 0, 2)] == [4, 12]


def test_codec_compression_sample_counts_and_metadata_reach_the_footer(store: MemoryStore) -> None:
    with make(store, compression="zstd") as p:
        p.append(
            [b"z" * 500] * MESH.slices, offset=0, sample_counts=[1, 2, 3, 4], metadata={"k": "v"}
        )
    log, m = latest(store)
    desc = log.descriptor(m, 0)
    ref = desc.objects[0]
    key = log.key(ref.key)
    footer = read_footer(
        store, key, footer_offset=ref.footer_offset, footer_length=ref.footer_length
    )
    assert footer.compression == "zstd"
    assert footer.metadata == {"k": "v"}
    assert [e.sample_count for e in footer.slices] == [1, 2, 3, 4]
    assert desc.samples == 10
    assert desc.bytes < 500 * MESH.slices  # compressed
    assert read_slice(store, key, footer, 3) == b"z" * 500


@pytest.mark.parametrize("algo", ["crc32c", "xxhash64", "xxh3"])
def test_checksum_algo_reaches_every_encoded_tgb(store: MemoryStore, algo: str) -> None:
    with make(store, checksum_algo=algo) as p:
        p.append(payloads(0), offset=0)
    log, m = latest(store)
    ref = log.descriptor(m, 0).objects[0]
    footer = read_footer(store, log.key(ref.key))
    assert footer.checksum_algo == algo
    assert ref.slices is not None
    assert ref.slices.checksum_algo == algo
    assert read_slice(store, log.key(ref.key), footer, 1) == payloads(0)[1]


def test_default_checksum_algo_is_crc32c(store: MemoryStore) -> None:
    with make(store) as p:
        p.append(payloads(0), offset=0)
    log, m = latest(store)
    ref = log.descriptor(m, 0).objects[0]
    assert read_footer(store, log.key(ref.key)).checksum_algo == "crc32c"


def test_unknown_checksum_algo_is_rejected_before_touching_the_store(store: MemoryStore) -> None:
    with pytest.raises(
        ValueError,
        match=r"producer 'p0': unknown checksum_algo 'md5'; expected one of 'crc32c', "
        r"'xxhash64', 'xxh3'",
    ):
        make(store, checksum_algo="md5")
    assert list(store.list()) == []


def test_wrong_slice_count_is_a_clear_error(store: MemoryStore) -> None:
    with make(store) as p, pytest.raises(ValueError, match=r"needs dp\*cp = 4"):
        p.append([b"a", b"b"], offset=0)


def test_mesh_mismatch_is_a_clear_error(store: MemoryStore) -> None:
    make(store).close()
    with pytest.raises(NamespaceMismatch, match="mesh"):
        Producer(store, NS, producer_id="p1", mesh=Mesh(dp=4, cp=1))


# ---------------------------------------------------------------------------------------------
# offsets


def test_offset_not_greater_than_last_appended_is_rejected(store: MemoryStore) -> None:
    with make(store) as p:
        p.append(payloads(5), offset=5)
        with pytest.raises(OffsetOrderError, match=r"offset 5 .*last appended offset 5"):
            p.append(payloads(5), offset=5)
        with pytest.raises(OffsetOrderError, match=r"offset 2 .*last appended offset 5"):
            p.append(payloads(2), offset=2)
        with pytest.raises(OffsetOrderError, match="non-negative"):
            p.append(payloads(0), offset=-1)
        p.append(payloads(6), offset=6)  # still usable
    assert committed_offsets(store, "p0") == [5, 6]


def test_numpy_integer_offsets_are_accepted_and_other_types_refused(store: MemoryStore) -> None:
    with make(store) as p:
        p.append(payloads(3), offset=np.int64(3))  # e.g. from np.arange over a dataset
        for bad in (True, 4.0, "5", None):
            with pytest.raises(OffsetOrderError, match="offset must be an integer"):
                p.append(payloads(7), offset=bad)  # type: ignore[arg-type]
        p.flush()
        assert p.committed_offset == 3
        assert type(p.committed_offset) is int
    assert committed_offsets(store, "p0") == [3]


def test_unknown_codec_or_compression_is_refused_before_touching_the_store(
    store: MemoryStore,
) -> None:
    with pytest.raises(ValueError, match=r"producer 'p0': unknown codec 'jsn'"):
        make(store, codec="jsn")
    with pytest.raises(ValueError, match=r"unknown compression 'gzip'"):
        make(store, compression="gzip")
    assert list(store.list()) == []


@pytest.mark.timeout(60)  # the bug this guards against is a hang
def test_interrupted_close_stops_although_commits_keep_failing(store: MemoryStore) -> None:
    class RefusingCommits(StoreWrapper):
        refuse = False

        def put(
            self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE
        ) -> None:
            if self.refuse and "/_manifests/" in key:
                raise TransientStoreError(f"injected: commits keep failing ({key})")
            super().put(key, data, mode=mode)

    failing = RefusingCommits(store)
    p = make(failing, policy="naive")
    failing.refuse = True
    p.append(payloads(1), offset=1)

    def interrupted(timeout: float | None = None) -> None:
        raise KeyboardInterrupt  # Ctrl-C while close() waits for the commit

    p.flush = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        p.close()  # before: waited forever for the commit thread, which kept retrying
    assert not p._committer.is_alive()
    with pytest.raises(ProducerError, match="closed"):
        p.append(payloads(2), offset=2)


def test_offset_not_greater_than_committed_offset_is_rejected_after_restart(
    store: MemoryStore,
) -> None:
    with make(store) as p:
        p.append(payloads(9), offset=9)
    with make(store) as p2:
        with pytest.raises(OffsetOrderError, match=r"offset 9 .*committed offset 9.*resume_offset"):
            p2.append(payloads(9), offset=9)
        p2.append(payloads(10), offset=10)
    assert committed_offsets(store, "p0") == [9, 10]


# ---------------------------------------------------------------------------------------------
# fencing


def test_zombie_is_fenced_after_a_new_incarnation_starts(store: MemoryStore) -> None:
    old = make(store)
    old.append(payloads(0), offset=0)
    old.flush()
    new = make(store)
    assert new.epoch == old.epoch + 1
    assert new.resume_offset == 1
    old.append(payloads(1), offset=1)
    with pytest.raises(ProducerFenced) as info:
        old.flush()
    msg = str(info.value)
    assert "'p0'" in msg
    assert f"epoch {new.epoch} for it" in msg
    assert f"this incarnation has epoch {old.epoch}" in msg
    assert "newer process" in msg
    # Once fenced, everything else fails the same way, and close still stops the threads.
    with pytest.raises(ProducerFenced):
        old.append(payloads(2), offset=2)
    with pytest.raises(ProducerFenced):
        old.close()
    new.append(payloads(1), offset=1)
    new.close()
    assert committed_offsets(store, "p0") == [0, 1]
    _, m = latest(store)
    assert all(d.epoch == new.epoch for d in m.tail if d.offset == 1)


def test_fenced_pending_tgbs_are_never_committed(store: MemoryStore) -> None:
    gate = threading.Event()
    slow = GatedStore(store, gate)
    old = make(slow)
    old.append(payloads(0), offset=0)  # upload blocked at the gate: not committable yet
    new = make(store)
    gate.set()
    with pytest.raises(ProducerFenced):
        old.flush()
    old.abort()
    assert committed_offsets(store, "p0") == []
    new.close()


# ---------------------------------------------------------------------------------------------
# flush, seal, close, context manager


def test_close_drains_everything_without_an_explicit_flush(store: MemoryStore) -> None:
    p = make(store, policy="fixed100")  # the policy alone would never commit 10 TGBs
    for off in range(10):
        p.append(payloads(off), offset=off)
    p.close()
    assert committed_offsets(store, "p0") == list(range(10))
    assert not p._committer.is_alive()
    p.close()  # idempotent
    with pytest.raises(ProducerError, match="closed"):
        p.append(payloads(10), offset=10)


def test_flush_forces_a_count_based_policy(store: MemoryStore) -> None:
    with make(store, policy="fixed100") as p:
        p.append(payloads(0), offset=0)
        p.flush()
        assert committed_offsets(store, "p0") == [0]
        p.flush()  # nothing new: returns at once


def test_seal_commits_the_flag_after_everything_pending(store: MemoryStore) -> None:
    p = make(store, policy="fixed10")
    for off in range(3):
        p.append(payloads(off), offset=off)
    p.seal()
    _, m = latest(store)
    assert m.sealed
    assert committed_offsets(store, "p0") == [0, 1, 2]
    with pytest.raises(ProducerError, match="sealed"):
        p.append(payloads(3), offset=3)
    p.close()
    with pytest.raises(NamespaceSealed, match="sealed"):
        make(store, pid="p1")


def test_exception_inside_with_stops_threads_without_sealing(store: MemoryStore) -> None:
    p = make(store, policy="fixed100")

    def body() -> None:
        with p:
            p.append(payloads(0), offset=0)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        body()
    assert not p._committer.is_alive()
    _, m = latest(store)
    assert not m.sealed
    # Nothing was drained: the restart resumes at 0 and publishes offset 0 exactly once.
    with make(store) as p2:
        assert p2.resume_offset == 0
        p2.append(payloads(0), offset=0)
    assert committed_offsets(store, "p0") == [0]


def test_flush_timeout_raises_timeout_error(store: MemoryStore) -> None:
    gate = threading.Event()
    p = make(GatedStore(store, gate))
    p.append(payloads(0), offset=0)
    with pytest.raises(TimeoutError, match=r"1 TGBs not committed \(offsets 0..0\)"):
        p.flush(timeout=0.05)
    gate.set()
    p.close()
    assert committed_offsets(store, "p0") == [0]


# ---------------------------------------------------------------------------------------------
# uploads: retries, permanent failures, bounded memory


def test_transient_upload_failures_are_retried_with_backoff(
    store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeTime(1000.0)
    faulty = FaultInjectingStore(store)
    faulty.fail_next("put", TransientStoreError("injected 503"), times=3, key_prefix=f"{NS}/data/")
    with (
        caplog.at_level(logging.WARNING, logger="batchweave.producer"),
        make(faulty, fake=fake, upload_threads=1) as p,
    ):
        p.append(payloads(0), offset=0)
        p.flush()
        stats = p.stats()
    assert committed_offsets(store, "p0") == [0]
    assert stats.transient_errors == 3
    assert fake.sleeps[:3] == [0.1, 0.2, 0.4]  # the default capped exponential backoff
    assert "injected 503" in caplog.text
    assert "nothing pending is dropped" in caplog.text


def test_permanent_upload_failure_surfaces_at_the_next_call(store: MemoryStore) -> None:
    faulty = FaultInjectingStore(store)
    faulty.fail_next("put", AccessDenied("no write permission"), key_prefix=f"{NS}/data/")
    p = make(faulty, upload_threads=1)
    p.append(payloads(0), offset=0)
    with pytest.raises(ProducerError, match="no write permission") as info:
        p.flush()
    assert isinstance(info.value.__cause__, AccessDenied)
    with pytest.raises(ProducerError, match="no write permission"):
        p.append(payloads(1), offset=1)
    with pytest.raises(ProducerError):
        p.close()
    assert not p._committer.is_alive()
    assert committed_offsets(store, "p0") == []


class _FailingCommits(StoreWrapper):
    """Manifest PUTs raise ``failure`` once it is set."""

    failure: BaseException | None = None

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        if self.failure is not None and "/_manifests/" in key:
            raise self.failure
        super().put(key, data, mode=mode)


@pytest.mark.parametrize(
    "failure",
    [
        AccessDenied("no PutObject on _manifests/"),
        OSError(errno.ENOSPC, "No space left on device"),
        RuntimeError("a bug in the commit loop"),
    ],
    ids=["access-denied", "disk-full", "bug"],
)
def test_a_permanent_commit_failure_surfaces_as_a_producer_error(
    store: MemoryStore, failure: BaseException
) -> None:
    # Upload failures were wrapped, the commit loop's reached flush/append/close raw (an
    # AccessDenied, an OSError), saying neither what was left uncommitted nor what to do.
    failing = _FailingCommits(store)
    p = make(failing)
    p.append(payloads(0), offset=0)
    p.flush()
    failing.failure = failure
    p.append(payloads(1), offset=1)
    with pytest.raises(ProducerError) as info:
        p.flush()
    assert info.value.__cause__ is failure
    message = str(info.value)
    assert str(failure) in message
    assert "'p0'" in message
    assert "uncommitted: offsets 1..1" in message
    assert "resumes from resume_offset (1)" in message
    with pytest.raises(ProducerError, match="commit loop failed"):
        p.append(payloads(2), offset=2)
    with pytest.raises(ProducerError, match="commit loop failed"):
        p.close()
    assert not p._committer.is_alive()
    assert committed_offsets(store, "p0") == [0]


def test_max_retries_are_bounded(store: MemoryStore) -> None:
    faulty = FaultInjectingStore(store)
    faulty.fail_next("put", TransientStoreError("503"), times=100, key_prefix=f"{NS}/data/")
    p = make(faulty, upload_threads=1, max_retries=2)
    p.append(payloads(0), offset=0)
    with pytest.raises(ProducerError, match="failed 3 times"):
        p.flush()
    p.abort()


def test_in_flight_bytes_are_bounded(store: MemoryStore) -> None:
    gate = threading.Event()
    gated = GatedStore(store, gate)
    sizes = [encode_tgb(payloads(off, 1000), MESH).size for off in range(2)]
    p = make(gated, max_inflight_bytes=int(sizes[0] * 2.5), upload_threads=4)
    p.append(payloads(0, 1000), offset=0)
    p.append(payloads(1, 1000), offset=1)
    assert p.stats().inflight_bytes == sum(sizes)
    assert gated.wait_for_puts(2)
    third = threading.Thread(target=p.append, args=(payloads(2, 1000),), kwargs={"offset": 2})
    third.start()
    third.join(0.3)
    assert third.is_alive(), "append must block while max_inflight_bytes are in flight"
    assert gated.data_puts_started == 2
    assert p.stats().inflight_bytes == sum(sizes)
    gate.set()
    third.join(10)
    assert not third.is_alive()
    p.close()
    assert committed_offsets(store, "p0") == [0, 1, 2]
    assert p.stats().inflight_bytes == 0


def test_a_single_tgb_larger_than_the_bound_still_goes(store: MemoryStore) -> None:
    with make(store, max_inflight_bytes=10) as p:
        p.append(payloads(0, 1000), offset=0)
        p.append(payloads(1, 1000), offset=1)
    assert committed_offsets(store, "p0") == [0, 1]


def test_only_the_contiguous_uploaded_prefix_is_committed(store: MemoryStore) -> None:
    gated = GatedStore(store, threading.Event(), gate_offsets={0})
    p = make(gated, upload_threads=2)
    p.append(payloads(0), offset=0)  # held at the gate
    p.append(payloads(1), offset=1)  # uploads at once
    with pytest.raises(TimeoutError):
        p.flush(timeout=0.2)
    assert committed_offsets(store, "p0") == []  # offset 1 waits for offset 0
    gated.gate.set()
    p.close()
    assert committed_offsets(store, "p0") == [0, 1]


# ---------------------------------------------------------------------------------------------
# commits: conflicts, ambiguous writes, transient errors, stats


def test_ambiguous_commit_that_landed_is_not_committed_twice(store: MemoryStore) -> None:
    faulty = FaultInjectingStore(store)
    with make(faulty) as p:
        faulty.fail_next("put", landed=True, key_prefix=f"{NS}/_manifests/")
        p.append(payloads(0), offset=0)
        p.flush()
        assert p.stats().ambiguous == 1
        assert p.stats().commits == 1
        p.append(payloads(1), offset=1)
    assert committed_offsets(store, "p0") == [0, 1]


def test_attempts_count_only_commits_whose_manifest_put_was_sent(store: MemoryStore) -> None:
    # A commit whose segment write failed (no manifest PUT sent) counted as an attempt "that
    # reached the store": 3 failed segment writes gave attempts=13 against 10 manifest PUTs.
    puts = PutLog(store)  # below the faults: the PUTs that reached the store
    faulty = FaultInjectingStore(puts)
    with make(faulty, tail_limit=2) as p:
        started = sum("/_manifests/" in k for k in puts.keys)  # version 0, the epoch commit
        faulty.fail_next("put", TransientStoreError, key_prefix=f"{NS}/_segments/", times=3)
        for off in range(10):
            p.append(payloads(off), offset=off)
            p.flush()
        stats = p.stats()
    assert faulty.injected == {"scripted_put": 3}
    manifest_puts = sum("/_manifests/" in k for k in puts.keys) - started
    assert stats.attempts == manifest_puts == stats.commits == 10
    assert stats.transient_errors == 3  # the failed segment writes: retried, not attempts
    assert committed_offsets(store, "p0") == list(range(10))


def test_ambiguous_counts_only_commit_attempts_once_each(store: MemoryStore) -> None:
    # Every ambiguous PUT through the manifest log counted: segment writes, the namespace's
    # creation and the epoch commit at start, so ambiguous exceeded attempts.
    faulty = FaultInjectingStore(store)
    faulty.fail_next("put", landed=True, key_prefix=f"{NS}/_manifests/")  # version 0
    make(faulty, pid="other").close()
    faulty.fail_next("put", landed=True, key_prefix=f"{NS}/_manifests/")  # the epoch commit
    with make(faulty, tail_limit=2) as p:
        assert faulty.injected == {"scripted_put": 2}
        assert (p.stats().attempts, p.stats().ambiguous) == (0, 0)  # start is no attempt
        faulty.fail_next("put", landed=True, key_prefix=f"{NS}/_segments/", times=3)
        for off in range(4):
            p.append(payloads(off), offset=off)
            p.flush()
        assert faulty.injected == {"scripted_put": 5}
        assert p.stats().ambiguous == 0
        # One attempt whose PUT is sent three times (twice lost unwritten): ambiguous once.
        faulty.fail_next("put", key_prefix=f"{NS}/_manifests/", times=2)
        p.append(payloads(4), offset=4)
        p.flush()
        assert faulty.injected == {"scripted_put": 7}
        stats = p.stats()
    assert stats.ambiguous == 1
    assert stats.attempts == stats.commits == 5
    assert committed_offsets(store, "p0") == list(range(5))


def test_a_commit_lost_to_a_reclaimed_base_is_an_attempt_and_a_conflict(
    store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    # No PUT is sent on a base found reclaimed (its successor exists: the PUT could only lose),
    # yet it is a lost race for the stats and the policy: conflicts stay within attempts.
    with make(store, pid="a", refresh_age=1e9) as a:  # commits on its own result: a HEAD checks
        a.append(payloads(0), offset=0)
        a.flush()
        base = a.stats()
        make(store, pid="b").close()  # version 3
        store.delete_many([f"{NS}/_manifests/{v:020d}.manifest" for v in (0, 1, 2)])  # reclaimed
        with caplog.at_level(logging.INFO, logger="batchweave.manifest"):
            a.append(payloads(1), offset=1)
            a.flush()
        stats = a.stats()
    assert "base version 2 of" in caplog.text
    assert "was reclaimed" in caplog.text
    assert (base.attempts, base.commits, base.conflicts) == (1, 1, 0)
    assert (stats.attempts, stats.commits, stats.conflicts) == (3, 2, 1)


def test_transient_errors_reading_the_base_keep_pending(store: MemoryStore) -> None:
    fake = FakeTime(1000.0)
    faulty = FaultInjectingStore(store)
    with make(faulty, fake=fake) as p:
        faulty.fail_next("get_range", times=2, key_prefix=f"{NS}/_manifests/")
        p.append(payloads(0), offset=0)
        p.flush()
        assert p.stats().transient_errors == 2
    assert committed_offsets(store, "p0") == [0]


def test_conflicting_producers_rebase_and_record_outcomes(store: MemoryStore) -> None:
    fake = FakeTime(1000.0)
    a = make(store, pid="a", fake=fake)
    b = make(store, pid="b", fake=fake, refresh_age=1e9)  # never refreshes: stale bases
    a.append(payloads(0), offset=0)
    a.flush()
    b.append(payloads(0), offset=0)
    b.flush()  # b's base predates a's commit: conflict, rebase, retry
    stats = b.stats()
    assert stats.conflicts >= 1
    assert stats.commits == 1
    assert stats.attempts == stats.conflicts + stats.commits
    a.close()
    b.close()
    log, m = latest(store)
    assert [(d.producer_id, d.offset) for _, d in log.descriptors(m, 0, m.next_step)] == [
        ("a", 0),
        ("b", 0),
    ]


def test_dac_gap_is_waited_with_the_injected_sleep(store: MemoryStore) -> None:
    fake = FakeTime(1000.0)
    ticking = TickingStore(store, fake, put_seconds=0.01)
    with make(ticking, fake=fake, policy="dac") as p:
        for off in range(3):
            p.append(payloads(off), offset=off)
            p.flush()
        stats = p.stats()
    assert committed_offsets(store, "p0") == [0, 1, 2]
    # One producer: only the duty bound applies, g* = W (1/0.1 - 1) = 9 W, jittered by +-20%.
    assert stats.last_fragile_window == pytest.approx(0.01)
    assert 0.072 - 1e-9 <= stats.gap <= 0.108 + 1e-9
    gap_waits = [s for s in fake.sleeps if s > 0.05]
    assert len(gap_waits) >= 2, fake.sleeps  # flushes 2 and 3 each waited out a gap


class FixedDraw:
    """A UniformSource returning the same fraction of every interval."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def uniform(self, a: float, b: float) -> float:
        return a + (b - a) * self.fraction


def test_first_dac_attempt_waits_a_random_fraction_of_the_start_gap(store: MemoryStore) -> None:
    fake = FakeTime(1000.0)
    ticking = TickingStore(store, fake, put_seconds=0.01)
    policy = bw.DacPolicy(jitter=0.0, rng=FixedDraw(0.5))
    with make(ticking, fake=fake, policy=policy) as p:
        # Pacing starts with the first data, not at start-up: nothing is seeded yet.
        assert policy.window is None
        # Start-up long before the first data must not let the first gap expire unseen.
        fake.advance(100.0)
        p.append(payloads(0), offset=0)
        p.flush()
        # The epoch commit measured W = 0.01 s (and so did the attempt): g* = 9 W = 0.09 s.
        assert policy.window == pytest.approx(0.01)
    assert committed_offsets(store, "p0") == [0]
    # The first gap was the half of g* that the draw picked, counted from the first data.
    assert fake.sleeps[0] == pytest.approx(0.045), fake.sleeps


def test_policy_starts_with_the_rank_among_active_producers_at_the_first_data(
    store: MemoryStore,
) -> None:
    starts: list[tuple[float, int, int | None, float | None]] = []

    class Recording(bw.DacPolicy):
        def start(
            self,
            window: float,
            active_producers: int,
            rank: int | None = None,
            loaded_window: float | None = None,
        ) -> None:
            starts.append((window, active_producers, rank, loaded_window))
            super().start(window, active_producers, rank, loaded_window)

    fake = FakeTime(1000.0)
    ticking = TickingStore(store, fake, put_seconds=0.01)
    b = make(ticking, pid="b", fake=fake, policy=Recording())
    a = make(ticking, pid="a", fake=fake)  # joins after b started, before b has data
    assert starts == []
    b.append(payloads(0), offset=0)
    b.close()
    a.close()
    # N and the rank come from the manifest read at the first data, which lists both ids; the
    # first upload's duration (a PUT under the data load, no fake time here) is passed along.
    assert starts == [(pytest.approx(0.01), 2, 1, 0.0)]
    assert committed_offsets(store, "b") == [0]


def test_flush_wakes_when_the_forced_gap_expires(store: MemoryStore) -> None:
    fake = FakeTime(1000.0)
    ticking = TickingStore(store, fake, put_seconds=0.01)
    policy = bw.DacPolicy(jitter=0.0, max_forced_gap=0.02, rng=FixedDraw(1.0))
    with make(ticking, fake=fake, policy=policy) as p:
        for off in range(3):
            p.append(payloads(off), offset=off)
            p.flush()
        stats = p.stats()
    assert committed_offsets(store, "p0") == [0, 1, 2]
    assert stats.gap == pytest.approx(0.09)  # what a non-forced attempt would wait
    assert policy.forced_gap == pytest.approx(0.02)
    # Each attempt's wait ends (or, if the commit loop saw the TGB before flush() registered,
    # first wakes) when the forced gap expires; a flush never needs the full 0.09 s gap.
    assert sum(1 for s in fake.sleeps if s == pytest.approx(0.02)) >= 3, fake.sleeps
    assert all(s <= 0.09 + 1e-9 for s in fake.sleeps), fake.sleeps


def test_tail_limit_is_passed_to_the_manifest_log(store: MemoryStore) -> None:
    with make(store, tail_limit=2) as p:
        for off in range(5):
            p.append(payloads(off), offset=off)
            p.flush()
    _, m = latest(store)
    assert m.next_step == 5
    assert len(m.tail) < 2
    assert sum(r.count for r in m.segments) >= 4


def test_tail_bytes_limit_is_passed_to_the_manifest_log(store: MemoryStore) -> None:
    # A count bound that is never reached and a byte bound below two descriptors: every commit
    # of two or more TGBs rolls its tail, by bytes.
    with make(store, tail_limit=10_000, tail_bytes_limit=600) as p:
        for off in range(6):
            p.append(payloads(off), offset=off)
            if off % 2:
                p.flush()
    _, m = latest(store)
    assert m.next_step == 6
    assert m.tail == ()
    assert sum(r.count for r in m.segments) == 6


def test_a_backlog_is_committed_at_most_one_full_segment_per_commit(store: MemoryStore) -> None:
    # Before: one commit took every uploaded TGB (an outage's whole backlog), rolled into one
    # segment of any size and rewritten whole by every retry once its roll grew old.
    p = make(store, policy="fixed100", tail_limit=1)  # max_segment_tgbs = 64
    assert p._log.max_segment_tgbs == 64
    for off in range(150):
        p.append(payloads(off), offset=off)
    p.flush()  # loops until the whole backlog is committed
    assert committed_offsets(store, "p0") == list(range(150))
    stats = p.stats()
    assert (stats.pending, stats.tgbs_published) == (0, 150)
    assert stats.commits >= 3
    assert stats.attempts >= stats.commits
    for off in range(150, 300):
        p.append(payloads(off), offset=off)
    p.seal()  # and so do seal() and close()
    p.close()
    assert committed_offsets(store, "p0") == list(range(300))
    log, head = latest(store)
    assert head.sealed
    steps = [log.read(v).next_step for v in log.versions()]
    appended = [b - a for a, b in itertools.pairwise(steps)]
    assert sum(appended) == 300
    assert max(appended) <= 64, appended
    assert sum(1 for n in appended if n) >= 6


class PutLog(StoreWrapper):
    """Records the keys of every PUT, in order."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.keys: list[str] = []

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.keys.append(key)
        super().put(key, data, mode=mode)


def _writes_after_last_manifest(keys: list[str]) -> list[str]:
    last = max(i for i, k in enumerate(keys) if "/_manifests/" in k)
    return [k for k in keys[last + 1 :] if "/_segments/" in k]


@pytest.mark.parametrize("final", ["flush", "close"])
def test_a_closing_producer_writes_no_merge_it_cannot_swap_in(
    store: MemoryStore, final: str
) -> None:
    log = PutLog(store)
    p = make(log, tail_limit=1)
    # Every commit rolls its TGB into a level-0 segment; the eighth calls for a level merge.
    for off in range(8):
        p.append(payloads(off), offset=off)
        if off < 7 or final == "flush":
            p.flush()
    p.close()
    # After a flush more commits may follow: the merge is written after the commit, to be
    # swapped in by the next one. Not so when the commit was close()'s last.
    assert len(_writes_after_last_manifest(log.keys)) == (1 if final == "flush" else 0)
    assert committed_offsets(store, "p0") == list(range(8))


def test_uploads_and_commit_bytes_reach_the_policy(store: MemoryStore) -> None:
    puts: list[tuple[float, int]] = []
    outcomes: list[bw.AttemptOutcome] = []

    class Recording(bw.DacPolicy):
        def observe_put(self, seconds: float, nbytes: int) -> None:
            puts.append((seconds, nbytes))
            super().observe_put(seconds, nbytes)

        def record(self, outcome: bw.AttemptOutcome) -> None:
            outcomes.append(outcome)
            super().record(outcome)

    fake = FakeTime(1000.0)
    with make(TickingStore(store, fake, put_seconds=0.01), fake=fake, policy=Recording()) as p:
        for off in range(3):
            p.append(payloads(off), offset=off)
        p.flush()
    log, m = latest(store)
    sizes = sorted(d.bytes for _, d in log.descriptors(m, 0, 3))
    # One observation per uploaded TGB, with its encoded size (no fake time passes in uploads).
    assert sorted(n for _, n in puts) == sizes
    assert all(seconds == 0.0 for seconds, _ in puts)
    # A committed attempt reports the bytes it sent: here, no roll, just the manifest.
    won = [o for o in outcomes if o.committed]
    assert won
    assert won[-1].bytes_written == len(store.get(f"{NS}/_manifests/{m.version:020d}.manifest"))


def test_a_regular_wait_wakes_for_every_forced_slot(store: MemoryStore) -> None:
    class SlottedPolicy(bw.DacPolicy):
        """Regular attempts only every 5 s, forced ones in a slot 30 ms away."""

        def regular_wait(
            self, since_last_attempt: float, now: float, rank: int | None
        ) -> float | None:
            return max(0.0, 5.0 - since_last_attempt)

        def forced_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float:
            return 0.03

    waited = threading.Event()
    fake = FakeTime(1000.0, on_sleep=lambda: len(fake.sleeps) >= 3 and waited.set())
    with make(store, fake=fake, policy=SlottedPolicy()) as p:
        p.append(payloads(0), offset=0)
        assert waited.wait(10), "the commit loop never waited for its regular turn"
    assert committed_offsets(store, "p0") == [0]
    # While waiting 5 s for its regular turn, the commit loop never slept past a forced slot
    # (a close() arriving meanwhile would have missed it): no sleep was the 0.25 s chunk.
    assert fake.sleeps
    assert max(fake.sleeps) <= 0.03 + 1e-9, fake.sleeps


# ---------------------------------------------------------------------------------------------
# max_lag


def test_time_blocked_by_max_lag_never_counts_a_clock_step_back(store: MemoryStore) -> None:
    # A clock stepped back an hour during the wait made lag_blocked_seconds negative.
    boundary = {"step": 0}
    slept = threading.Event()
    fake = FakeTime(10_000.0)

    def sleep(seconds: float) -> None:
        with fake._lock:
            fake.now -= 3600.0  # an NTP step back while the producer waits
        slept.set()
        time.sleep(0.001)  # yield to the test thread; the boundary, not this, ends the wait

    p = make(store, fake=fake, sleep=sleep, max_lag=0, boundary=lambda: boundary["step"])
    p.append(payloads(0), offset=0)
    p.flush()
    blocked = threading.Thread(target=p.append, args=(payloads(1),), kwargs={"offset": 1})
    blocked.start()
    assert slept.wait(10)
    boundary["step"] = 1
    blocked.join(10)
    assert not blocked.is_alive()
    assert p.stats().lag_blocked_seconds == 0.0
    p.close()
    assert committed_offsets(store, "p0") == [0, 1]


def test_max_lag_blocks_until_the_boundary_moves(
    store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    boundary = {"step": 0}
    slept = threading.Event()
    tick = threading.Event()
    fake = FakeTime(1000.0)

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        slept.set()
        tick.wait(0.01)

    p = make(
        store,
        fake=fake,
        sleep=sleep,
        max_lag=3,
        boundary=lambda: boundary["step"],
        lag_log_interval=0.0,
    )
    for off in range(3):
        p.append(payloads(off), offset=off)
    p.flush()
    p.append(payloads(3), offset=3)  # visible 3 - boundary 0 <= 3: goes
    p.flush()
    blocked = threading.Thread(target=p.append, args=(payloads(4),), kwargs={"offset": 4})
    with caplog.at_level(logging.INFO, logger="batchweave.producer"):
        blocked.start()
        assert slept.wait(10)
        assert blocked.is_alive()
        assert p.stats().lag_blocked
        boundary["step"] = 1
        blocked.join(10)
    assert not blocked.is_alive()
    stats = p.stats()
    assert not stats.lag_blocked
    assert stats.lag_blocked_seconds > 0
    assert "blocked by max_lag: 4 visible steps, reclamation boundary 0, max_lag 3" in caplog.text
    p.close()
    assert committed_offsets(store, "p0") == [0, 1, 2, 3, 4]


def test_default_boundary_comes_from_the_namespace_watermarks(
    store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    lagging = threading.Event()
    fake = FakeTime(1000.0)

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        lagging.set()

    with make(store, fake=fake, sleep=sleep, max_lag=2, lag_log_interval=0.0) as p:
        for off in range(3):
            p.append(payloads(off), offset=off)
        p.flush()
        marks = Watermarks(store, NS, clock=fake.wall)
        marks.record("ckpt-1", step=1)
        marks.record("ckpt-3", step=3)
        p.append(payloads(3), offset=3)  # 3 visible - boundary 1 <= 2
        p.flush()
        assert not lagging.is_set()
        blocked = threading.Thread(target=p.append, args=(payloads(4),), kwargs={"offset": 4})
        with caplog.at_level(logging.INFO, logger="batchweave.producer"):
            blocked.start()
            assert lagging.wait(10)  # 4 visible - boundary 1 > 2: blocked
            assert blocked.is_alive()
        # The log names what holds the boundary back.
        assert "the oldest is 'ckpt-1' at step 1, recorded" in caplog.text
        marks.release("ckpt-1")  # boundary becomes 3
        blocked.join(10)
        assert not blocked.is_alive()
    assert committed_offsets(store, "p0") == [0, 1, 2, 3, 4]


def test_max_lag_lines_are_paced_across_appends(store: MemoryStore) -> None:
    # The pacing was per append() call: a producer blocked briefly by each append logged (and,
    # with a Watermarks boundary, LISTed the watermarks) once per append, 20 lines in 2 s with
    # lag_log_interval=5.
    fake = FakeTime(1000.0)
    appender = threading.get_ident()
    marks = Watermarks(store, NS, clock=fake.wall)
    marks.record("ckpt-0", step=0)
    moved = [0]

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        if threading.get_ident() == appender:  # the wait of a blocked append: a checkpoint
            moved[0] += 1
            marks.record(f"ckpt-{moved[0]}", step=moved[0])
            marks.release(f"ckpt-{moved[0] - 1}")

    lines: list[logging.LogRecord] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "blocked by max_lag" in record.getMessage():
                lines.append(record)

    handler = Lines(logging.INFO)
    logger = logging.getLogger("batchweave.producer")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with make(store, fake=fake, sleep=sleep, max_lag=1, lag_log_interval=5.0) as p:
            began = fake.clock()
            for off in range(22):
                p.append(payloads(off), offset=off)  # from offset 2 on, each waits once
            elapsed = fake.clock() - began
            assert moved[0] == 20
            assert 1 <= len(lines) <= 1 + elapsed // 5, (len(lines), elapsed)
            assert "the oldest is 'ckpt-0' at step 0" in lines[0].getMessage()
            # Paced, not silenced: once the interval has passed, the next wait logs again.
            logged = len(lines)
            fake.advance(5.0)
            p.append(payloads(22), offset=22)
            assert moved[0] == 21
            assert len(lines) == logged + 1
            assert "the oldest is 'ckpt-20' at step 20" in lines[-1].getMessage()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


class _NoWithCondition(threading.Condition):
    """A condition that refuses ``with``: its ``__enter__``/``__exit__`` are Python functions,
    where a Ctrl-C can land between acquiring and releasing and leave the lock held for ever."""

    def __enter__(self) -> bool:
        raise AssertionError("`with` the producer's condition: take its C-level lock instead")

    def __exit__(self, *exc: object) -> None:
        raise AssertionError("`with` the producer's condition: take its C-level lock instead")


class _ThreadingWithStrictCondition:
    """The ``threading`` module, but for conditions that refuse ``with``."""

    Condition = _NoWithCondition

    def __getattr__(self, name: str) -> object:
        return getattr(threading, name)


def test_retries_and_max_lag_waits_take_the_lock_not_the_condition(
    store: MemoryStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Retries and LagGate still took the producer's lock with `with cond`, where the rest of the
    # producer uses `with lock` (a Ctrl-C inside Condition.__exit__ leaves the lock held).
    import batchweave._producer._client as client

    monkeypatch.setattr(client, "threading", _ThreadingWithStrictCondition())
    boundary = {"step": 0}
    fake = FakeTime(1000.0)
    appending: list[int] = []

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        if threading.get_ident() in appending:
            boundary["step"] += 1  # a checkpoint while append waits

    faulty = FaultInjectingStore(store)
    faulty.fail_next("put", TransientStoreError, key_prefix=f"{NS}/_manifests/", times=2)
    p = make(faulty, fake=fake, sleep=sleep, max_lag=1, boundary=lambda: boundary["step"])
    assert isinstance(p._cond, _NoWithCondition)
    faulty.fail_next("put", TransientStoreError, key_prefix=f"{NS}/data/")  # an upload retry
    appending.append(threading.get_ident())
    for off in range(3):  # the third waits for max_lag once
        p.append(payloads(off), offset=off)
    p.close()
    stats = p.stats()
    assert faulty.injected == {"scripted_put": 3}
    assert stats.transient_errors == 3  # 2 at start (version 0, the epoch commit), 1 upload
    assert stats.lag_blocked_seconds > 0
    assert not stats.lag_blocked
    assert committed_offsets(store, "p0") == [0, 1, 2]


def _lag_lines_until_warned(
    store: MemoryStore, *, mark_step: int | None
) -> list[logging.LogRecord]:
    """Block a producer by max_lag=2 until it has warned and logged once more; its lag lines.

    ``mark_step``: a watermark recorded before the wait (and never moved), or none at all.
    """
    lines: list[logging.LogRecord] = []
    info_after_warning = threading.Event()

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "blocked by max_lag" in record.getMessage():
                lines.append(record)
                warned = any(r.levelno == logging.WARNING for r in lines)
                if warned and record.levelno == logging.INFO:
                    info_after_warning.set()

    handler = Lines(logging.INFO)
    logger = logging.getLogger("batchweave.producer")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    fake = FakeTime(1000.0)
    marks = Watermarks(store, NS, clock=fake.wall)
    if mark_step is not None:
        marks.record("ckpt-0", step=mark_step)
    try:
        with make(store, fake=fake, max_lag=2, lag_log_interval=5.0) as p:
            for off in range(3):
                p.append(payloads(off), offset=off)
            p.flush()
            blocked = threading.Thread(target=p.append, args=(payloads(3),), kwargs={"offset": 3})
            blocked.start()
            assert info_after_warning.wait(60)
            marks.record("ckpt-1", step=2)
            if mark_step is not None:
                marks.release("ckpt-0")
            blocked.join(10)
            assert not blocked.is_alive()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    return lines


def _waited(record: logging.LogRecord) -> float:
    return float(record.getMessage().split("waiting ")[1].split(" s")[0])


def test_a_long_max_lag_wait_with_no_watermark_warns_once(store: MemoryStore) -> None:
    # Blocking is normal back-pressure and logs at INFO, which default logging hides: a job whose
    # trainer never calls checkpoint_hook looked like a producer that hangs in append.
    lines = _lag_lines_until_warned(store, mark_step=None)
    warnings = [r for r in lines if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no watermark is recorded yet" in warnings[0].getMessage()
    assert "checkpoint_hook" in warnings[0].getMessage()
    assert lines[0].levelno == logging.INFO  # the first minute is ordinary back-pressure
    assert LAG_WARN_AFTER <= _waited(warnings[0]) < LAG_WARN_LONG


def test_a_max_lag_wait_on_a_watermark_that_never_moves_warns_after_ten_minutes(
    store: MemoryStore,
) -> None:
    # A job that records a start mark and then never calls the hook: a watermark exists, so the
    # one-minute warning does not apply, and before this the wait stayed at INFO for ever.
    lines = _lag_lines_until_warned(store, mark_step=0)
    warnings = [r for r in lines if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "the oldest is 'ckpt-0' at step 0" in warnings[0].getMessage()
    assert _waited(warnings[0]) >= LAG_WARN_LONG
    assert all(r.levelno == logging.INFO for r in lines if _waited(r) < LAG_WARN_LONG)


# ---------------------------------------------------------------------------------------------
# helpers


class GatedStore(StoreWrapper):
    """Delegates to ``inner``; data PUTs (optionally only some offsets) wait for ``gate``."""

    def __init__(
        self, inner: ObjectStore, gate: threading.Event, gate_offsets: set[int] | None = None
    ) -> None:
        super().__init__(inner)
        self.gate = gate
        self.gate_offsets = gate_offsets
        self.data_puts_started = 0
        self._started = threading.Condition()

    def wait_for_puts(self, count: int, timeout: float = 10.0) -> bool:
        """Wait until ``count`` data PUTs have started (reached the gate)."""
        with self._started:
            return self._started.wait_for(lambda: self.data_puts_started >= count, timeout)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        if "/data/" in key:
            with self._started:
                self.data_puts_started += 1
                self._started.notify_all()
            offset = int(key.rsplit("/", 1)[1].split("-", 1)[0])
            if self.gate_offsets is None or offset in self.gate_offsets:
                assert self.gate.wait(30), "test gate never opened"
        self.inner.put(key, data, mode=mode)


class TickingStore(GatedStore):
    """Conditional PUTs take ``put_seconds`` of fake time: a measurable fragile window."""

    def __init__(self, inner: ObjectStore, fake: FakeTime, put_seconds: float) -> None:
        super().__init__(inner, threading.Event(), gate_offsets=set())
        self.fake = fake
        self.put_seconds = put_seconds

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        if mode is PutMode.CREATE:
            self.fake.advance(self.put_seconds)
        super().put(key, data, mode=mode)


def test_public_names_are_exported() -> None:
    assert bw.Producer is Producer
    assert bw.ProducerStats.__doc__


@pytest.fixture(scope="module")
def closed_producer() -> Producer:
    """A producer whose ``_descriptor`` is called directly (it reads only settings)."""
    p = make(MemoryStore())
    p.close()
    return p


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    dp=st.integers(1, 12),
    cp=st.integers(1, 12),
    data=st.data(),
    compression=st.sampled_from([None, "zstd"]),
    algo=st.sampled_from(CHECKSUM_ALGOS),
    metadata=st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=2),
    offset=st.integers(0, 1 << 62),
)
def test_descriptor_of_an_own_encoding_equals_the_validated_descriptor(
    closed_producer: Producer,
    dp: int,
    cp: int,
    data: st.DataObject,
    compression: str | None,
    algo: ChecksumAlgo,
    metadata: dict[str, str],
    offset: int,
) -> None:
    # A TGB the producer encoded itself gets its descriptor without validation; it must be the
    # validated one, nested models and persisted JSON included (meshes above the 128-slice
    # table limit too).
    mesh = Mesh(dp=dp, cp=cp)
    sizes = data.draw(st.lists(st.integers(0, 40), min_size=mesh.slices, max_size=mesh.slices))
    counts = data.draw(
        st.none()
        | st.lists(st.none() | st.integers(0, 1 << 40), min_size=mesh.slices, max_size=mesh.slices)
    )
    enc = encode_tgb(
        [bytes([i % 256]) * n for i, n in enumerate(sizes)],
        mesh,
        compression=compression,
        checksum_algo=algo,
        sample_counts=counts,
        metadata=metadata,
    )
    p = closed_producer
    entry = _Entry(offset=offset, key=f"data/p0/0/{offset:020d}-{'ab' * 16}.tgb", size=enc.size)
    fast = p._descriptor(entry, enc, validate=False)
    checked = p._descriptor(entry, enc, validate=True)
    assert fast == checked
    assert fast.objects == checked.objects
    assert fast.objects[0].slices == checked.objects[0].slices
    assert (fast.objects[0].slices is None) == (mesh.slices > 128)
    assert fast.model_dump_json() == checked.model_dump_json()
    assert repr(fast) == repr(checked)
    assert fast.model_fields_set == checked.model_fields_set
    assert fast.objects[0].model_fields_set == checked.objects[0].model_fields_set
    assert TgbDescriptor.model_validate_json(fast.model_dump_json()) == checked


def test_a_tgb_built_by_the_caller_is_still_validated_before_commit() -> None:
    # Only TGBs encoded from payloads skip validation: a caller's EncodedTgb whose footer
    # names a codec nobody knows fails its upload instead of reaching a manifest.
    store = MemoryStore()
    enc = encode_tgb(payloads(0), MESH)
    bogus = EncodedTgb(
        parts=enc.parts,
        footer=enc.footer.model_copy(update={"codec": "bogus"}),
        footer_offset=enc.footer_offset,
        footer_length=enc.footer_length,
    )
    p = make(store)
    # Refused before its upload: the footer it carries is not the one its bytes hold.
    with pytest.raises(bw.FormatError, match="not the one stored in its bytes"):
        p.append(bogus, offset=0)
    p.abort()
    assert committed_offsets(store, "p0") == []
    assert not [m for m in store.list("") if "/data/" in m.key]


# -- max_lag with a count-paced policy; append racing close() ----------------------------------


class _ManifestPuts(StoreWrapper):
    """Sets ``landed`` whenever a manifest version is created."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.landed = threading.Event()

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        super().put(key, data, mode=mode)
        if "/_manifests/" in key:
            self.landed.set()

    def wait_for_next_step(self, next_step: int, why: str) -> None:
        """Return once the newest version holds ``next_step`` steps; fail with ``why`` if no
        manifest version lands for 10 s before that."""
        log = ManifestLog(self.inner, NS)
        while True:
            self.landed.clear()
            if log.latest().next_step == next_step:
                return
            assert self.landed.wait(10), why


def _payloads(offset: int) -> list[bytes]:
    return [f"{offset}/{i}".encode() for i in range(Mesh(dp=2, cp=1).slices)]


def _fake_time_producer(store: ObjectStore, fake: FakeTime, **options: Any) -> Producer:
    """Producer ``p0`` of ``NS`` (dp=2, cp=1) on ``fake``'s clocks (and its ``sleep`` unless
    ``options`` name another)."""
    options.setdefault("sleep", fake.sleep)
    return Producer(
        store,
        NS,
        producer_id="p0",
        mesh=Mesh(dp=2, cp=1),
        clock=fake.clock,
        wall_clock=fake.wall,
        **options,
    )


def _committed_offsets(store: ObjectStore) -> list[int]:
    """The offsets of the TGBs the latest manifest of ``NS`` holds, in step order."""
    log = ManifestLog(store, NS)
    m = log.latest()
    return [d.offset for _, d in log.descriptors(m, 0, m.next_step)]


def test_max_lag_commits_what_it_counts_when_a_count_policy_holds_it_back() -> None:
    # max_lag counts this producer's uncommitted TGBs as visible. With a count-paced policy
    # (fixed10) and max_lag below its count, the TGBs that block append were never committed:
    # no consumer could read them, so no checkpoint could move the boundary: a deadlock.
    store = _ManifestPuts(MemoryStore())
    fake = FakeTime(1000.0)
    tick = threading.Event()
    boundary = {"step": 0}

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        tick.wait(0.005)  # the blocked append re-checks with backoff; keep it from spinning

    p = _fake_time_producer(
        store, fake, sleep=sleep, policy="fixed10", max_lag=3, boundary=lambda: boundary["step"]
    )
    try:
        for off in range(4):  # 0 + 3 pending <= max_lag when offset 3 is appended
            p.append(_payloads(off), offset=off)
        blocked = threading.Thread(target=p.append, args=(_payloads(4),), kwargs={"offset": 4})
        blocked.start()
        # Blocked by its own pending TGBs, the producer must publish them so consumers can
        # reach a checkpoint: a manifest with the four steps appears.
        store.wait_for_next_step(4, "pending TGBs never committed while append was blocked")
        assert blocked.is_alive()
        boundary["step"] = 4  # the consumers checkpointed past them
        blocked.join(10)
        assert not blocked.is_alive()
    finally:
        p.close()
    assert _committed_offsets(store) == [0, 1, 2, 3, 4]


def test_an_append_racing_close_is_committed_or_refused_never_silently_dropped() -> None:
    # close() drains what was appended when it began, then the commit thread ends (nothing left
    # to commit and closing). An append from another thread that lands after that drain, before
    # close() marks the producer closed, used to return normally, although no thread would ever
    # commit it: close() then returned without error and the TGB was lost.
    store = MemoryStore()
    fake = FakeTime(1000.0)
    p = _fake_time_producer(store, fake, policy="naive")
    p.append(_payloads(0), offset=0)
    outcome: list[BaseException | None] = []
    shutdown = p._shutdown

    def late_append_then_shutdown(*, abort: bool) -> None:
        # What another thread's append() sees right after close()'s drain: the commit thread has
        # finished (nothing left to commit), the producer is not yet marked closed.
        p._committer.join(10)
        assert not p._committer.is_alive()
        try:
            p.append(_payloads(1), offset=1)
            outcome.append(None)
        except ProducerError as exc:
            outcome.append(exc)
        shutdown(abort=abort)

    p._shutdown = late_append_then_shutdown  # type: ignore[method-assign]
    p.close()
    committed = _committed_offsets(store)
    assert len(outcome) == 1
    refused = isinstance(outcome[0], ProducerError)
    assert refused or committed == [0, 1], (
        f"append returned normally during close() but committed offsets are {committed}"
    )
    assert committed[0] == 0


# ---------------------------------------------------------------------------------------------
# seal after close, several blocked appends, prompt abort, interrupted append, cancelled uploads


def _bounded(fn: Any, timeout: float = 10.0) -> tuple[bool, list[BaseException | None]]:
    """Run ``fn`` in a daemon thread for at most ``timeout`` s: whether it ended, and how."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    return not thread.is_alive(), outcome


def test_seal_after_close_raises_instead_of_waiting_forever(store: MemoryStore) -> None:
    # close() stops the commit thread; seal() then waited (with no timeout: for ever) for a
    # commit that nothing would make. The same when another thread's close() ends just before.
    p = make(store)
    p.append(payloads(0), offset=0)
    p.close()
    q = make(store, "p1")
    real_flush = q.flush

    def flush_then_closed_elsewhere(timeout: float | None = None) -> None:
        real_flush(timeout)
        q.flush = real_flush  # type: ignore[method-assign]
        closer = threading.Thread(target=q.close)
        closer.start()
        closer.join(10)

    q.flush = flush_then_closed_elsewhere  # type: ignore[method-assign]
    for producer in (p, q):
        ended, outcome = _bounded(producer.seal)
        assert ended, "seal() after close() never returned"
        assert isinstance(outcome[0], ProducerError), outcome
        assert "is closed" in str(outcome[0])
        assert "seal() before close()" in str(outcome[0])
    assert not latest(store)[1].sealed


_REAL_TIME: dict[str, object] = {
    "clock": time.monotonic,
    "wall_clock": time.time,
    "sleep": time.sleep,
}


class _Holding(PolicyWrapper):
    """Naive pacing, but no forced attempt (flush, close, seal) starts while ``hold`` is set:
    a commit that cannot land, as during an outage, without retries to wait out."""

    def __init__(self) -> None:
        super().__init__(bw.make_policy("naive"))
        self.hold = threading.Event()
        self.holding = threading.Event()
        """Set once a forced attempt was held back."""

    def forced_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float:
        if self.hold.is_set():
            self.holding.set()
            return math.inf
        return self.inner.forced_wait(since_last_attempt, now, rank)


def test_close_after_a_timed_out_seal_does_not_wait_for_the_seal(store: MemoryStore) -> None:
    # A seal() that timed out left its request behind: close() then waited for the seal for as
    # long as it could not be committed (an outage: for ever), and committed it once it could.
    policy = _Holding()
    p = make(store, policy=policy, **_REAL_TIME)
    try:
        p.append(payloads(0), offset=0)
        p.flush()
        policy.hold.set()  # from here the seal cannot be committed
        with pytest.raises(TimeoutError) as info:
            p.seal(timeout=0)
        ended, outcome = _bounded(p.close)
        assert ended, "close() waited for the seal that timed out"
        assert outcome == [None]
    finally:
        policy.hold.clear()
        p.abort()
    assert not latest(store)[1].sealed
    assert committed_offsets(store, "p0") == [0]
    assert "the request is withdrawn" in str(info.value)


def test_append_is_taken_again_after_a_timed_out_seal(store: MemoryStore) -> None:
    # append() said the namespace was sealed after a seal() that timed out, though it was not.
    policy = _Holding()
    p = make(store, policy=policy, **_REAL_TIME)
    try:
        p.append(payloads(0), offset=0)
        p.flush()
        policy.hold.set()
        with pytest.raises(TimeoutError):
            p.seal(timeout=0)
        policy.hold.clear()
        p.append(payloads(1), offset=1)
        p.close()
    finally:
        policy.hold.clear()
        p.abort()
    assert committed_offsets(store, "p0") == [0, 1]
    assert not latest(store)[1].sealed


def test_an_interrupt_while_close_joins_the_commit_thread_stops_it(store: MemoryStore) -> None:
    # close() joined the commit thread outside its Ctrl-C handling: interrupted there (the
    # thread committing a seal() another thread waits for, through an outage), it raised but
    # left the thread running, and the seal landed after close() had raised.
    policy = _Holding()
    p = make(store, policy=policy, **_REAL_TIME)
    p.append(payloads(0), offset=0)
    p.flush()
    policy.hold.set()
    sealing: list[BaseException | None] = []

    def seal() -> None:
        try:
            p.seal()
            sealing.append(None)
        except BaseException as exc:
            sealing.append(exc)

    sealer = threading.Thread(target=seal, daemon=True)
    sealer.start()
    try:
        assert policy.holding.wait(10), "the commit loop never tried to seal"
        real_join = p._committer.join

        def interrupted(timeout: float | None = None) -> None:
            p._committer.join = real_join  # type: ignore[method-assign]
            raise KeyboardInterrupt  # Ctrl-C while close() waits for the commit thread

        p._committer.join = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            p.close()
        assert not p._committer.is_alive()
        sealer.join(10)
        assert len(sealing) == 1
        assert isinstance(sealing[0], ProducerError), sealing
        assert "aborted" in str(sealing[0])
    finally:
        policy.hold.clear()
        sealer.join(10)
    assert not latest(store)[1].sealed


def test_max_lag_keeps_committing_while_a_second_append_is_still_blocked() -> None:
    # Two appends blocked by max_lag: the first to go cleared the blocked flag for both, so the
    # count policy held back the TGB it appended, and the other append waited for ever on a
    # step no consumer could read (and stats() said nothing was blocked).
    store = _ManifestPuts(MemoryStore())
    fake = FakeTime(1000.0)
    boundary = {"step": 0}
    blocked = {"A": threading.Event(), "B": threading.Event()}
    a_appended = threading.Event()
    tick = threading.Event()

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        name = threading.current_thread().name
        if name in blocked:  # an appending thread sleeps only while max_lag blocks it
            blocked[name].set()
            if name == "B":
                a_appended.wait(10)  # B re-checks only once A has appended
        tick.wait(0.005)  # keep the blocked appends from spinning

    p = _fake_time_producer(
        store, fake, sleep=sleep, policy="fixed10", max_lag=0, boundary=lambda: boundary["step"]
    )
    threads = {
        name: threading.Thread(
            target=p.append, args=(_payloads(off),), kwargs={"offset": off}, name=name, daemon=True
        )
        for name, off in (("A", 1), ("B", 2))
    }
    try:
        p.append(_payloads(0), offset=0)
        for name in ("A", "B"):
            threads[name].start()
            assert blocked[name].wait(10), f"append {name} was not blocked by max_lag"
        boundary["step"] = 1  # consumers checkpointed past step 0: A goes, B waits one more
        threads["A"].join(10)
        assert not threads["A"].is_alive()
        a_appended.set()
        assert threads["B"].is_alive()
        assert p.stats().lag_blocked, "B is blocked by max_lag, stats() says nothing is"
        store.wait_for_next_step(2, "offset 1 never committed although B waits on it")
        boundary["step"] = 2
        threads["B"].join(10)
        assert not threads["B"].is_alive()
        assert not p.stats().lag_blocked
    finally:
        a_appended.set()
        p.close()
    assert _committed_offsets(store) == [0, 1, 2]


@pytest.mark.parametrize("failure", [bw.StoreUnavailable, TransientStoreError])
def test_abort_does_not_wait_out_the_commit_backoff(
    store: MemoryStore, failure: type[Exception]
) -> None:
    # While commits keep failing (an outage raises; a transient error is a conflict with no
    # winner) the commit loop sleeps its backoff, 5 s by default and unbounded with backoff=.
    # abort() (and a Ctrl-C in close()) join that thread: they waited the whole sleep.
    class RefusingCommits(StoreWrapper):
        refused = threading.Event()

        def put(
            self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE
        ) -> None:
            if "/_manifests/" in key and mode is PutMode.CREATE and refusing.is_set():
                self.refused.set()
                raise failure(f"injected: commits keep failing ({key})")
            super().put(key, data, mode=mode)

    fake = FakeTime(1000.0)
    refusing = threading.Event()
    never = threading.Event()  # a long sleep lasts until the test ends
    backing_off = threading.Event()
    committer_sleeps: list[float] = []

    def sleep(seconds: float) -> None:
        fake.sleep(seconds)
        if threading.current_thread().name.startswith("bw-commit-"):
            committer_sleeps.append(seconds)
            if RefusingCommits.refused.is_set():
                backing_off.set()
            if seconds > 1.0:
                never.wait(30)

    failing = RefusingCommits(store)
    p = make(failing, fake=fake, sleep=sleep, backoff=lambda attempt: 3600.0)
    try:
        refusing.set()
        p.append(payloads(0), offset=0)
        assert backing_off.wait(10), "the commit loop never backed off"
        ended, outcome = _bounded(p.abort)
        assert ended, "abort() waited out the commit loop's backoff"
        assert outcome == [None]
        assert not p._committer.is_alive()
        assert max(committer_sleeps) <= 0.25, max(committer_sleeps)  # pieces, not 3600 s
    finally:
        never.set()


def test_an_interrupt_before_the_upload_is_submitted_takes_the_tgb_back(
    store: MemoryStore,
) -> None:
    # A Ctrl-C between registering a TGB and submitting its upload left it pending with its
    # bytes counted: no upload would ever run for it, so close() waited for ever.
    p = make(store)
    real_submit = p._uploads.submit

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        p._uploads.submit = real_submit  # type: ignore[method-assign]
        raise KeyboardInterrupt

    p._uploads.submit = interrupted  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt):
        p.append(payloads(0), offset=0)
    stats = p.stats()
    assert (stats.pending, stats.inflight_bytes) == (0, 0)
    p.append(payloads(0), offset=0)  # the offset was not taken: it can be appended again
    ended, outcome = _bounded(p.close)
    assert ended, "close() waited for an upload that never runs"
    assert outcome == [None]
    assert committed_offsets(store, "p0") == [0]


def test_an_interrupt_just_after_registering_a_tgb_takes_it_back(store: MemoryStore) -> None:
    # A Ctrl-C landing once append had registered the TGB (pending, its bytes counted, its
    # offset taken) but before its upload was submitted left it pending with no upload: flush()
    # and close() waited for ever, and appending the offset again was refused.
    p = make(store)
    p.append(payloads(0), offset=0)
    p.flush()

    class InterruptedOnce(deque[_Entry]):
        armed = True

        def append(self, entry: _Entry) -> None:
            super().append(entry)
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt  # as a SIGINT handled as the call returns

    p._entries = InterruptedOnce(p._entries)
    with pytest.raises(KeyboardInterrupt):
        p.append(payloads(1), offset=1)
    stats = p.stats()
    assert (stats.pending, stats.inflight_bytes) == (0, 0)
    p.append(payloads(1), offset=1)  # the offset was not taken: it can be appended again
    ended, outcome = _bounded(p.close)
    assert ended, "close() waited for an upload that never runs"
    assert outcome == [None]
    assert committed_offsets(store, "p0") == [0, 1]


def test_an_interrupt_inside_submit_leaves_no_upload_behind(store: MemoryStore) -> None:
    # A Ctrl-C inside submit() once the upload was queued: append took the TGB back, but its
    # upload still ran, released its bytes a second time (inflight_bytes below 0, loosening
    # max_inflight_bytes) and wrote an object for an offset append said it had not taken.
    gate = threading.Event()
    gated = GatedStore(store, gate, gate_offsets={0})
    p = make(gated, upload_threads=1)
    try:
        p.append(payloads(0), offset=0)
        assert gated.wait_for_puts(1)  # the only upload thread is busy with offset 0
        real_submit = p._uploads.submit

        def queued_then_interrupted(*args: Any, **kwargs: Any) -> Any:
            p._uploads.submit = real_submit  # type: ignore[method-assign]
            real_submit(*args, **kwargs)  # queued behind offset 0
            raise KeyboardInterrupt

        p._uploads.submit = queued_then_interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            p.append(payloads(1), offset=1)
        stats = p.stats()
        assert stats.pending == 1
        assert stats.inflight_bytes == p._entries[0].size
    finally:
        gate.set()
    p.append(payloads(1), offset=1)  # the offset was not taken: it can be appended again
    p.close()
    assert p.stats().inflight_bytes == 0
    assert (
        gated.data_puts_started == 2
    )  # the upload queued for the interrupted append wrote nothing
    assert committed_offsets(store, "p0") == [0, 1]


def test_abort_releases_the_bytes_of_uploads_it_cancels(store: MemoryStore) -> None:
    # abort() cancels the uploads not yet started; they never run the code that releases their
    # bytes, so inflight_bytes stayed counted for ever.
    gate = threading.Event()
    gated = GatedStore(store, gate)
    p = make(gated, upload_threads=1)
    try:
        for off in range(3):
            p.append(payloads(off), offset=off)
        assert gated.wait_for_puts(1)  # offset 0 is uploading; 1 and 2 wait for the thread
        p.abort()
        assert p.stats().inflight_bytes == p._entries[0].size  # only the upload under way
    finally:
        gate.set()
    p._uploads.shutdown(wait=True)  # the upload under way ends (the gate is open)
    assert p.stats().inflight_bytes == 0
    assert gated.data_puts_started == 1


class _ArrivalLock:
    """A lock that sets ``arrived`` when a thread comes to take it."""

    def __init__(self, arrived: threading.Event) -> None:
        self._lock = threading.Lock()
        self._arrived = arrived

    def __enter__(self) -> None:
        self._arrived.set()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_thread_started_while_the_upload_pool_shuts_down_gets_its_stop_signal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # shutdown() posted one stop signal per thread without the spawn lock: a submit() that had
    # passed the closed check was still starting a thread, which never got a signal and lived
    # on (or hung close()'s join) after the producer closed.
    from batchweave._producer import _uploads

    busy, spawning, resume, arrived = (threading.Event() for _ in range(4))
    real_thread = threading.Thread

    class PausedThread(real_thread):  # type: ignore[valid-type, misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if threading.current_thread().name == "submitter":
                spawning.set()
                assert resume.wait(30)
            super().__init__(*args, **kwargs)

    pool = _uploads.UploadThreads(2, name="bw-upload-test")
    pool._spawn_lock = _ArrivalLock(arrived)  # type: ignore[assignment]
    pool.submit(busy.wait, 30)  # the one thread is busy: the next submit starts another

    class Threading:  # the module's threading, starting PausedThreads
        Thread = PausedThread

        def __getattr__(self, name: str) -> Any:
            return getattr(threading, name)

    monkeypatch.setattr(_uploads, "threading", Threading())
    submitter = real_thread(target=pool.submit, args=(lambda: None,), name="submitter")
    submitter.start()
    assert spawning.wait(30)  # inside _spawn, past the closed check, before the thread exists
    arrived.clear()

    def shut_down() -> None:
        pool.shutdown(wait=False)
        arrived.set()  # unserialised, it is done before the thread it raced exists

    closer = real_thread(target=shut_down)
    closer.start()
    assert arrived.wait(30)  # the shutdown waits for the spawn lock, or is done already
    resume.set()
    submitter.join(30)
    closer.join(30)
    monkeypatch.undo()
    busy.set()
    for thread in pool.threads:
        thread.join(30)
    assert [t.name for t in pool.threads if t.is_alive()] == []
    assert len(pool.threads) == 2


def test_a_starting_producer_retries_its_epoch_on_the_newest_version_not_the_winner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # After a lost race it retried on the winner (one version past its base), needing one
    # conflict and one backoff per version committed meanwhile: behind busy producers it took
    # minutes to start. Here it opens 8 versions behind the head (a lagging listing).
    store = MemoryStore()
    with bw.Producer(store, "ns", producer_id="busy", mesh=bw.Mesh(dp=1)) as busy:
        for offset in range(10):
            busy.append([b"x"], offset=offset)
            busy.flush()
    real_open, real_commit = ManifestLog.create_or_open, ManifestLog.commit
    attempts: list[int] = []

    def stale_open(self: ManifestLog, mesh: bw.Mesh | None = None) -> Manifest:
        head = real_open(self, mesh)
        return self.read(head.version - 8)

    def counted(self: ManifestLog, base: Manifest, **changes: Any) -> Any:
        if "late" in changes.get("producers", {}):
            attempts.append(base.version)
        return real_commit(self, base, **changes)

    monkeypatch.setattr(ManifestLog, "create_or_open", stale_open)
    monkeypatch.setattr(ManifestLog, "commit", counted)
    late = bw.Producer(store, "ns", producer_id="late", mesh=bw.Mesh(dp=1), sleep=lambda _: None)
    late.close()
    assert len(attempts) == 2, attempts  # lost on the stale base, then won on the newest


def test_appends_go_on_when_the_os_refuses_another_upload_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: with the pool's one thread busy and the OS refusing another (a container's pids
    limit), append raised "producer ... was stopped" (it was not; an IndexError attached)."""
    store = MemoryStore()
    released = threading.Event()

    class Gated(bw.StoreWrapper):  # the first upload holds the one thread until released
        def put(self, key: str, data: Any, *, mode: bw.PutMode = bw.PutMode.OVERWRITE) -> None:
            if "/data/" in key:
                assert released.wait(30)
            super().put(key, data, mode=mode)

    real_start = threading.Thread.start

    def refuse(self: threading.Thread) -> None:
        if self.name.startswith("bw-upload-a_") and not self.name.endswith("_0"):
            raise RuntimeError("can't start new thread")
        real_start(self)

    gated = Gated(store)
    with bw.Producer(gated, "ns", producer_id="a", mesh=bw.Mesh(dp=1), upload_threads=4) as p:
        monkeypatch.setattr(threading.Thread, "start", refuse)
        for offset in range(5):  # every one after the first finds the thread busy
            p.append([bytes([offset])], offset=offset)
        assert not p.failed
        released.set()
        assert len(p._uploads.threads) == 1  # the one thread the OS allowed did every upload
    assert ManifestLog(store, "ns").latest().next_step == 5

"""Watermarks: record, release, keep-last-K, the boundary, and refusing corrupt objects."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import BaseModel

import batchweave as bw
from batchweave import _watermarks
from batchweave._manifest import ManifestLog
from batchweave._manifest._codec import encode_object

NS = "runs/wm"


@pytest.fixture
def store() -> bw.MemoryStore:
    return bw.MemoryStore("watermarks")


def test_no_watermark_means_boundary_zero(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    assert marks.live() == []
    assert marks.boundary() == 0


def test_record_release_and_boundary(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS, clock=lambda: 123.0)
    recorded = marks.record("ckpt-100", 100, version=7)
    marks.record("ckpt-200", 200, version=9)
    assert recorded == bw.Watermark(
        checkpoint_id="ckpt-100", step=100, version=7, recorded_at=123.0
    )
    assert [m.checkpoint_id for m in marks.live()] == ["ckpt-100", "ckpt-200"]
    assert marks.boundary() == 100
    assert marks.get("ckpt-200") is not None
    assert store.head(f"{NS}/_watermarks/ckpt-100.json").size > 0

    marks.release("ckpt-100")
    marks.release("ckpt-100")  # idempotent
    assert marks.boundary() == 200
    assert marks.get("ckpt-100") is None
    marks.release("ckpt-200")
    assert marks.boundary() == 0


def test_recording_again_replaces(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    marks.record("latest", 10, version=1)
    marks.record("latest", 30, version=2)
    assert [(m.step, m.version) for m in marks.live()] == [(30, 2)]


def test_keep_last_releases_lowest_steps(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS, keep_last=2)
    for step in (10, 20, 30, 40):
        marks.record(f"ckpt-{step}", step, version=step)
    assert [m.step for m in marks.live()] == [30, 40]
    assert marks.boundary() == 30


def test_keep_last_keeps_the_new_watermark_even_after_a_rollback(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS, keep_last=1)
    marks.record("ckpt-50", 50, version=5)
    # Training rolled back to an earlier checkpoint and checkpointed again at a lower step.
    marks.record("ckpt-40b", 40, version=6)
    assert [m.checkpoint_id for m in marks.live()] == ["ckpt-40b"]


def test_version_defaults_to_latest_manifest(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    assert marks.record("before-namespace", 0).version == 0
    log = ManifestLog(store, NS)
    base = log.create_or_open(bw.Mesh(dp=1, cp=1))
    log.commit(base, base_step=None)
    assert marks.record("after", 0).version == 1


@pytest.mark.parametrize("bad", ["", "a/b", "..", ".hidden", "-x", "a b", "x" * 201, "ä"])
def test_unsafe_checkpoint_ids_are_refused(store: bw.MemoryStore, bad: str) -> None:
    marks = bw.Watermarks(store, NS)
    with pytest.raises(ValueError, match="safe key segment"):
        marks.record(bad, 1)
    assert list(store.list(f"{NS}/")) == []


def test_bad_arguments(store: bw.MemoryStore) -> None:
    with pytest.raises(ValueError, match="keep_last"):
        bw.Watermarks(store, NS, keep_last=0)
    with pytest.raises(ValueError, match="step"):
        bw.Watermarks(store, NS).record("c", -1)
    with pytest.raises(TypeError, match="step must be an integer"):
        bw.Watermarks(store, NS).record("c", 1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="step must be an integer"):
        bw.Watermarks(store, NS).record("c", True)
    assert list(store.list(f"{NS}/")) == []


def test_numpy_steps_are_recorded_as_plain_ints(store: bw.MemoryStore) -> None:
    # A training loop's step counter is often a NumPy integer; the watermark must still be
    # plain JSON that every reader decodes.
    marks = bw.Watermarks(store, NS)
    mark = marks.record("ckpt-7", np.int64(7), version=0)
    assert type(mark.step) is int
    assert [(m.checkpoint_id, m.step) for m in marks.live()] == [("ckpt-7", 7)]


@pytest.mark.parametrize(
    ("mangle", "error", "match"),
    [
        (lambda b: b[:-3], bw.FormatError, "truncated"),
        (lambda b: b.replace(b'"step":5', b'"step":6'), bw.ChecksumMismatch, "checksum"),
        (lambda b: b'{"step": 5}', bw.FormatError, "not a BatchWeave"),
    ],
)
def test_corrupt_watermark_is_an_error_naming_the_key(
    store: bw.MemoryStore, mangle: object, error: type[Exception], match: str
) -> None:
    marks = bw.Watermarks(store, NS)
    marks.record("good", 50, version=1)
    marks.record("ckpt-5", 5, version=1)
    key = f"{NS}/_watermarks/ckpt-5.json"
    assert callable(mangle)
    store.put(key, mangle(store.get(key)))
    with pytest.raises(error, match=match) as info:
        marks.boundary()
    assert key in str(info.value)
    assert "reclaimed" in str(info.value)


def test_future_format_asks_for_an_upgrade(store: bw.MemoryStore) -> None:
    from batchweave._manifest._codec import encode_object

    class Future(bw.Watermark):
        pass

    data = encode_object(
        "batchweave-watermark",
        Future(format=2, checkpoint_id="c", step=1, version=0),
    )
    store.put(f"{NS}/_watermarks/c.json", data)
    with pytest.raises(bw.UnsupportedFormatVersion, match="upgrade"):
        bw.Watermarks(store, NS).live()


def test_a_watermark_copied_under_another_name_is_refused(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    marks.record("ckpt-1", 1, version=0)
    store.put(f"{NS}/_watermarks/ckpt-2.json", store.get(f"{NS}/_watermarks/ckpt-1.json"))
    with pytest.raises(bw.FormatError, match=r"ckpt-2\.json"):
        marks.live()


def test_other_files_under_the_prefix_are_ignored(store: bw.MemoryStore) -> None:
    marks = bw.Watermarks(store, NS)
    marks.record("ckpt-3", 3, version=0)
    store.put(f"{NS}/_watermarks/README.txt", b"operators notes")
    assert marks.boundary() == 3


class _LooseWatermark(BaseModel):
    """A watermark as a hand-written tool might store it: the step as a string."""

    format: int = 1
    checkpoint_id: str
    step: str
    version: int
    recorded_at: float = 0.0


def test_a_watermark_whose_step_is_not_an_integer_is_refused(store: bw.MemoryStore) -> None:
    # A validly enveloped watermark with "step": "5" was coerced to 5; a value nothing in
    # BatchWeave writes is refused as manifests are, naming the key and the field.
    key = f"{NS}/_watermarks/ckpt-5.json"
    loose = _LooseWatermark(checkpoint_id="ckpt-5", step="5", version=1)
    store.put(key, encode_object(_watermarks._MAGIC, loose))
    with pytest.raises(bw.FormatError, match="step") as info:
        bw.Watermarks(store, NS).boundary()
    assert key in str(info.value)

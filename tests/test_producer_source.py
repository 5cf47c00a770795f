"""``Producer(source=...)``: a restart whose offsets would mean other data is refused.

Exactly-once resume assumes the source maps every offset to the same data after a restart. The
producer commits an opaque identity of its source with its epoch; a later start of the same id
with another identity raises ``SourceMismatch`` before anything is committed, ``source=None``
checks nothing and keeps what is committed, and an identity given where none is committed is
adopted. Manifests are written in format 4 only when some producer state has a source, so
namespaces that do not use it stay readable by releases that read format 3.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import lance
import numpy as np
import pyarrow as pa
import pytest
from fake_time import FakeTime
from manifest_helpers import body, envelope
from pydantic import BaseModel, ConfigDict, ValidationError

import batchweave as bw
from batchweave import (
    FormatError,
    MemoryStore,
    Mesh,
    Producer,
    SourceMismatch,
    UnsupportedFormatVersion,
)
from batchweave._manifest import _codec, decode_manifest, encode_manifest
from batchweave._manifest._log import Committed, ManifestLog
from batchweave._manifest._models import Manifest, ProducerState
from batchweave.cli._seal import seal_namespace
from batchweave.lance import LanceSource

MESH = Mesh(dp=2)
NS = "runs/source"
V1 = "lance:'/data/corpus.lance' version=1 shard=0/4"
V2 = "lance:'/data/corpus.lance' version=2 shard=0/4"


def make(store: bw.ObjectStore, producer_id: str = "prep-0", **kw: Any) -> Producer:
    opts: dict[str, Any] = {"policy": "naive", **FakeTime(1000.0).producer_options(), **kw}
    return Producer(store, NS, producer_id=producer_id, mesh=MESH, **opts)


def publish(store: bw.ObjectStore, offsets: range, **kw: Any) -> Producer:
    """Start a producer, append ``offsets`` (one byte string per slice), close it."""
    with make(store, **kw) as p:
        for offset in offsets:
            p.append([f"{offset}/{i}".encode() for i in range(MESH.slices)], offset=offset)
    return p


def latest(store: bw.ObjectStore) -> Manifest:
    return ManifestLog(store, NS).latest()


def manifest_bodies(store: MemoryStore) -> dict[int, dict[str, Any]]:
    """The JSON body of every manifest version, by version."""
    out = {}
    for meta in store.list(f"{NS}/_manifests/"):
        out[int(meta.key.rsplit("/", 1)[1].split(".")[0])] = json.loads(body(store.get(meta.key)))
    return out


def read_all(store: bw.ObjectStore) -> list[bytes]:
    """Rank 0's slice of every committed step (the namespace is not sealed)."""
    consumer = bw.Consumer(store, NS, mesh=MESH, dp_rank=0, timeout=0, prefetch=0)
    try:
        steps = latest(store).next_step
        return [bytes(data) for _, data in itertools.islice(consumer, steps)]
    finally:
        consumer.close()


def test_a_restart_with_another_source_is_refused_before_anything_is_committed() -> None:
    store = MemoryStore()
    publish(store, range(3), source=V1)
    before = latest(store)
    objects = sorted((m.key, m.size) for m in store.list(""))
    with pytest.raises(SourceMismatch) as err:
        make(store, source=V2)
    message = str(err.value)
    for part in (repr(NS), "'prep-0'", repr(V1), repr(V2), "version=N", "new producer_id"):
        assert part in message, (part, message)
    assert f"manifest version {before.version}" in message
    assert isinstance(err.value, bw.ProducerError)
    # Nothing changed: no new version, no new object, the committed state is intact.
    assert latest(store) == before
    assert sorted((m.key, m.size) for m in store.list("")) == objects
    assert before.producers["prep-0"].source == V1
    assert before.producers["prep-0"].offset == 2
    assert read_all(store) == [b"0/0", b"1/0", b"2/0"]
    # The committed source resumes where the history ends.
    with make(store, source=V1) as p:
        assert p.resume_offset == 3
        assert p.committed_source == V1
        p.append([b"3/0", b"3/1"], offset=3)
    assert read_all(store) == [b"0/0", b"1/0", b"2/0", b"3/0"]


def test_another_producer_id_may_use_another_source() -> None:
    store = MemoryStore()
    publish(store, range(2), source=V1)
    p = publish(store, range(2), producer_id="prep-0-v2", source=V2)
    assert p.committed_source == V2
    states = latest(store).producers
    assert (states["prep-0"].source, states["prep-0-v2"].source) == (V1, V2)


def test_a_source_given_where_none_is_committed_is_adopted_and_kept_by_commits() -> None:
    store = MemoryStore()
    publish(store, range(2))
    assert latest(store).producers["prep-0"].source is None
    # Adopted by the epoch commit, and kept by the commits that append (they rebuild the state).
    with make(store, source=V1) as p:
        assert p.committed_source == V1
        assert p.resume_offset == 2
        assert latest(store).producers["prep-0"].source == V1
        p.append([b"2/0", b"2/1"], offset=2)
    state = latest(store).producers["prep-0"]
    assert (state.source, state.offset) == (V1, 2)
    with pytest.raises(SourceMismatch):
        make(store, source=V2)


def test_every_commit_path_keeps_a_committed_source() -> None:
    # The manifest's producer states are rebuilt by every commit: those of other producers
    # (tail rolls into segments, level merges swapped in), a rebase after a lost race, a
    # reclaimer's base_step commit, a retirement of another id and a seal. None may drop the
    # source, nor write the version in format 3.
    store = MemoryStore()
    log = ManifestLog(store, NS)

    def kept(after: str) -> None:
        manifest = latest(store)
        assert manifest.producers["prep-0"].source == V1, after
        assert manifest.format == 4, after
        again = decode_manifest(encode_manifest(manifest), key="v")
        assert again.producers["prep-0"].source == V1

    small = {"tail_limit": 2}
    stale = {"refresh_age": 1e9}  # a commits on the base it read last: b's commits beat it
    with make(store, source=V1, **small, **stale) as a, make(store, "other", **small) as b:
        for offset in range(12):
            b.append([b"b", b"b"], offset=offset)
            b.flush()  # rolls the tail into segments, merging them level by level
            a.append([b"a", b"a"], offset=offset)
            a.flush()  # its base is older than b's commit: a lost race, then a rebase
        assert a.stats().conflicts > 0
        assert latest(store).segments
        kept("commits of another producer and rebases")
    base = latest(store)
    assert isinstance(log.commit(base, base_step=base.next_step - 2), Committed)
    kept("a reclaimer's base_step commit")
    bw.retire_producers(store, NS, idle_for=1.0, producer_ids=["other"], wall_clock=lambda: 1e12)
    assert "other" not in latest(store).producers
    kept("a retirement of another id")
    assert seal_namespace(store, NS)[1]
    kept("a seal")


def test_source_none_checks_nothing_and_keeps_the_committed_source() -> None:
    store = MemoryStore()
    publish(store, range(2), source=V1)
    p = publish(store, range(2, 4))
    assert p.committed_source == V1
    state = latest(store).producers["prep-0"]
    assert (state.source, state.offset) == (V1, 3)
    # Still checked for the next start that gives one.
    with pytest.raises(SourceMismatch):
        make(store, source=V2)


def test_without_sources_nothing_is_committed_or_checked() -> None:
    store = MemoryStore()
    p = publish(store, range(2))
    assert p.committed_source is None
    assert publish(store, range(2, 3)).committed_source is None
    assert latest(store).producers["prep-0"].offset == 2


def test_manifests_are_format_3_until_a_source_is_committed() -> None:
    store = MemoryStore()
    publish(store, range(2))
    publish(store, range(2, 3), producer_id="other", source=V1)
    bodies = manifest_bodies(store)
    with_source = [v for v, doc in bodies.items() if doc["format"] == 4]
    assert with_source, bodies
    first = min(with_source)
    # Every version before the first source is format 3 and names no source; every later one
    # carries it (the producer states are copied into every version).
    for version, doc in bodies.items():
        states = doc["producers"].values()
        assert doc["format"] == (4 if version >= first else 3), version
        assert any("source" in s for s in states) == (version >= first), version
    assert "source" not in bodies[max(bodies)]["producers"]["prep-0"]
    assert bodies[max(bodies)]["producers"]["other"]["source"] == V1


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        ("", ValueError, "1 to 1024 printable characters, got 0"),
        ("x" * 1025, ValueError, "got 1025 characters"),
        ("a\nb", ValueError, "printable"),
        ("tab\there", ValueError, "printable"),
        (7, TypeError, "source must be a str or None, got the int 7"),
        (b"v1", TypeError, "source must be a str or None"),
    ],
)
def test_a_bad_source_is_refused_before_the_namespace_is_touched(
    source: object, error: type[Exception], match: str
) -> None:
    store = MemoryStore()
    with pytest.raises(error, match=match) as err:
        make(store, source=source)
    assert "'prep-0'" in str(err.value)
    assert list(store.list("")) == []


def test_the_longest_source_is_accepted_and_round_trips() -> None:
    store = MemoryStore()
    longest = "é" * 1024  # characters, not bytes
    assert publish(store, range(1), source=longest).committed_source == longest
    assert latest(store).producers["prep-0"].source == longest
    with make(store, source=longest) as p:
        assert p.committed_source == longest


# ------------------------------------------------------------------------------------------------
# with a LanceSource: a restart on another dataset version


def _write(path: Path, start: int, count: int, mode: str = "create") -> None:
    ids = np.arange(start, start + count, dtype=np.int64)
    lance.write_dataset(pa.table({"id": pa.array(ids)}), str(path), mode=mode)


def test_a_lance_producer_restarted_on_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "rows.lance"
    _write(path, 0, 40)
    store = MemoryStore()

    def run(source: LanceSource, stop: int) -> Producer:
        with make(store, source=source.source_id) as p:
            for offset, table in source.iter_from(p.resume_offset, stop=stop):
                ids = table.column("id").to_numpy()
                p.append([ids.tobytes(), ids[::-1].tobytes()], offset=offset)
        return p

    first = LanceSource(path, rows_per_batch=4, seed=3)
    run(first, stop=3)
    _write(path, 40, 40, mode="append")  # the dataset moves to version 2
    before = latest(store)
    with pytest.raises(SourceMismatch, match="version=1") as err:
        run(LanceSource(path, rows_per_batch=4, seed=3), stop=6)
    assert "version=2" in str(err.value)
    assert latest(store) == before
    # Pinned to the version the run started on, it resumes.
    resumed = run(LanceSource(path, rows_per_batch=4, seed=3, version=first.version), stop=6)
    assert resumed.resume_offset == 3
    expected = [first.take(o).column("id").to_numpy().tobytes() for o in range(6)]
    assert read_all(store) == expected


def test_lance_sources_that_read_the_same_rows_have_the_same_source_id(tmp_path: Path) -> None:
    # A restart spelling an argument differently, or changing one that has no effect on the
    # rows, must not be refused: the seed only orders rows when shuffling, shuffle is a truth
    # value, and column names are names however the list holds them.
    path = tmp_path / "rows.lance"
    _write(path, 0, 40)
    plain = LanceSource(path, rows_per_batch=4, seed=3, shuffle=False, columns=["id"])
    same = [
        LanceSource(path, rows_per_batch=4, seed=9, shuffle=False, columns=["id"]),
        LanceSource(path, rows_per_batch=4, seed=3, shuffle=0, columns=np.array(["id"])),
    ]
    for other in same:
        assert [other.take(o) for o in range(10)] == [plain.take(o) for o in range(10)]
        assert other.source_id == plain.source_id
    shuffled = LanceSource(path, rows_per_batch=4, seed=3)
    assert LanceSource(path, rows_per_batch=4, seed=3, shuffle=1).source_id == shuffled.source_id
    assert LanceSource(path, rows_per_batch=4, seed=9).source_id != shuffled.source_id


# ------------------------------------------------------------------------------------------------
# format 4: written only for sources, refused clearly by a format-3 reader


class _Format3State(BaseModel):
    """A producer state as a format-3 reader (BatchWeave before source identities) knows it."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    epoch: int
    offset: int | None = None
    last_version: int
    last_commit_at: float = 0.0


class _Format3Reader(BaseModel):
    """The part of a format-3 reader's manifest schema that meets a source: its states."""

    model_config = ConfigDict(extra="ignore")
    format: int
    producers: dict[str, _Format3State]


def _manifest(**states: ProducerState) -> Manifest:
    return Manifest(namespace_id="ns", mesh=MESH, version=3, commit_id="c", producers=states)


KEY = f"{NS}/_manifests/00000000000000000003.manifest"


def test_format_3_without_sources_reads_in_a_format_3_reader() -> None:
    manifest = _manifest(a=ProducerState(epoch=1, offset=4, last_version=2))
    raw = body(encode_manifest(manifest))
    assert json.loads(raw)["format"] == 3
    assert b"source" not in raw  # written only when set
    assert decode_manifest(encode_manifest(manifest), key=KEY) == manifest
    old = _codec._validate(raw, _Format3Reader, key=KEY, what="manifest", supported=3)
    assert old.producers["a"].offset == 4


def test_format_4_round_trips_and_a_format_3_reader_asks_to_upgrade() -> None:
    manifest = _manifest(
        a=ProducerState(epoch=1, offset=4, last_version=2),
        b=ProducerState(epoch=2, last_version=3, source=V1),
    )
    raw = body(encode_manifest(manifest))
    assert json.loads(raw)["format"] == 4
    assert "source" not in json.loads(raw)["producers"]["a"]
    decoded = decode_manifest(encode_manifest(manifest), key=KEY)
    assert decoded == manifest
    assert decoded.format == 4
    assert decoded.producers["b"].source == V1
    # An older reader: its schema refuses the unknown field, the format says why.
    with pytest.raises(UnsupportedFormatVersion, match="upgrade batchweave") as err:
        _codec._validate(raw, _Format3Reader, key=KEY, what="manifest", supported=3)
    message = str(err.value)
    assert KEY in message
    assert "format 4 was written by a newer BatchWeave" in message
    assert "reads formats up to 3" in message
    # The same with this schema and the supported format of a format-3 release.
    with pytest.raises(UnsupportedFormatVersion, match="upgrade batchweave"):
        _codec._validate(raw, Manifest, key=KEY, what="manifest", supported=3)


def test_a_source_in_a_format_3_manifest_is_refused() -> None:
    with pytest.raises(ValidationError, match="format 3 lacks"):
        Manifest(
            format=3,
            namespace_id="ns",
            mesh=MESH,
            version=3,
            commit_id="c",
            producers={"b": ProducerState(epoch=2, last_version=3, source=V1)},
        )
    doc = json.loads(
        body(encode_manifest(_manifest(b=ProducerState(epoch=2, last_version=3, source=V1))))
    )
    doc["format"] = 3
    with pytest.raises(FormatError, match="format 3 lacks") as err:
        decode_manifest(envelope(json.dumps(doc).encode()), key=KEY)
    assert KEY in str(err.value)


@pytest.mark.parametrize("source", ["", "x" * 1025, "a\nb", "\x1b[31mred"])
def test_a_committed_source_that_is_not_printable_or_too_long_is_a_format_error(
    source: str,
) -> None:
    doc = json.loads(
        body(encode_manifest(_manifest(b=ProducerState(epoch=2, last_version=3, source=V1))))
    )
    doc["producers"]["b"]["source"] = source
    with pytest.raises(FormatError, match=r"producers\.b\.source") as err:
        decode_manifest(envelope(json.dumps(doc).encode()), key=KEY)
    assert KEY in str(err.value)

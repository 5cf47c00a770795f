"""Hostile, damaged or foreign manifest content: refused with a named error, never mis-mapped.

How manifests, segments and slice tables are read when their content is hostile: a huge slice
count is refused without allocating it, any JSON in a slice table field is accepted or a
validation error, a hostile slice table is a ``FormatError`` naming the object, a segment
reused under another reference is not served from the cache, a segment object replaced by a
huge one is refused without downloading it, and a later version with another mesh is a
``NamespaceMismatch``.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manifest_helpers import descriptor, grow
from pydantic import ValidationError

from batchweave import CountingStore, FormatError, MemoryStore, Mesh, NamespaceMismatch
from batchweave._manifest import (
    Manifest,
    ManifestLog,
    encode_manifest,
    manifest_key,
)
from batchweave._manifest._codec import body_checksum, decode_manifest
from batchweave._manifest._models import SliceTable

MESH = Mesh(dp=2, cp=1)
NS = "runs/hostile"


def _table(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "codec": "raw",
        "checksum_algo": "crc32c",
        "count": 2,
        "lengths": 10,
        "checksums": "AAAAAAAAAAA=",  # two zero crc32c values
        "sample_counts": 1,
    }
    fields.update(overrides)
    return fields


def test_the_compact_table_fixture_is_valid() -> None:
    table = SliceTable.model_validate(_table())
    assert table.lengths == (10, 10)
    assert table.checksums == (0, 0)


def test_a_huge_slice_count_is_refused_without_allocating_it() -> None:
    # A few bytes of JSON must not expand into a column of 10**12 entries (MemoryError or OOM).
    with pytest.raises(ValidationError, match="checksums"):
        SliceTable.model_validate(_table(count=10**12, checksums=[0]))
    with pytest.raises(ValidationError, match="checksums"):
        SliceTable.model_validate(_table(count=10**12, checksums=None))


@pytest.mark.parametrize("algo", [["crc32c"], {"a": 1}, None, 32])
def test_a_non_string_checksum_algorithm_is_a_validation_error(algo: object) -> None:
    with pytest.raises(ValidationError):
        SliceTable.model_validate(_table(checksum_algo=algo))


def test_a_hostile_slice_table_in_a_manifest_is_a_format_error_naming_the_object() -> None:
    body = json.loads(
        Manifest(namespace_id="n", mesh=MESH, version=3, commit_id="c").model_dump_json()
    )
    desc = json.loads(descriptor("p", 0).model_dump_json())
    desc["objects"][0]["slices"] = _table(checksum_algo=["crc32c"])
    body["tail"] = [desc]
    raw = json.dumps(body).encode()
    header = f"batchweave-manifest crc32c={body_checksum(raw):08x} length={len(raw)}\n"
    with pytest.raises(FormatError, match="ns/_manifests/x"):
        decode_manifest(header.encode() + raw, key="ns/_manifests/x")


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(
    field=st.sampled_from(
        [
            "codec",
            "compression",
            "checksum_algo",
            "count",
            "lengths",
            "checksums",
            "uncompressed_lengths",
            "sample_counts",
        ]
    ),
    value=_JSON | st.integers(min_value=2**31, max_value=2**80),
)
def test_any_json_in_a_slice_table_field_is_accepted_or_a_validation_error(
    field: str, value: object
) -> None:
    try:
        table = SliceTable.model_validate(_table(**{field: value}))
    except ValidationError:
        return  # anything else (TypeError, MemoryError...) fails the test
    assert len(table.checksums) == len(table.lengths) == len(table.sample_counts)


def test_a_segment_reused_under_another_reference_is_not_served_from_the_cache() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS, tail_limit=4, merge_fanout=2)
    head = grow(log, log.create_or_open(Mesh(dp=8)), 12)  # the helper's descriptors: 8 slices
    assert [(r.first_step, r.count) for r in head.segments] == [(0, 8), (8, 4)]
    first, second = head.segments
    assert log.descriptor(head, 0).offset == 0  # caches the segment of steps 0..7
    # A hostile version points steps 8..11 at the first segment's key (with the second's
    # checksum and size): step 8 must not silently become the descriptor of step 0.
    hostile = head.model_copy(
        update={"segments": (first, second.model_copy(update={"key": first.key}))}
    )
    with pytest.raises(FormatError, match=first.key):
        log.descriptor(hostile, 8)
    # The honest version still reads from the cache.
    assert log.descriptor(head, 8).offset == 8


def test_a_later_version_with_another_mesh_is_a_namespace_mismatch() -> None:
    store = MemoryStore()
    log = ManifestLog(store, NS)
    head = grow(log, log.create_or_open(MESH), 2)
    # Same namespace id, same slice count, another meaning of each slice: consumers and
    # producers would silently read or write the wrong replicas.
    forged = head.model_copy(
        update={"version": head.version + 1, "parent": head.version, "mesh": Mesh(dp=1, cp=2)}
    )
    store.put(log.key(manifest_key(forged.version)), encode_manifest(forged))
    with pytest.raises(NamespaceMismatch, match="mesh"):
        log.latest(head)
    with pytest.raises(NamespaceMismatch, match=f"{forged.version:020d}"):
        log.read(forged.version)


def test_a_segment_object_replaced_by_a_huge_one_is_refused_without_downloading_it() -> None:
    inner = MemoryStore()
    log = ManifestLog(inner, NS, tail_limit=4, merge_fanout=2)
    head = grow(log, log.create_or_open(MESH), 12)
    second = head.segments[1]
    inner.put(log.key(second.key), b"x" * (second.bytes + (8 << 20)))
    store = CountingStore(inner)
    with pytest.raises(FormatError, match=second.key):
        ManifestLog(store, NS).descriptor(head, 8)
    # One byte past the size the reference records is enough to tell: not the whole object.
    assert store.snapshot().range_bytes + store.snapshot().get_bytes <= second.bytes + 1


@pytest.mark.parametrize("with_table", [True, False])
@pytest.mark.parametrize("first_slice", [1, 0])
def test_objects_that_do_not_tile_the_mesh_are_refused_by_readers(
    with_table: bool, first_slice: int
) -> None:
    # Before: an object reference saying first_slice=1 (valid JSON, valid checksum) made rank 1
    # receive rank 0's slice, silently, and export label rows with shifted ranks. first_slice=0
    # with slice_count=1 leaves slice 1 in no object: rank 0 would read on, rank 1 fail.
    from batchweave import Consumer, Producer
    from batchweave._history import iter_membership
    from batchweave.cli._verify import verify_namespace

    store = MemoryStore()
    mesh = Mesh(dp=2)
    with Producer(store, "ns", producer_id="p", mesh=mesh, policy="naive") as producer:
        producer.append([b"rank0", b"rank1"], offset=0)
        producer.seal()
    key = max(m.key for m in store.list("ns/_manifests/"))  # the newest version
    data = store.get(key)
    doc = json.loads(data[data.index(b"\n") + 1 :])
    ref = doc["tail"][0]["objects"][0]
    if first_slice:
        ref["first_slice"] = first_slice
    else:
        ref["slice_count"] = 1
        with_table = False  # the table must have slice_count entries
    if not with_table:
        ref.pop("slices", None)
    body = json.dumps(doc, separators=(",", ":")).encode()
    header = f"batchweave-manifest crc32c={body_checksum(body):08x} length={len(body)}\n"
    store.put(key, header.encode() + body)
    for rank in range(2):
        consumer = Consumer(store, "ns", mesh=mesh, dp_rank=rank)
        with pytest.raises(FormatError, match=r"step 0 .*objects .* slices"):
            next(consumer)
        consumer.close()
    with pytest.raises(FormatError, match=r"step 0 .*objects .* slices"):
        list(iter_membership(store, "ns"))
    assert any("step 0: objects" in p for p in verify_namespace(store, "ns").problems)

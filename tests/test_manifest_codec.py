"""Encoding of manifests and segments: round trips and every way bytes can be wrong."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import struct
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from manifest_helpers import KEY, SEG_KEY, body, decode_outcome, envelope
from pydantic import TypeAdapter

from batchweave import (
    ChecksumMismatch,
    FormatError,
    MemoryStore,
    Mesh,
    Producer,
    UnsupportedFormatVersion,
)
from batchweave._format._checksum import checksum
from batchweave._manifest import (
    MANIFEST_FORMAT,
    MAX_MANIFEST_BYTES,
    Manifest,
    ProducerState,
    Segment,
    SegmentRef,
    SliceTable,
    TgbDescriptor,
    TgbObjectRef,
    _codec,
    _models,
    decode_manifest,
    decode_segment,
    encode_manifest,
    encode_segment,
    manifest_key,
)
from batchweave._manifest._models import MAX_SOURCE_LENGTH

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**63 - 1)
names = st.text(min_size=1, max_size=20)
keys = st.lists(
    st.from_regex(r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,9}", fullmatch=True), min_size=1, max_size=3
).map("/".join)
"""Object keys relative to the namespace (what the store layer accepts)."""
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)

objects = st.builds(
    TgbObjectRef,
    key=keys,
    size=u64,
    first_slice=st.integers(0, 1 << 20),
    slice_count=st.integers(1, 1 << 20),
    footer_offset=u64,
    footer_length=st.integers(1, 1 << 30),
    footer_checksum=u64,
)


@st.composite
def objects_with_tables(draw: st.DrawFn) -> TgbObjectRef:
    """Object references whose slice table is consistent with their slice count and footer."""
    lengths = draw(st.lists(st.integers(0, 1 << 40), min_size=1, max_size=40).map(tuple))
    compressed = draw(st.booleans())
    n = len(lengths)
    table = SliceTable(
        codec=draw(st.sampled_from(["raw", "arrow", "tensors"])),
        compression="zstd" if compressed else None,
        checksum_algo="crc32c",
        lengths=lengths,
        checksums=draw(st.lists(u32, min_size=n, max_size=n).map(tuple)),
        uncompressed_lengths=(
            draw(st.lists(u64, min_size=n, max_size=n).map(tuple)) if compressed else None
        ),
        sample_counts=draw(st.lists(u32, min_size=n, max_size=n).map(tuple)),
    )
    return TgbObjectRef(
        key=draw(keys),
        size=draw(u64),
        slice_count=n,
        footer_offset=sum(lengths),
        footer_length=draw(st.integers(1, 1 << 30)),
        footer_checksum=draw(u64),
        slices=table,
    )


descriptors = st.builds(
    TgbDescriptor,
    producer_id=names,
    epoch=u32,
    offset=u64,
    objects=st.lists(objects | objects_with_tables(), min_size=1, max_size=3).map(tuple),
    bytes=u64,
    samples=st.none() | u32,
)
sources = st.text(
    st.characters(exclude_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp", "Zs"))
    | st.just(" "),
    min_size=1,
    max_size=MAX_SOURCE_LENGTH,
)
"""Valid source identities: 1 to 1024 printable characters (``str.isprintable``)."""
producer_states = st.builds(
    ProducerState,
    epoch=u32,
    offset=st.none() | u64,
    last_version=u64,
    last_commit_at=times,
    source=st.none() | sources,
)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    start = draw(st.integers(0, 10**9))
    refs = []
    step = start
    for count in draw(st.lists(st.integers(1, 5000), max_size=5)):
        refs.append(
            SegmentRef(key=draw(keys), first_step=step, count=count, bytes=draw(u32), checksum=0)
        )
        step += count
    tail = tuple(draw(st.lists(descriptors, max_size=4)))
    next_step = step + len(tail)
    version = draw(st.integers(0, 10**12))
    return Manifest(
        namespace_id=draw(st.uuids()).hex,
        mesh=Mesh(dp=draw(st.integers(1, 4096)), cp=draw(st.integers(1, 64))),
        version=version,
        parent=version - 1 if version else None,
        commit_id=draw(st.uuids()).hex,
        created_at=draw(times),
        base_step=draw(st.integers(start, next_step)),
        segments=tuple(refs),
        tail=tail,
        tail_start=step,
        producers=draw(st.dictionaries(names, producer_states, max_size=4)),
        sealed=draw(st.booleans()),
    )


segments = st.builds(
    Segment,
    namespace_id=st.uuids().map(lambda u: u.hex),
    first_step=u64,
    tgbs=st.lists(descriptors, min_size=1, max_size=5).map(tuple),
)


@settings(max_examples=60, deadline=None)
@given(manifests())
def test_manifest_round_trip(manifest: Manifest) -> None:
    data = encode_manifest(manifest)
    assert data.startswith(b"batchweave-manifest crc32c=")
    assert decode_manifest(data, key=KEY) == manifest


@settings(max_examples=60, deadline=None)
@given(manifests())
def test_manifests_use_format_4_only_for_producer_sources(manifest: Manifest) -> None:
    # Format 4 only adds ProducerState.source: without one, format-3 readers still read it.
    doc = json.loads(body(encode_manifest(manifest)))
    sourced = {pid for pid, state in manifest.producers.items() if state.source is not None}
    assert doc["format"] == manifest.format == (4 if sourced else 3)
    assert {pid for pid, state in doc["producers"].items() if "source" in state} == sourced


@settings(max_examples=60, deadline=None)
@given(manifests(), producer_states, st.sampled_from(["__all__", "__all_", "all", "..."]))
def test_a_producer_id_pydantic_reads_specially_leaves_other_sources_alone(
    manifest: Manifest, state: ProducerState, pid: str
) -> None:
    # "__all__" as an exclude key means every entry: an id-keyed exclude of the unset sources
    # dropped every other producer's source when a producer was named "__all__".
    producers = {**manifest.producers, pid: state}
    fields = {name: getattr(manifest, name) for name in Manifest.model_fields}
    del fields["format"]  # the format follows from the producers (3 or 4)
    manifest = Manifest(**{**fields, "producers": producers})
    doc = json.loads(body(encode_manifest(manifest)))
    sourced = {p for p, s in producers.items() if s.source is not None}
    assert {p for p, s in doc["producers"].items() if "source" in s} == sourced
    decoded = decode_manifest(encode_manifest(manifest), key=KEY)
    assert {p: s.source for p, s in decoded.producers.items()} == {
        p: s.source for p, s in producers.items()
    }


def test_manifest_bytes_are_those_earlier_releases_wrote() -> None:
    # Pinned bytes (written by the release before the source serializer moved into
    # ProducerState): manifests already stored must decode, and re-encode, the same.
    states = {
        "a": ProducerState(epoch=1, offset=3, last_version=7, last_commit_at=1.25),
        "b": ProducerState(epoch=2, last_version=6, source="kafka://t"),
    }
    fields = dict(namespace_id="ns", mesh=Mesh(dp=2, cp=2), version=7, parent=6, commit_id="c")
    head = (
        '"namespace_id":"ns","mesh":{"dp":2,"cp":2},"version":7,"parent":6,"commit_id":"c",'
        '"created_at":1.5,"base_step":0,"segments":[],"tail":[],"tail_start":0,"producers":'
        '{"a":{"epoch":1,"offset":3,"last_version":7,"last_commit_at":1.25}'
    )
    v3 = Manifest(**fields, created_at=1.5, producers={"a": states["a"]})
    assert body(encode_manifest(v3)).decode() == '{"format":3,' + head + '},"sealed":false}'
    v4 = Manifest(**fields, created_at=1.5, producers=states)
    assert body(encode_manifest(v4)).decode() == (
        '{"format":4,' + head + ',"b":{"epoch":2,"offset":null,"last_version":6,'
        '"last_commit_at":0.0,"source":"kafka://t"}},"sealed":false}'
    )
    for manifest in (v3, v4):
        data = encode_manifest(manifest)
        assert encode_manifest(decode_manifest(data, key=KEY)) == data


@settings(max_examples=60, deadline=None)
@given(segments)
def test_segment_round_trip(segment: Segment) -> None:
    data = encode_segment(segment)
    decoded, crc = decode_segment(data, key=SEG_KEY)
    assert decoded == segment
    assert crc == checksum(body(data))


def _sample_manifest() -> Manifest:
    return Manifest(
        namespace_id="ns",
        mesh=Mesh(dp=2, cp=2),
        version=7,
        parent=6,
        commit_id="c",
        producers={"p": ProducerState(epoch=1, offset=3, last_version=7)},
    )


def test_body_is_plain_json_after_the_header() -> None:
    data = encode_manifest(_sample_manifest())
    header, body = data.split(b"\n", 1)
    assert re.fullmatch(rb"batchweave-manifest crc32c=[0-9a-f]{8} length=\d+", header)
    assert json.loads(body)["format"] == 3  # no producer state has a source


@pytest.mark.parametrize("position", [60, -1, -30])
def test_flipped_byte_is_a_checksum_mismatch_naming_key_and_values(position: int) -> None:
    data = bytearray(encode_manifest(_sample_manifest()))
    data[position] ^= 0x01
    with pytest.raises(ChecksumMismatch) as err:
        decode_manifest(bytes(data), key=KEY)
    message = str(err.value)
    assert KEY in message
    header, body = bytes(data).split(b"\n", 1)
    stored = header.split(b"crc32c=")[1][:8].decode()
    computed = f"{checksum(body):08x}"
    assert stored in message
    assert computed in message


def test_truncated_manifest_is_a_format_error() -> None:
    data = encode_manifest(_sample_manifest())
    with pytest.raises(FormatError, match="truncated") as err:
        decode_manifest(data[:-10], key=KEY)
    assert KEY in str(err.value)
    assert not isinstance(err.value, ChecksumMismatch)


@pytest.mark.parametrize(
    "data",
    [b"", b"PAR1 not ours", b'{"format": 1}', b"x" * 500],
)
def test_foreign_bytes_are_a_format_error(data: bytes) -> None:
    with pytest.raises(FormatError, match="not a BatchWeave manifest") as err:
        decode_manifest(data, key=KEY)
    assert KEY in str(err.value)


def _header_variants() -> list[object]:
    data = encode_manifest(_sample_manifest())
    header, rest = data.split(b"\n", 1)
    crc = header.split(b"crc32c=")[1][:8]
    return [
        pytest.param(header.replace(crc, crc.upper()) + b"\n" + rest, id="upper-case-hex"),
        pytest.param(header.replace(b" ", b"  ", 1) + b"\n" + rest, id="double-space"),
        pytest.param(header + b"\r\n" + rest, id="crlf"),
        pytest.param(header.replace(b"length=", b"length=0") + b"\n" + rest, id="leading-zero"),
        pytest.param(b"batchweave-manifest crc32c=zz\n{}", id="not-hex"),
        pytest.param(b"batchweave-manifest " + b"x" * 200, id="no-newline"),
    ]


@pytest.mark.parametrize("data", _header_variants())
def test_a_malformed_header_line_is_named_with_what_was_expected(data: bytes) -> None:
    # Before: an upper-case checksum (correct otherwise) was "not a BatchWeave manifest (no
    # 'batchweave-manifest crc32c=... length=...' header line)", though the line is there.
    with pytest.raises(FormatError) as err:
        decode_manifest(data, key=KEY)
    message = str(err.value)
    assert KEY in message
    assert "malformed manifest header line b'batchweave-manifest" in message
    assert "<8 lower-case hex digits>" in message
    assert "no header line" not in message


def test_segment_is_not_a_manifest() -> None:
    seg = Segment(namespace_id="ns", first_step=0, tgbs=(_descriptor(),))
    with pytest.raises(FormatError, match="expected a manifest, found a 'batchweave-segment'"):
        decode_manifest(encode_segment(seg), key=KEY)


def test_absurd_size_is_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert MAX_MANIFEST_BYTES >= 1 << 20  # real manifests (KBs) fit with a wide margin
    monkeypatch.setattr(_codec, "MAX_MANIFEST_BYTES", 1000)
    data = b"batchweave-manifest crc32c=00000000 length=1001\n" + b"{" * 1001
    with pytest.raises(FormatError, match="far larger than any manifest"):
        decode_manifest(data, key=KEY)


def test_future_format_asks_to_upgrade() -> None:
    doc = json.loads(body(encode_manifest(_sample_manifest())))
    doc["format"] = MANIFEST_FORMAT + 1
    doc["some_new_field"] = {"x": 1}
    with pytest.raises(UnsupportedFormatVersion, match="upgrade batchweave") as err:
        decode_manifest(envelope(json.dumps(doc).encode()), key=KEY)
    assert KEY in str(err.value)
    assert f"format {MANIFEST_FORMAT + 1}" in str(err.value)


def test_future_format_with_known_fields_still_refused() -> None:
    doc = json.loads(body(encode_manifest(_sample_manifest())))
    doc["format"] = MANIFEST_FORMAT + 5
    with pytest.raises(UnsupportedFormatVersion):
        decode_manifest(envelope(json.dumps(doc).encode()), key=KEY)


def test_invalid_schema_is_a_format_error_naming_key_and_field() -> None:
    doc = json.loads(body(encode_manifest(_sample_manifest())))
    doc["mesh"]["dp"] = 0
    del doc["commit_id"]
    with pytest.raises(FormatError) as err:
        decode_manifest(envelope(json.dumps(doc).encode()), key=KEY)
    message = str(err.value)
    assert KEY in message
    assert "mesh.dp" in message
    assert "commit_id" in message
    assert "invalid manifest" in message


def test_broken_step_layout_is_a_format_error() -> None:
    doc = json.loads(body(encode_manifest(_sample_manifest())))
    doc["base_step"] = 5  # beyond next_step 0
    with pytest.raises(FormatError, match="base_step 5"):
        decode_manifest(envelope(json.dumps(doc).encode()), key=KEY)


def test_invalid_json_is_a_format_error() -> None:
    with pytest.raises(FormatError, match="invalid manifest"):
        decode_manifest(envelope(b"{not json"), key=KEY)


def _descriptor() -> TgbDescriptor:
    return TgbDescriptor(
        producer_id="p",
        epoch=0,
        offset=0,
        objects=(
            TgbObjectRef(
                key="k", size=10, slice_count=1, footer_offset=0, footer_length=4, footer_checksum=0
            ),
        ),
        bytes=10,
    )


def test_segment_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    seg = Segment(namespace_id="ns", first_step=3, tgbs=(_descriptor(),))
    data = encode_segment(seg)
    flipped = bytearray(data)
    flipped[-5] ^= 0x02
    with pytest.raises(ChecksumMismatch, match=SEG_KEY):
        decode_segment(bytes(flipped), key=SEG_KEY)
    with pytest.raises(FormatError, match="truncated"):
        decode_segment(data[:-1], key=SEG_KEY)
    with pytest.raises(FormatError, match="expected a segment"):
        decode_segment(encode_manifest(_sample_manifest()), key=SEG_KEY)
    doc = json.loads(body(data))
    doc["format"] = 99
    with pytest.raises(UnsupportedFormatVersion, match="upgrade batchweave"):
        decode_segment(envelope(json.dumps(doc).encode(), "batchweave-segment"), key=SEG_KEY)
    doc["format"] = 1
    doc["tgbs"] = []
    with pytest.raises(FormatError, match="invalid segment"):
        decode_segment(envelope(json.dumps(doc).encode(), "batchweave-segment"), key=SEG_KEY)
    monkeypatch.setattr(_codec, "MAX_SEGMENT_BYTES", len(data) - 1)
    with pytest.raises(FormatError, match="far larger than any segment"):
        decode_segment(data, key=SEG_KEY)


def _format_1_body() -> dict[str, object]:
    """A manifest as format 1 wrote it: descriptors without slice tables."""
    doc = json.loads(body(encode_manifest(_sample_manifest())))
    doc["format"] = 1
    doc["tail"] = [json.loads(_descriptor().model_dump_json(exclude={"objects": {0: {"slices"}}}))]
    return doc


def test_a_format_1_manifest_is_still_read() -> None:
    manifest = decode_manifest(envelope(json.dumps(_format_1_body()).encode()), key=KEY)
    assert manifest.format == 1
    assert manifest.tail[0].objects[0].slices is None


def test_an_inconsistent_slice_table_is_a_format_error_naming_the_key() -> None:
    body = _format_1_body()
    body["format"] = MANIFEST_FORMAT
    ref = body["tail"][0]["objects"][0]  # type: ignore[index]
    ref["slices"] = {
        "codec": "raw",
        "checksum_algo": "crc32c",
        "lengths": [1] * ref["slice_count"],
        "checksums": [0] * ref["slice_count"],
        "sample_counts": [0] * ref["slice_count"],
    }
    ref["footer_offset"] = ref["slice_count"] + 1  # the table says the footer starts earlier
    with pytest.raises(FormatError, match="slice table ends at byte") as err:
        decode_manifest(envelope(json.dumps(body).encode()), key=KEY)
    assert KEY in str(err.value)


def test_a_format_2_manifest_with_per_slice_lists_is_still_read() -> None:
    body = _format_1_body()
    body["format"] = 2
    ref = body["tail"][0]["objects"][0]  # type: ignore[index]
    count = ref["slice_count"]
    ref["slices"] = {
        "codec": "raw",
        "compression": None,
        "checksum_algo": "crc32c",
        "lengths": [1] * (count - 1) + [ref["footer_offset"] - (count - 1)],
        "checksums": list(range(count)),
        "uncompressed_lengths": None,
        "sample_counts": [2] * count,
    }
    manifest = decode_manifest(envelope(json.dumps(body).encode()), key=KEY)
    table = manifest.tail[0].objects[0].slices
    assert manifest.format == 2
    assert table is not None
    assert table.checksums == tuple(range(count))
    assert table.payload_length == ref["footer_offset"]
    # Written again, the same table takes the compact form of the current format.
    assert decode_manifest(encode_manifest(manifest), key=KEY).tail == manifest.tail


def test_the_same_bytes_are_decoded_once_per_process() -> None:
    data = encode_manifest(_sample_manifest())
    first = decode_manifest(data, key=KEY)
    assert decode_manifest(bytes(data), key=KEY) is first  # equal bytes: the shared result
    seg = encode_segment(Segment(namespace_id="ns", first_step=3, tgbs=(_descriptor(),)))
    assert decode_segment(seg, key=SEG_KEY)[0] is decode_segment(bytes(seg), key=SEG_KEY)[0]


def test_other_bytes_under_a_decoded_key_are_verified_afresh() -> None:
    data = encode_manifest(_sample_manifest())
    decode_manifest(data, key=KEY)
    flipped = bytearray(data)
    flipped[-5] ^= 0x02
    with pytest.raises(ChecksumMismatch, match=KEY):
        decode_manifest(bytes(flipped), key=KEY)
    other_key = KEY.replace("manifest", "other")
    assert decode_manifest(data, key=other_key) == decode_manifest(data, key=KEY)


def test_the_decoded_cache_is_bounded_in_entries_and_bytes() -> None:
    cache = _codec._RecentlyDecoded(entries=2, max_bytes=100)
    cache.put("a", b"x" * 10, "A")
    cache.put("b", b"y" * 10, "B")
    cache.put("c", b"z" * 10, "C")  # over the entry bound: the oldest goes
    assert cache.get("a", b"x" * 10) is None
    assert cache.get("b", b"y" * 10) == "B"
    cache.put("d", b"w" * 24, "D")  # 10 + 24 bytes with "c" evicted first (b was used last)
    assert cache.get("c", b"z" * 10) is None
    assert cache.get("b", b"y" * 10) == "B"
    cache.put("big", b"q" * 26, "Q")  # more than a quarter of the byte bound: never kept
    assert cache.get("big", b"q" * 26) is None
    assert cache.get("b", b"y" * 11) is None  # same key, other bytes: a miss


class _CountedLock:
    """A lock that counts the threads that came to wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.arrived = threading.Semaphore(0)

    def __enter__(self) -> None:
        self.arrived.release()
        self._lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_concurrent_misses_of_one_key_wait_for_one_decode() -> None:
    # Ranks as threads start together and asked for the same segment at once: each decoded it
    # (8 decodes of a 1,500-descriptor segment at dp=8, about 10% of their read time).
    cache = _codec._RecentlyDecoded(entries=4, max_bytes=1 << 20)
    lock = _CountedLock()
    cache._decoding = [lock]  # type: ignore[list-item]
    release = threading.Event()
    decodes: list[str] = []

    def decode(name: str) -> tuple[str, int]:
        decodes.append(name)
        release.wait()
        return f"decoded by {name}", 1

    results: list[str] = []
    threads = [
        threading.Thread(
            target=lambda n=n: results.append(cache.decoded("k", b"d", str, lambda: decode(n)))
        )
        for n in ("first", "second", "third")
    ]
    for t in threads:
        t.start()
    for _ in threads:
        assert lock.arrived.acquire(timeout=30)  # every thread missed and came to the lock
    release.set()
    for t in threads:
        t.join(timeout=30)
    assert len(decodes) == 1
    assert results == [f"decoded by {decodes[0]}"] * 3
    assert cache.decoded("k", b"d", str, lambda: decode("later")) == results[0]
    # A cached object of another kind (a manifest under a segment's key) is no hit.
    assert cache.decoded("k", b"d", int, lambda: (7, 0)) == 7


@settings(max_examples=60, deadline=None)
@given(manifests(), segments)
def test_encoding_from_cached_descriptors_is_pydantics_json_byte_for_byte(
    manifest: Manifest, segment: Segment
) -> None:
    # A producer state's source is written only when set (format 3 has no such field): the
    # state's own serializer leaves it out, so pydantic's JSON already does.
    expected = manifest.model_dump_json().encode()
    for _ in range(2):  # the second time every descriptor comes from the cache
        assert body(encode_manifest(manifest)) == expected
        assert body(encode_segment(segment)) == segment.model_dump_json().encode()
    tail_json = TypeAdapter(tuple[TgbDescriptor, ...]).dump_json(manifest.tail)
    assert _codec.descriptors_json_bytes(manifest.tail) == len(tail_json)


def test_a_copied_descriptor_is_encoded_with_its_own_values() -> None:
    desc = _descriptor()
    first = encode_segment(Segment(namespace_id="ns", first_step=0, tgbs=(desc,)))
    copy = desc.model_copy(update={"offset": desc.offset + 1})
    second = encode_segment(Segment(namespace_id="ns", first_step=0, tgbs=(copy,)))
    assert decode_segment(first, key=SEG_KEY)[0].tgbs[0].offset == desc.offset
    assert decode_segment(second, key=SEG_KEY)[0].tgbs[0].offset == desc.offset + 1


def test_the_descriptor_json_cache_is_bounded_and_keyed_by_identity() -> None:
    cache = _codec._DescriptorJson(entries=2)
    a, b, c = (_descriptor().model_copy(update={"offset": i}) for i in range(3))
    assert cache.get(a) == a.model_dump_json().encode()
    cache.get(b)
    cache.get(c)  # over the bound: a, the least recently used, goes
    assert id(a) not in cache._items
    assert id(c) in cache._items
    assert cache.get(a) == a.model_dump_json().encode()


# --- decoding with a previous manifest: its tail descriptors are reused -----------------------


@st.composite
def manifests_and_previous(draw: st.DrawFn) -> tuple[Manifest, Manifest]:
    """A manifest and a ``previous`` one whose tail holds a run of its tail, as commits leave it.

    The run is the same objects or equal copies, between descriptors of its own; ``previous``
    is otherwise the same manifest (``decode_manifest`` looks at its tail only).
    """
    manifest = draw(manifests())
    tail = manifest.tail
    start = draw(st.integers(0, len(tail)))
    run = tail[start : draw(st.integers(start, len(tail)))]
    if draw(st.booleans()):
        run = tuple(d.model_copy() for d in run)
    before = draw(st.lists(descriptors, max_size=2))
    after = draw(st.lists(descriptors, max_size=2))
    return manifest, manifest.model_copy(update={"tail": (*before, *run, *after)})


@settings(max_examples=150, deadline=None)
@given(manifests_and_previous())
def test_decoding_with_a_previous_manifest_equals_decoding_afresh(
    pair: tuple[Manifest, Manifest],
) -> None:
    manifest, previous = pair
    data = encode_manifest(manifest)
    fresh, reused = decode_outcome(data, None), decode_outcome(data, previous)
    assert isinstance(reused, Manifest)
    assert isinstance(fresh, Manifest)
    assert reused == fresh == manifest
    assert reused.model_fields_set == fresh.model_fields_set
    assert encode_manifest(reused) == data
    plain = b"\\" not in data and data.count(b'"tail"') == 1  # see _codec._reuse_tail
    if plain and manifest.tail and any(d == manifest.tail[0] for d in previous.tail):
        # The tail's first descriptor is in previous: it and its run are previous's objects.
        assert any(reused.tail[0] is d for d in previous.tail)


@settings(max_examples=300, deadline=None)
@given(
    manifests_and_previous(),
    st.integers(0, 2**16),
    st.sampled_from(
        [b",", b"]", b"[", b"{", b"}", b'"', b"0", b" ", b'"tail":[', b'"t\\u0061il":[],', b""]
    ),
    st.integers(0, 3),
)
def test_decoding_any_body_with_a_previous_manifest_gives_the_fresh_outcome(
    pair: tuple[Manifest, Manifest], at: int, insert: bytes, remove: int
) -> None:
    # Edited bodies under a valid checksum: what another writer could store. Reusing the
    # previous tail must give the same manifest, or the same error, as decoding afresh.
    manifest, previous = pair
    raw = body(encode_manifest(manifest))
    at %= len(raw) + 1
    data = envelope(raw[:at] + insert + raw[at + remove :])
    assert decode_outcome(data, previous) == decode_outcome(data, None)


def test_reused_descriptors_count_in_the_step_layout() -> None:
    # Every step reclaimed: base_step equals next_step only with the reused descriptors counted.
    tail = tuple(_descriptor().model_copy(update={"offset": i}) for i in range(3))
    manifest = Manifest(
        namespace_id="ns", mesh=Mesh(dp=1), version=4, commit_id="c", tail=tail, base_step=3
    )
    reused = decode_manifest(encode_manifest(manifest), key=KEY, previous=manifest)
    assert reused == manifest
    assert all(a is b for a, b in zip(reused.tail, tail, strict=True))
    beyond = encode_manifest(manifest).replace(b'"base_step":3', b'"base_step":4')
    with pytest.raises(FormatError, match=r"base_step 4 outside the listed steps \[0, 3\]"):
        decode_manifest(envelope(body(beyond)), key=KEY, previous=manifest)


def test_a_ctrl_c_in_a_serializer_is_raised_as_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    # pydantic-core reported it as a PydanticSerializationError, so a Ctrl-C while a producer
    # started (its epoch commit encodes a manifest) escaped `except KeyboardInterrupt`.
    store = MemoryStore()
    with Producer(store, "ns", producer_id="p", mesh=Mesh(dp=2)) as producer:
        producer.append([b"a", b"b"], offset=0)  # a slice table inline: a Python serializer
    data = store.get(f"ns/{manifest_key(2)}")
    copy = Manifest.model_validate_json(body(data))  # new objects: not in the JSON cache

    class Interrupted:
        def __getattr__(self, name: str) -> object:
            return getattr(struct, name)

        @staticmethod
        def pack(*args: object) -> bytes:
            raise KeyboardInterrupt

    monkeypatch.setattr(_models, "struct", Interrupted())
    with pytest.raises(KeyboardInterrupt):
        encode_manifest(copy)
    with pytest.raises(KeyboardInterrupt):
        encode_segment(Segment(namespace_id="ns", first_step=0, tgbs=copy.tail))
    monkeypatch.undo()
    assert encode_manifest(copy) == data


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_child_forked_while_a_decode_runs_can_decode() -> None:
    # A decode holds its key's lock throughout (18 ms for a 1,500-descriptor segment): a fork
    # meanwhile (DataLoader workers forked while a consumer reads) copied it held, and the
    # child's first decode of a key behind it waited for ever.
    data = encode_manifest(_sample_manifest())
    held = [*_codec._DECODED._decoding, _codec._DECODED._lock, _codec._DESCRIPTOR_JSON._lock]
    for lock in held:
        lock.acquire()  # as by decodes running in other threads
    try:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: decode (and encode) under every key's lock, then report
            try:
                manifest = decode_manifest(data, key="a-key-nobody-decoded")
                encode_manifest(manifest)
                os.write(write, b"ok")
            finally:
                os._exit(0)
    finally:
        for lock in held:
            lock.release()
    os.close(write)
    ready, _, _ = select.select([read], [], [], 60)
    answer = os.read(read, 2) if ready else b""
    if not ready:
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(read)
    assert answer == b"ok", "the forked child hung on a lock held at the fork"

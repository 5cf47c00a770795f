"""Adversarial cases for ``decode_manifest(..., previous=...)``: reusing the previous tail.

The claim under test: decoding a body with a ``previous`` manifest gives exactly what decoding
it afresh gives, the same manifest (``==``, the same ``model_fields_set``, the same encoded
bytes) or the same error, for any body another writer could store under a valid checksum. A
reused descriptor is ``previous``'s own object, so its nested fields set is the one it was
decoded or built with (nothing reads nested fields sets).
"""

from __future__ import annotations

import json
import threading

import pytest
from manifest_helpers import KEY, body, decode_outcome, descriptor, envelope
from test_consumer import in_threads

from batchweave import FormatError, Mesh, UnsupportedFormatVersion
from batchweave._manifest import (
    Manifest,
    ProducerState,
    TgbDescriptor,
    TgbObjectRef,
    _codec,
    decode_manifest,
    encode_manifest,
)
from batchweave._manifest._models import MANIFEST_FORMAT, SliceTable


def _manifest(tail: tuple[TgbDescriptor, ...], **fields: object) -> Manifest:
    return Manifest(
        namespace_id="ns", mesh=Mesh(dp=1), version=4, commit_id="c", tail=tail, **fields
    )


def _json(desc: TgbDescriptor) -> bytes:
    return desc.__pydantic_serializer__.to_json(desc)


TAIL = (descriptor("p", 0), descriptor("p", 1), descriptor("p", 2))
PREVIOUS = _manifest(TAIL)


def _same(data: bytes, previous: Manifest) -> None:
    fresh, reused = decode_outcome(data, None), decode_outcome(data, previous)
    assert reused == fresh
    if isinstance(fresh, Manifest):
        assert isinstance(reused, Manifest)
        assert reused.model_fields_set == fresh.model_fields_set
        assert encode_manifest(reused) == encode_manifest(fresh)


# -- counterexamples found in review (now fixed) ---------------------------------------------


@pytest.mark.parametrize("gap", [b"", b" ", b"\n"])
@pytest.mark.parametrize("reused", [1, 3])
def test_a_trailing_comma_after_reused_descriptors_is_invalid_json_either_way(
    reused: int, gap: bytes
) -> None:
    # [X,] is not JSON. Afresh it is a FormatError; the fast path cuts "X," and validates
    # "[]" (or "[ ]"), which is valid, and returns a manifest holding X.
    elements = b",".join(_json(d) for d in TAIL[:reused])
    raw = body(encode_manifest(PREVIOUS)).replace(
        b",".join(_json(d) for d in TAIL) + b"]", elements + b"," + gap + b"]"
    )
    data = envelope(raw)
    assert isinstance(decode_outcome(data, None), str)  # "FormatError: ... trailing comma ..."
    _same(data, PREVIOUS)


@pytest.mark.parametrize(
    "spelling", [b'"t\\u0061il":', b'"tail" :', b'"tail"\n:', b'"\\u0074ail":']
)
def test_a_later_duplicate_tail_key_wins_as_it_does_afresh(spelling: bytes) -> None:
    # Duplicate keys: the last one wins. A second "tail" key spelled so that the byte search for
    # '"tail":' does not count it empties the tail afresh; the fast path cuts the descriptors
    # out of the first "tail" and puts them back, so the version decodes to another step ->
    # TGB mapping for a reader that had read the version before it.
    raw = body(encode_manifest(PREVIOUS))
    at = raw.index(b'"tail_start"')
    data = envelope(raw[:at] + spelling + b"[]," + raw[at:])
    fresh = decode_outcome(data, None)
    assert isinstance(fresh, Manifest)
    assert fresh.tail == ()
    _same(data, PREVIOUS)


def test_descriptors_reused_from_a_format_2_previous_equal_a_fresh_decode() -> None:
    # previous was read from a format-2 manifest (per-slice lists, "compression": null given);
    # the next version, written by this library, holds the same descriptors in compact form.
    count = 8
    table = {
        "codec": "raw",
        "compression": None,
        "checksum_algo": "crc32c",
        "lengths": [100] * count,
        "checksums": list(range(count)),
        "uncompressed_lengths": None,
        "sample_counts": [2] * count,
    }
    old = json.loads(body(encode_manifest(PREVIOUS)))
    old["format"] = 2
    for d in old["tail"]:
        d["objects"][0].update(slices=table, footer_offset=100 * count)
    previous = decode_manifest(envelope(json.dumps(old).encode()), key=KEY)
    data = encode_manifest(previous.model_copy(update={"format": 3, "version": 5}))
    _same(data, previous)
    reused = decode_outcome(data, previous)
    assert isinstance(reused, Manifest)
    assert all(a is b for a, b in zip(reused.tail, previous.tail, strict=True))


def test_a_descriptor_committed_in_process_is_reused_as_it_was_built() -> None:
    # ManifestLog's newest version may be one this process committed: its descriptors were
    # built, not decoded (here without ``samples``).
    built = TgbDescriptor(
        producer_id="p", epoch=0, offset=0, objects=TAIL[0].objects, bytes=TAIL[0].bytes
    )
    previous = _manifest((built,))
    data = encode_manifest(previous.model_copy(update={"version": 5}))
    _same(data, previous)
    reused = decode_outcome(data, previous)
    assert isinstance(reused, Manifest)
    assert reused.tail[0] is built


@pytest.mark.xfail(strict=True, reason="trusts previous: its descriptors must be valid values")
def test_a_previous_holding_an_unvalidated_descriptor_does_not_make_a_body_valid() -> None:
    # A previous built with model_construct (no validation): a key escaping the namespace.
    # Afresh the body is refused; with it as previous the fast path reuses the descriptor.
    ref = TAIL[0].objects[0].model_copy(update={"key": "../other/x.tgb"})
    bad = TAIL[0].model_copy(update={"objects": (ref,)})
    previous = Manifest.model_construct(**{**dict(PREVIOUS), "tail": (bad,)})
    data = envelope(body(encode_manifest(PREVIOUS)).replace(_json(TAIL[0]), _json(bad)))
    assert isinstance(decode_outcome(data, None), str)
    _same(data, previous)


# -- regressions: cases the fast path already gets right ------------------------------------


@pytest.mark.parametrize("spelling", [b'"t\\u0061il":', b'"tail" :'])
def test_an_earlier_duplicate_tail_key_loses_either_way(spelling: bytes) -> None:
    raw = body(encode_manifest(PREVIOUS))
    at = raw.index(b'"segments"')
    _same(envelope(raw[:at] + spelling + b"[]," + raw[at:]), PREVIOUS)


def test_a_literal_duplicate_tail_key_disables_the_fast_path() -> None:
    raw = body(encode_manifest(PREVIOUS))
    at = raw.index(b'"tail_start"')
    _same(envelope(raw[:at] + b'"tail":[],' + raw[at:]), PREVIOUS)


@pytest.mark.parametrize(
    "producer", ["tail", 'x"tail', 'x","tail":[', "tail\\", "\u0022tail", "t\u00e4il"]
)
def test_producers_named_like_the_tail_key_decode_as_afresh(producer: str) -> None:
    state = ProducerState(epoch=0, offset=2, last_version=4)
    tail = tuple(descriptor("p", i).model_copy(update={"producer_id": producer}) for i in range(3))
    manifest = _manifest(tail, producers={producer: state})
    data = encode_manifest(manifest.model_copy(update={"version": 5}))
    _same(data, manifest)
    assert decode_outcome(data, manifest) == manifest.model_copy(update={"version": 5})


@pytest.mark.parametrize(
    "edit",
    [
        (b"},{", b"},,{"),  # [X,,Y]: the cut leaves "[,Y"
        (b"},{", b"}, {"),  # whitespace between descriptors
        (b'"tail":[', b'"tail": ['),
        (b'"tail":[', b'"tail":[ '),
        (b'"tail":[', b'"tail":[{},'),  # an invalid descriptor before the reusable ones
    ],
)
def test_edits_around_the_cut_decode_as_afresh(edit: tuple[bytes, bytes]) -> None:
    old, new = edit
    _same(envelope(body(encode_manifest(PREVIOUS)).replace(old, new, 1)), PREVIOUS)


def test_a_tail_made_empty_or_from_a_later_run_of_previous_decodes_as_afresh() -> None:
    for tail, start in [
        ((), 3),
        (TAIL[1:], 1),
        (TAIL[2:], 2),
        ((*TAIL[1:], descriptor("q", 0)), 1),
    ]:
        manifest = _manifest(tail, tail_start=start, base_step=start)
        _same(encode_manifest(manifest), PREVIOUS)
        assert decode_outcome(encode_manifest(manifest), PREVIOUS) == manifest
    _same(encode_manifest(PREVIOUS), _manifest(()))


@pytest.mark.parametrize("fmt", [0, -1, MANIFEST_FORMAT + 1, 10**30])
def test_a_reusable_tail_does_not_hide_an_unsupported_format(fmt: int) -> None:
    data = envelope(
        body(encode_manifest(PREVIOUS)).replace(b'"format":3', f'"format":{fmt}'.encode())
    )
    expected = UnsupportedFormatVersion if fmt > MANIFEST_FORMAT else FormatError
    with pytest.raises(expected):
        decode_manifest(data, key=KEY, previous=PREVIOUS)
    _same(data, PREVIOUS)


def test_a_format_1_or_2_previous_and_body_decode_as_afresh() -> None:
    lists = {
        "codec": "raw",
        "compression": None,
        "checksum_algo": "crc32c",
        "lengths": [100] * 8,
        "checksums": list(range(8)),
        "uncompressed_lengths": None,
        "sample_counts": [2] * 8,
    }
    for fmt, slices in [(1, None), (2, lists)]:
        old = json.loads(body(encode_manifest(PREVIOUS)))
        old["format"] = fmt
        for d in old["tail"]:
            d["objects"][0].update(slices=slices, footer_offset=800)
        data = envelope(json.dumps(old, separators=(",", ":")).encode())
        previous = decode_manifest(data, key=KEY)
        old["version"] = 5
        _same(envelope(json.dumps(old, separators=(",", ":")).encode()), previous)


def test_a_previous_of_another_namespace_and_mesh_gives_the_fresh_manifest() -> None:
    other = PREVIOUS.model_copy(update={"namespace_id": "other", "mesh": Mesh(dp=4, cp=2)})
    _same(encode_manifest(PREVIOUS), other)


def test_a_step_layout_broken_by_the_cut_count_is_refused_either_way() -> None:
    raw = body(encode_manifest(_manifest(TAIL, base_step=3)))
    for base_step in (3, 4):
        _same(
            envelope(raw.replace(b'"base_step":3', f'"base_step":{base_step}'.encode())), PREVIOUS
        )


def test_concurrent_decodes_with_one_previous_agree() -> None:
    # The descriptor JSON cache is shared: threads serializing and reusing the same previous
    # at once must all get the fresh manifest.
    fresh_table = SliceTable(
        codec="raw",
        checksum_algo="crc32c",
        lengths=(100,) * 8,
        checksums=tuple(range(8)),
        sample_counts=(2,) * 8,
    )
    ref = TgbObjectRef(
        key="data/p/0/x.tgb",
        size=1000,
        slice_count=8,
        footer_offset=800,
        footer_length=180,
        footer_checksum=1,
        slices=fresh_table,
    )
    tail = tuple(
        TgbDescriptor(producer_id="p", epoch=0, offset=i, objects=(ref,), bytes=1000, samples=16)
        for i in range(64)
    )
    previous = _manifest(tail)
    # Equal copies: previous's own objects are not yet in the cache when the threads start.
    data = encode_manifest(_manifest((*(d.model_copy() for d in tail), descriptor("q", 0))))
    expected = decode_outcome(data, None)
    barrier = threading.Barrier(8)
    results: list[object] = []
    lock = threading.Lock()

    def decode(worker: int) -> None:
        barrier.wait()
        for _ in range(20):
            got = _codec._reuse_tail(body(data), previous.tail)
            with lock:
                results.append(got)

    assert in_threads(8, decode) == []
    assert len(results) == 160
    assert all(r == expected for r in results)

"""Fuzzing every parser of stored bytes: manifests, segments, watermarks and TGB objects.

Property: whatever bytes a store returns, a parser either returns a valid object or raises
``FormatError`` (one of its subclasses) naming the key. Never another exception type, never a
hang, never a huge allocation. Inputs are arbitrary bytes and, more usefully, valid encodings
with bytes flipped, cut, inserted or spliced, plus JSON bodies re-enveloped with a correct
checksum so the schema validation itself is fuzzed. Bounded for CI by ``max_examples``;
``tests/test_fuzz_atheris.py`` runs the same targets under atheris (coverage-guided) when it is
installed.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from manifest_helpers import body, envelope

from batchweave import FormatError, MemoryStore, Mesh, Producer, encode_tgb
from batchweave._format._tgb_read import decode_slice, parse_footer, parse_footer_exact
from batchweave._manifest._codec import (
    decode_manifest,
    decode_segment,
    encode_manifest,
    encode_segment,
)
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import Segment
from batchweave._watermarks import Watermarks

NS = "runs/fuzz"
KEY = f"{NS}/_manifests/00000000000000000003.manifest"
FUZZ = settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _seed_objects() -> dict[str, bytes]:
    """Valid bytes of every kind, taken from a real namespace and its watermark."""
    store = MemoryStore()
    with Producer(store, NS, producer_id="p0", mesh=Mesh(dp=2), policy="naive") as p:
        for offset in range(6):
            p.append([bytes([offset]) * 5, b"xyz"], offset=offset)
    log = ManifestLog(store, NS)
    latest = log.latest()
    descriptors = tuple(d for _, d in log.descriptors(latest, latest.base_step, latest.next_step))
    marks = Watermarks(store, NS)
    marks.record("ckpt-1", 3)
    return {
        "manifest": encode_manifest(latest),
        "segment": encode_segment(
            Segment(namespace_id=latest.namespace_id, first_step=0, tgbs=descriptors)
        ),
        "watermark": store.get(marks.key("ckpt-1")),
        "tgb": encode_tgb([b"a" * 40, b"b" * 7], Mesh(dp=2), compression="zstd").data,
    }


SEEDS = _seed_objects()
WATERMARKS = Watermarks(MemoryStore(), NS)


def _parse_manifest(data: bytes) -> object:
    return decode_manifest(data, key=KEY)


def _parse_segment(data: bytes) -> object:
    return decode_segment(data, key=f"{NS}/_segments/x.seg")


def _parse_watermark(data: bytes) -> object:
    return WATERMARKS._decode(data, WATERMARKS.key("ckpt-1"))


def _parse_tgb(data: bytes) -> object:
    footer = parse_footer(data, key="k.tgb")
    for i in range(len(footer.slices)):
        entry = footer.slices[i]
        decode_slice(data[entry.offset : entry.offset + entry.length], footer, i, key="k.tgb")
    return footer


def _parse_footer_exact(data: bytes) -> object:
    return parse_footer_exact(memoryview(data), key="k.tgb")


PARSERS: dict[str, Callable[[bytes], object]] = {
    "manifest": _parse_manifest,
    "segment": _parse_segment,
    "watermark": _parse_watermark,
    "tgb": _parse_tgb,
}


def _holds(parse: Callable[[bytes], object], data: bytes) -> None:
    message = "parsed"
    try:
        parse(data)
    except FormatError as exc:
        message = str(exc)
    assert message, "a FormatError must say what is wrong"


@st.composite
def mutated(draw: st.DrawFn, seed: bytes) -> bytes:
    data = bytearray(seed)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "splice", "set"]))
        pos = draw(st.integers(0, max(0, len(data) - 1)))
        if op == "flip" and data:
            data[pos] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del data[pos : pos + draw(st.integers(1, 64))]
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=32))
        elif op == "splice":
            other = SEEDS[draw(st.sampled_from(sorted(SEEDS)))]
            data[pos:] = other[draw(st.integers(0, len(other))) :]
        elif data:
            data[pos] = draw(st.sampled_from([0, 0x7F, 0x80, 0xFF, ord("9"), ord("{")]))
    return bytes(data)


@FUZZ
@given(kind=st.sampled_from(sorted(PARSERS)), data=st.data())
def test_mutated_objects_parse_or_raise_format_error(kind: str, data: st.DataObject) -> None:
    _holds(PARSERS[kind], data.draw(mutated(SEEDS[kind])))


@FUZZ
@given(kind=st.sampled_from(sorted(PARSERS)), blob=st.binary(max_size=2048))
def test_arbitrary_bytes_parse_or_raise_format_error(kind: str, blob: bytes) -> None:
    _holds(PARSERS[kind], blob)


@FUZZ
@given(blob=st.binary(max_size=4096))
def test_exact_footer_parser_never_crashes(blob: bytes) -> None:
    _holds(_parse_footer_exact, blob)


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def tampered_bodies(draw: st.DrawFn, kind: str) -> bytes:
    """A valid body with one field replaced by any JSON value, re-enveloped with a good checksum."""
    seed = SEEDS[kind]
    doc: Any = json.loads(body(seed))
    node = doc
    path: list[Any] = []
    while isinstance(node, (dict, list)) and node and draw(st.booleans()):
        k = (
            draw(st.sampled_from(sorted(node)))
            if isinstance(node, dict)
            else draw(st.integers(0, len(node) - 1))
        )
        path.append(k)
        node = node[k]
    value = draw(JSON_VALUES)
    if path:
        target = doc
        for k in path[:-1]:
            target = target[k]
        target[path[-1]] = value
    else:
        doc = value
    magic = seed.split(b" ", 1)[0].decode()
    return envelope(json.dumps(doc).encode(), magic)


@FUZZ
@given(kind=st.sampled_from(["manifest", "segment", "watermark"]), data=st.data())
def test_schema_violations_are_format_errors(kind: str, data: st.DataObject) -> None:
    _holds(PARSERS[kind], data.draw(tampered_bodies(kind)))


def test_seeds_are_valid() -> None:
    """The fuzzers start from objects every parser accepts (else they would fuzz nothing)."""
    for kind, parse in PARSERS.items():
        assert parse(SEEDS[kind]) is not None, kind

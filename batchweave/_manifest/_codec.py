"""Bytes of manifest and segment objects: a one-line envelope, then the JSON body.

An encoded object is::

    batchweave-manifest crc32c=1a2b3c4d length=1234\\n
    {"format":1,"namespace_id":...}

The header line names what the object is (``batchweave-manifest`` or ``batchweave-segment``), the
CRC-32C of the body (8 lowercase hex digits) and the body's length in bytes; the body is the
pydantic model's JSON. The checksum covers the exact body bytes, so no JSON canonicalization is
needed to verify it, and ``tail -n +2`` of an object is plain JSON for ``jq``. The schema version is
the body's ``format`` field; the envelope itself is versioned by its magic word.

Decoding never trusts the bytes: it bounds the size before parsing anything, checks the header,
the length (truncation), the checksum, then the format version (a newer one is
:class:`~batchweave.UnsupportedFormatVersion`, "upgrade batchweave") and only then validates the
schema, translating pydantic errors into :class:`~batchweave.FormatError` naming the key and the
fields. Manifests, segments and watermarks are validated in pydantic's strict mode: nothing is
coerced (``"3"``, ``3.0`` and ``true`` are no integer), so bytes that another writer produced
never decode into values nobody committed; what this module encodes always passes.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Final, NamedTuple, ParamSpec, TypeVar

from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails, PydanticSerializationError

from batchweave._errors import ChecksumMismatch, FormatError, UnsupportedFormatVersion
from batchweave._format._checksum import checksum
from batchweave._manifest._models import (
    MANIFEST_FORMAT,
    SEGMENT_FORMAT,
    TAIL_REUSED,
    Manifest,
    Segment,
    TgbDescriptor,
)
from batchweave._unchecked import unchecked

__all__ = [
    "MAX_MANIFEST_BYTES",
    "MAX_SEGMENT_BYTES",
    "body_checksum",
    "decode_manifest",
    "decode_object",
    "decode_segment",
    "descriptors_json_bytes",
    "encode_manifest",
    "encode_object",
    "encode_segment",
    "forget_decoded",
]

MAX_MANIFEST_BYTES: Final = 64 << 20
"""Largest manifest object accepted. Real manifests are kilobytes; more means corruption."""

MAX_SEGMENT_BYTES: Final = 512 << 20
"""Largest segment object accepted (a full merged segment is a few megabytes)."""

_MANIFEST_MAGIC: Final = "batchweave-manifest"
_SEGMENT_MAGIC: Final = "batchweave-segment"
_MAX_HEADER: Final = 128
_HEADER_RE: Final = re.compile(rb"([a-z-]+) crc32c=([0-9a-f]{8}) length=(0|[1-9][0-9]{0,12})")

_M = TypeVar("_M", bound=BaseModel)


def body_checksum(body: bytes) -> int:
    """CRC-32C of an object's JSON body, as written in its header (and in a ``SegmentRef``)."""
    return checksum(body, "crc32c")


_P = ParamSpec("_P")
_R = TypeVar("_R")
_WRAPPED_INTERRUPT: Final = re.compile(r"`: KeyboardInterrupt\b")


def _keeps_interrupts(encode: Callable[_P, _R]) -> Callable[_P, _R]:
    """Raise a Ctrl-C that lands in one of the models' Python serializers as itself.

    pydantic-core reports any exception raised in a ``model_serializer`` function as a
    ``PydanticSerializationError``, a ``KeyboardInterrupt`` too: a Ctrl-C while a producer
    starts (its epoch commit encodes a manifest) escaped ``except KeyboardInterrupt`` cleanups
    as pydantic's error.
    """

    @functools.wraps(encode)
    def encode_keeping_interrupts(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return encode(*args, **kwargs)
        except PydanticSerializationError as exc:
            if _WRAPPED_INTERRUPT.search(str(exc)):
                raise KeyboardInterrupt from exc
            raise

    return encode_keeping_interrupts


def _encode(magic: str, model: BaseModel, body: bytes | None = None) -> bytes:
    if body is None:
        body = model.model_dump_json().encode()
    header = f"{magic} crc32c={body_checksum(body):08x} length={len(body)}\n".encode()
    return header + body


class _DescriptorJson:
    """The JSON of recently encoded descriptors, by object identity.

    A commit re-encodes its base's whole tail (up to ``tail_bytes_limit`` of descriptors) plus
    its own, inside its fragile window, and measures the tail before that: without this, every
    descriptor of the tail is serialized twice per commit, about 4 us each. Descriptors are
    immutable, and the very same objects move from a base to the manifest built on it, so each
    is serialized once per process. Entries are found by ``id`` and hold their object, so an id
    is never reused while its entry lives; a copy (``model_copy``) is a new object and gets its
    own entry. Thread-safe; bounded.
    """

    def __init__(self, entries: int) -> None:
        self._entries = entries
        self._items: OrderedDict[int, tuple[TgbDescriptor, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def new_lock(self) -> None:
        """A fresh lock in a forked child (one held by another thread at the fork never frees)."""
        self._lock = threading.Lock()

    def get(self, desc: TgbDescriptor) -> bytes:
        with self._lock:
            item = self._items.get(id(desc))
            if item is not None and item[0] is desc:
                self._items.move_to_end(id(desc))
                return item[1]
        data = desc.__pydantic_serializer__.to_json(desc)
        with self._lock:
            self._items[id(desc)] = (desc, data)
            if len(self._items) > self._entries:
                self._items.popitem(last=False)
        return data


_DESCRIPTOR_JSON: Final = _DescriptorJson(entries=4096)
os.register_at_fork(after_in_child=_DESCRIPTOR_JSON.new_lock)


@_keeps_interrupts
def descriptors_json_bytes(descriptors: Sequence[TgbDescriptor]) -> int:
    """The exact length of ``descriptors`` as a JSON array, as a manifest's tail writes it."""
    commas = max(len(descriptors) - 1, 0)
    return sum(len(_DESCRIPTOR_JSON.get(d)) for d in descriptors) + commas + 2


def _body_with_descriptors(model: BaseModel, field: str) -> bytes:
    """``model``'s JSON, byte for byte, with the descriptors of ``field`` from their cache.

    The fields before and after ``field`` are serialized by pydantic as usual (with the same
    separators and order), the descriptor array is joined from :class:`_DescriptorJson`.
    """
    names = list(type(model).model_fields)
    at = names.index(field)
    to_json = model.__pydantic_serializer__.to_json
    head = to_json(model, include=set(names[:at]))
    rest = to_json(model, include=set(names[at + 1 :]))
    array = b",".join(_DESCRIPTOR_JSON.get(d) for d in getattr(model, field))
    parts = [head[:-1], b',"', field.encode(), b'":[', array, b"]"]
    if rest != b"{}":
        parts += [b",", rest[1:]]
    else:
        parts.append(b"}")
    return b"".join(parts)


@_keeps_interrupts
def encode_manifest(manifest: Manifest) -> bytes:
    """Serialize ``manifest`` into the bytes of a ``.manifest`` object.

    A producer state's ``source`` is written only when set (``ProducerState`` leaves it out
    itself): a format-3 manifest (no state has one) is exactly what releases without source
    identities wrote and read.
    """
    return _encode(_MANIFEST_MAGIC, manifest, _body_with_descriptors(manifest, "tail"))


@_keeps_interrupts
def encode_segment(segment: Segment) -> bytes:
    """Serialize ``segment`` into the bytes of a ``.seg`` object."""
    return _encode(_SEGMENT_MAGIC, segment, _body_with_descriptors(segment, "tgbs"))


def _split_envelope(data: bytes, *, key: str, magic: str, limit: int) -> tuple[int, bytes]:
    """Check the envelope of ``data`` and return ``(header checksum, body)``.

    Raises :class:`FormatError` for oversized, foreign or truncated bytes and
    :class:`ChecksumMismatch` when the body does not match the header's checksum.
    """
    what = magic.removeprefix("batchweave-")
    if len(data) > limit:
        raise FormatError(
            f"{key}: {len(data)} bytes is far larger than any {what} ({limit} bytes at most); "
            "the object is corrupt or not a BatchWeave object"
        )
    newline = data.find(b"\n", 0, _MAX_HEADER)
    match = _HEADER_RE.fullmatch(data[:newline]) if newline >= 0 else None
    if match is None and data.startswith(magic.encode() + b" "):
        line = data[:newline] if newline >= 0 else data[:_MAX_HEADER]
        unended = "" if newline >= 0 else f" (no newline in its first {_MAX_HEADER} bytes)"
        raise FormatError(
            f"{key}: malformed {what} header line {line!r}{unended}: expected "
            f"'{magic} crc32c=<8 lower-case hex digits> length=<decimal, no leading zeros>' and "
            "a newline (single spaces); the object was damaged or written by another tool"
        )
    if match is None:
        raise FormatError(
            f"{key}: not a BatchWeave {what} (no '{magic} crc32c=... length=...' header line); "
            "the prefix may hold other data"
        )
    if match.group(1).decode() != magic:
        raise FormatError(f"{key}: expected a {what}, found a {match.group(1).decode()!r} object")
    stored = int(match.group(2), 16)
    length = int(match.group(3))
    body = data[newline + 1 :]
    if len(body) != length:
        state = "truncated" if len(body) < length else "longer than its header says"
        raise FormatError(
            f"{key}: {what} is {state}: header says {length} body bytes, found {len(body)}"
        )
    computed = body_checksum(body)
    if computed != stored:
        raise ChecksumMismatch(
            f"{key}: {what} checksum mismatch: stored crc32c {stored:08x}, "
            f"computed {computed:08x}; the object is corrupt"
        )
    return stored, body


def _validate(body: bytes, model: type[_M], *, key: str, what: str, supported: int) -> _M:
    try:
        obj = model.model_validate_json(body, strict=True)
    except ValidationError as exc:
        peeked = _peek_format(body)
        if isinstance(peeked, int) and not isinstance(peeked, bool) and peeked > supported:
            raise _unsupported(key, what, peeked, supported) from None
        summary = "; ".join(_describe(err) for err in exc.errors()[:5])
        raise FormatError(
            f"{key}: invalid {what}: {summary}; the object is corrupt or was not written by "
            "BatchWeave"
        ) from exc
    fmt: int = getattr(obj, "format", supported)
    if fmt > supported:
        raise _unsupported(key, what, fmt, supported)
    if fmt < 1:
        raise FormatError(f"{key}: invalid {what} format {fmt}")
    return obj


def _describe(err: ErrorDetails) -> str:
    """``field.path: message (got <value>)`` for one validation error, the value cut short."""
    where = ".".join(str(p) for p in err["loc"]) or "<root>"
    got = err.get("input")
    if isinstance(got, dict | list):  # a whole sub-object: the field path says enough
        return f"{where}: {err['msg']}"
    shown = repr(got)
    return f"{where}: {err['msg']} (got {shown[:40]}{'...' if len(shown) > 40 else ''})"


def _peek_format(body: bytes) -> object:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        # RecursionError: hostile nesting (pydantic already refused it, with a clear message).
        return None
    return obj.get("format") if isinstance(obj, dict) else None


def _unsupported(key: str, what: str, fmt: int, supported: int) -> UnsupportedFormatVersion:
    return UnsupportedFormatVersion(
        f"{key}: {what} format {fmt} was written by a newer BatchWeave; this version reads "
        f"formats up to {supported}: upgrade batchweave"
    )


_D = TypeVar("_D")


class _RecentlyDecoded:
    """The manifests and segments this process decoded last, reused for the very same bytes.

    Manifest versions and segments are immutable and every consumer of a namespace reads the same
    ones, so a process that runs several consumers (a host driving several devices, ranks as
    threads) would otherwise validate the same JSON once per consumer: about 10 us per
    descriptor. An entry is reused only when the key and every byte match (one ``memcmp``);
    anything else is decoded and verified afresh. Thread-safe; bounded in entries, encoded bytes
    and descriptors (a segment's, a manifest's tail): decoded, a descriptor takes about ten
    times its JSON (4 KB at ``dp=2``, 10 KB at ``dp=64``), so bytes alone would let a few
    full segments hold gigabytes. An object of more than a quarter of the byte bound, or more
    descriptors than their bound, is not kept.
    """

    def __init__(self, entries: int, max_bytes: int, max_tgbs: int = 64 * 256) -> None:
        # max_tgbs defaults to one full segment of the default size (max_segment_tgbs = 64 *
        # tail_limit), about 65 MB decoded at dp=2; the process-wide _DECODED below holds two.
        self._entries = entries
        self._max_bytes = max_bytes
        self._max_tgbs = max_tgbs
        self._bytes = 0
        self._tgbs = 0
        self._items: OrderedDict[str, tuple[bytes, object, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._decoding = [threading.Lock() for _ in range(16)]  # striped by key

    def new_locks(self) -> None:
        """Fresh locks in a forked child: a decode running in another thread of the parent at
        the fork (held for all of it, 18 ms for a 1,500-descriptor segment) would leave its
        lock held for ever in the child (DataLoader workers forked while a consumer reads)."""
        self._lock = threading.Lock()
        self._decoding = [threading.Lock() for _ in self._decoding]

    def decoded(
        self, key: str, data: bytes, kind: type[_D], decode: Callable[[], tuple[_D, int]]
    ) -> _D:
        """What ``key`` holding ``data`` decodes to: cached, or ``decode()`` (the object and its
        descriptor count), run by one thread at a time per key.

        Ranks that start together ask for the same segment at the same moment: each decoded it
        (8 ranks as threads at ``dp=8``: 8 decodes of a 1,500-descriptor segment, about 10% of
        their read time), so a miss waits for a decode of the same key in progress instead.
        """
        cached = self.get(key, data)
        if isinstance(cached, kind):
            return cached
        with self._decoding[hash(key) % len(self._decoding)]:
            cached = self.get(key, data)
            if isinstance(cached, kind):
                return cached
            decoded, tgbs = decode()
            self.put(key, data, decoded, tgbs)
            return decoded

    @property
    def cached_tgbs(self) -> int:
        """Descriptors the cached objects hold."""
        with self._lock:
            return self._tgbs

    def get(self, key: str, data: bytes) -> object | None:
        with self._lock:
            item = self._items.get(key)
            if item is None or item[0] != data:
                return None
            self._items.move_to_end(key)
            return item[1]

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._bytes = 0
            self._tgbs = 0

    def put(self, key: str, data: bytes, decoded: object, tgbs: int = 0) -> None:
        """Keep ``decoded`` (the object ``key`` holding ``data``, with ``tgbs`` descriptors)."""
        if len(data) > self._max_bytes // 4 or tgbs > self._max_tgbs:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= len(old[0])
                self._tgbs -= old[2]
            self._items[key] = (data, decoded, tgbs)
            self._bytes += len(data)
            self._tgbs += tgbs
            while (
                len(self._items) > self._entries
                or self._bytes > self._max_bytes
                or self._tgbs > self._max_tgbs
            ):
                _, (evicted, _, count) = self._items.popitem(last=False)
                self._bytes -= len(evicted)
                self._tgbs -= count


# Two full segments of the default size (2 x max_segment_tgbs = 2 x 64 x 256 descriptors): a
# full segment the ranks of a process share stays cached next to the manifests (tails of up to
# tail_limit descriptors) and the next segment they decode; with one segment's worth, any
# manifest evicted the full segment and each rank decoded it again.
_DECODED: Final = _RecentlyDecoded(entries=64, max_bytes=64 << 20, max_tgbs=2 * 64 * 256)
os.register_at_fork(after_in_child=_DECODED.new_locks)


def forget_decoded() -> None:
    """Drop every manifest and segment this process decoded, as in a newly started process.

    For measurements (``bench/consumers.py`` reuses worker processes between runs); reads never
    need it, since an entry is reused only for the very same key and bytes.
    """
    _DECODED.clear()


def decode_manifest(data: bytes, *, key: str, previous: Manifest | None = None) -> Manifest:
    """Parse and verify the bytes of the manifest object ``key`` (used in error messages).

    ``previous``, a manifest decoded before (the newest one the caller has seen), makes decoding
    cheaper: the descriptors at the start of the tail that are byte for byte those of
    ``previous``'s tail are taken from it instead of being validated again (see
    :func:`_reuse_tail`). The result is the same either way.
    """

    def decode() -> tuple[Manifest, int]:
        _, body = _split_envelope(data, key=key, magic=_MANIFEST_MAGIC, limit=MAX_MANIFEST_BYTES)
        manifest = None if previous is None else _reuse_tail(body, previous.tail)
        if manifest is None:
            manifest = _validate(
                body, Manifest, key=key, what="manifest", supported=MANIFEST_FORMAT
            )
        return manifest, len(manifest.tail)

    return _DECODED.decoded(key, data, Manifest, decode)


_TAIL_KEY: Final = b'"tail"'
_TAIL_START: Final = b',"tail":['


def _reuse_tail(body: bytes, known: Sequence[TgbDescriptor]) -> Manifest | None:
    """``body``'s manifest, its leading tail descriptors taken from ``known`` (None: no match).

    A commit copies its base's tail into the manifest it writes, so consecutive versions share
    most of their tail, and validating a descriptor costs about 12 us against about 1 us of
    JSON parsing. Here the run of ``known`` descriptors whose JSON (as :func:`encode_manifest`
    writes it) starts the tail array, each followed by ``,{`` or the array's ``]``, is cut out
    of ``body``; the rest is validated in full, in strict mode, with the step layout checked as
    if the run were there (:data:`TAIL_REUSED`), and the run's objects are put back in front of
    its tail. Validating a descriptor depends on its JSON alone, and JSON decodes to what it
    encodes (the round-trip tests), so the result equals validating ``body`` whole: an equal
    manifest with the same fields set, which encodes to the same bytes (a reused descriptor's
    own fields set is that of the object in ``known``, which nothing reads). ``known`` must hold
    validated values: descriptors this library decoded or built.

    The cut is made only where it cannot change what the JSON means: the body has no escape at
    all (no backslash: a ``\\u`` escape could spell a key) and ``"tail"`` exactly once (its first
    and last occurrence are the tail key's; cheaper than counting), so the root's tail key is the
    only key of that name (a duplicate key, which JSON parsers resolve to the last, cannot
    exist) and the array the cut is made in is the root's; an element the cut takes with its
    comma must be followed by another element, so ``[X,]`` stays invalid. Anything else, and
    any body that fails to validate, returns None and is decoded in full, which also gives the
    error its usual message.
    """
    if not known or b"\\" in body:  # one memchr; what a manifest holds is rarely escaped
        return None
    at = body.find(_TAIL_START)
    if at < 0 or body.find(_TAIL_KEY) != at + 1 or body.rfind(_TAIL_KEY) != at + 1:
        return None
    start = at + len(_TAIL_START)
    first = next(
        (i for i, d in enumerate(known) if body.startswith(_DESCRIPTOR_JSON.get(d), start)), None
    )
    if first is None:
        return None
    end, stop = start, first
    while stop < len(known):
        element = _DESCRIPTOR_JSON.get(known[stop])
        if not body.startswith(element, end):
            break
        after = end + len(element)
        separator = body[after : after + 2]
        if separator[:1] == b"]":
            end, stop = after, stop + 1
            break
        if separator != b",{":
            break
        end, stop = after + 1, stop + 1  # the comma goes with its element
    if stop == first:
        return None
    run = tuple(known[first:stop])
    try:
        rest = Manifest.model_validate_json(
            body[:start] + body[end:], strict=True, context={TAIL_REUSED: len(run)}
        )
    except ValidationError:
        return None
    if not 1 <= rest.format <= MANIFEST_FORMAT:
        return None
    fields = {name: getattr(rest, name) for name in Manifest.model_fields}
    fields["tail"] = run + rest.tail
    return unchecked(Manifest, fields, set(rest.model_fields_set))


def decode_segment(data: bytes, *, key: str) -> tuple[Segment, int]:
    """Parse and verify the segment object ``key``; return it with its body checksum."""

    def decode() -> tuple[_DecodedSegment, int]:
        stored, body = _split_envelope(data, key=key, magic=_SEGMENT_MAGIC, limit=MAX_SEGMENT_BYTES)
        segment = _validate(body, Segment, key=key, what="segment", supported=SEGMENT_FORMAT)
        return _DecodedSegment(segment, stored), len(segment.tgbs)

    return _DECODED.decoded(key, data, _DecodedSegment, decode)


class _DecodedSegment(NamedTuple):
    segment: Segment
    checksum: int


@_keeps_interrupts
def encode_object(magic: str, model: BaseModel) -> bytes:
    """Serialize another persisted model (e.g. a watermark) in the same checksummed envelope."""
    return _encode(magic, model)


def decode_object(
    data: bytes, model: type[_M], *, key: str, magic: str, limit: int, supported: int
) -> _M:
    """Parse and verify an object written by :func:`encode_object` with the same ``magic``."""
    _, body = _split_envelope(data, key=key, magic=magic, limit=limit)
    what = magic.removeprefix("batchweave-")
    return _validate(body, model, key=key, what=what, supported=supported)

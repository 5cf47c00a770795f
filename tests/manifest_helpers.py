"""Shared helpers for the manifest tests: descriptors, counting and fault-injecting wrappers."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator

from batchweave import ByteRange, Mesh, ObjectStore, PutMode, StoreWrapper, encode_tgb
from batchweave._format._checksum import checksum
from batchweave._manifest import (
    Committed,
    Manifest,
    ManifestLog,
    TgbDescriptor,
    TgbObjectRef,
    decode_manifest,
    encode_manifest,
)
from batchweave._manifest._codec import forget_decoded
from batchweave._store._base import ObjectMeta

__all__ = [
    "KEY",
    "SEG_KEY",
    "CountingStore",
    "FaultyPutStore",
    "body",
    "decode_outcome",
    "descriptor",
    "envelope",
    "grow",
    "landed_then",
    "one_object_per_chunk",
]

KEY = "runs/x/_manifests/00000000000000000007.manifest"
"""The key bytes decoded outside a store are read as (decode errors name it)."""
SEG_KEY = "runs/x/_segments/00000000000000000000-abc.seg"
"""The same for segments."""


def envelope(body: bytes, magic: str = "batchweave-manifest") -> bytes:
    """``body`` behind the header the encoder writes (``magic``, the body's CRC-32C and length):
    a well-formed object around a body the encoder would never write."""
    return f"{magic} crc32c={checksum(body):08x} length={len(body)}\n".encode() + body


def body(data: bytes | memoryview) -> bytes:
    """The JSON body of a manifest or segment object (of any object in this envelope, watermarks
    too): what follows its header line, unchecked. The inverse of :func:`envelope`."""
    raw = bytes(data)
    return raw[raw.index(b"\n") + 1 :]


def decode_outcome(data: bytes, previous: Manifest | None = None) -> Manifest | str:
    """What decoding ``data`` (read at :data:`KEY`) gives with nothing cached: the manifest, or
    the error's type and message, so that two ways of decoding can be compared with ``==``."""
    forget_decoded()
    try:
        return decode_manifest(data, key=KEY, previous=previous)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


def descriptor(producer: str, offset: int, *, epoch: int = 0, size: int = 1000) -> TgbDescriptor:
    """A plausible descriptor for ``producer``'s TGB at ``offset``."""
    return TgbDescriptor(
        producer_id=producer,
        epoch=epoch,
        offset=offset,
        objects=(
            TgbObjectRef(
                key=f"data/{producer}/{epoch}/{offset:012d}-0123456789abcdef0123456789abcdef.tgb",
                size=size,
                slice_count=8,
                footer_offset=size - 200,
                footer_length=180,
                footer_checksum=0xDEADBEEF,
            ),
        ),
        bytes=size,
        samples=64,
    )


class CountingStore(StoreWrapper):
    """Counts requests by kind (``get``, ``put``, ``head``, ``list``...) and the keys read."""

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self.calls: Counter[str] = Counter()
        self.gets: list[str] = []
        self._lock = threading.Lock()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.calls[kind] += 1

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.gets.clear()

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self._count("put")
        super().put(key, data, mode=mode)

    def get(self, key: str) -> bytes:
        self._count("get")
        with self._lock:
            self.gets.append(key)
        return super().get(key)

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        # Counted as a GET: manifests and segments are read with one bounded range read each.
        self._count("get")
        with self._lock:
            self.gets.append(key)
        return super().get_range(key, rng)

    def head(self, key: str) -> ObjectMeta:
        self._count("head")
        return super().head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self._count("list")
        return super().list(prefix, start_after=start_after)


class FaultyPutStore(StoreWrapper):
    """Conditional PUTs whose outcome is reported wrongly, as a flaky network or SDK would.

    ``fault(key) -> (land, error)`` decides per conditional PUT whether the write really happens
    and which exception (if any) the caller sees afterwards.
    """

    def __init__(
        self,
        inner: ObjectStore,
        fault: Callable[[str], tuple[bool, Exception | None]],
    ) -> None:
        super().__init__(inner)
        self.fault = fault

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        if mode is not PutMode.CREATE:
            super().put(key, data, mode=mode)
            return
        land, error = self.fault(key)
        if land:
            super().put(key, data, mode=mode)
        if error is not None:
            raise error


def one_object_per_chunk(log: ManifestLog, step: int, chunks: list[bytes]) -> TgbDescriptor:
    """A descriptor of producer ``ext`` for ``step`` whose CP chunk ``c`` is object ``c``.

    The format allows a TGB to be several objects (``TgbObjectRef.first_slice``); BatchWeave's
    producer writes one, so tests build such a TGB by hand (for a mesh ``dp=1, cp=len(chunks)``).
    """
    refs = []
    for chunk, payload in enumerate(chunks):
        encoded = encode_tgb([payload], Mesh(dp=1))
        key = f"data/ext/0/{step:020d}-{chunk:032x}.tgb"
        log.store.put_parts(log.key(key), encoded.parts)
        refs.append(
            TgbObjectRef(
                key=key,
                size=encoded.size,
                first_slice=chunk,
                slice_count=1,
                footer_offset=encoded.footer_offset,
                footer_length=encoded.footer_length,
                footer_checksum=checksum(encoded.footer_bytes, encoded.footer.checksum_algo),
            )
        )
    return TgbDescriptor(
        producer_id="ext",
        epoch=0,
        offset=step,
        objects=tuple(refs),
        bytes=0,
        samples=len(chunks),
    )


def grow(log: ManifestLog, head: Manifest, count: int, sizes: list[int] | None = None) -> Manifest:
    """Commit ``count`` one-TGB versions on ``head``; append each manifest's size to ``sizes``."""
    for _ in range(count):
        result = log.commit(head, append=[descriptor("p", head.next_step)])
        assert isinstance(result, Committed)
        head = result.manifest
        if sizes is not None:
            sizes.append(len(encode_manifest(head)))
    return head


def commit_empty(log: ManifestLog, head: Manifest, count: int) -> Manifest:
    """Commit ``count`` versions on ``head`` that publish nothing (only the version count grows)."""
    for _ in range(count):
        result = log.commit(head)
        assert isinstance(result, Committed)
        head = result.manifest
    return head


def landed_then(error: type[Exception]) -> tuple[bool, Exception]:
    """The write lands, then the caller sees ``error`` (an SDK retry's 412, or a timeout)."""
    message = "simulated: conditional PUT landed, then the client saw an error"
    return True, error(message)

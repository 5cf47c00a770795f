"""Lifecycle test helpers, and a reclaimer process that can SIGKILL itself mid-run.

As a module: :class:`FakeClock`, :class:`Writer` (a deterministic, single-threaded producer that
uploads real TGB objects and commits them through the manifest log), :func:`expected_slice`,
:func:`publish_one_slice` (the same through a real ``Producer``, mesh dp=1) and
:class:`RefuseOne` (a store that refuses to delete one key).

As a script (``python tests/_reclaimer_worker.py ROOT NAMESPACE NOW GRACE [KILL_AFTER]``): runs
one reclaimer pass on the file store at ROOT with the clock frozen at NOW; with KILL_AFTER, the
process SIGKILLs itself right after its KILL_AFTER-th deleted key, so a test can crash it at an
exact deletion point.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterable

from batchweave import (
    AccessDenied,
    FileStore,
    Mesh,
    ObjectStore,
    Producer,
    Reclaimer,
    StoreWrapper,
    encode_tgb,
)
from batchweave._format._checksum import checksum
from batchweave._manifest import Committed, Manifest, ManifestLog, TgbDescriptor, TgbObjectRef

__all__ = [
    "ONE_SLICE",
    "FakeClock",
    "KillingStore",
    "RefuseOne",
    "Writer",
    "expected_slice",
    "main",
    "publish_one_slice",
]


class FakeClock:
    """A wall clock that moves only when told to."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def expected_slice(producer_id: str, offset: int, index: int) -> bytes:
    """The payload :class:`Writer` stores for slice ``index`` of ``producer_id``'s ``offset``."""
    return f"{producer_id}:{offset}:{index}:".encode() * 8


class Writer:
    """Uploads TGBs with real objects and commits them with one-attempt retries on conflict."""

    def __init__(
        self,
        store: ObjectStore,
        namespace: str,
        mesh: Mesh,
        producer_id: str = "w0",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.log = ManifestLog(store, namespace, clock=clock, monotonic=clock)
        self.store = store
        self.mesh = mesh
        self.producer_id = producer_id
        self.base = self.log.create_or_open(mesh)
        state = self.base.producers.get(producer_id)
        self.offset = 0 if state is None or state.offset is None else state.offset + 1
        self.orphans = 0

    def upload(self, offset: int) -> TgbDescriptor:
        """Upload the TGB for ``offset`` (not committed) and return its descriptor."""
        slices = [expected_slice(self.producer_id, offset, i) for i in range(self.mesh.slices)]
        encoded = encode_tgb(slices, self.mesh)
        key = f"data/{self.producer_id}/0/{offset:020d}-{uuid.uuid4().hex}.tgb"
        self.store.put(self.log.key(key), encoded.data)
        start = encoded.footer_offset
        footer_bytes = encoded.data[start : start + encoded.footer_length]
        ref = TgbObjectRef(
            key=key,
            size=encoded.size,
            slice_count=self.mesh.slices,
            footer_offset=encoded.footer_offset,
            footer_length=encoded.footer_length,
            footer_checksum=checksum(footer_bytes, encoded.footer.checksum_algo),
        )
        return TgbDescriptor(
            producer_id=self.producer_id,
            epoch=0,
            offset=offset,
            objects=(ref,),
            bytes=encoded.size,
        )

    def publish(self, count: int) -> Manifest:
        """Upload and commit the next ``count`` TGBs; return the committing manifest."""
        descs = [self.upload(self.offset + i) for i in range(count)]
        while True:
            self.base = self.log.latest(self.base)
            result = self.log.commit(self.base, append=descs)
            if isinstance(result, Committed):
                self.base = result.manifest
                self.offset += count
                return result.manifest

    def orphan(self) -> str:
        """Upload a TGB that is never committed (a producer crashed); return its store key."""
        self.orphans += 1
        desc = self.upload(10**9 + self.orphans)
        return self.log.key(desc.objects[0].key)


ONE_SLICE = Mesh(dp=1, cp=1)
"""The mesh of :func:`publish_one_slice`: one slice per TGB."""


def publish_one_slice(store: ObjectStore, count: int, namespace: str = "ns") -> None:
    """Publish offsets up to ``count`` of producer ``p0`` (one 10-byte slice each) through a
    real ``Producer``, resuming after what is already committed."""
    with Producer(store, namespace, producer_id="p0", mesh=ONE_SLICE) as producer:
        for offset in range(producer.resume_offset, count):
            producer.append([b"x" * 10], offset=offset)


class RefuseOne(StoreWrapper):
    """Refuses to delete one key (an object lock), like a store with a partial permission."""

    def __init__(self, inner: ObjectStore, refused: str) -> None:
        super().__init__(inner)
        self.refused = refused

    def delete_many(self, keys: Iterable[str]) -> None:
        names = list(keys)
        if self.refused in names:
            raise AccessDenied(f"{self.refused}: access denied")
        super().delete_many(names)


class KillingStore(StoreWrapper):
    """Deletes keys one at a time and SIGKILLs this process right after the ``kill_after``-th."""

    def __init__(self, inner: ObjectStore, kill_after: int | None) -> None:
        super().__init__(inner)
        self.kill_after = kill_after
        self.deleted = 0

    def delete_many(self, keys: Iterable[str]) -> None:
        for key in keys:
            self.inner.delete_many([key])
            self.deleted += 1
            if self.kill_after is not None and self.deleted >= self.kill_after:
                os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str]) -> int:
    root, namespace, now, grace = argv[0], argv[1], float(argv[2]), float(argv[3])
    kill_after = int(argv[4]) if len(argv) > 4 else None
    store = KillingStore(FileStore(root), kill_after)
    report = Reclaimer(store, namespace, grace=grace, clock=lambda: now).run_once()
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""A producer process for the multi-process tests (run as a script, not collected by pytest).

It publishes offsets ``resume_offset .. total-1`` of a deterministic source for one producer id
and reports progress as lines on stdout, which the test reads as events:

- ``started <epoch> <resume_offset>`` once the epoch commit landed;
- with ``--flush-at N``, the worker flushes after appending offset ``N`` (so a later ``--hold``
  commit provably finds earlier TGBs committed and later ones not yet appended);
- ``hold <before|after> <offset>`` when a ``--hold`` point was reached: the process then blocks
  forever inside a manifest PUT, either just before sending it or just after it landed (the
  test SIGKILLs it there: a crash mid-commit, the second one with an unacknowledged success);
- ``done <committed_offset>`` after ``close()`` drained everything.

Every incarnation passes the same ``source=`` (:func:`source_id`), so the restarts exercise
source identities: a worker exits with status 3 if the state it restarts from, or the final
state, does not carry that source (a commit path that dropped it).

Credentials come from ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` in the environment, never
from the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
import threading

from batchweave import Mesh, NamespaceNotFound, ObjectStore, Producer, PutMode, StoreWrapper
from batchweave._manifest._codec import decode_manifest
from batchweave._manifest._log import ManifestLog
from batchweave._store._open import open_store

MESH = Mesh(dp=2, cp=1)


def payload(producer_id: str, offset: int) -> list[bytes]:
    """The deterministic source: TGB ``offset`` of ``producer_id``."""
    return [f"{producer_id}:{offset}:{c}".encode().ljust(64, b".") for c in range(MESH.slices)]


def source_id(producer_id: str) -> str:
    """The source identity every incarnation of ``producer_id`` passes."""
    return f"test-worker-source {producer_id} dp={MESH.dp}"


def committed_source(store: ObjectStore, namespace: str, producer_id: str) -> str | None:
    """The source the newest manifest holds for ``producer_id`` (``None``: none, or no state)."""
    state = ManifestLog(store, namespace).latest().producers.get(producer_id)
    return None if state is None else state.source


def check_source(where: str, found: str | None, expected: str) -> None:
    if found != expected:
        sys.stderr.write(f"{where}: committed source {found!r}, expected {expected!r}\n")
        sys.exit(3)


def report(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class HoldingStore(StoreWrapper):
    """Blocks forever in the first manifest PUT that commits ``producer_id`` past ``offset``."""

    def __init__(self, inner: ObjectStore, producer_id: str, where: str, offset: int) -> None:
        super().__init__(inner)
        self._pid = producer_id
        self._where = where
        self._offset = offset
        self._held = False

    def _hold_point(self, key: str, data: bytes | memoryview) -> int | None:
        if self._held or "/_manifests/" not in key:
            return None
        manifest = decode_manifest(bytes(data), key=key)
        state = manifest.producers.get(self._pid)
        if state is None or state.offset is None or state.offset < self._offset:
            return None
        return state.offset

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        offset = self._hold_point(key, data) if mode is PutMode.CREATE else None
        if offset is not None and self._where == "before":
            self._held = True
            report(f"hold before {offset}")
            threading.Event().wait()  # until SIGKILL
        self.inner.put(key, data, mode=mode)  # a lost race raises here: hold at a later commit
        if offset is not None:
            self._held = True
            report(f"hold after {offset}")
            threading.Event().wait()  # the PUT landed; the producer never learns it


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--store", required=True, help="s3://bucket/prefix")
    parser.add_argument("--endpoint-url", required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--producer-id", required=True)
    parser.add_argument("--total", type=int, required=True, help="source offsets 0..total-1")
    parser.add_argument("--hold", choices=("before", "after"), default=None)
    parser.add_argument("--hold-offset", type=int, default=0)
    parser.add_argument(
        "--flush-at", type=int, action="append", default=[], help="flush after this offset"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    store: ObjectStore = open_store(
        args.store,
        endpoint_url=args.endpoint_url,
        access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
        secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
        region=os.environ.get("AWS_DEFAULT_REGION", "us-east-1"),
    )
    source = source_id(args.producer_id)
    with contextlib.suppress(NamespaceNotFound):  # the first workers find no namespace yet
        state = ManifestLog(store, args.namespace).latest().producers.get(args.producer_id)
        if state is not None:  # a restart: its predecessor's commits must have kept the source
            check_source("before the restart", state.source, source)
    if args.hold is not None:
        store = HoldingStore(store, args.producer_id, args.hold, args.hold_offset)
    with Producer(
        store,
        args.namespace,
        producer_id=args.producer_id,
        mesh=MESH,
        policy="dac",
        source=source,
    ) as producer:
        report(f"started {producer.epoch} {producer.resume_offset}")
        for offset in range(producer.resume_offset, args.total):
            producer.append(payload(args.producer_id, offset), offset=offset)
            if offset in args.flush_at:
                producer.flush()
    check_source("after close", committed_source(store, args.namespace, args.producer_id), source)
    stats = producer.stats()
    report(
        f"done {producer.committed_offset} attempts={stats.attempts} commits={stats.commits} "
        f"conflicts={stats.conflicts} ambiguous={stats.ambiguous} gap={stats.gap:.3f} "
        f"window={stats.last_fragile_window:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

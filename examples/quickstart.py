"""End-to-end on the embedded ``file://`` store: two producers publish, every rank reads its slice.

Run: ``python examples/quickstart.py [--root DIR] [--steps N]``. It writes a fresh namespace,
publishes ``--steps`` TGBs from two producer threads, seals the namespace, reads it back with one
consumer per rank of a dp=2, cp=2 mesh, and checks that every rank got exactly its slice of every
step. Without ``--root`` the store is a temporary directory, deleted at the end; with it the
namespace stays, and the script prints the ``batchweave inspect`` command to look at it.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path

import numpy as np

import batchweave as bw

MESH = bw.Mesh(dp=2, cp=2)


def make_slices(producer: int, offset: int) -> list[dict[str, np.ndarray]]:
    """One TGB: for each (d, c), a micro-batch of token ids tagged with who made it."""
    slices = []
    for d in range(MESH.dp):
        for c in range(MESH.cp):
            tokens = np.full((4, 16), offset, dtype=np.int32)
            tag = np.array([producer, offset, d, c], dtype=np.int64)
            slices.append({"tokens": tokens, "tag": tag})
    return slices


def produce(store: bw.ObjectStore, namespace: str, producer: int, count: int) -> None:
    with bw.Producer(
        store, namespace, producer_id=f"prep-{producer}", mesh=MESH, codec="tensors"
    ) as p:
        for offset in range(p.resume_offset, count):
            p.append(make_slices(producer, offset), offset=offset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, help="store directory (default: a temp dir)")
    parser.add_argument("--steps", type=int, default=200, help="TGBs to publish (default 200)")
    args = parser.parse_args()
    if args.steps < 2 or args.steps % 2:
        parser.error("--steps must be a positive even number (two producers publish half each)")

    with tempfile.TemporaryDirectory() as tmp:
        root = (args.root or Path(tmp)).resolve()
        store = bw.open_store(root.as_uri())
        namespace = f"quickstart-{uuid.uuid4().hex[:8]}"
        per_producer = args.steps // 2

        started = time.perf_counter()
        producers = [
            threading.Thread(target=produce, args=(store, namespace, i, per_producer))
            for i in range(2)
        ]
        for t in producers:
            t.start()
        for t in producers:
            t.join()
        with bw.Producer(store, namespace, producer_id="prep-0", mesh=MESH) as p:
            p.seal()
        written = time.perf_counter() - started

        seen: dict[tuple[int, int], list[tuple[int, int]]] = {}
        started = time.perf_counter()
        for d in range(MESH.dp):
            for c in range(MESH.cp):
                consumer = bw.Consumer(store, namespace, mesh=MESH, dp_rank=d, cp_rank=c)
                for _step, data in consumer:
                    producer, offset, dd, cc = (int(x) for x in data["tag"])
                    assert (dd, cc) == (d, c), f"rank ({d}, {c}) got slice ({dd}, {cc})"
                    assert int(data["tokens"][0, 0]) == offset
                    seen.setdefault((d, c), []).append((producer, offset))
        read = time.perf_counter() - started

        sequences = list(seen.values())
        assert all(seq == sequences[0] for seq in sequences), "ranks disagree on step order"
        expected = {(p, o) for p in range(2) for o in range(per_producer)}
        assert sorted(sequences[0]) == sorted(expected), "a TGB was lost or duplicated"
        kept = "" if args.root else " (a temporary directory, deleted now: keep it with --root)"
        print(f"store      {store.url}  namespace {namespace}{kept}")
        print(f"published  {len(expected)} TGBs from 2 producers in {written:.2f}s")
        print(f"read back  {len(sequences[0])} steps x {MESH.slices} ranks in {read:.2f}s")
        print("verified   every rank got exactly its slice of every step, in one agreed order")
        if args.root:
            print(f"inspect it: batchweave inspect {root} {namespace}")


if __name__ == "__main__":
    main()

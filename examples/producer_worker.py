"""A preprocessing worker embedding a BatchWeave producer, fed by a Lance dataset.

Run one per producer id (``--producer-id prep-0``, ``prep-1``, ... with matching ``--shard``); kill
and restart it at will: it resumes at its committed offset under a new epoch, so every source batch
is published exactly once. The producer commits the source's identity (dataset, version, shard,
...): a restart that would read another dataset version (``SourceMismatch``) stops before
publishing anything, naming the ``--dataset-version`` the worker was started on: pass that.
SIGTERM (or Ctrl-C) stops it cleanly after committing what it has appended, also while ``append``
is blocked by ``--max-lag`` (no checkpoints are advancing the watermarks, e.g. no trainer is
running). With ``--metrics-port`` it serves Prometheus metrics on 127.0.0.1.

    python examples/producer_worker.py --store /tmp/weave --namespace runs/demo \\
        --producer-id prep-0 --shard 0 --shards 2 --batches 100 &
    python examples/producer_worker.py --store /tmp/weave --namespace runs/demo \\
        --producer-id prep-1 --shard 1 --shards 2 --batches 100
    wait; batchweave seal /tmp/weave runs/demo          # all workers are done: end the stream

Without ``--dataset`` it writes a small synthetic Lance dataset first: next to a store directory
(``/tmp/weave-corpus.lance``), or in the current directory for a store URL. Seal the
namespace only once every worker is done (``batchweave seal``, or ``--seal`` on a lone worker): a
sealed namespace takes no more TGBs, so a worker still running stops with ``NamespaceSealed``.
Training ranks read the stream with ``bw.Consumer(store, "runs/demo", mesh=bw.Mesh(dp=2, cp=1))``
(the workers' ``--dp``/``--cp``); each slice is ``{"tokens": int32[seq_len], "ids": int64[rows]}``.
``batchweave inspect /tmp/weave runs/demo`` shows every worker's epoch and committed offset.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import threading
from pathlib import Path
from types import FrameType

import lance
import numpy as np
import pyarrow as pa

import batchweave as bw
from batchweave.lance import LanceSource


def synthetic_dataset(path: Path, rows: int = 2_000) -> Path:
    """Documents of varying length: ``id`` and ``tokens`` (a list of int32)."""
    if path.exists():
        return path
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 256, rows)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    values = rng.integers(1, 32_000, int(offsets[-1]), dtype=np.int32)
    table = pa.table(
        {
            "id": pa.array(np.arange(rows, dtype=np.int64)),
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(values)),
        }
    )
    # Workers started together all get here: each writes its own copy and renames it into place
    # (atomic), and those that lose the race use the winner's identical dataset.
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    lance.write_dataset(table, str(tmp))
    try:
        tmp.rename(path)
    except OSError:
        if not path.exists():
            raise
        shutil.rmtree(tmp)
    return path


def to_slices(table: pa.Table, mesh: bw.Mesh, seq_len: int) -> list[dict[str, np.ndarray]]:
    """Concatenate the batch's tokens and cut them into ``dp * cp`` equal token blocks."""
    flat = table.column("tokens").combine_chunks().values.to_numpy()
    need = mesh.slices * seq_len
    flat = np.resize(flat, need) if len(flat) < need else flat[:need]
    blocks = flat.reshape(mesh.slices, seq_len)
    ids = table.column("id").to_numpy()
    return [{"tokens": blocks[i], "ids": ids} for i in range(mesh.slices)]


def close_on(stop: threading.Event, producer: bw.Producer) -> None:
    """Once ``stop`` is set, commit what was appended and stop ``producer``."""
    stop.wait()
    producer.close()


def mismatch_advice(producer_id: str, source: LanceSource, exc: bw.SourceMismatch) -> str:
    """What to do when ``producer_id`` committed another source (another dataset version)."""
    # The error quotes the committed source identity first: its version is the one needed.
    committed = re.search(r"committed source .*?\bversion=(\d+)\b", str(exc))
    if committed is None or int(committed[1]) == source.version:
        return f"{producer_id}: {exc}"  # not (only) the version: shard, seed, rows... differ
    return (
        f"{producer_id}: this producer id was started on version {committed[1]} of "
        f"{source.dataset.uri}, not version {source.version}: its offsets map to the rows of "
        f"version {committed[1]}. Restart with --dataset-version {committed[1]}, or use a new "
        "--producer-id for the new data. Nothing was committed."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True, help="store URL or directory")
    parser.add_argument("--namespace", default="runs/producer-worker")
    parser.add_argument("--producer-id", default="prep-0")
    parser.add_argument("--dataset", type=Path, help="Lance dataset (default: synthetic)")
    parser.add_argument(
        "--dataset-version",
        type=int,
        help="Lance version to read; a restart must pass the version the first run printed",
    )
    parser.add_argument("--shard", type=int, default=0)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--batches", type=int, default=100, help="offsets 0 .. batches-1")
    parser.add_argument("--rows", type=int, default=16, help="documents per TGB")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--dp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--max-lag", type=int, default=1_000, help="producer max_lag in steps")
    parser.add_argument(
        "--seal",
        action="store_true",
        help="seal the namespace when done (only the last worker to finish: no TGBs after it)",
    )
    parser.add_argument("--metrics-port", type=int, help="serve /metrics on 127.0.0.1")
    args = parser.parse_args()

    url = args.store if "://" in args.store else Path(args.store).resolve().as_uri()
    store = bw.open_store(url)
    dataset = args.dataset
    if dataset is None:
        if "://" in args.store:  # s3://, file://: in the current directory
            dataset = synthetic_dataset(Path.cwd() / "producer-worker-corpus.lance")
        else:  # next to the store directory
            root = Path(args.store).resolve()
            dataset = synthetic_dataset(root.parent / f"{root.name}-corpus.lance")
    source = LanceSource(
        dataset,
        rows_per_batch=args.rows,
        seed=1,
        shard=args.shard,
        num_shards=args.shards,
        version=args.dataset_version,
    )
    mesh = bw.Mesh(dp=args.dp, cp=args.cp)
    if args.metrics_port is not None:
        metrics = bw.start_metrics_server(args.metrics_port)
        print(f"{args.producer_id}: metrics at http://127.0.0.1:{metrics.port}/metrics")

    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    try:
        producer = bw.Producer(
            store,
            args.namespace,
            producer_id=args.producer_id,
            mesh=mesh,
            source=source.source_id,  # a restart on another dataset version is refused
            codec="tensors",
            policy=bw.instrument_policy("dac"),
            max_lag=args.max_lag,
        )
    except bw.SourceMismatch as exc:
        raise SystemExit(mismatch_advice(args.producer_id, source, exc)) from None
    with producer:
        # Offsets map to rows of one dataset version: a restart reading a newer one would publish
        # other rows under the offsets it resumes at. Printed once the producer accepted it.
        print(
            f"{args.producer_id}: reading {source.dataset.uri} version {source.version} "
            f"(restart with --dataset-version {source.version})"
        )
        bw.track_metrics(producer)
        # An append blocked by max_lag waits for checkpoints that may never come, so the signal
        # alone cannot end it. Closing the producer from another thread commits everything
        # appended so far and makes that append raise ProducerError within a second.
        threading.Thread(target=close_on, args=(stop, producer), daemon=True).start()
        print(
            f"{args.producer_id}: epoch {producer.epoch}, resuming at offset "
            f"{producer.resume_offset} of {args.batches}"
        )
        try:
            for offset, table in source.iter_from(producer.resume_offset, stop=args.batches):
                if stop.is_set():
                    print(f"{args.producer_id}: stopping at offset {offset}")
                    break
                producer.append(to_slices(table, mesh, args.seq_len), offset=offset)
        except bw.ProducerError:
            if not stop.is_set():
                raise
            print(f"{args.producer_id}: stopping at offset {offset} (was blocked by max_lag)")
        producer.flush()
        stats = producer.stats()
        print(
            f"{args.producer_id}: committed offset {producer.committed_offset}; "
            f"{stats.commits} commits / {stats.attempts} attempts, "
            f"{stats.tgbs_published} TGBs, {stats.bytes_published} bytes"
        )
        if args.seal and not stop.is_set():
            producer.seal()
            print(f"{args.producer_id}: sealed {args.namespace}")


if __name__ == "__main__":
    main()

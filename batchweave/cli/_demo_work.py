"""The demo's real work: a generated corpus, token packing, and the worker processes.

Run by ``batchweave demo`` as ``python -m batchweave.cli._demo_work {producer|consumer} CONFIG
INDEX DRIVER_PID``. Everything a worker does is a function of the config and its index, so the
driver can recompute any slice to check what the consumers received.

- Corpus: a Lance dataset of documents with variable lengths (``doc_id``, ``tokens``).
- Producer ``i``: :class:`~batchweave.lance.LanceSource` over shard ``i`` of the corpus (one
  batched ``take`` per TGB), packs the documents first-fit-decreasing into ``dp * micro_batch``
  sequences of ``seq_len`` tokens, splits each DP replica's sequences into ``cp`` chunks along the
  sequence axis, and appends the ``dp * cp`` slices with the document ids as sample ids.
- Consumer rank ``r``: iterates its slice of every step, logs a digest of what it got, sleeps
  ``step_time`` (the "training"), checkpoints its state every ``checkpoint_every`` steps and then
  records its watermark; a restarted consumer resumes from its last checkpoint.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import xxhash

if TYPE_CHECKING:
    from batchweave.lance import LanceSource

__all__ = [
    "WorkerConfig",
    "demo_source",
    "die_with_parent",
    "expected_digests",
    "make_corpus",
    "pack_tgb",
    "rows_per_batch",
    "slice_digest",
]

PAD = 0
MEAN_DOC_TOKENS = 300
_PR_SET_PDEATHSIG = 1


@dataclass
class WorkerConfig:
    """What every worker process needs; written by the driver as JSON."""

    store_url: str
    store_options: dict[str, Any]
    namespace: str
    corpus: str
    work_dir: str
    dp: int
    cp: int
    producers: int
    per_producer: int
    seq_len: int
    micro_batch: int
    step_time: float
    max_lag: int
    checkpoint_every: int
    seed: int = 7
    metrics_port: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def load(cls, path: Path) -> WorkerConfig:
        return cls(**json.loads(path.read_text()))


def make_corpus(path: Path, documents: int, seed: int, vocab: int = 50_000) -> int:
    """Write a Lance dataset of ``documents`` documents of 16..4096 tokens; return total tokens."""
    os.environ.setdefault("LANCE_LOG", "error")
    import lance

    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(MEAN_DOC_TOKENS) - 0.5, 1.0, documents), 16, 4096)
    lengths = lengths.astype(np.int32)
    offsets = np.zeros(documents + 1, dtype=np.int64)  # int32 wraps past ~7M documents
    np.cumsum(lengths, out=offsets[1:])
    tokens = rng.integers(1, vocab, int(offsets[-1]), dtype=np.int32)
    table = pa.table(
        {
            "doc_id": pa.array(np.arange(documents, dtype=np.int64)),
            "tokens": pa.ListArray.from_arrays(pa.array(offsets), pa.array(tokens)),
            "length": pa.array(lengths),
        }
    )
    lance.write_dataset(table, str(path), mode="overwrite", max_rows_per_group=1024)
    return int(offsets[-1])


def rows_per_batch(config: WorkerConfig) -> int:
    """Documents sampled per TGB: enough tokens to fill it, on average, with some to spare."""
    need = config.dp * config.micro_batch * config.seq_len
    return max(1, int(need / MEAN_DOC_TOKENS * 1.3))


def pack_tgb(
    table: pa.Table, config: WorkerConfig, producer: int, offset: int
) -> tuple[list[dict[str, np.ndarray]], list[list[int]]]:
    """Token-pack ``table``'s documents into one TGB: ``dp * cp`` slices and their doc ids.

    Documents longer than ``seq_len`` are split into ``seq_len`` pieces; the pieces go first-fit
    decreasing into ``dp * micro_batch`` bins of ``seq_len`` tokens (what fits nowhere is
    dropped), padding with ``PAD``. Each slice
    holds ``tokens``, ``doc_ids`` (-1 on padding) and ``positions`` (within the document) of shape
    ``(micro_batch, seq_len // cp)``, plus ``tag = [producer, offset, d, c]``.
    """
    dp, cp, mb, seq = config.dp, config.cp, config.micro_batch, config.seq_len
    bins = dp * mb
    tokens = np.full((bins, seq), PAD, dtype=np.int32)
    doc_ids = np.full((bins, seq), -1, dtype=np.int64)
    positions = np.zeros((bins, seq), dtype=np.int32)
    fill = np.zeros(bins, dtype=np.int64)
    ids = table.column("doc_id").to_numpy()
    docs = table.column("tokens").combine_chunks()
    offsets = docs.offsets.to_numpy()
    values = docs.values.to_numpy()
    # (doc index, start within the doc, length): documents longer than a sequence are split
    pieces = [
        (i, at, min(seq, int(offsets[i + 1] - offsets[i]) - at))
        for i in range(len(ids))
        for at in range(0, int(offsets[i + 1] - offsets[i]), seq)
    ]
    pieces.sort(key=lambda piece: -piece[2])  # stable: ties keep document order
    for i, start, n in pieces:
        fits = np.nonzero(seq - fill >= n)[0]
        if len(fits) == 0:
            continue
        b = int(fits[0])
        at = int(fill[b])
        src = int(offsets[i]) + start
        tokens[b, at : at + n] = values[src : src + n]
        doc_ids[b, at : at + n] = ids[i]
        positions[b, at : at + n] = np.arange(start, start + n, dtype=np.int32)
        fill[b] += n
    chunk = seq // cp
    slices: list[dict[str, np.ndarray]] = []
    sample_ids: list[list[int]] = []
    for d in range(dp):
        rows = slice(d * mb, (d + 1) * mb)
        for c in range(cp):
            cols = slice(c * chunk, (c + 1) * chunk)
            part = doc_ids[rows, cols]
            slices.append(
                {
                    "tokens": np.ascontiguousarray(tokens[rows, cols]),
                    "doc_ids": np.ascontiguousarray(part),
                    "positions": np.ascontiguousarray(positions[rows, cols]),
                    "tag": np.array([producer, offset, d, c], dtype=np.int64),
                }
            )
            sample_ids.append(sorted(int(x) for x in np.unique(part) if x >= 0))
    return slices, sample_ids


def slice_digest(data: dict[str, Any]) -> str:
    """A digest of a delivered slice: what consumers log and the driver recomputes."""
    h = xxhash.xxh64()
    for name in ("tokens", "doc_ids", "positions", "tag"):
        h.update(np.ascontiguousarray(data[name]).tobytes())
    return h.hexdigest()


def demo_source(config: WorkerConfig, producer: int) -> LanceSource:
    """Producer ``producer``'s shard of the corpus, as the demo samples it."""
    from batchweave.lance import LanceSource

    return LanceSource(
        config.corpus,
        rows_per_batch=rows_per_batch(config),
        seed=config.seed,
        shard=producer,
        num_shards=config.producers,
        columns=["doc_id", "tokens"],
    )


def expected_digests(
    config: WorkerConfig, producer: int, offset: int, source: LanceSource
) -> list[str]:
    """The digest of every slice of producer ``producer``'s TGB ``offset``, recomputed."""
    slices, _ = pack_tgb(source.take(offset), config, producer, offset)
    return [slice_digest(s) for s in slices]


# -- worker processes ------------------------------------------------------------------------


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _open(config: WorkerConfig) -> Any:
    from batchweave._store._open import open_store

    return open_store(config.store_url, **config.store_options)


def _serve_metrics(config: WorkerConfig, slot: int) -> None:
    if config.metrics_port is not None:
        from batchweave._metrics import start_metrics_server

        start_metrics_server(config.metrics_port + slot)


def run_producer(config: WorkerConfig, index: int) -> None:
    """Publish offsets ``resume_offset .. per_producer - 1`` of producer ``index``."""
    from batchweave._history import SAMPLE_IDS_KEY, sample_ids_metadata
    from batchweave._mesh import Mesh
    from batchweave._metrics import instrument_policy, track_metrics
    from batchweave._producer import Producer

    _serve_metrics(config, 1 + index)
    store = _open(config)
    source = demo_source(config, index)
    stats_path = Path(config.work_dir) / "stats" / f"producer-{index}-{os.getpid()}.json"
    mesh = Mesh(dp=config.dp, cp=config.cp)
    with Producer(
        store,
        config.namespace,
        producer_id=f"prep-{index}",
        mesh=mesh,
        source=source.source_id,
        codec="tensors",
        max_lag=config.max_lag,
        policy=instrument_policy("dac"),
    ) as producer:
        track_metrics(producer)
        start = producer.resume_offset
        _write_json(stats_path, {"epoch": producer.epoch, "resume_offset": start})
        last_report = time.monotonic()
        for offset, table in source.iter_from(start, stop=config.per_producer):
            slices, ids = pack_tgb(table, config, index, offset)
            meta = {SAMPLE_IDS_KEY: sample_ids_metadata(ids)}
            producer.append(slices, offset=offset, metadata=meta)
            if time.monotonic() - last_report > 0.5:
                last_report = time.monotonic()
                _write_json(stats_path, _producer_stats(producer, start))
        producer.flush()
        _write_json(stats_path, {**_producer_stats(producer, start), "done": True})


def _producer_stats(producer: Any, start: int) -> dict[str, Any]:
    stats = producer.stats()
    return {
        "epoch": producer.epoch,
        "resume_offset": start,
        "attempts": stats.attempts,
        "commits": stats.commits,
        "conflicts": stats.conflicts,
        "ambiguous": stats.ambiguous,
        "tgbs_published": stats.tgbs_published,
        "bytes_published": stats.bytes_published,
        "lag_blocked_seconds": stats.lag_blocked_seconds,
        "gap": stats.gap,
        "fragile_window": stats.last_fragile_window,
    }


def run_consumer(config: WorkerConfig, rank: int) -> None:
    """Read rank ``rank``'s slices to the end of the sealed stream, checkpointing as it goes."""
    from batchweave._consumer import Consumer
    from batchweave._lifecycle import checkpoint_hook
    from batchweave._mesh import Mesh
    from batchweave._metrics import track_metrics
    from batchweave._watermarks import Watermarks

    _serve_metrics(config, 1 + config.producers + rank)
    store = _open(config)
    mesh = Mesh(dp=config.dp, cp=config.cp)
    d, c = divmod(rank, config.cp)
    work = Path(config.work_dir)
    ckpt_path = work / "checkpoints" / f"rank-{rank}.json"
    log_path = work / "logs" / f"rank-{rank}.jsonl"
    stats_path = work / "stats" / f"consumer-{rank}-{os.getpid()}.json"
    consumer = Consumer(
        store,
        config.namespace,
        mesh=mesh,
        dp_rank=d,
        cp_rank=c,
        prefetch=4,
        poll_interval=0.02,
        max_poll_interval=0.25,
        timeout=300.0,
    )
    track_metrics(consumer)
    watermarks = Watermarks(store, config.namespace)
    if ckpt_path.exists():
        restored = json.loads(ckpt_path.read_text())["consumer"]
        consumer.load_state_dict(restored)
        # A kill between the durable checkpoint and its hook left the watermark an interval
        # behind; with max_lag that holds producers back until this rank's next checkpoint.
        checkpoint_hook(consumer, watermarks, f"rank-{rank}", state=restored, rank=0)
    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def emit(record: dict[str, Any]) -> None:
        os.write(log, (json.dumps(record) + "\n").encode())

    emit({"event": "start", "step": consumer.step, "pid": os.getpid(), "t": time.time()})
    last_report = time.monotonic()
    for step, data in consumer:
        tag = data["tag"]
        emit({"step": step, "producer": int(tag[0]), "offset": int(tag[1]),
              "digest": slice_digest(data), "t": time.time()})  # fmt: skip
        if config.step_time > 0:
            time.sleep(config.step_time)
        if (step + 1) % config.checkpoint_every == 0:
            state = consumer.state_dict()
            _write_json(ckpt_path, {"consumer": state})  # the "checkpoint" is durable ...
            checkpoint_hook(  # ... then its watermark keeps the data it resumes from
                consumer, watermarks, f"rank-{rank}", state=state, rank=0
            )
            emit({"event": "checkpoint", "step": state["step"]})
        if time.monotonic() - last_report > 0.5:
            last_report = time.monotonic()
            _write_json(stats_path, _consumer_stats(consumer))
    _write_json(stats_path, {**_consumer_stats(consumer), "done": True})
    emit({"event": "done", "step": consumer.step, "t": time.time()})
    os.close(log)
    consumer.close()


def _consumer_stats(consumer: Any) -> dict[str, Any]:
    s = consumer.stats
    return {
        "steps": s.steps,
        "bytes_read": s.bytes_read,
        "bytes_delivered": s.bytes_delivered,
        "requests": s.requests,
        "stall_seconds": s.stall_seconds,
        "time_to_first_batch": s.time_to_first_batch,
    }


def die_with_parent(parent: int) -> None:
    """End this worker when the demo driver dies, even by SIGKILL (Linux only).

    The driver stops its workers on every exit it sees (a failure, Ctrl-C, SIGTERM); only a
    SIGKILL gives it no chance, and orphaned workers would go on publishing and polling.
    ``PR_SET_PDEATHSIG`` has the kernel SIGKILL this process when the driver goes; a driver
    that died before the call shows as a changed parent PID.
    """
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str]) -> int:
    """``{producer|consumer} CONFIG INDEX [DRIVER_PID]``: with the driver's PID, the worker
    ends when the driver does."""
    if len(argv) > 3:
        die_with_parent(int(argv[3]))
    role, config_path, index = argv[0], Path(argv[1]), int(argv[2])
    config = WorkerConfig.load(config_path)
    if role == "producer":
        run_producer(config, index)
    elif role == "consumer":
        run_consumer(config, index)
    else:
        raise SystemExit(f"unknown role {role!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

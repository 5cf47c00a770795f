"""One training rank's loop: a BatchWeave consumer feeding a (tiny, CPU) torch model.

Each rank reads only its own slice of every step. The rank's place in the ``--dp`` x ``--cp``
mesh comes from ``RANK``/``WORLD_SIZE`` (as set by ``torchrun``): the script prints the
``dp_rank``/``cp_rank`` that ``bw.coordinates_from_env`` derives. Every ``--every`` steps the
loop saves model, optimizer and ``consumer.state_dict()`` with ``torch.save`` and then calls
``batchweave.checkpoint_hook``, which records the checkpoint's watermark (on rank 0; other ranks
get ``None``) so the reclaimer keeps exactly the data a resume needs. Rank 0 prints each
watermark it records and, at the end, the live ones (``Watermarks.live()``).

Rank 0 also starts a producer thread that publishes ``--steps`` batches of a linear-regression
problem. Every rank trains half of the steps, "restarts" from its last checkpoint into a fresh
model and consumer, finishes, and checks that the resumed run saw exactly the steps after its
checkpoint.

    python examples/consumer_training_loop.py                     # one process: rank 0 of dp=2
    torchrun --standalone --nproc-per-node 2 examples/consumer_training_loop.py --root /tmp/ctl

``--root`` (a new directory; default: a temporary one, deleted at the end) holds the store
(``ROOT/store``) and each rank's checkpoints (``ROOT/ckpt/rank-N``); it is shared by the ranks,
and afterwards ``batchweave inspect ROOT/store runs/training-loop`` shows the namespace and its
watermarks. With ``--dp 2 --cp 2``, run 4 processes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import torch

import batchweave as bw

NAMESPACE = "runs/training-loop"
FEATURES = 8


def publish(store: bw.ObjectStore, mesh: bw.Mesh, steps: int, rows: int) -> None:
    """A producer: each TGB slice holds ``rows`` samples of y = x @ w + noise."""
    rng = np.random.default_rng(0)
    w = rng.normal(size=(FEATURES, 1)).astype(np.float32)
    with bw.Producer(store, NAMESPACE, producer_id="gen-0", mesh=mesh, codec="tensors") as p:
        for offset in range(p.resume_offset, steps):
            slices = []
            for _ in range(mesh.slices):
                x = rng.normal(size=(rows, FEATURES)).astype(np.float32)
                y = x @ w + 0.01 * rng.normal(size=(rows, 1)).astype(np.float32)
                slices.append({"x": x, "y": y, "offset": np.array([offset])})
            p.append(slices, offset=offset)
        p.seal()  # consumers stop after the last step instead of waiting for more


def train(
    store: bw.ObjectStore,
    mesh: bw.Mesh,
    ckpt_dir: Path,
    *,
    every: int,
    stop_after: int | None,
) -> list[int]:
    """Train from the newest checkpoint (if any) until the stream ends or ``stop_after`` steps."""
    rank = os.environ["RANK"]
    torch.manual_seed(0)
    model = torch.nn.Linear(FEATURES, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    consumer = bw.Consumer(store, NAMESPACE, mesh=mesh, timeout=60)  # rank from RANK/WORLD_SIZE
    watermarks = bw.Watermarks(store, NAMESPACE, keep_last=2)
    latest = ckpt_dir / "latest.pt"
    if latest.exists():
        state: dict[str, Any] = torch.load(latest, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        consumer.load_state_dict(state["data"])
        # a crash between the save and its hook left this checkpoint without a watermark
        bw.checkpoint_hook(consumer, watermarks, f"step-{consumer.step}", state=state["data"])
        print(f"rank {rank}: resumed at step {consumer.step}")
    seen: list[int] = []
    loss = torch.tensor(0.0)
    with consumer:
        for step, batch in consumer:
            x, y = torch.from_numpy(batch["x"].copy()), torch.from_numpy(batch["y"].copy())
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen.append(step)
            if (step + 1) % every == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "data": consumer.state_dict(),
                }
                tmp = ckpt_dir / "latest.pt.tmp"
                torch.save(state, tmp)
                tmp.replace(latest)  # durable first ...
                mark = bw.checkpoint_hook(
                    consumer, watermarks, f"step-{step + 1}", state=state["data"]
                )
                if mark is not None:  # ... then the watermark (rank 0 writes it)
                    print(f"rank {rank}: watermark {mark.checkpoint_id!r} keeps step {mark.step}")
            if stop_after is not None and len(seen) >= stop_after:
                break
    print(f"rank {rank}: {len(seen)} steps, last loss {loss.item():.4f}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--dp", type=int, default=2, help="the job's data-parallel degree")
    parser.add_argument("--cp", type=int, default=1, help="the job's context-parallel degree")
    parser.add_argument("--root", type=Path, help="a new directory shared by the ranks")
    args = parser.parse_args()

    mesh = bw.Mesh(dp=args.dp, cp=args.cp)
    # Outside torchrun, this process plays rank 0 of the job's dp x cp ranks.
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", str(mesh.slices))
    coords = bw.coordinates_from_env(mesh)  # what bw.Consumer(..., mesh=mesh) derives too
    print(
        f"rank {coords.rank} of {coords.world_size}: dp_rank={coords.dp_rank}, "
        f"cp_rank={coords.cp_rank} of mesh dp={mesh.dp}, cp={mesh.cp}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = (args.root or Path(tmp)).resolve()
        store = bw.open_store((root / "store").as_uri())
        if coords.rank == 0 and any(store.list(f"{NAMESPACE}/_manifests/")):
            raise SystemExit(
                f"{root} holds a finished run (its namespace is sealed): pass a new --root"
            )
        ckpt_dir = root / "ckpt" / f"rank-{coords.rank}"
        ckpt_dir.mkdir(parents=True)
        producer = None
        if coords.rank == 0:
            producer = threading.Thread(target=publish, args=(store, mesh, args.steps, args.rows))
            producer.start()
        first = train(store, mesh, ckpt_dir, every=args.every, stop_after=args.steps // 2 + 3)
        resumed = train(store, mesh, ckpt_dir, every=args.every, stop_after=None)
        if producer is not None:
            producer.join()
        checkpointed = (len(first) // args.every) * args.every
        assert resumed == list(range(checkpointed, args.steps)), "resume skipped or repeated"
        print(
            f"rank {coords.rank}: resumed at step {checkpointed} (crash after {len(first)}): "
            "no step lost or repeated"
        )
        if coords.rank == 0:
            live = [(m.checkpoint_id, m.step) for m in bw.Watermarks(store, NAMESPACE).live()]
            newest_two = list(range(args.every, args.steps + 1, args.every))[-2:]
            assert live == [(f"step-{s}", s) for s in newest_two], f"watermarks: {live}"
            print(f"live watermarks (keep_last=2): {live}")
            if args.root:
                print(f"inspect it: batchweave inspect {root / 'store'} {NAMESPACE}")


if __name__ == "__main__":
    main()

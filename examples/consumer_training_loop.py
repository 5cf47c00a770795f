"""One training rank's loop: a BatchWeave consumer feeding a (tiny, CPU) torch model.

Each rank reads only its own slice of every step. The rank's coordinates come from
``RANK``/``WORLD_SIZE`` (as set by ``torchrun``) and the mesh degrees; every ``--every`` steps
the loop saves model, optimizer and ``consumer.state_dict()`` with ``torch.save`` and then calls
``batchweave.checkpoint_hook`` so the reclaimer keeps exactly the data a resume needs.

Standalone (``python examples/consumer_training_loop.py``) it also starts a producer thread
that publishes ``--steps`` batches of a linear-regression problem, trains half of the steps,
"restarts" from the last checkpoint into a fresh model and consumer, finishes, and checks that
the resumed run saw exactly the steps after its checkpoint.
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
        p.seal()


def train(
    store: bw.ObjectStore,
    mesh: bw.Mesh,
    ckpt_dir: Path,
    *,
    every: int,
    stop_after: int | None,
) -> list[int]:
    """Train from the newest checkpoint (if any) until the stream ends or ``stop_after`` steps."""
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
        print(f"rank {os.environ.get('RANK', '0')}: resumed at step {consumer.step}")
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
                bw.checkpoint_hook(consumer, watermarks, f"step-{step + 1}", state=state["data"])
            if stop_after is not None and len(seen) >= stop_after:
                break
    print(f"rank {os.environ.get('RANK', '0')}: {len(seen)} steps, last loss {loss.item():.4f}")
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--rows", type=int, default=32)
    args = parser.parse_args()

    mesh = bw.Mesh(dp=2, cp=1)
    os.environ.setdefault("RANK", "1")
    os.environ.setdefault("WORLD_SIZE", "2")
    with tempfile.TemporaryDirectory() as tmp:
        store = bw.open_store(Path(tmp, "store").as_uri())
        ckpt_dir = Path(tmp, "ckpt")
        ckpt_dir.mkdir()
        producer = threading.Thread(target=publish, args=(store, mesh, args.steps, args.rows))
        producer.start()
        first = train(store, mesh, ckpt_dir, every=args.every, stop_after=args.steps // 2 + 3)
        resumed = train(store, mesh, ckpt_dir, every=args.every, stop_after=None)
        producer.join()
        checkpointed = (len(first) // args.every) * args.every
        assert resumed == list(range(checkpointed, args.steps)), "resume skipped or repeated"
        print(
            f"resumed at step {checkpointed} (crash after {len(first)}): no step lost or repeated"
        )


if __name__ == "__main__":
    main()

"""Crash and resume a real (small, CPU) torch training loop without skipping or repeating data.

What happens (about 10-20 s on a laptop CPU):

1. Two producer threads publish ``--steps`` TGBs (``x``/``y`` tensors plus the batch's id) into a
   file-store namespace, held back by ``max_lag`` so storage stays bounded.
2. A reclaimer thread (``grace`` of a few seconds, as a test would use) deletes what no live
   checkpoint needs, while a sampler thread records the namespace's stored bytes.
3. Two training processes read the stream: ``reference`` runs uninterrupted; ``main`` is
   SIGKILLed by this driver after a few checkpoints, then restarted. Each checkpoints every
   ``--every`` steps with ``torch.save`` (model, optimizer and ``consumer.state_dict()``), then
   calls ``batchweave.checkpoint_hook``; it keeps its two newest checkpoints and releases the
   watermark of every checkpoint it deletes. The reclamation boundary (the oldest live watermark)
   therefore trails a trainer's next checkpoint by two intervals, so ``--max-lag`` must be at
   least ``2 x --every - 1`` or the producers stop before any trainer can checkpoint again; the
   example asks for ``2 x --every``, leaving a step of margin.
4. The driver checks that ``main`` resumed at its last checkpoint's step, that every step saw the
   same batch in both runs, that the final weights are bitwise identical, and prints the peak
   stored bytes next to the bytes that were produced. Exit status 0 means all checks passed.

Run it::

    python examples/train_resume.py [--steps 120] [--every 10] [--max-lag 30] [--kill-after 45]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

import batchweave as bw

NAMESPACE = "runs/train-resume"
MESH = bw.Mesh(dp=1, cp=1)
PRODUCERS = 2
BATCH, FEATURES, CLASSES = 256, 16, 4
KEEP_LAST = 2
"""Checkpoints (and watermarks) each trainer keeps: max_lag must be at least this x --every."""


# -- producers -------------------------------------------------------------------------------


def make_batch(producer: int, offset: int) -> dict[str, np.ndarray]:
    """The deterministic batch a producer derives from its source offset."""
    rng = np.random.default_rng([producer, offset])
    x = rng.standard_normal((BATCH, FEATURES), dtype=np.float32)
    y = (x[:, :CLASSES].argmax(axis=1)).astype(np.int64)
    return {"x": x, "y": y, "id": np.array([producer, offset], dtype=np.int64)}


def produce(store: bw.ObjectStore, producer: int, count: int, max_lag: int) -> None:
    with bw.Producer(
        store,
        NAMESPACE,
        producer_id=f"prep-{producer}",
        mesh=MESH,
        codec="tensors",
        policy="naive",
        max_lag=max_lag,
    ) as p:
        for offset in range(p.resume_offset, count):
            p.append([make_batch(producer, offset)], offset=offset)
        p.flush()


# -- trainer (a child process) ---------------------------------------------------------------


def train(root: str, run: str, every: int, pause_after: int | None) -> None:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    store = bw.FileStore(root)
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(), torch.nn.Linear(32, CLASSES)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    consumer = bw.Consumer(
        store,
        NAMESPACE,
        mesh=MESH,
        dp_rank=0,
        poll_interval=0.01,
        max_poll_interval=0.1,
        timeout=120,
    )
    marks = bw.Watermarks(store, NAMESPACE)
    ckpt_dir = Path(root).parent / f"ckpt-{run}"
    ckpt_dir.mkdir(exist_ok=True)
    saved = sorted(ckpt_dir.glob("step-*.pt"))
    if saved:
        state = torch.load(saved[-1], weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        consumer.load_state_dict(state["data"])
        # a kill between the save and its hook left no watermark for this checkpoint: record it
        bw.checkpoint_hook(consumer, marks, f"{run}-{saved[-1].stem.removeprefix('step-')}", rank=0)
        print(f"[{run}] resumed from {saved[-1].name} at step {consumer.step}", flush=True)
    log = (Path(root).parent / f"{run}.log").open("a")
    for step, batch in consumer:
        x, y = (
            torch.tensor(batch["x"]),
            torch.tensor(batch["y"]),
        )  # copies: decoded arrays are read-only
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        log.write(f"{step} {batch['id'][0]}:{batch['id'][1]}\n")
        log.flush()
        if (step + 1) % every == 0:
            path = ckpt_dir / f"step-{step + 1:06d}.pt"
            state = {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "data": consumer.state_dict(),
            }
            torch.save(state, path.with_suffix(".tmp"))
            os.replace(path.with_suffix(".tmp"), path)  # durable and complete: now the hook
            bw.checkpoint_hook(consumer, marks, f"{run}-{step + 1:06d}", rank=0)
            marks.release(f"{run}-000000")  # the job's start: no longer needed
            for old in sorted(ckpt_dir.glob("step-*.pt"))[:-KEEP_LAST]:  # keep the newest two
                old.unlink()
                marks.release(f"{run}-{old.stem.removeprefix('step-')}")
        if pause_after is not None and step >= pause_after:
            print(f"[{run}] hanging after step {step} until killed", flush=True)
            threading.Event().wait()  # the driver SIGKILLs this process now
    torch.save(model.state_dict(), Path(root).parent / f"{run}-final.pt")
    consumer.close()
    print(f"[{run}] finished", flush=True)


# -- driver ----------------------------------------------------------------------------------


def namespace_bytes(store: bw.ObjectStore, under: str = "") -> int:
    return sum(meta.size for meta in store.list(f"{NAMESPACE}/{under}"))


def spawn(root: str, run: str, args: argparse.Namespace, *, pause: bool) -> subprocess.Popen[str]:
    cmd = [sys.executable, __file__, "--child", run, "--root", root, "--every", str(args.every)]
    if pause:
        cmd += ["--pause-after", str(args.kill_after)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)


def read_log(path: Path) -> list[tuple[int, str]]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [(int(s), batch) for s, batch in (line.split() for line in lines)]


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout: float) -> str:
    """Read ``proc``'s output until a line containing ``needle`` (or fail after ``timeout``)."""
    assert proc.stdout is not None
    found: list[str] = []
    done = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            print(line, end="")
            if needle in line and not found:
                found.append(line)
                done.set()
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    if not done.wait(timeout) or not found:
        proc.kill()
        raise SystemExit(f"timed out waiting for {needle!r}")
    return found[0]


def drive(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bw-train-resume-") as tmp:
        return drive_in(Path(tmp), args)


def drive_in(work: Path, args: argparse.Namespace) -> int:
    import torch

    root = str(work / "store")
    store = bw.FileStore(root)
    per_producer = args.steps // PRODUCERS
    marks = bw.Watermarks(store, NAMESPACE)
    for run in ("reference", "main"):
        # A job protects its starting step before anything is reclaimed ("checkpoint 0").
        marks.record(f"{run}-000000", 0)
    producers = [
        threading.Thread(target=produce, args=(store, i, per_producer, args.max_lag))
        for i in range(PRODUCERS)
    ]
    for t in producers:
        t.start()

    stop = threading.Event()
    samples: list[tuple[int, int]] = []

    def sample() -> None:
        while not stop.wait(0.02):
            try:
                samples.append((namespace_bytes(store), namespace_bytes(store, "data/")))
            except bw.StoreError:
                continue  # an object vanished mid-LIST: take the next sample

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    reclaimer = bw.Reclaimer(store, NAMESPACE, grace=args.grace)
    reclaimer.start(0.1)

    reference = spawn(root, "reference", args, pause=False)
    main = spawn(root, "main", args, pause=True)
    wait_for_line(main, "hanging after step", timeout=120)
    main.send_signal(signal.SIGKILL)
    main.wait()
    print(f"[driver] SIGKILLed main after step {read_log(work / 'main.log')[-1][0]}")
    before_kill = read_log(work / "main.log")

    main = spawn(root, "main", args, pause=False)
    resumed = wait_for_line(main, "resumed from", timeout=120)
    for t in producers:
        t.join()
    with bw.Producer(store, NAMESPACE, producer_id="sealer", mesh=MESH) as sealer:
        sealer.seal()
    for proc in (main, reference):
        if proc.wait(timeout=300) != 0:
            raise SystemExit(f"a trainer failed with exit status {proc.returncode}")
    stop.set()
    sampler.join()
    reclaimer.stop()
    reclaimer.run_once()

    # -- checks ------------------------------------------------------------------------------
    resume_step = int(resumed.rsplit(" ", 1)[1])
    ckpt_steps = [s + 1 for s, _ in before_kill if (s + 1) % args.every == 0]
    ref_log = dict(read_log(work / "reference.log"))
    main_log = read_log(work / "main.log")
    after = main_log[len(before_kill) :]
    failures: list[str] = []
    if resume_step != ckpt_steps[-1]:
        failures.append(f"resumed at {resume_step}, last checkpoint was {ckpt_steps[-1]}")
    if [s for s, _ in after] != list(range(resume_step, len(ref_log))):
        failures.append("the resumed run skipped or repeated steps")
    if sorted(ref_log) != list(range(args.steps)):
        failures.append("the reference run did not see every step exactly once")
    mismatched = [s for s, batch in main_log if ref_log.get(s) != batch]
    if mismatched:
        failures.append(f"steps with other batches than the uninterrupted run: {mismatched[:5]}")
    final_main = torch.load(work / "main-final.pt")
    final_ref = torch.load(work / "reference-final.pt")
    if not all(torch.equal(final_main[k], final_ref[k]) for k in final_ref):
        failures.append("final weights differ from the uninterrupted run")
    tgb_bytes = len(bw.encode_tgb([make_batch(0, 0)], MESH, codec="tensors").data)
    produced = tgb_bytes * args.steps
    peak = max(total for total, _ in samples)
    peak_data = max(data for _, data in samples)
    # Producers see a new watermark at once, the reclaimer deletes on its next pass: the window
    # is about one checkpoint interval plus max_lag (plus prefetch and in-flight uploads).
    bound = (args.every + args.max_lag + 4) * tgb_bytes  # 4: the consumers' default prefetch
    if peak_data > 2 * bound:
        failures.append(f"peak TGB bytes {peak_data} are not bounded by ~{bound}")
    summary = {
        "steps": args.steps,
        "killed_after_step": before_kill[-1][0],
        "resumed_at_step": resume_step,
        "replayed_steps": before_kill[-1][0] + 1 - resume_step,
        "tgb_bytes": tgb_bytes,
        "produced_tgb_bytes": produced,
        "peak_stored_tgb_bytes": peak_data,
        "bound_tgb_bytes": bound,
        "peak_stored_bytes_all_objects": peak,
        "final_stored_bytes": namespace_bytes(store),
        "checks_failed": failures,
    }
    print(json.dumps(summary, indent=2))
    if failures:
        return 1
    print(
        f"OK: main resumed at step {resume_step} and saw exactly the reference's batches; "
        f"peak TGB storage {peak_data / 1024:.0f} KiB for {produced / 1024:.0f} KiB of TGBs "
        f"produced (estimate {bound / 1024:.0f} KiB: --every + --max-lag + prefetch TGBs, "
        "plus what one commit interval of each producer overshoots; checked against 2x)"
    )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--max-lag", type=int, default=30)
    parser.add_argument("--kill-after", type=int, default=45)
    parser.add_argument("--grace", type=float, default=3.0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--root", help=argparse.SUPPRESS)
    parser.add_argument("--pause-after", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        train(args.root, args.child, args.every, args.pause_after)
        return 0
    if args.steps % PRODUCERS or args.kill_after < args.every:
        parser.error(f"--steps must be a multiple of {PRODUCERS}, --kill-after >= --every")
    if args.every < 1:
        parser.error("--every must be at least 1")
    if args.max_lag < KEEP_LAST * args.every:
        # The boundary is the oldest of the KEEP_LAST watermarks a trainer keeps; it moves only
        # once the trainer checkpoints again, KEEP_LAST x --every steps past it, and producers
        # publish at most --max-lag steps past it: below that, both trainers wait for ever.
        parser.error(
            f"--max-lag {args.max_lag} must be at least {KEEP_LAST} x --every "
            f"({KEEP_LAST * args.every}): each trainer keeps its {KEEP_LAST} newest "
            "checkpoints, so producers held --max-lag steps past the oldest one stop before "
            "the trainer reaches its next checkpoint below keep_last x checkpoint interval - 1 "
            "(this example asks for a step of margin); raise --max-lag or lower --every"
        )
    return drive(args)


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint-driven lifecycle: stored bytes over a run, with and without deletion (Figure 9).

A producer thread publishes TGBs of a fixed size under ``max_lag``; the training loop consumes one
TGB per step, checkpoints every ``--every`` steps (``checkpoint_hook``, the newest checkpoint kept)
and, in the run with deletion, runs one reclaimer pass right after each checkpoint. The bytes of
every object under the namespace (TGBs, manifests, segments, watermarks) are sampled after every
step. Time is simulated (one second per step) so manifest-version grace periods are reproducible.

Target: with deletion, peak stored bytes <= 1.1 x (interval + max_lag + prefetch) x TGB size, and
at least the paper's 72% reduction of the peak against the run without deletion.

    python bench/lifecycle.py            # 1,000 steps, PNG in docs/, JSON in bench/results/
    python bench/lifecycle.py --smoke    # a tiny run (CI)
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_REPO / "bench"))

from _report import Report, parser  # noqa: E402

import batchweave as bw  # noqa: E402

NAMESPACE = "bench/lifecycle"
MESH = bw.Mesh(dp=2, cp=1)
PREFETCH = 4
PLOT = _REPO / "docs" / "lifecycle_storage.png"


class SimClock:
    """Simulated wall clock: the training loop advances it by one second per step."""

    def __init__(self) -> None:
        self.now = 1_700_000_000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


@dataclass
class Run:
    deletion: bool
    samples: list[int]
    data_samples: list[int]
    tgb_bytes: int
    reclaimed_bytes: int
    seconds: float


def payload_for(offset: int, size: int) -> bytes:
    return offset.to_bytes(8, "little") * (size // 8)


def stored(store: bw.ObjectStore, under: str = "") -> int:
    return sum(meta.size for meta in store.list(f"{NAMESPACE}/{under}"))


def run(steps: int, every: int, max_lag: int, tgb_bytes: int, *, deletion: bool) -> Run:
    clock = SimClock()
    store = bw.MemoryStore(f"bench-lifecycle-{deletion}", clock=clock)
    slice_bytes = tgb_bytes // MESH.slices
    marks = bw.Watermarks(store, NAMESPACE, keep_last=1, clock=clock)
    marks.record("start", 0, version=0)  # the job protects its first step before it starts
    reclaimer = bw.Reclaimer(store, NAMESPACE, grace=3 * every, clock=clock)
    failure: list[BaseException] = []

    def produce() -> None:
        try:
            with bw.Producer(
                store,
                NAMESPACE,
                producer_id="prep-0",
                mesh=MESH,
                policy="naive",
                max_lag=max_lag,
                backoff=lambda _: 0.002,
            ) as producer:
                for offset in range(steps):
                    payload = payload_for(offset, slice_bytes)
                    producer.append([payload] * MESH.slices, offset=offset)
                producer.seal()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=produce, name="bench-producer")
    started = time.perf_counter()
    thread.start()
    samples: list[int] = []
    data_samples: list[int] = []
    reclaimed = 0
    consumer = bw.Consumer(
        store,
        NAMESPACE,
        mesh=MESH,
        dp_rank=0,
        prefetch=PREFETCH,
        poll_interval=0.001,
        max_poll_interval=0.01,
        timeout=120,
    )
    with consumer:
        for step, _ in consumer:
            clock.advance(1.0)
            if (step + 1) % every == 0:
                bw.checkpoint_hook(consumer, marks, f"ckpt-{step + 1:06d}", rank=0)
                if deletion:
                    reclaimed += reclaimer.run_once().bytes_deleted
            samples.append(stored(store))
            data_samples.append(stored(store, "data/"))
    thread.join()
    if failure:
        raise failure[0]
    tgb_size = len(bw.encode_tgb([payload_for(0, slice_bytes)] * MESH.slices, MESH).data)
    return Run(deletion, samples, data_samples, tgb_size, reclaimed, time.perf_counter() - started)


def plot(runs: list[Run], bound: int, every: int, max_lag: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6), dpi=120)
    mib = 1 << 20
    for r in runs:
        label = "with deletion" if r.deletion else "without deletion"
        ax.plot([b / mib for b in r.samples], label=label)
    ax.axhline(bound / mib, color="grey", linestyle="--", linewidth=1, label="1.1 x bound")
    ax.set_xlabel("training step")
    ax.set_ylabel("stored bytes (MiB)")
    ax.set_title(f"Checkpoint every {every} steps, max_lag {max_lag}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(PLOT)
    plt.close(fig)


def main() -> int:
    p = parser(__doc__.split("\n", 1)[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=None)
    args = p.parse_args()
    steps = args.steps or (120 if args.smoke else 1000)
    every, max_lag = 10, (20 if args.smoke else 80)
    tgb_bytes = (16 if args.smoke else 128) << 10
    runs = [run(steps, every, max_lag, tgb_bytes, deletion=d) for d in (False, True)]
    without, with_ = runs
    tgb = with_.tgb_bytes
    bound = int(1.1 * (every + max_lag + PREFETCH) * tgb)
    reduction = 1 - max(with_.samples) / max(without.samples)
    report = Report(
        name="lifecycle" + ("-smoke" if args.smoke else ""),
        columns=[
            "deletion",
            "steps",
            "peak_bytes",
            "peak_tgb_bytes",
            "final_bytes",
            "peak_in_tgbs",
            "reclaimed_bytes",
            "seconds",
        ],
    )
    for r in runs:
        report.add(
            deletion=r.deletion,
            steps=steps,
            peak_bytes=max(r.samples),
            peak_tgb_bytes=max(r.data_samples),
            final_bytes=r.samples[-1],
            peak_in_tgbs=max(r.samples) / tgb,
            reclaimed_bytes=r.reclaimed_bytes,
            seconds=r.seconds,
        )
    ok_bound = max(with_.samples) <= bound
    ok_reduction = reduction >= 0.72
    report.notes += [
        f"TGB size {tgb} bytes, checkpoint every {every} steps, max_lag {max_lag}, "
        f"prefetch {PREFETCH}; peaks count every object under the namespace",
        f"bound 1.1 x ({every} + {max_lag} + {PREFETCH}) x TGB = {bound} bytes: "
        f"{'met' if ok_bound else 'MISSED'} (peak {max(with_.samples)})",
        f"peak reduction vs no deletion: {reduction:.1%} (target >= 72%): "
        f"{'met' if ok_reduction else 'MISSED'}",
        "samples (bytes after each step) are in the JSON rows' companion field 'series'",
    ]
    report.rows[0]["series"] = without.samples
    report.rows[1]["series"] = with_.samples
    report.columns = [c for c in report.columns if c != "series"]
    if not args.smoke:
        plot(runs, bound, every, max_lag)
        report.notes.append(f"plot: {PLOT.relative_to(_REPO)}")
    report.emit(args.out)
    return 0 if ok_bound and ok_reduction else 1


if __name__ == "__main__":
    sys.exit(main())

"""A deterministic discrete-event simulation of producers contending for manifest versions.

No real time passes: a virtual clock jumps from event to event, so a five-minute run of sixteen
producers takes a fraction of a second and every figure is reproducible from its seed. It is the
test bed for commit policies (``tests/test_policy_sim.py``) and the source of the tables in
``docs/dac.md`` (``python -m batchweave._dac_sim``).

The model:

- each producer materializes TGBs as a Poisson process of rate ``tgb_rate``; an arrived TGB is
  *pending* (uploaded, not yet committed);
- the producer's commit loop asks its :class:`~batchweave._policy.CommitPolicy` whether to
  attempt, at each new TGB and when the time since its last attempt reaches ``policy.gap`` (the
  random-phase loop: producers have no rank, so DAC's slots are not simulated) and tells it the
  true producer count as ``active_producers``;
- an attempt reads the latest manifest version at its start and ends after a fragile window drawn
  uniformly from ``window * (1 +- window_spread)`` (plus ``window_growth`` per committed version,
  to mimic manifests whose commit cost grows); it commits the TGBs pending at its start, and
  conflicts if any other producer committed in between (the conditional PUT of version ``v+1``
  found the name taken);
- with ``blocking=True`` a producer makes no TGBs while inside an attempt (the paper's single
  loop, where manifest I/O time is production time lost); by default it keeps producing, like
  :class:`batchweave.Producer`, whose uploads run beside the commit loop.

It ignores store-side effects: attempts never slow each other down and never fail for reasons
other than a lost race.
"""

from __future__ import annotations

import heapq
import inspect
import itertools
import math
import random
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from batchweave._policy import AttemptOutcome, CommitPolicy, policy_class, policy_names
from batchweave._stats import nearest_rank

__all__ = [
    "PolicyFactory",
    "SimResult",
    "format_table",
    "policy_factory",
    "simulate",
    "sweep",
]

PolicyFactory = Callable[[random.Random], CommitPolicy]
"""Builds one producer's policy from that producer's own seeded random source."""


def policy_factory(name: str, **options: Any) -> PolicyFactory:
    """A factory for the policy registered as ``name``, passing each producer's ``rng`` to
    policies that take one (so DAC's jitter differs per producer yet stays reproducible).

    ``options`` go to the policy's constructor; one policy is built here, so a bad option is
    refused now (``ValueError``, as :func:`~batchweave._policy.make_policy` does) rather than by
    :func:`simulate`. ``rng`` and ``seed`` are refused: the simulation draws each producer's
    ``rng`` from its own ``seed``.
    """
    cls: Callable[..., CommitPolicy] = policy_class(name)
    reserved = sorted({"rng", "seed"} & options.keys())
    if reserved:
        raise ValueError(
            f"policy options {reserved} are not allowed here: the simulation gives each "
            f"producer's policy its own rng, drawn from simulate(seed=...)"
        )
    takes_rng = "rng" in inspect.signature(cls).parameters

    def build(rng: random.Random) -> CommitPolicy:
        return cls(rng=rng, **options) if takes_rng else cls(**options)

    try:
        build(random.Random(0))
    except TypeError as exc:
        raise ValueError(
            f"bad options {sorted(options)} for commit policy {name!r}: {exc}"
        ) from exc
    return build


@dataclass(frozen=True)
class SimResult:
    """Counts over the measured span ``[warmup, warmup + duration]`` of one simulation."""

    policy: str
    producers: int
    duration: float
    """Measured virtual seconds (after the warmup)."""
    attempts: int
    """Attempts that ended in the measured span."""
    commits: int
    conflicts: int
    tgbs_produced: int
    tgbs_committed: int
    window_time: float
    """Producer-seconds spent inside fragile windows of the counted attempts."""
    latency_p50: float
    """Median seconds from a TGB's arrival to its commit (over TGBs committed in the span)."""
    latency_p95: float
    mean_gap: float
    """Mean ``policy.gap`` after the counted attempts (0 for count-based policies)."""

    @property
    def conflict_rate(self) -> float:
        """Conflicts per attempt."""
        return self.conflicts / self.attempts if self.attempts else 0.0

    @property
    def success_rate(self) -> float:
        """Commits per attempt."""
        return self.commits / self.attempts if self.attempts else 0.0

    @property
    def commits_per_second(self) -> float:
        """Successful commits per second, all producers together."""
        return self.commits / self.duration

    @property
    def attempts_per_second(self) -> float:
        """Conditional PUTs per second, all producers together (load on the store)."""
        return self.attempts / self.duration

    @property
    def tgbs_per_second(self) -> float:
        """TGBs made visible per second, all producers together."""
        return self.tgbs_committed / self.duration

    @property
    def duty(self) -> float:
        """Fraction of producer time spent inside fragile windows."""
        return self.window_time / (self.producers * self.duration)

    def as_dict(self) -> dict[str, Any]:
        """Fields and derived rates, for JSON reports."""
        out = asdict(self)
        for name in (
            "conflict_rate",
            "success_rate",
            "commits_per_second",
            "attempts_per_second",
            "tgbs_per_second",
            "duty",
        ):
            out[name] = getattr(self, name)
        return out


@dataclass
class _Producer:
    policy: CommitPolicy
    pending: list[float] = field(default_factory=list)
    """Arrival times of pending TGBs, oldest first."""
    attempting: bool = False
    attempt_start: float = 0.0
    attempt_tgbs: int = 0
    base_version: int = 0
    last_end: float | None = None
    arrival_token: int = 0
    wake_token: int = 0
    wake_at: float = -1.0


_ARRIVAL, _WAKE, _END = 0, 1, 2


def simulate(
    policy: str | PolicyFactory,
    producers: int,
    window: float,
    duration: float,
    seed: int,
    *,
    tgb_rate: float = 20.0,
    window_spread: float = 0.5,
    window_growth: float = 0.0,
    warmup: float = 0.0,
    blocking: bool = False,
) -> SimResult:
    """Run ``producers`` commit loops against one shared manifest for ``warmup + duration``
    virtual seconds and count what happened after the warmup.

    ``policy`` is a registered name (built with defaults via :func:`policy_factory`) or a
    factory. ``window`` is the mean fragile window in seconds; ``tgb_rate`` TGBs per second per
    producer. The same arguments always give the same result.
    """
    if producers < 1:
        raise ValueError(f"producers must be >= 1, got {producers!r}")
    if not (window > 0 and math.isfinite(window)):
        raise ValueError(f"window must be a finite number of seconds > 0, got {window!r}")
    if not 0 <= window_spread < 1:
        raise ValueError(f"window_spread must be in [0, 1), got {window_spread!r}")
    if not (window_growth >= 0 and math.isfinite(window_growth)):
        raise ValueError(f"window_growth must be a finite number >= 0, got {window_growth!r}")
    # Finite: an endless run or an infinite TGB rate (arrivals 0 s apart) would never return.
    if not all(math.isfinite(x) for x in (duration, warmup, tgb_rate)) or not (
        duration > 0 and warmup >= 0 and tgb_rate > 0
    ):
        raise ValueError(
            f"duration and tgb_rate must be finite numbers > 0 and warmup a finite number >= 0, "
            f"got duration={duration!r}, tgb_rate={tgb_rate!r}, warmup={warmup!r}"
        )
    factory = policy_factory(policy) if isinstance(policy, str) else policy
    rng = random.Random(seed)
    states = [_Producer(factory(random.Random(rng.getrandbits(64)))) for _ in range(producers)]
    policy_name = states[0].policy.name
    end_time = warmup + duration

    heap: list[tuple[float, int, int, int, int, float]] = []
    order = itertools.count()

    def push(t: float, kind: int, i: int, token: int = 0, since: float = 0.0) -> None:
        heapq.heappush(heap, (t, next(order), kind, i, token, since))

    version = 0
    attempts = commits = produced = committed_tgbs = 0
    window_time = gap_sum = 0.0
    latencies: list[float] = []

    def maybe_start(i: int, now: float, since_floor: float) -> None:
        p = states[i]
        if p.attempting or not p.pending:
            return
        since = math.inf if p.last_end is None else max(now - p.last_end, since_floor)
        if p.policy.ready(len(p.pending), since):
            p.attempting = True
            p.attempt_start = now
            p.attempt_tgbs = len(p.pending)
            p.base_version = version
            p.wake_token += 1  # any scheduled wake-up belongs to the previous gap
            p.wake_at = -1.0
            mean = window + window_growth * version
            w = mean * (1 + rng.uniform(-window_spread, window_spread))
            push(now + w, _END, i)
            if blocking:
                p.arrival_token += 1
            return
        gap = p.policy.gap
        if p.last_end is not None and gap > since:
            wake_at = p.last_end + gap
            if wake_at != p.wake_at:
                p.wake_at = wake_at
                p.wake_token += 1
                push(wake_at, _WAKE, i, p.wake_token, gap)

    for i in range(producers):
        push(rng.expovariate(tgb_rate), _ARRIVAL, i, 0)

    while heap:
        now, _, kind, i, token, since = heapq.heappop(heap)
        if now > end_time:
            break
        p = states[i]
        measured = now >= warmup
        if kind == _ARRIVAL:
            if token != p.arrival_token:
                continue
            p.pending.append(now)
            produced += measured
            push(now + rng.expovariate(tgb_rate), _ARRIVAL, i, token)
            maybe_start(i, now, 0.0)
        elif kind == _WAKE:
            if token == p.wake_token:
                maybe_start(i, now, since)
        else:
            won = version == p.base_version
            w = now - p.attempt_start
            n = p.attempt_tgbs
            if won:
                version += 1
                if measured:
                    latencies.extend(now - t for t in p.pending[:n])
                del p.pending[:n]
            p.policy.record(AttemptOutcome(won, w, producers, n))
            if measured:
                attempts += 1
                commits += won
                committed_tgbs += n if won else 0
                window_time += w
                gap_sum += p.policy.gap
            p.attempting = False
            p.last_end = now
            if blocking:
                push(now + rng.expovariate(tgb_rate), _ARRIVAL, i, p.arrival_token)
            maybe_start(i, now, 0.0)

    latencies.sort()
    return SimResult(
        policy=policy_name,
        producers=producers,
        duration=duration,
        attempts=attempts,
        commits=commits,
        conflicts=attempts - commits,
        tgbs_produced=produced,
        tgbs_committed=committed_tgbs,
        window_time=window_time,
        latency_p50=nearest_rank(latencies, 0.5),
        latency_p95=nearest_rank(latencies, 0.95),
        mean_gap=gap_sum / attempts if attempts else 0.0,
    )


def sweep(
    policies: Iterable[str],
    producer_counts: Iterable[int],
    *,
    window: float,
    duration: float,
    seed: int,
    **options: Any,
) -> list[SimResult]:
    """:func:`simulate` every policy at every producer count with the same seed and options."""
    counts = list(producer_counts)
    return [
        simulate(name, n, window, duration, seed, **options) for name in policies for n in counts
    ]


def format_table(results: Iterable[SimResult]) -> str:
    """A markdown table of simulation results, one row per run."""
    lines = [
        "| policy | N | attempts/s | commits/s | conflict rate | TGBs/s | duty | "
        "latency p50 (s) | latency p95 (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.policy} | {r.producers} | {r.attempts_per_second:.2f} | "
            f"{r.commits_per_second:.2f} | {r.conflict_rate:.3f} | {r.tgbs_per_second:.1f} | "
            f"{r.duty:.3f} | {r.latency_p50:.2f} | {r.latency_p95:.2f} |"
        )
    return "\n".join(lines)


def _main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description="Simulate commit policies under contention.")
    parser.add_argument("--producers", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--policies", nargs="+", default=policy_names())
    parser.add_argument("--window", type=float, default=0.05, help="mean fragile window (s)")
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--tgb-rate", type=float, default=20.0)
    parser.add_argument("--window-growth", type=float, default=0.0)
    parser.add_argument("--blocking", action="store_true")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    results = sweep(
        args.policies,
        args.producers,
        window=args.window,
        duration=args.duration,
        seed=args.seed,
        warmup=args.warmup,
        tgb_rate=args.tgb_rate,
        window_growth=args.window_growth,
        blocking=args.blocking,
    )
    print(format_table(results))


if __name__ == "__main__":
    _main()

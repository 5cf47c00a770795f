"""Producer ingestion benchmark: commit policies x producers x payload sizes x storages.

Every producer is a separate process (a persistent pool, so interpreter start-up is never
timed). A run publishes a fixed number of TGBs split evenly over its producers, each with the
real :class:`batchweave.Producer` (encode, upload threads, commit loop paced by the policy) and
ends when every producer's ``close()`` returned, i.e. when everything is committed. In the same
run and with the same client, each (storage, producers, payload) point also measures raw PUT
throughput: the same encoded objects put by the same number of processes and threads, with no
manifest at all. Reported per run:

- ``MB/s``: encoded TGB bytes committed per second over the whole run (all producers), up to
  the moment every TGB is visible; ``ingest MB/s``: the same bytes over the time until every
  upload finished (before ``close()`` drains the last commits); ``vs_raw``: ``MB/s`` over the
  raw PUT throughput of the same point;
- ``success``: committed attempts / commit attempts (epoch commits at start-up excluded), and
  the same without each producer's first attempt (all producers start together, so the first
  attempts collide whatever the policy);
- ``commit p50/p95``: duration of a commit attempt (read the base, write segments if the tail
  rolls, conditional PUT), the DAC "fragile window";
- ``visible p50/p95``: time from ``append()`` to the TGB being visible in a committed manifest;
- ``mf KB/commit``: manifest and segment bytes sent per committed version, over the first and the
  last tenth of the run's commits ("without segmented manifests" = an inline tail that never
  rolls into segments, so it grows with history); ``window KB/commit`` the same counting only
  the bytes a producer sent inside its own fragile windows (segment merges written between
  commits are not in it);
- ``drain ms``: from the end of the last upload to the last ``close()`` returning (the final
  commits); ``first/steady/close won/att``: won and total attempts by phase: *close* attempts
  were started by ``flush()``/``close()`` or after that producer's last upload, *first* is a
  producer's first attempt otherwise, *steady* the rest. A 2,000-TGB run of 16 producers is
  mostly start-up and close; ``--tgbs N`` runs each matrix point with ``N`` TGBs instead, long
  enough for a steady state. The JSON rows also hold ``close attempts``, the final drain's
  timeline: ``(producer, start ms, end ms, won)`` of each close attempt from the last upload's end,
  and ``close slots``, what sized each closer's grid: ``(producer, period s, slot window ms, put
  floor ms, start-up window ms)``.

``--long-run`` publishes 20,000 TGBs (segmented, DAC) and compares throughput over the last
tenth of the TGBs with the first tenth: as ingestion of each producer against itself (its
appends, which block while its upload queue is full; its first tenth starts once the queue has
filled), as ingestion of all producers together (whose last tenth counts only the producers not
yet finished, while the others drain their final commits), and as visibility (TGBs committed per
second; the last tenth includes the final drain of ``close()``). The same run measures raw PUTs
of 20,000 TGBs, whose own last/first shows how much the store itself slows as it fills.

``--rounds N`` (3 recommended for runs that judge the targets; default 1) measures each
(storage, producers, payload, segmented) group ``N`` times: each round runs the raw PUTs and
every policy, in an order rotated by one more each round, so that load drifting over minutes on
this shared machine does not favour whichever policy runs first. Each row is that policy's
median round by ``MB/s`` (its ``raw MB/s`` the raw PUTs' median round); the JSON rows also hold
``round figures`` (``MB/s``, ``success``, ``attempts`` and ``drain ms`` of every round, in round
order) and ``raw MB/s by round``. The long run runs once.

    python bench/producers.py                 # the default subset (about 15-20 min, 2 cores)
    python bench/producers.py --rounds 3      # the same, three rotated rounds (three times as long)
    python bench/producers.py --full          # the whole matrix of issue #3 (hours)
    python bench/producers.py --long-run --only-long-run
    python bench/producers.py --storages file --producers 16 --policies dac,fixed100 --tgbs 10000
    python bench/producers.py --smoke         # seconds, for CI
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, ClassVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import Report, median_round, parser, percentile, rotated
from _servers import STORAGES, StoreSpec, add_file_root_option, storages
from _workers import Task, TimedStore, WorkerPool

from batchweave import AttemptOutcome, CommitPolicy, Mesh, Producer, encode_tgb
from batchweave._manifest._log import DEFAULT_TAIL_BYTES_LIMIT, DEFAULT_TAIL_LIMIT
from batchweave._policy import PolicyWrapper, make_policy, policy_names

PAYLOADS = {"100KB": 100_000, "1MB": 1_000_000, "10MB": 10_000_000}
MESH = Mesh(dp=4)
"""Each TGB holds four slices of payload/4 bytes (the payload size is the TGB size)."""
UNSEGMENTED = 1 << 40
"""A ``tail_limit`` no run reaches: the inline tail never rolls into segments."""
UPLOAD_THREADS = 4
MIB = 1 << 20

POINT_COLUMNS = ["storage", "producers", "payload", "policy", "segmented", "tgbs", "MB/s"]
"""What both tables start with: the point measured and its throughput."""
COLUMNS = [
    *POINT_COLUMNS,
    "ingest MB/s",
    "raw MB/s",
    "vs_raw",
    "success",
    "success after 1st",
    "attempts",
    "commit p50 ms",
    "commit p95 ms",
    "visible p50 ms",
    "visible p95 ms",
    "mf KB/commit first",
    "mf KB/commit last",
    "drain ms",
    "first won/att",
    "steady won/att",
    "close won/att",
    "rounds",
]
LONG_COLUMNS = [
    *POINT_COLUMNS,
    "ingest first TGB/s",
    "ingest last TGB/s",
    "ingest last/first",
    "raw last/first",
    "producer ingest last/first",
    "first tenth TGB/s",
    "last tenth TGB/s",
    "last/first",
    "success",
    "commit p50 ms",
    "commit p95 ms",
    "mf KB/commit first",
    "mf KB/commit last",
    "window KB/commit first",
    "window KB/commit last",
]
RAW = "raw PUT"
"""The raw-PUT baseline's entry in a group's rotation (no policy has this name)."""
ROUND_FIGURES = ("MB/s", "success", "attempts", "drain ms")
"""What a row's ``round figures`` keep of each of its policy's rounds."""


class RecordingPolicy(PolicyWrapper):
    """Delegates to ``inner`` and logs every attempt: ``(end time, committed, window, tgbs)``.

    ``forced`` says, per logged attempt, whether ``flush()``/``close()`` started it.
    """

    name: ClassVar[str] = "recording"

    def __init__(self, inner: CommitPolicy) -> None:
        super().__init__(inner)
        self.log: list[tuple[float, bool, float, int]] = []
        self.forced: list[bool] = []
        self.slot_periods: list[float] = []
        """DAC's ``flush()``/``close()`` slot period when the attempt ended (0 for others)."""
        self.slot_windows: list[tuple[float, float]] = []
        """DAC's ``(slot_window, put_floor)`` when the attempt ended: what sized the period."""

    def record(self, outcome: AttemptOutcome) -> None:
        self.log.append((time.monotonic(), outcome.committed, outcome.fragile_window, outcome.tgbs))
        self.forced.append(outcome.forced)
        self.slot_periods.append(float(getattr(self.inner, "slot_period", 0.0)))
        self.slot_windows.append(
            (
                float(getattr(self.inner, "slot_window", 0.0)),
                float(getattr(self.inner, "put_floor", 0.0)),
            )
        )
        self.inner.record(outcome)


def _slices(payload: int) -> list[bytes]:
    blob = os.urandom(payload)
    step = payload // MESH.slices
    return [blob[i * step : (i + 1) * step] for i in range(MESH.slices)]


def _is_manifest_write(op: str, key: str) -> bool:
    """A manifest or segment write (segment reads, made by merges, are not bytes sent)."""
    if op == "cput" and "/_manifests/" in key:
        return True
    return op in ("put", "cput") and "/_segments/" in key


def _is_data_put(op: str, key: str) -> bool:
    return op == "put" and key.endswith(".tgb")


def _is_timed(op: str, key: str) -> bool:
    return _is_manifest_write(op, key) or _is_data_put(op, key)


def produce_task(params: dict[str, Any], ready: Callable[[], None]) -> dict[str, Any]:
    """One producer process: publish ``tgbs`` TGBs with the real Producer, then close."""
    spec: StoreSpec = params["spec"]
    store = TimedStore(spec.open(), keep=_is_timed)
    slices = _slices(params["payload"])
    policy = RecordingPolicy(make_policy(params["policy"]))
    producer = Producer(
        store,
        params["namespace"],
        producer_id=params["producer_id"],
        mesh=MESH,
        policy=policy,
        upload_threads=UPLOAD_THREADS,
        max_inflight_bytes=params["max_inflight"],
        tail_limit=DEFAULT_TAIL_LIMIT if params["segmented"] else UNSEGMENTED,
        tail_bytes_limit=DEFAULT_TAIL_BYTES_LIMIT if params["segmented"] else None,
    )
    ready()
    t0 = time.monotonic()
    appended: list[float] = []
    for offset in range(params["tgbs"]):
        appended.append(time.monotonic())
        producer.append(slices, offset=offset)
    while producer.stats().inflight_bytes:
        time.sleep(0.005)
    polled = time.monotonic()
    producer.close()
    t1 = time.monotonic()
    stats = producer.stats()
    store.close()
    # The end of the last upload is when its PUT returned, not when the loop above noticed (on
    # a machine loaded by 16 producer processes that can be tens of milliseconds later).
    t_uploaded = max(
        (e.start + e.seconds for e in store.events if e.ok and _is_data_put(e.op, e.key)),
        default=polled,
    )
    return {
        "t0": t0,
        "t1": t1,
        "t_uploaded": t_uploaded,
        "bytes": stats.bytes_published,
        "tgbs": stats.tgbs_published,
        "attempts": stats.attempts,
        "commits": stats.commits,
        "conflicts": stats.conflicts,
        "ambiguous": stats.ambiguous,
        "transient": stats.transient_errors,
        "log": policy.log,
        "forced": policy.forced,
        "slot_periods": policy.slot_periods,
        "slot_windows": policy.slot_windows,
        "start_window": getattr(producer, "_start_window", float("nan")),
        "put_window": getattr(policy.inner, "put_window", None),
        "appended": appended,
        "writes": [
            (e.start, e.nbytes)
            for e in store.events
            if e.start >= t0 and _is_manifest_write(e.op, e.key)
        ],
    }


def raw_put_task(params: dict[str, Any], ready: Callable[[], None]) -> dict[str, Any]:
    """The baseline: put the same encoded TGB ``tgbs`` times with the same threads, no manifest."""
    spec: StoreSpec = params["spec"]
    store = spec.open()
    data = encode_tgb(_slices(params["payload"]), MESH).data
    prefix = f"{params['namespace']}/raw/{params['producer_id']}"

    def put(i: int) -> float:
        store.put(f"{prefix}/{i}.tgb", data)
        return time.monotonic()

    ready()
    t0 = time.monotonic()
    with ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        done = list(pool.map(put, range(params["tgbs"])))
    t1 = time.monotonic()
    store.close()
    return {"t0": t0, "t1": t1, "bytes": len(data) * params["tgbs"], "done": done}


def _throughput(results: Sequence[dict[str, Any]]) -> float:
    start = min(r["t0"] for r in results)
    end = max(r["t1"] for r in results)
    return float(sum(r["bytes"] for r in results) / 1e6 / (end - start))


def _split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def _visibility(result: dict[str, Any]) -> list[float]:
    """Seconds from append to visibility of each TGB of one producer (commits are in order)."""
    commit_times: list[float] = []
    cumulative: list[int] = []
    total = 0
    for t, committed, _, tgbs in result["log"]:
        if committed and tgbs:
            total += tgbs
            commit_times.append(t)
            cumulative.append(total)
    out = []
    for i, appended in enumerate(result["appended"]):
        j = bisect.bisect_left(cumulative, i + 1)
        if j < len(commit_times):
            out.append(commit_times[j] - appended)
    return out


def _in_window(result: dict[str, Any]) -> list[tuple[float, int]]:
    """The writes of one producer that started inside one of its own fragile windows."""
    windows = sorted((t - w, t) for t, _, w, _ in result["log"])
    starts = [a for a, _ in windows]
    out = []
    for start, nbytes in result["writes"]:
        i = bisect.bisect_right(starts, start) - 1
        if i >= 0 and start <= windows[i][1]:
            out.append((start, nbytes))
    return out


def _manifest_kb_per_commit(
    results: Sequence[dict[str, Any]], *, window_only: bool = False
) -> list[float]:
    """Manifest + segment KB sent per committed version, in ten buckets of the run's commits.

    A write belongs to the first commit that ends after it started (failed attempts are charged
    to the next success). With fewer than ten commits some buckets are empty (NaN).
    ``window_only`` counts only the writes made inside the writer's fragile windows (not the
    segment merges written after a commit).
    """
    commits = sorted(t for r in results for t, ok, _, n in r["log"] if ok and n)
    if not commits:
        return [float("nan")] * 10
    sent = [0.0] * len(commits)
    for r in results:
        for start, nbytes in _in_window(r) if window_only else r["writes"]:
            sent[min(len(commits) - 1, bisect.bisect_left(commits, start))] += nbytes
    buckets: list[list[float]] = [[] for _ in range(10)]
    for i, s in enumerate(sent):
        buckets[i * 10 // len(commits)].append(s)
    return [sum(b) / 1e3 / len(b) if b else float("nan") for b in buckets]


def _first_last(buckets: Sequence[float]) -> tuple[float, float]:
    """The first and the last measured (non-NaN) of ten buckets: with fewer than ten commits
    the last commit falls in an earlier bucket than the tenth, and is still the last tenth."""
    measured = [b for b in buckets if not math.isnan(b)]
    return (measured[0], measured[-1]) if measured else (float("nan"), float("nan"))


def _commit_cost_by_tenth(results: Sequence[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """Commit time (ms) and manifest + segment bytes (KB) per 100 committed TGBs, by tenths.

    The direct measure of flat commit cost: the run's commits in ten buckets (as
    :func:`_manifest_kb_per_commit`), each bucket's attempt windows (failed attempts charged to
    the next success) and writes (segment merges included) over the TGBs its commits published.
    Merges are lumpy (one level merge rewrites several segments at once), so single buckets
    swing; a cost that grows with history shows as a trend.
    """
    commits = sorted((t, n) for r in results for t, ok, _, n in r["log"] if ok and n)
    if not commits:
        return [float("nan")] * 10, [float("nan")] * 10
    ends = [t for t, _ in commits]
    spent = [0.0] * len(commits)
    sent = [0.0] * len(commits)
    for r in results:
        for t, _, window, _ in r["log"]:
            spent[min(len(commits) - 1, bisect.bisect_left(ends, t))] += window
        for start, nbytes in r["writes"]:
            sent[min(len(commits) - 1, bisect.bisect_left(ends, start))] += nbytes
    ms: list[float] = []
    kb: list[float] = []
    for b in range(10):
        members = [i for i in range(len(commits)) if i * 10 // len(commits) == b]
        tgbs = sum(commits[i][1] for i in members)
        ms.append(sum(spent[i] for i in members) * 1e3 * 100 / tgbs if tgbs else float("nan"))
        kb.append(sum(sent[i] for i in members) / 1e3 * 100 / tgbs if tgbs else float("nan"))
    return ms, kb


def _tenths(results: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """Committed TGBs per second over the first and the last tenth of all committed TGBs.

    Commits publish TGBs in batches, so each tenth is widened to whole commits: the first runs
    from the start to the first commit reaching 10% of the TGBs, the last from the last commit
    at or below 90% to the end.
    """
    events = sorted((t, n) for r in results for t, ok, _, n in r["log"] if ok and n)
    start = min(r["t0"] for r in results)
    times = [start]
    cumulative = [0]
    for t, n in events:
        times.append(t)
        cumulative.append(cumulative[-1] + n)
    total = cumulative[-1]
    i_first = bisect.bisect_left(cumulative, total / 10)
    i_last = bisect.bisect_right(cumulative, total - total / 10) - 1
    first = cumulative[i_first] / (times[i_first] - start)
    last = (total - cumulative[i_last]) / (times[-1] - times[i_last])
    return first, last


def _success(logs: Iterable[Sequence[tuple[float, bool, float, int]]]) -> float:
    outcomes = [ok for log in logs for _, ok, _, _ in log]
    return sum(outcomes) / len(outcomes) if outcomes else float("nan")


def _edge_rates(times: Sequence[float], count: int) -> tuple[float, float]:
    """Events per second over the first and over the last ``count`` of sorted event ``times``
    (``count - 1`` intervals each): the rates of a run's first and last tenth."""
    first = (count - 1) / (times[count - 1] - times[0])
    last = (count - 1) / (times[-1] - times[-count])
    return first, last


def _ingest_tenths(
    results: Sequence[dict[str, Any]], payload: int, max_inflight: int
) -> tuple[float, float]:
    """Appended TGBs per second over the first and the last tenth of the run's TGBs.

    ``append`` blocks while the upload queue is full, so once the queue has filled (the first
    ``max_inflight // payload`` appends of each producer return at once) the append rate is the
    ingestion rate, free of the final drain of commits that ``close()`` adds at the very end.
    """
    times = sorted(t for r in results for t in r["appended"])
    queued = len(results) * max(1, max_inflight // payload)
    tenth = len(times) // 10
    if len(times) < queued + 2 * tenth:
        return float("nan"), float("nan")
    return _edge_rates(times[queued:], tenth + 1)


def _producer_ingest_ratios(
    results: Sequence[dict[str, Any]], payload: int, max_inflight: int
) -> list[float]:
    """Per producer: its append rate over the last tenth of its TGBs over that of its first tenth.

    As :func:`_ingest_tenths`, but each producer against itself: in the run's last tenth some
    producers have already finished (their shares end at different times) and are draining
    their final commits with ``close()``, so the aggregate rate there counts fewer producers.
    A producer's own tenths show whether its ingestion slows as the namespace's history grows.
    """
    ratios = []
    for r in results:
        times = r["appended"][max(1, max_inflight // payload) :]
        tenth = len(times) // 10
        if tenth < 2:
            return []
        first, last = _edge_rates(times, tenth)
        ratios.append(last / first)
    return ratios


def _raw_tenths(results: Sequence[dict[str, Any]]) -> tuple[float, float]:
    """Raw PUTs completed per second over the first and the last tenth of the run's PUTs.

    The baseline of the long run's ingestion ratio: a store that slows down as it fills (more
    objects, a growing volume) slows raw PUTs by as much, and that is no cost of BatchWeave's.
    """
    times = sorted(t for r in results for t in r["done"])
    tenth = len(times) // 10
    if tenth < 1:
        return float("nan"), float("nan")
    # From the start: the first PUT's completion already took one PUT's time.
    return _edge_rates([min(r["t0"] for r in results), *times], tenth + 1)


PHASES = ("first", "steady", "close")


def _phase(result: dict[str, Any], i: int) -> str:
    t, _, w, _ = result["log"][i]
    if result["forced"][i] or t - w >= result["t_uploaded"]:
        return "close"
    return "first" if i == 0 else "steady"


def _phases(results: Sequence[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """``(won, attempts)`` per phase of the producers' attempts.

    *close*: started by ``flush()``/``close()`` or after the producer's last upload finished (the
    final drain); *first*: a producer's first attempt, if not a close one (all producers start
    together); *steady*: the rest.
    """
    counts = {phase: [0, 0] for phase in PHASES}
    for r in results:
        for i, (_, ok, _, _) in enumerate(r["log"]):
            phase = _phase(r, i)
            counts[phase][0] += ok
            counts[phase][1] += 1
    return {phase: (won, attempts) for phase, (won, attempts) in counts.items()}


def _close_attempts(results: Sequence[dict[str, Any]]) -> list[tuple[int, float, float, bool]]:
    """``(producer, start ms, end ms, won)`` of every close attempt, from the last upload's end.

    The timeline of the final drain: which attempts overlapped, and which waited for nothing.
    """
    zero = max(r["t_uploaded"] for r in results)
    return sorted(
        (index, round((t - w - zero) * 1e3, 2), round((t - zero) * 1e3, 2), ok)
        for index, r in enumerate(results)
        for i, (t, ok, w, _) in enumerate(r["log"])
        if _phase(r, i) == "close"
    )


def _close_slots(results: Sequence[dict[str, Any]]) -> list[tuple[int, float, float, float, float]]:
    """``(producer, period s, slot window ms, put floor ms, start-up window ms)`` per close
    attempt: why a closer sat on the grid it did."""
    return [
        (
            index,
            r["slot_periods"][i],
            round(r["slot_windows"][i][0] * 1e3, 2),
            round(r["slot_windows"][i][1] * 1e3, 2),
            round(r["start_window"] * 1e3, 2),
        )
        for index, r in enumerate(results)
        for i in range(len(r["log"]))
        if _phase(r, i) == "close"
    ]


def _summary(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    attempts = sum(r["attempts"] for r in results)
    commits = sum(r["commits"] for r in results)
    windows = [w * 1e3 for r in results for _, _, w, _ in r["log"]]
    visible = [v * 1e3 for r in results for v in _visibility(r)]
    mf = _manifest_kb_per_commit(results)
    mf_window = _manifest_kb_per_commit(results, window_only=True)
    mf_first, mf_last = _first_last(mf)
    window_first, window_last = _first_last(mf_window)
    return {
        "tgbs": sum(r["tgbs"] for r in results),
        "MB/s": _throughput(results),
        "ingest MB/s": _throughput([{**r, "t1": r["t_uploaded"]} for r in results]),
        "success": commits / attempts if attempts else float("nan"),
        "success after 1st": _success([r["log"][1:] for r in results]),
        "attempts": attempts,
        "conflicts": sum(r["conflicts"] for r in results),
        "ambiguous": sum(r["ambiguous"] for r in results),
        "transient": sum(r["transient"] for r in results),
        "commit p50 ms": percentile(windows, 50),
        "commit p95 ms": percentile(windows, 95),
        "visible p50 ms": percentile(visible, 50),
        "visible p95 ms": percentile(visible, 95),
        "mf KB/commit first": mf_first,
        "mf KB/commit last": mf_last,
        "mf KB/commit by tenth": mf,
        "window KB/commit first": window_first,
        "window KB/commit last": window_last,
        "window KB/commit by tenth": mf_window,
        # The final drain: from the last upload's end to the last close() returning.
        "drain ms": (max(r["t1"] for r in results) - max(r["t_uploaded"] for r in results)) * 1e3,
        **{f"{phase} won/att": f"{won}/{att}" for phase, (won, att) in _phases(results).items()},
        "slot periods at close": sorted(
            r["slot_periods"][i]
            for r in results
            for i in range(len(r["log"]))
            if _phase(r, i) == "close"
        ),
        "put window ms": sorted(
            round(r["put_window"] * 1e3, 2) for r in results if r.get("put_window") is not None
        ),
        "close attempts": _close_attempts(results),
        "close slots": _close_slots(results),
        "close commit ms": sorted(
            round(w * 1e3, 2)
            for r in results
            for i, (_, _, w, _) in enumerate(r["log"])
            if _phase(r, i) == "close"
        ),
    }


def run_producers(
    pool: WorkerPool,
    spec: StoreSpec,
    *,
    producers: int,
    payload: int,
    policy: str,
    segmented: bool,
    tgbs: int,
    max_inflight: int,
) -> list[dict[str, Any]]:
    return _run_split(
        pool,
        spec,
        produce_task,
        "prod",
        producers=producers,
        tgbs=tgbs,
        policy=policy,
        payload=payload,
        segmented=segmented,
        max_inflight=max_inflight,
    )


def run_raw(
    pool: WorkerPool, spec: StoreSpec, *, producers: int, payload: int, tgbs: int
) -> list[dict[str, Any]]:
    """Raw PUTs of ``tgbs`` encoded TGBs by ``producers`` processes; one result per process."""
    return _run_split(
        pool, spec, raw_put_task, "raw", producers=producers, tgbs=tgbs, payload=payload
    )


def _run_split(
    pool: WorkerPool,
    spec: StoreSpec,
    task: Task,
    prefix: str,
    *,
    producers: int,
    tgbs: int,
    **common: Any,
) -> list[dict[str, Any]]:
    """``task`` in ``producers`` processes, ``tgbs`` split between them, in a fresh namespace
    (``prefix-<random>``, deleted afterwards); ``common`` goes to every process."""
    namespace = f"{prefix}-{uuid.uuid4().hex[:10]}"
    params = [
        {"spec": spec, "namespace": namespace, "producer_id": f"p{i}", **common, "tgbs": n}
        for i, n in enumerate(_split(tgbs, producers))
    ]
    try:
        return pool.run(task, params)
    finally:
        spec.clean(namespace)


def groups(
    points: Iterable[tuple[int, str, str, bool]],
) -> list[tuple[tuple[int, str, bool], list[str]]]:
    """The planned points as ``((producers, payload, segmented), policies)`` groups: the runs
    compared with each other (and with the same raw PUTs), groups in the order the plan first
    names them, each group's policies in plan order (a policy named twice runs once)."""
    out: dict[tuple[int, str, bool], list[str]] = {}
    for producers, size, policy, segmented in points:
        policies = out.setdefault((producers, size, segmented), [])
        if policy not in policies:
            policies.append(policy)
    return list(out.items())


def round_entries(policies: Sequence[str], round_: int, *, raw: bool) -> tuple[str, ...]:
    """What a group's round ``round_`` (from 0) runs, in order: the raw PUTs (:data:`RAW`, when
    ``raw``: measured in this group) and then ``policies``, rotated by one more each round."""
    return rotated([RAW, *policies] if raw else list(policies), round_)


def group_rows(
    key: Mapping[str, Any], runs: Mapping[str, Sequence[dict[str, Any]]]
) -> list[dict[str, Any]]:
    """One row per policy of a group, in the order of ``runs``: the policy's median round by
    ``MB/s`` (a :func:`_summary`), with ``raw MB/s`` the median of the raw PUTs' rounds
    (``runs[RAW]``, each ``{"MB/s": ...}``), ``vs_raw`` the two medians' ratio, ``rounds`` how
    many rounds the policy ran, ``round figures`` each round's :data:`ROUND_FIGURES` and ``raw
    MB/s by round`` the baseline's rounds, both in round order."""
    if not runs.get(RAW):
        raise ValueError(f"group {dict(key)}: no raw PUT round, which every ratio needs")
    raw = float(median_round(runs[RAW], "MB/s")["MB/s"])
    rows = []
    for policy, rounds in runs.items():
        if policy == RAW:
            continue
        median = median_round(rounds, "MB/s")
        rows.append(
            {
                **key,
                "policy": policy,
                **median,
                "raw MB/s": raw,
                "vs_raw": median["MB/s"] / raw,
                "rounds": len(rounds),
                "round figures": [{f: r[f] for f in ROUND_FIGURES} for r in rounds],
                "raw MB/s by round": [r["MB/s"] for r in runs[RAW]],
            }
        )
    return rows


def tgbs_for(payload: int, producers: int, budget: int, max_tgbs: int) -> int:
    """TGBs per run: ``budget`` bytes, at most ``max_tgbs``, at least four per producer."""
    return max(4 * producers, min(max_tgbs, budget // payload))


def plan(args: Any, storage: str) -> list[tuple[int, str, str, bool]]:
    """The (producers, payload, policy, segmented) points to run on ``storage``, in order."""
    matrix_flags = (args.producers, args.payloads, args.policies, args.segmented)
    if args.full or any(f is not None for f in matrix_flags):
        full = args.full
        producers = args.producers or ([4, 8, 16] if full else [16])
        payloads = args.payloads or (list(PAYLOADS) if full else ["100KB"])
        policies = args.policies or (policy_names() if full else ["dac"])
        segmented = args.segmented or ([True, False] if full else [True])
        return list(itertools.product(producers, payloads, policies, segmented))
    if args.smoke:
        return [(2, "100KB", p, s) for p in ("dac", "naive") for s in (True, False)]
    if storage == "seaweedfs":
        # A DAC run of 16 producers on SeaweedFS spends minutes draining (its gap is about
        # 140 fragile windows, and windows reach a second under contention): the default
        # stops at 8 producers there; pass --producers 16 to measure it.
        points = [(8, "100KB", p, True) for p in policy_names()]
        points += [(n, size, "dac", True) for n in (4, 8) for size in ("1MB", "10MB")]
        return points
    # Every policy at the contended point the targets name (16 producers, 100 KB), with and
    # without segments; DAC across all producer counts and payload sizes.
    points = [(16, "100KB", p, s) for p in policy_names() for s in (True, False)]
    points += [
        (n, size, "dac", True)
        for n in (4, 8, 16)
        for size in PAYLOADS
        if (n, size) != (16, "100KB")
    ]
    return points


def _csv(cast: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    return lambda text: [cast(x) for x in text.split(",") if x]


def _yes_no(text: str) -> bool:
    if text not in ("yes", "no"):
        raise ValueError(text)
    return text == "yes"


def _check_payload(text: str) -> str:
    if text not in PAYLOADS:
        raise ValueError(text)
    return text


def _check_policy(text: str) -> str:
    if text not in policy_names():
        raise ValueError(text)
    return text


def _fmt_target(met: bool | None) -> str:
    return "not measured" if met is None else ("MET" if met else "NOT MET")


def _lowest(values: Iterable[float]) -> float | None:
    """The lowest of ``values``, NaN if any is NaN (``min`` skips a NaN that is not first, which
    would let one unmeasured run pass a target), ``None`` if there are none."""
    values = list(values)
    if any(math.isnan(v) for v in values):
        return float("nan")
    return min(values, default=None)


def _at_least(value: float, floor: float) -> bool | None:
    """Whether ``value`` reaches ``floor``; ``None`` (not measured) for NaN."""
    return None if math.isnan(value) else value >= floor


def round_ratios(
    dac: Mapping[str, Any], baselines: Sequence[Mapping[str, Any]]
) -> list[tuple[float, str]]:
    """Per round, in round order: DAC's ``MB/s`` over the best baseline's of the same round, and
    that baseline's name (from the rows' ``round figures``). Empty when a row has none or the
    rows' round counts differ (rounds can only be paired when they ran together)."""
    counts = {len(r.get("round figures") or ()) for r in (dac, *baselines)}
    if not baselines or len(counts) != 1 or 0 in counts:
        return []
    out = []
    for i, own in enumerate(dac["round figures"]):
        measured = [
            (b["round figures"][i]["MB/s"], b["policy"])
            for b in baselines
            if b["round figures"][i]["MB/s"] > 0  # NaN (unmeasured) and 0 compare False
        ]
        if not measured:
            out.append((math.nan, "-"))
            continue
        best, name = max(measured)
        out.append((own["MB/s"] / best, name))
    return out


def targets(rows: Sequence[dict[str, Any]], long_rows: Sequence[dict[str, Any]]) -> list[str]:
    """The issue's targets, evaluated on whatever this run measured (with ``--rounds``, on
    each policy's median round; the 1.5x line is followed by the ratio of every round)."""
    notes = []
    for storage in sorted({r["storage"] for r in rows} | {r["storage"] for r in long_rows}):
        mine = [r for r in rows if r["storage"] == storage]
        dac16 = [r for r in mine if r["policy"] == "dac" and r["producers"] == 16]
        ok = _lowest(r["success"] for r in dac16)
        notes.append(
            f"[{storage}] DAC commit success >= 90% at 16 producers: "
            f"{_fmt_target(None if ok is None else _at_least(ok, 0.9))}"
            + ("" if ok is None else f" (lowest {ok:.0%})")
        )
        for seg in (True, False):
            point = [
                r
                for r in mine
                if r["producers"] == 16 and r["payload"] == "100KB" and r["segmented"] == seg
            ]
            dac = [r for r in point if r["policy"] == "dac"]
            others = [r for r in point if r["policy"] != "dac"]
            base = [(r["MB/s"], r["policy"]) for r in others]
            if dac and base:
                best, name = max(base)
                ratio = dac[0]["MB/s"] / best
                # No policy publishes faster than the raw PUTs of the same payloads: raw / best
                # is the most any policy can gain over the best baseline in this run.
                ceiling = point[0]["raw MB/s"] / best
                where = f"at 16 producers, 100 KB (segmented={'yes' if seg else 'no'})"
                notes.append(
                    f"[{storage}] DAC >= 1.5x best baseline MB/s {where}: "
                    f"{_fmt_target(ratio >= 1.5)} "
                    f"({ratio:.2f}x {name}; raw PUT is {ceiling:.2f}x {name}, the ceiling)"
                )
                by_round = round_ratios(dac[0], others)
                if len(by_round) > 1:
                    notes.append(
                        f"[{storage}] DAC / best baseline MB/s by round {where}: "
                        + ", ".join(f"{x:.2f}x {n}" for x, n in by_round)
                    )
            elif seg:
                notes.append(
                    f"[{storage}] DAC >= 1.5x best baseline at 16 producers, 100 KB: not measured"
                )
        for what, key in (("until visible", "MB/s"), ("uploads only", "ingest MB/s")):
            big = [
                r[key] / r["raw MB/s"]
                for r in mine
                if r["payload"] == "10MB" and r["policy"] == "dac"
            ]
            worst = _lowest(big)
            notes.append(
                f"[{storage}] ingestion >= 80% of raw PUT at 10 MB ({what}): "
                f"{_fmt_target(None if worst is None else _at_least(worst, 0.8))}"
                + ("" if worst is None else f" (lowest {worst:.0%})")
            )
        longs = [r for r in long_rows if r["storage"] == storage and r["segmented"] == "yes"]
        for r in longs:
            run = f"[{storage}] segmented long run ({r['tgbs']} TGBs)"
            worst = r.get("producer ingest last/first", float("nan"))
            notes.append(
                f"{run}, ingestion of each producer: last tenth of its TGBs within 15% of its "
                f"first: {_fmt_target(_at_least(worst, 0.85))} (worst "
                f"producer {worst:.2f}; raw PUT's last/first in the same run "
                f"{r.get('raw last/first', float('nan')):.2f})"
            )
            if "commit ms/100 TGBs by tenth" in r:
                ms, kb = r["commit ms/100 TGBs by tenth"], r["mf KB/100 TGBs by tenth"]
                notes.append(
                    f"{run}, commit cost per 100 TGBs by tenth of the commits: "
                    f"{' '.join(f'{x:.0f}' for x in ms)} ms in windows; "
                    f"{' '.join(f'{x:.0f}' for x in kb)} KB of manifests and segments"
                )
            for what, key in (
                ("ingestion of all producers together", "ingest last/first"),
                ("visible", "last/first"),
            ):
                notes.append(
                    f"{run}, {what}: last tenth within 15% of the first: "
                    f"{_fmt_target(_at_least(r[key], 0.85))} (last/first = {r[key]:.2f})"
                )
    return notes


def main() -> None:
    p = parser(__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--full", action="store_true", help="the whole matrix of issue #3")
    p.add_argument("--storages", type=_csv(str), default=None, help="file,seaweedfs")
    add_file_root_option(p)
    p.add_argument("--producers", type=_csv(int), default=None, help="e.g. 4,8,16")
    p.add_argument("--payloads", type=_csv(_check_payload), default=None, help="100KB,1MB,10MB")
    p.add_argument("--policies", type=_csv(_check_policy), default=None, help="dac,naive,...")
    p.add_argument("--segmented", type=_csv(_yes_no), default=None, help="yes,no")
    p.add_argument("--budget-mb", type=int, default=600, help="payload MB per run")
    p.add_argument("--max-tgbs", type=int, default=2000, help="TGBs per run at most")
    p.add_argument(
        "--tgbs",
        type=int,
        default=None,
        help="TGBs per matrix run, overriding --budget-mb/--max-tgbs (steady-state runs)",
    )
    p.add_argument("--max-inflight-mb", type=int, default=64, help="upload queue per producer")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds per (storage, producers, payload, segmented) group, raw PUTs and policies "
        "in a rotated order each round; each row is the policy's median round (3 recommended "
        "for target runs)",
    )
    p.add_argument("--long-run", action="store_true", help="also run the 20,000-TGB run")
    p.add_argument("--only-long-run", action="store_true", help="skip the matrix")
    p.add_argument("--long-run-tgbs", type=int, default=20_000)
    p.add_argument("--long-run-producers", type=int, default=4)
    p.add_argument("--long-run-payload", type=_check_payload, default="100KB")
    p.add_argument(
        "--long-run-unsegmented", action="store_true", help="also the long run without segments"
    )
    args = p.parse_args()
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: a group needs at least one round (3 for target runs)")
    if args.smoke:
        args.storages = args.storages or ["file"]
        args.budget_mb, args.max_tgbs, args.max_inflight_mb = 2, 24, 1
        args.long_run, args.long_run_tgbs, args.long_run_producers = True, 200, 2
    names = args.storages or list(STORAGES)
    plans = {name: [] if args.only_long_run else plan(args, name) for name in names}
    long_run = args.long_run or args.only_long_run
    pool_size = max(
        [n for points in plans.values() for n, *_ in points]
        + ([args.long_run_producers] if long_run else [])
    )

    command = "python bench/producers.py " + " ".join(sys.argv[1:])
    report = Report("producers", COLUMNS)
    long_report = Report("producers_longrun", LONG_COLUMNS)
    with storages(names, file_root=args.file_root) as specs, WorkerPool(pool_size) as pool:
        for name in names:
            spec = specs[name][0]
            raw_once: dict[tuple[int, str], list[dict[str, Any]]] = {}
            for (producers, size, segmented), policies in groups(plans[name]):
                payload = PAYLOADS[size]
                tgbs = args.tgbs or tgbs_for(
                    payload, producers, args.budget_mb * 1_000_000, args.max_tgbs
                )
                key = {
                    "storage": spec.label,
                    "producers": producers,
                    "payload": size,
                    "segmented": "yes" if segmented else "no",
                }
                # One round measures the raw PUTs once per (producers, payload), for both
                # segmented groups; more rounds measure them in every group, among its policies.
                shared = raw_once.get((producers, size)) if args.rounds == 1 else None
                runs: dict[str, list[dict[str, Any]]] = {RAW: shared} if shared else {}
                for round_ in range(args.rounds):
                    tag = f" (round {round_ + 1}/{args.rounds})" if args.rounds > 1 else ""
                    for entry in round_entries(policies, round_, raw=not shared):
                        if entry == RAW:
                            raw = _throughput(
                                run_raw(pool, spec, producers=producers, payload=payload, tgbs=tgbs)
                            )
                            runs.setdefault(RAW, []).append({"MB/s": raw})
                            row = {**key, "policy": RAW, "tgbs": tgbs, "MB/s": raw}
                            print(_progress(row, tag), flush=True)
                            continue
                        results = run_producers(
                            pool,
                            spec,
                            producers=producers,
                            payload=payload,
                            policy=entry,
                            segmented=segmented,
                            tgbs=tgbs,
                            max_inflight=args.max_inflight_mb * MIB,
                        )
                        runs.setdefault(entry, []).append(_summary(results))
                        row = {**key, "policy": entry, **runs[entry][-1]}
                        print(_progress(row, tag), flush=True)
                raw_once[(producers, size)] = runs[RAW]
                for row in group_rows(key, runs):
                    report.add(**row)
            if long_run:
                payload = PAYLOADS[args.long_run_payload]
                raw_first, raw_last = _raw_tenths(
                    run_raw(
                        pool,
                        spec,
                        producers=args.long_run_producers,
                        payload=payload,
                        tgbs=args.long_run_tgbs,
                    )
                )
                for segmented in (True, False) if args.long_run_unsegmented else (True,):
                    results = run_producers(
                        pool,
                        spec,
                        producers=args.long_run_producers,
                        payload=payload,
                        policy="dac",
                        segmented=segmented,
                        tgbs=args.long_run_tgbs,
                        max_inflight=args.max_inflight_mb * MIB,
                    )
                    first, last = _tenths(results)
                    ingest_first, ingest_last = _ingest_tenths(
                        results, payload, args.max_inflight_mb * MIB
                    )
                    cost_ms, cost_kb = _commit_cost_by_tenth(results)
                    per_producer = _producer_ingest_ratios(
                        results, payload, args.max_inflight_mb * MIB
                    )
                    row = {
                        "storage": spec.label,
                        "producers": args.long_run_producers,
                        "payload": args.long_run_payload,
                        "policy": "dac",
                        "segmented": "yes" if segmented else "no",
                        **_summary(results),
                        "ingest first TGB/s": ingest_first,
                        "ingest last TGB/s": ingest_last,
                        "ingest last/first": ingest_last / ingest_first,
                        "raw last/first": raw_last / raw_first,
                        "producer ingest last/first": min(per_producer, default=float("nan")),
                        "producer ingest last/first all": per_producer,
                        "commit ms/100 TGBs by tenth": cost_ms,
                        "mf KB/100 TGBs by tenth": cost_kb,
                        "first tenth TGB/s": first,
                        "last tenth TGB/s": last,
                        "last/first": last / first,
                    }
                    long_report.add(**row)
                    print(_progress(row), flush=True)
    notes = [
        f"command: {command}",
        f"machine: {os.cpu_count()} cores shared with other engineers' test runs; every "
        "producer is a process; TGB = 4 slices of payload/4 bytes, raw codec; "
        f"{UPLOAD_THREADS} upload threads and {args.max_inflight_mb} MiB in flight per producer",
        (
            f"each (storage, producers, payload, segmented) group ran {args.rounds} rounds, the "
            "raw PUTs and the policies in an order rotated by one each round (round 1: raw PUTs, "
            "then the policies in table order); each row is the policy's median round by MB/s, "
            "raw MB/s the raw PUTs' median round"
            if args.rounds > 1
            else "each point ran once, after the raw PUTs of its (producers, payload) and the "
            "policies before it in table order (--rounds 3 rotates the order over three rounds)"
        ),
        *targets(
            [{**r, "segmented": r["segmented"] == "yes"} for r in report.rows], long_report.rows
        ),
    ]
    report.notes = notes
    report.emit(args.out)
    if long_report.rows:
        long_report.notes = [f"command: {command}"]
        out = None if args.out is None else args.out.with_name(args.out.stem + "_longrun.json")
        long_report.emit(out)


def _progress(row: dict[str, Any], tag: str = "") -> str:
    keys: Iterable[str] = ("storage", "producers", "payload", "policy", "segmented", "tgbs")
    head = " ".join(f"{row[k]}" for k in keys) + tag
    line = f"[{time.strftime('%H:%M:%S')}] {head}: {row['MB/s']:.1f} MB/s"
    if "success" not in row:  # the raw PUTs
        return line
    return f"{line}, success {row['success']:.0%}, commit p50 {row['commit p50 ms']:.0f} ms"


if __name__ == "__main__":
    main()

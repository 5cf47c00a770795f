"""The benchmarks' measurement code: what columns count and when a target line says MET.

The open issues' targets are judged by ``bench/producers.py`` and ``bench/consumers.py``; these
tests pin, on made-up data, that a column counts what ``docs/benchmarks.md`` says it counts
(manifest bytes, a rank's time, read amplification, when uploads ended, medians of rounds),
that a target line cannot say MET on a missing or unmeasurable value, that a dead worker or a
killed run's leftovers fail or are cleaned up, and that the JSON written is valid JSON.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from batchweave import Bounded, MemoryStore, PutMode, StoreWrapper, open_store

# -- producers: what the manifest-bytes columns count ------------------------------------------


def test_manifest_bytes_count_writes_not_segment_reads(producers: ModuleType) -> None:
    # `mf KB/commit` is manifest plus segment bytes *sent*. A producer merging segments reads
    # other producers' segments back: those bytes were received, not sent.
    store = producers.TimedStore(MemoryStore(), keep=producers._is_manifest_write)
    store.put("ns/_segments/a.seg", b"s" * 100)
    store.put("ns/_manifests/00000001", b"m" * 10, mode=PutMode.CREATE)
    store.put("ns/data/p0/1/x.tgb", b"d" * 1000)
    store.get_range("ns/_segments/a.seg", Bounded(0, 100))
    store.get("ns/_segments/a.seg")
    store.get_range("ns/_manifests/00000001", Bounded(0, 10))
    assert sorted((e.op, e.nbytes) for e in store.events) == [("cput", 10), ("put", 100)]


def _result(log: list[tuple[float, bool, float, int]], writes: list[tuple[float, int]]) -> Any:
    """One producer's task result with the fields ``_summary`` reads."""
    return {
        "t0": 0.0,
        "t1": log[-1][0] + 0.1,
        "t_uploaded": log[-1][0] - 0.5,
        "bytes": 1_000_000,
        "tgbs": sum(n for _, ok, _, n in log if ok),
        "attempts": len(log),
        "commits": sum(ok for _, ok, _, _ in log),
        "conflicts": sum(not ok for _, ok, _, _ in log),
        "ambiguous": 0,
        "transient": 0,
        "log": log,
        "forced": [False] * len(log),
        "slot_periods": [0.0] * len(log),
        "slot_windows": [(0.0, 0.0)] * len(log),
        "start_window": 0.001,
        "put_window": None,
        "appended": [0.0] * sum(n for _, ok, _, n in log if ok),
        "writes": writes,
    }


def test_manifest_bytes_first_and_last_with_fewer_commits_than_tenths(
    producers: ModuleType,
) -> None:
    # Three commits (a smoke run, or a short close-dominated run): the first tenth of the
    # commits is the first commit and the last tenth the last one, not an empty bucket.
    log = [(1.0, True, 0.01, 5), (2.0, True, 0.01, 5), (3.0, True, 0.01, 5)]
    writes = [(0.995, 1_000), (1.995, 2_000), (2.995, 4_000)]
    row = producers._summary([_result(log, writes)])
    assert row["mf KB/commit first"] == pytest.approx(1.0)
    assert row["mf KB/commit last"] == pytest.approx(4.0)
    assert row["window KB/commit first"] == pytest.approx(1.0)
    assert row["window KB/commit last"] == pytest.approx(4.0)


def test_manifest_bytes_first_and_last_tenth_of_many_commits(producers: ModuleType) -> None:
    # Twenty commits: two per tenth; the last two wrote 3 KB each, a lost attempt's write before
    # the last commit is charged to it.
    log = [(float(i + 1), True, 0.01, 1) for i in range(20)]
    writes = [(t - 0.005, 1_000 if t < 19 else 3_000) for t, _, _, _ in log]
    writes.append((19.9, 2_000))
    row = producers._summary([_result(log, writes)])
    assert row["mf KB/commit first"] == pytest.approx(1.0)
    assert row["mf KB/commit last"] == pytest.approx((3 + 3 + 2) / 2)


# -- producers: target lines -------------------------------------------------------------------


def _row(**over: Any) -> dict[str, Any]:
    row = {
        "storage": "s",
        "producers": 16,
        "payload": "100KB",
        "policy": "dac",
        "segmented": True,
        "success": 0.95,
        "MB/s": 10.0,
        "ingest MB/s": 10.0,
        "raw MB/s": 10.0,
    }
    return row | over


def _line(notes: list[str], needle: str) -> str:
    (line,) = [n for n in notes if needle in n]
    return line


def test_success_target_is_not_met_by_ignoring_an_unmeasured_row(producers: ModuleType) -> None:
    # min() skips a NaN that is not first: one run with no attempts must not leave "MET".
    rows = [_row(success=0.95), _row(payload="1MB", success=math.nan)]
    line = _line(producers.targets(rows, []), "DAC commit success")
    assert "MET" not in line.replace("NOT MET", "")


def test_ingestion_target_is_not_met_by_ignoring_an_unmeasured_row(producers: ModuleType) -> None:
    rows = [
        _row(payload="10MB", producers=4),
        _row(payload="10MB", producers=8, **{"MB/s": math.nan, "ingest MB/s": math.nan}),
    ]
    for what in ("until visible", "uploads only"):
        line = _line(producers.targets(rows, []), f"10 MB ({what})")
        assert "MET" not in line.replace("NOT MET", "")


def test_the_baseline_target_uses_its_own_point(producers: ModuleType) -> None:
    # 1.5x at 16 producers and 100 KB, segmented: other payloads, producer counts and the
    # unsegmented rows (whose baselines differ) must not enter the ratio or its ceiling.
    rows = [
        _row(policy="dac", **{"MB/s": 30.0, "raw MB/s": 60.0}),
        _row(policy="fixed100", **{"MB/s": 20.0, "raw MB/s": 60.0}),
        _row(policy="naive", payload="1MB", **{"MB/s": 1.0}),
        _row(policy="naive", producers=8, **{"MB/s": 1.0}),
        _row(policy="naive", segmented=False, **{"MB/s": 1.0}),
        _row(policy="dac", segmented=False, **{"MB/s": 1.2}),
    ]
    notes = producers.targets(rows, [])
    seg = _line(notes, "segmented=yes")
    assert "NOT MET (1.50x fixed100" not in seg
    assert seg.endswith("MET (1.50x fixed100; raw PUT is 3.00x fixed100, the ceiling)")
    assert "NOT MET (1.20x naive" in _line(notes, "segmented=no")


def test_an_unmeasurable_long_run_ratio_is_not_measured(producers: ModuleType) -> None:
    row = {
        "storage": "s",
        "segmented": "yes",
        "tgbs": 100,
        "producer ingest last/first": math.nan,
        "raw last/first": math.nan,
        "ingest last/first": math.nan,
        "last/first": 1.0,
    }
    notes = producers.targets([], [row])
    assert "not measured" in _line(notes, "ingestion of all producers together")
    assert "not measured" in _line(notes, "ingestion of each producer")
    assert ": MET" in _line(notes, "TGBs), visible:")


# -- consumers: target lines -------------------------------------------------------------------


def _crow(mode: str, slice_: str, vs_dense: float, world: int = 32) -> dict[str, Any]:
    return {
        "client": "c",
        "world": world,
        "slice": slice_,
        "mode": mode,
        "amp": 1.001,
        "vs dense": vs_dense,
        "vs raw": 0.9,
    }


def test_dense_target_names_the_points_where_dense_was_not_measured(consumers: ModuleType) -> None:
    rows = [_crow("batchweave", "100KB", 6.0), _crow("batchweave", "10MB", math.nan)]
    line = _line(consumers.targets(rows), ">= 5x dense-read")
    assert "10MB" in line
    assert "not measured" in line


def test_dense_target_with_no_dense_at_all_is_not_measured(consumers: ModuleType) -> None:
    line = _line(consumers.targets([_crow("batchweave", "1MB", math.nan)]), ">= 5x dense-read")
    assert line.endswith(": not measured (1MB: no dense-read row)")


# -- JSON --------------------------------------------------------------------------------------


def test_json_has_no_nan_or_infinity_tokens(producers: ModuleType, tmp_path: Path) -> None:
    report = producers.Report("t", ["a", "b"])
    report.add(a=math.nan, b=[1.0, math.inf, (2, -math.inf)], c={"d": math.nan, "e": 3.5})
    path = report.save(tmp_path / "t.json")

    def refuse(token: str) -> Any:
        raise AssertionError(f"{token} is not JSON")

    payload = json.loads(path.read_text(), parse_constant=refuse)
    (row,) = payload["rows"]
    assert row == {"a": None, "b": [1.0, None, [2, None]], "c": {"d": None, "e": 3.5}}
    # The table still shows what was not measured.
    assert "| nan |" in report.markdown()


# -- consumers: what a rank's time and read amplification count --------------------------------

WORLD, SIZE, STEPS = 2, 1_000, 3


def _read(consumers: ModuleType, tmp_path: Path, mode: str, *, run: bool = True) -> Any:
    """``read_task`` in this process, on a sealed ``file://`` namespace of 3 steps x 2 ranks
    (written on the first call for ``mode``); with ``run=False`` only its parameters."""
    root = tmp_path / "store"
    root.mkdir(exist_ok=True)
    spec = consumers.StoreSpec("file", "file", f"file://{root}", root=str(root))
    written = tmp_path / f"{mode}.json"
    if not written.exists():
        written.write_text(
            json.dumps(consumers.write_namespace(spec, mode, WORLD, SIZE, STEPS, "crc32c"))
        )
    keys, ranges, checksums, footer_size = json.loads(written.read_text())
    ranges = [tuple(r) for r in ranges]
    params = {
        "spec": spec,
        "namespace": mode,
        "mode": mode,
        "world": WORLD,
        "steps": STEPS,
        "ranks": list(range(WORLD)),
        "keys": keys,
        "ranges": ranges,
        "checksums": checksums,
        "algo": "crc32c",
        "footer_size": footer_size,
        "dense_window": 1,
    }
    return consumers.read_task(params, lambda: None) if run else params


class _SlowShutdownPool(ThreadPoolExecutor):
    """A read-ahead pool whose shutdown takes 0.3 s, long after the last step arrived."""

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        time.sleep(0.3)
        super().shutdown(wait, cancel_futures=cancel_futures)


@pytest.mark.parametrize("mode", ["raw-range", "dense"])
def test_a_ranks_time_ends_with_its_last_step(
    consumers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # `rank MB/s` is delivered bytes over the time from start to the last step: tearing down
    # the rank's read-ahead pool afterwards is not part of it.
    monkeypatch.setattr(consumers, "ThreadPoolExecutor", _SlowShutdownPool)
    result = _read(consumers, tmp_path, mode)
    for rank in result["ranks"].values():
        assert rank["delivered"] == STEPS * SIZE
        assert rank["end"] - rank["t0"] < 0.25


def test_read_amplification_counts_the_manifest(consumers: ModuleType, tmp_path: Path) -> None:
    raw = _read(consumers, tmp_path, "raw-inline")
    assert raw["bytes_read"] == WORLD * STEPS * SIZE
    bw = _read(consumers, tmp_path, "batchweave")
    latest = max((tmp_path / "store" / "batchweave" / "_manifests").iterdir())
    # Each rank reads the sealed manifest (at least once) on top of its slices.
    assert bw["bytes_read"] >= WORLD * (STEPS * SIZE + latest.stat().st_size)


def test_every_round_decodes_the_manifest_afresh(
    consumers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker processes run every round and both S3 clients. A process keeps the manifests
    # and segments it decoded last; without a reset, later rounds of `batchweave` would skip
    # the decoding a new training process pays (3-4 ms of time to first batch at W = 8 on
    # file://, about a tenth of a rank's run) and the median round would usually be one of them.
    from batchweave._manifest import _codec

    _read(consumers, tmp_path, "batchweave")
    decoded: list[str] = []
    split = _codec._split_envelope

    def counting(data: bytes, *, key: str, **kwargs: Any) -> Any:
        decoded.append(key)
        return split(data, key=key, **kwargs)

    monkeypatch.setattr(_codec, "_split_envelope", counting)
    params = _read(consumers, tmp_path, "batchweave", run=False)
    consumers.read_task(params, lambda: None)
    assert any("/_manifests/" in key for key in decoded)


# -- servers: no leftovers of a killed run -----------------------------------------------------


def test_a_killed_runs_directory_is_removed_by_the_next_run(
    producers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A run killed with SIGKILL (or the OOM killer) cannot remove its directory; under
    # --file-root /dev/shm that is memory taken from every later run's page cache.
    servers = sys.modules["_servers"]
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep pytest's SIGTERM handler
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    stale = tmp_path / "bw-bench-stale"
    (stale / "file").mkdir(parents=True)
    (stale / servers.OWNER_FILE).write_text(f"{socket.gethostname()} {dead.stdout.strip()}")
    live = tmp_path / "bw-bench-live"
    live.mkdir()
    (live / servers.OWNER_FILE).write_text(f"{socket.gethostname()} {os.getpid()}")
    unknown = tmp_path / "bw-bench-unknown"  # no owner recorded: not ours to judge
    unknown.mkdir()
    with servers.storages(["file"], file_root=str(tmp_path)) as specs:
        (spec,) = specs["file"]
        root = Path(spec.root)
        assert (root.parent / servers.OWNER_FILE).exists()
        assert not stale.exists()
        assert live.exists()
        assert unknown.exists()
    assert not root.parent.exists()


# -- producers: when the uploads ended ---------------------------------------------------------


def test_uploads_end_when_the_last_data_put_returns(
    producers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `ingest MB/s`, `drain ms` and the close phase start at the end of a producer's last
    # upload, not when the benchmark's polling loop noticed it (5 ms sleeps, and far later on a
    # machine loaded by 16 producer processes: here 100 ms).
    ends: list[float] = []

    class Clocked(StoreWrapper):
        """Under the benchmark's own TimedStore: when each data PUT returned."""

        def put_parts(self, key: str, parts: Any, *, mode: PutMode = PutMode.OVERWRITE) -> None:
            self.inner.put_parts(key, parts, mode=mode)
            if key.endswith(".tgb"):
                ends.append(time.monotonic())

    spec = producers.StoreSpec("file", "file", f"file://{tmp_path}", root=str(tmp_path))
    monkeypatch.setattr(producers.StoreSpec, "open", lambda self: Clocked(open_store(self.url)))
    slow = types.SimpleNamespace(monotonic=time.monotonic, sleep=lambda s: time.sleep(0.1))
    monkeypatch.setattr(producers, "time", slow)
    params = {
        "spec": spec,
        "namespace": "ns",
        "producer_id": "p0",
        "policy": "fixed10",
        "payload": 4_000,
        "segmented": True,
        "tgbs": 30,
        "max_inflight": 1 << 20,
    }
    result = producers.produce_task(params, lambda: None)
    assert len(ends) == 30
    assert max(ends) <= result["t_uploaded"] <= max(ends) + 0.02
    # Only manifest and segment writes are kept as the run's manifest bytes.
    assert result["writes"]
    assert sum(n for _, n in result["writes"]) < 30 * 4_000


# -- worker pool -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_dead_worker_fails_the_run_at_once(producers: ModuleType) -> None:
    # A producer process killed by the OOM killer (16 processes x 64 MiB in flight at 10 MB)
    # must fail the run, not hang it for the 30-minute run timeout.
    workers = sys.modules["_workers"]
    with workers.WorkerPool(1) as pool:
        (proc,) = pool._procs
        proc.kill()
        proc.join()
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="worker 0 died"):
            pool.run(max, [{}], timeout=30.0)
        assert time.monotonic() - started < 15


# -- consumers: rounds, medians, ratios --------------------------------------------------------


def test_three_rounds_put_every_mode_in_a_different_place(consumers: ModuleType) -> None:
    orders = [consumers.round_order(r) for r in range(3)]
    assert all(sorted(o) == sorted(consumers.MODES) for o in orders)
    for mode in consumers.MODES:
        assert len({o.index(mode) for o in orders}) == 3


def test_a_points_rows_are_median_rounds_against_the_faster_raw_mode(
    consumers: ModuleType,
) -> None:
    def rounds(*values: tuple[float, float]) -> list[dict[str, Any]]:
        return [{"agg MB/s": agg, "rank MB/s": rank} for agg, rank in values]

    runs = {
        "batchweave": rounds((90, 9), (300, 30), (100, 10)),  # median by agg: 100
        "dense": rounds((10, 2), (12, 1), (11, 5)),  # median by agg: 11 (rank 5)
        "raw-range": rounds((150, 15), (160, 16), (170, 17)),
        "raw-inline": rounds((200, 20), (120, 12), (180, 18)),  # median 180: the faster
        "raw-verify": rounds((50, 5), (60, 6), (70, 7)),
    }
    rows = {r["mode"]: r for r in consumers.point_rows({"client": "c"}, runs)}
    bw = rows["batchweave"]
    assert (bw["agg MB/s"], bw["rank MB/s"], bw["rounds"]) == (100, 10, 3)
    assert bw["vs raw"] == pytest.approx(100 / 180)
    assert bw["vs dense"] == pytest.approx(10 / 5)
    assert rows["raw-inline"]["vs raw"] == pytest.approx(1.0)
    del runs["dense"]
    rows = {r["mode"]: r for r in consumers.point_rows({"client": "c"}, runs)}
    assert math.isnan(rows["batchweave"]["vs dense"])


# -- rounds: rotation and medians (bench/_report.py, shared by both benchmarks) ----------------


def test_rotation_puts_every_entry_in_every_place_once(producers: ModuleType) -> None:
    rotated = producers.rotated  # bench/_report.py's, which consumers.py uses too
    items = ("raw PUT", "dac", "naive", "fixed100")
    orders = [rotated(items, r) for r in range(len(items))]
    assert orders[0] == items  # round 1 runs in plan order: one round is today's order
    assert orders[1] == ("dac", "naive", "fixed100", "raw PUT")
    for item in items:
        assert sorted(o.index(item) for o in orders) == [0, 1, 2, 3]
    assert rotated(items, len(items) + 1) == orders[1]
    assert rotated((), 2) == ()


def test_the_median_round_is_one_whole_round(producers: ModuleType) -> None:
    median_round = producers.median_round  # bench/_report.py's, which consumers.py uses too
    rounds = [{"MB/s": 30.0, "success": 0.3}, {"MB/s": 10.0, "success": 0.1}]
    rounds.append({"MB/s": 20.0, "success": 0.2})
    assert median_round(rounds, "MB/s") == {"MB/s": 20.0, "success": 0.2}
    # Two rounds: the upper one (a real round, not an average of two).
    assert median_round(rounds[:2], "MB/s")["MB/s"] == 30.0
    # An unmeasured round counts as the lowest: it is the median only when most are NaN.
    nan = {"MB/s": math.nan, "success": 0.0}
    assert median_round([rounds[0], nan, rounds[1]], "MB/s")["MB/s"] == 10.0
    assert math.isnan(median_round([nan, nan, rounds[0]], "MB/s")["MB/s"])
    with pytest.raises(ValueError, match="MB/s"):
        median_round([], "MB/s")


# -- producers: rounds -------------------------------------------------------------------------


def test_a_groups_rounds_rotate_the_raw_puts_and_the_policies(producers: ModuleType) -> None:
    # The default plan names dac and every baseline with and without segments, interleaved:
    # each segmented value is one group, compared with its own raw PUTs.
    plan = [(16, "100KB", p, s) for p in ("dac", "naive", "fixed100") for s in (True, False)]
    assert producers.groups(plan) == [
        ((16, "100KB", True), ["dac", "naive", "fixed100"]),
        ((16, "100KB", False), ["dac", "naive", "fixed100"]),
    ]
    policies = ["dac", "naive", "fixed100"]
    orders = [producers.round_entries(policies, r, raw=True) for r in range(3)]
    assert orders[0] == (producers.RAW, "dac", "naive", "fixed100")
    for entry in (producers.RAW, *policies):
        assert len({o.index(entry) for o in orders}) == 3  # never twice in the same place
    assert orders[1][-1] == producers.RAW  # the baseline also runs after the policies
    # One round whose raw PUTs were measured for the other segmented group: today's order.
    assert producers.round_entries(policies, 0, raw=False) == tuple(policies)


def _summary_round(mbps: float, success: float) -> dict[str, Any]:
    """A ``_summary`` of one round, as far as the rows and the targets read it."""
    return {"tgbs": 20, "MB/s": mbps, "success": success, "attempts": 7, "drain ms": 40.0}


def test_a_groups_rows_are_median_rounds_against_the_median_raw_round(
    producers: ModuleType,
) -> None:
    key = {"storage": "s", "producers": 16, "payload": "100KB", "segmented": "yes"}
    runs = {
        producers.RAW: [{"MB/s": 100.0}, {"MB/s": 50.0}, {"MB/s": 80.0}],  # median 80
        "dac": [_summary_round(30, 0.9), _summary_round(10, 0.5), _summary_round(20, 0.7)],
        "naive": [_summary_round(5, 0.2), _summary_round(6, 0.3), _summary_round(4, 0.1)],
    }
    dac, naive = producers.group_rows(key, runs)
    assert (dac["policy"], dac["segmented"], dac["rounds"]) == ("dac", "yes", 3)
    # Every figure of the row comes from the median round (MB/s 20), not from others.
    assert (dac["MB/s"], dac["success"]) == (20, 0.7)
    assert dac["raw MB/s"] == 80.0
    assert dac["vs_raw"] == pytest.approx(20 / 80)
    assert [f["MB/s"] for f in dac["round figures"]] == [30, 10, 20]  # in round order
    assert set(dac["round figures"][0]) == {"MB/s", "success", "attempts", "drain ms"}
    assert dac["raw MB/s by round"] == [100.0, 50.0, 80.0]
    assert (naive["MB/s"], naive["success"]) == (5, 0.2)
    with pytest.raises(ValueError, match="raw PUT"):
        producers.group_rows(key, {"dac": runs["dac"]})


def test_the_baseline_target_uses_median_rows_and_names_each_rounds_ratio(
    producers: ModuleType,
) -> None:
    def row(policy: str, *mbps: float) -> dict[str, Any]:
        runs = {producers.RAW: [{"MB/s": 100.0}] * len(mbps)}
        runs[policy] = [_summary_round(x, 0.9) for x in mbps]
        key = {"storage": "s", "producers": 16, "payload": "100KB"}
        (out,) = producers.group_rows(key, runs)
        median: dict[str, Any] = out | {"segmented": True, "ingest MB/s": out["MB/s"]}
        return median

    rows = [row("dac", 30, 24, 40), row("fixed100", 20, 12, 40), row("naive", 10, 16, 10)]
    notes = producers.targets(rows, [])
    # Medians: DAC 30, fixed100 20, naive 10: 1.50x fixed100, whatever single rounds said.
    assert _line(notes, "1.5x best baseline MB/s").endswith(
        "MET (1.50x fixed100; raw PUT is 5.00x fixed100, the ceiling)"
    )
    # Each round against that round's best baseline (round 2: naive's 16, not fixed100's 12).
    assert _line(notes, "by round").endswith(": 1.50x fixed100, 1.50x naive, 1.00x fixed100")
    # One round has nothing to spread.
    one = [row("dac", 30), row("fixed100", 20)]
    assert not [n for n in producers.targets(one, []) if "by round" in n]


def test_round_ratios_skip_unmeasured_baseline_rounds(producers: ModuleType) -> None:
    def rounds(policy: str, *mbps: float) -> dict[str, Any]:
        return {"policy": policy, "round figures": [{"MB/s": x} for x in mbps]}

    dac = rounds("dac", 30, 24, 40)
    baselines = [rounds("fixed100", math.nan, 12, 0.0), rounds("naive", 10, math.nan, 0.0)]
    ratios = producers.round_ratios(dac, baselines)
    # Round 1: fixed100 unmeasured, naive's 10; round 2: fixed100's 12; round 3: nothing measured.
    assert ratios[:2] == [(3.0, "naive"), (2.0, "fixed100")]
    assert math.isnan(ratios[2][0])
    assert ratios[2][1] == "-"

"""``batchweave demo`` at a small scale, and its delivery checks on tampered logs.

Arguments that cannot work are refused before the demo starts, naming the option.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from batchweave import Consumer, Mesh, Watermarks, open_store
from batchweave.cli._app import EXIT_TERMINATED, cli
from batchweave.cli._common import CliFailure
from batchweave.cli._demo import DemoConfig, _check, _RankLog, _verify_deliveries, run_demo
from batchweave.cli._demo_work import (
    WorkerConfig,
    demo_source,
    expected_digests,
    make_corpus,
    pack_tgb,
    run_consumer,
    run_producer,
)
from batchweave.cli._seal import seal_namespace
from batchweave.testing import S3Endpoint

# max_lag 4 holds producers back until consumers pass the middle, so one is alive to be killed
SMALL = [
    "--steps",
    "24",
    "--producers",
    "2",
    "--step-time",
    "0.05",
    "--documents",
    "400",
    "--seq-len",
    "128",
    "--micro-batch",
    "2",
    "--checkpoint-every",
    "3",
    "--max-lag",
    "4",
]


@pytest.mark.slow
def test_demo_kills_restarts_and_verifies_exactly_once(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", "demo", *SMALL],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "PASS: exactly-once delivery verified" in out
    assert "SIGKILLed producer prep-" in out
    assert "SIGKILLed consumer rank 1" in out
    for figure in ("steps/s", "commit success rate", "read amplification", "stall", "peak"):
        assert figure in out
    store = tmp_path / "weave-data" / "store"
    assert store.is_dir()
    namespace = out.split("inspect it: batchweave inspect ")[1].split()[1]
    inspected = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", "inspect", str(store), namespace, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    data = json.loads(inspected.stdout)
    assert data["sealed"] is True
    assert data["next_step"] == 24
    # The restarted victim finished its stream (the exactly-once PASS above checks every offset).
    victim = out.split("SIGKILLed producer ")[1].split()[0]
    states = {p["producer_id"]: p for p in data["producers"]}
    assert states[victim]["committed_offset"] is not None
    assert not states[victim]["retired"]


def test_demo_rejects_bad_options(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", "demo", "--seq-len", "127", "--cp", "2"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "must be a multiple of --cp" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> WorkerConfig:
    work = tmp_path_factory.mktemp("demo")
    make_corpus(work / "corpus.lance", 300, seed=7)
    return WorkerConfig(
        store_url="memory://unused",
        store_options={},
        namespace="n",
        corpus=str(work / "corpus.lance"),
        work_dir=str(work),
        dp=2,
        cp=2,
        producers=2,
        per_producer=3,
        seq_len=64,
        micro_batch=2,
        step_time=0,
        max_lag=4,
        checkpoint_every=2,
    )


def test_packing_is_deterministic_and_fills_sequences(config: WorkerConfig) -> None:
    source = demo_source(config, 1)
    slices, ids = pack_tgb(source.take(2), config, 1, 2)
    again, ids_again = pack_tgb(source.take(2), config, 1, 2)
    assert ids == ids_again
    assert len(slices) == 4
    for s, s2 in zip(slices, again, strict=True):
        assert s["tokens"].shape == (2, 32)
        assert (s["tokens"] == s2["tokens"]).all()
        assert list(s["tag"][:2]) == [1, 2]
    taken = set(source.take(2).column("doc_id").to_pylist())
    assert {i for slice_ids in ids for i in slice_ids} <= taken
    filled = sum(int((s["doc_ids"] >= 0).sum()) for s in slices)
    assert filled > 0.8 * 4 * 2 * 32  # most of the TGB holds real tokens


def _write_logs(config: WorkerConfig, tmp: Path, tamper: str | None) -> list[_RankLog]:
    sources = {p: demo_source(config, p) for p in range(config.producers)}
    order = [(p, o) for o in range(config.per_producer) for p in range(config.producers)]
    logs = []
    for rank in range(config.dp * config.cp):
        path = tmp / f"rank-{rank}.jsonl"
        lines = [{"event": "start", "step": 0}]
        for step, (p, o) in enumerate(order):
            digest = expected_digests(config, p, o, sources[p])[rank]
            if tamper == "content" and rank == 2 and step == 3:
                digest = "0" * 16
            if tamper == "order" and rank == 1 and step in (1, 2):
                p, o = order[3 - step]
                digest = expected_digests(config, p, o, sources[p])[rank]
            lines.append({"step": step, "producer": p, "offset": o, "digest": digest})
            if tamper == "restart" and rank == 3 and step == 4:
                lines.append({"event": "start", "step": 2})  # resumed: steps 2.. come again
                for s in range(2, 5):
                    q, r = order[s]
                    d = expected_digests(config, q, r, sources[q])[rank]
                    lines.append({"step": s, "producer": q, "offset": r, "digest": d})
        if tamper == "lost" and rank == 0:
            lines = lines[:-1]
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        log = _RankLog(path)
        log.poll()
        logs.append(log)
    return logs


@pytest.mark.parametrize(
    ("tamper", "needle"),
    [
        (None, None),
        ("restart", None),
        ("content", "data differs"),
        ("order", "ranks disagree"),
        ("lost", "not delivered exactly once"),
    ],
)
def test_delivery_checks_catch_every_kind_of_damage(
    config: WorkerConfig, tmp_path: Path, tamper: str | None, needle: str | None
) -> None:
    total = config.producers * config.per_producer
    failures = _verify_deliveries(config, _write_logs(config, tmp_path, tamper), total)
    if needle is None:
        assert failures == []
    else:
        assert failures
        assert any(needle in f for f in failures), failures


@pytest.mark.slow
@pytest.mark.moto_server
@pytest.mark.filterwarnings("ignore:lance is not fork-safe")  # moto's fixture forks after import
def test_demo_on_s3(moto_endpoint: S3Endpoint, s3_bucket: str, s3_prefix: str) -> None:
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": moto_endpoint.access_key_id,
        "AWS_SECRET_ACCESS_KEY": moto_endpoint.secret_access_key,
        "AWS_DEFAULT_REGION": moto_endpoint.region,
    }
    url = f"s3://{s3_bucket}/{s3_prefix}"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "batchweave.cli", "demo", "--store", url, *SMALL),
            *("--endpoint-url", moto_endpoint.endpoint_url, "--addressing-style", "path"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS: exactly-once delivery verified" in proc.stdout
    assert f"--endpoint-url {moto_endpoint.endpoint_url}" in proc.stdout


@pytest.mark.slow
def test_demo_reports_a_stall_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # no checkpoint before the end keeps the boundary at 0, so max_lag 1 blocks the producer
    # (the argument check now refuses this; the watchdog guards against stalls it cannot see)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("batchweave.cli._demo._check", lambda config: None)
    config = DemoConfig(
        producers=1, steps=8, documents=100, seq_len=64, step_time=0, max_lag=1,
        checkpoint_every=100, no_kill=True, stall_limit=3.0,
    )  # fmt: skip
    assert run_demo(config) is False
    out = capsys.readouterr().out
    assert "no progress for 3 s" in out
    assert "reclamation boundary 0" in out
    assert "of 8 delivered to all 4 ranks" in out  # not "8 x 4 ranks": it delivered 2
    assert "8 x 4 ranks" not in out


def test_a_restarted_rank_re_records_the_watermark_of_the_checkpoint_it_restores(
    config: WorkerConfig, tmp_path: Path
) -> None:
    # a kill between the durable checkpoint and its hook leaves the watermark behind it
    for sub in ("logs", "checkpoints", "stats"):
        (tmp_path / sub).mkdir()
    worker = WorkerConfig(
        **{**config.__dict__, "store_url": (tmp_path / "store").as_uri(), "work_dir": str(tmp_path),
           "max_lag": 100, "checkpoint_every": 100}
    )  # fmt: skip
    for producer in range(worker.producers):
        run_producer(worker, producer)
    store = open_store(worker.store_url)
    seal_namespace(store, worker.namespace)
    consumer = Consumer(store, worker.namespace, mesh=Mesh(dp=2, cp=2), dp_rank=0, cp_rank=1)
    for _ in zip(range(4), consumer, strict=False):
        pass
    state = consumer.state_dict()
    consumer.close()
    (tmp_path / "checkpoints" / "rank-1.json").write_text(json.dumps({"consumer": state}))
    marks = Watermarks(store, worker.namespace)
    marks.record("rank-1", 2)

    run_consumer(worker, 1)

    mark = marks.get("rank-1")
    assert mark is not None
    assert mark.step == 4
    delivered = [json.loads(line) for line in (tmp_path / "logs" / "rank-1.jsonl").open()]
    assert [r["step"] for r in delivered if "digest" in r] == [4, 5]


def test_a_demo_that_fails_leaves_no_work_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The work directory (corpus, logs) went only at a normal end: a failure or Ctrl-C left it.
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    store = open_store((tmp_path / "store").as_uri())
    store.put("taken/x", b"")
    config = DemoConfig(store=store.url, namespace="taken")
    with pytest.raises(CliFailure, match="is not empty"):
        run_demo(config)
    assert list((tmp_path / "tmp").iterdir()) == []


# -- arguments checked before the demo starts --------------------------------------------------


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        # Before: each started the whole demo. --seq-len 0 crashed every producer with
        # "range() arg 3 must not be zero" (FAIL, exit 1); a memory:// store (one per process)
        # hung until the 60 s no-progress watchdog.
        ({"seq_len": 0}, "--seq-len"),
        ({"store": "memory://demo"}, "memory://"),
        ({"step_time": -1.0}, "--step-time"),
        # Before: one message for three options, naming none of them as the wrong one.
        ({"micro_batch": 0}, "--micro-batch must be >= 1, got 0"),
        ({"documents": 50}, "--documents must be >= 100, got 50"),
        ({"documents": 1_000_001}, "--documents must be <= 1000000, got 1000001"),
    ],
)
def test_demo_refuses_arguments_that_cannot_work_before_starting(
    options: dict[str, Any], needle: str
) -> None:
    with pytest.raises(CliFailure, match=re.escape(needle)):
        _check(DemoConfig(**options))


@pytest.mark.parametrize("documents", ["7500000", "10000000000000"])
def test_demo_refuses_too_many_documents_naming_the_option(documents: str) -> None:
    """Before: 7.5M documents wrapped the corpus's int32 offsets ("negative dimensions are not
    allowed", naming no option); 10**13 ended in a MemoryError traceback, exit 1 ("FAIL")."""
    result = CliRunner().invoke(cli, ["demo", "--no-kill", "--documents", documents])
    assert result.exit_code == 2, result.output
    assert "Invalid value for '--documents'" in result.output
    assert "100<=x<=1000000" in result.output


@pytest.mark.parametrize(
    ("namespace", "needle"),
    [("../x", "'..' segment"), ("ns/", "must not end with '/'"), ("a" * 300, "300-byte part")],
    ids=["dot-dot", "trailing-slash", "too-long"],
)
def test_demo_refuses_a_bad_namespace_before_making_any_directory(
    tmp_path: Path, namespace: str, needle: str
) -> None:
    # Before: the demo made weave-data/store/.bw-tmp in the working directory, then refused.
    proc = subprocess.run(
        [sys.executable, "-m", "batchweave.cli", "demo", "--namespace", namespace],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert f"--namespace: namespace {namespace[:40]!r}" in proc.stderr
    assert needle in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_demo_defaults_pass_the_argument_check() -> None:
    _check(DemoConfig())


@pytest.mark.parametrize(("taken", "role"), [(0, "the demo's reclaimer"), (2, "producer 1")])
def test_a_metrics_port_in_use_is_refused_before_starting(
    tmp_path: Path, taken: int, role: str
) -> None:
    # Before: a taken worker port (P+2, producer 1's) ran the demo, whose producer exited with
    # status 1: "FAILED producer 1 exited with status 1", exit 1 as for a failed check; a taken
    # P was an error advising port 0, which --metrics-port refuses.
    with socket.create_server(("127.0.0.1", 0)) as holder:
        busy = holder.getsockname()[1]
        port = busy - taken
        proc = subprocess.run(
            [sys.executable, "-m", "batchweave.cli", "demo", "--metrics-port", str(port)],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    said = " ".join(proc.stderr.split())
    assert said.startswith(f"batchweave: error: --metrics-port {port}: ")
    assert f"port {busy} (metrics of {role}) is in use" in said
    assert "pick a --metrics-port whose 8 ports from it are all free" in said
    assert "0 for any" not in said  # start_metrics_server's advice, refused by the option
    assert "--metrics-port 0" not in said
    assert list(tmp_path.iterdir()) == []  # refused before making anything


# -- stopped from outside: SIGTERM, SIGKILL -------------------------------------------------------

WORKERS = 2 + 2 * 2  # SMALL's producers plus dp * cp consumer ranks


def _identity(pid: int) -> str | None:
    """``pid``'s start time (which tells it from a later process given the same PID), or None
    once it is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] in ("Z", "X") else fields[19]


def _descendants(pid: int) -> dict[int, str]:
    """Every live process below ``pid``, with its identity."""
    found: dict[int, str] = {}
    todo = [pid]
    while todo:
        parent = todo.pop()
        for children in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                for child in map(int, children.read_text().split()):
                    identity = _identity(child)
                    if identity is not None and child not in found:
                        found[child] = identity
                        todo.append(child)
    return found


def _alive(processes: dict[int, str]) -> list[int]:
    return [pid for pid, identity in processes.items() if _identity(pid) == identity]


@contextlib.contextmanager
def _demo_with_workers(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], dict[int, str]]]:
    """A demo whose every worker process is running (slow steps keep them busy); whatever
    survives the test is SIGKILLed by PID afterwards."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "batchweave.cli", "demo", *SMALL, "--step-time", "1"),
            *("--no-kill", "--store", str(tmp_path / "store"), "--namespace", "stopped"),
        ],
        env={**os.environ, "TMPDIR": str(temp)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    workers: dict[int, str] = {}
    try:
        deadline = time.monotonic() + 90
        while len(workers) < WORKERS and proc.poll() is None and time.monotonic() < deadline:
            workers = _descendants(proc.pid)
            time.sleep(0.05)
        assert len(workers) >= WORKERS, (proc.poll(), workers)
        yield proc, workers
    finally:
        for pid in _alive(workers):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
        assert proc.stderr is not None
        proc.stderr.close()


@pytest.mark.slow
def test_sigterm_stops_every_worker_and_removes_the_work_directory(tmp_path: Path) -> None:
    # Before: SIGTERM (kill PID, timeout, a cancelled CI job) ended the driver at once, without
    # its cleanup: 7-11 worker processes kept running and the work directory stayed behind.
    with _demo_with_workers(tmp_path) as (proc, workers):
        assert [p.name for p in (tmp_path / "tmp").iterdir()], "no work directory to remove"
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == EXIT_TERMINATED == 143, stderr
        assert stderr.splitlines()[-1] == (
            "batchweave: terminated (SIGTERM); the command is safe to run again"
        )
        assert "Traceback" not in stderr
        assert _alive(workers) == []  # the driver waited for each one it stopped
        assert list((tmp_path / "tmp").iterdir()) == []


@pytest.mark.slow
def test_workers_do_not_outlive_a_sigkilled_driver(tmp_path: Path) -> None:
    # Before: nothing told the workers, which went on polling and publishing as orphans.
    with _demo_with_workers(tmp_path) as (proc, workers):
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        while _alive(workers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _alive(workers) == []

"""``batchweave demo``: the whole system end to end, with crashes, verified exactly-once.

The driver (this process) generates a Lance corpus, starts ``producers`` producer processes and
``dp * cp`` consumer processes (:mod:`batchweave.cli._demo_work`), runs the reclaimer in a
thread and samples the namespace's stored bytes. When the slowest rank passes half of the steps it
SIGKILLs one producer and one consumer and starts them again: the producer resumes at its
committed offset under a new epoch, the consumer at its last checkpoint. When every producer is
done it seals the namespace; consumers then finish. Finally it checks:

1. every rank received steps ``0 .. N - 1`` exactly once in its effective history (steps a
   restarted rank re-read after its checkpoint must equal what it read before the crash);
2. all ranks agree on the step -> (producer, offset) mapping;
3. every producer's offsets ``0 .. per_producer - 1`` appear exactly once (nothing lost,
   nothing duplicated, across the crash);
4. every delivered slice equals the slice recomputed from the corpus (token packing is
   deterministic in (producer, offset));
5. ``batchweave verify`` passes on what the store still holds.
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from batchweave._checks import check_namespace, new_name_problem
from batchweave._errors import BatchWeaveError
from batchweave._lifecycle import Reclaimer
from batchweave._manifest._log import ManifestLog
from batchweave._metrics import start_metrics_server, track_metrics
from batchweave._store._base import ObjectStore
from batchweave._watermarks import Watermarks
from batchweave.cli._common import (
    DEMO_DOCUMENTS,
    MEMORY_STORE_REFUSAL,
    CliFailure,
    err_console,
    open_cli_store,
    out_console,
    store_url,
)
from batchweave.cli._demo_work import WorkerConfig, demo_source, expected_digests, make_corpus
from batchweave.cli._inspect import human_bytes
from batchweave.cli._seal import seal_namespace
from batchweave.cli._verify import verify_namespace

__all__ = ["DemoConfig", "run_demo"]

_RECLAIM_GRACE = 5.0
_RECLAIM_INTERVAL = 1.0
_SAMPLE_INTERVAL = 0.5
_STALL_LIMIT = 60.0
"""Seconds without a commit, a delivered step or a process exit before the demo gives up."""


@dataclass
class DemoConfig:
    """The ``demo`` command's options."""

    store: str | None = None
    namespace: str | None = None
    producers: int = 3
    dp: int = 2
    cp: int = 2
    steps: int = 360
    seq_len: int = 1024
    micro_batch: int = 4
    documents: int = 20000
    step_time: float = 0.1
    max_lag: int = 60
    checkpoint_every: int = 10
    no_kill: bool = False
    keep: bool = False
    metrics_port: int | None = None
    store_options: dict[str, Any] = field(default_factory=dict)
    stall_limit: float = _STALL_LIMIT


def _default_base() -> Path:
    base = Path.cwd() / "weave-data"
    try:
        base.mkdir(exist_ok=True)
        probe = base / f".probe-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
        return base
    except OSError:
        return Path(tempfile.mkdtemp(prefix="weave-data-"))


def _namespace_problems(namespace: str) -> list[str]:
    """Why ``--namespace`` cannot be created, found before the demo makes any directory."""
    try:
        check_namespace(namespace)
    except ValueError as exc:  # InvalidKey is one
        return [f"--namespace: {exc}"]
    problem = new_name_problem("namespace", namespace)
    return [] if problem is None else [f"--namespace: {problem}"]


def _check(config: DemoConfig) -> None:
    problems = []
    if config.producers < 1:
        problems.append("--producers must be >= 1")
    if config.dp < 1 or config.cp < 1:
        problems.append("--dp and --cp must be >= 1")
    if config.seq_len % config.cp:
        problems.append(f"--seq-len {config.seq_len} must be a multiple of --cp {config.cp}")
    if config.steps < 2 * config.producers:
        problems.append("--steps must be at least twice --producers")
    for option, value, least in (
        ("--checkpoint-every", config.checkpoint_every, 1),
        ("--micro-batch", config.micro_batch, 1),
        ("--documents", config.documents, DEMO_DOCUMENTS[0]),
        ("--seq-len", config.seq_len, 1),
        ("--step-time", config.step_time, 0),
    ):
        if value < least:
            problems.append(f"{option} must be >= {least}, got {value}")
    if config.documents > DEMO_DOCUMENTS[1]:
        problems.append(f"--documents must be <= {DEMO_DOCUMENTS[1]}, got {config.documents}")
    problems.extend(_lag_problems(config))
    if config.metrics_port is not None:
        workers = config.producers + config.dp * config.cp
        if config.metrics_port + workers > 65535:
            problems.append(
                f"--metrics-port {config.metrics_port}: the {workers} workers serve metrics on "
                f"the ports after it, up to {config.metrics_port + workers}, past 65535; pick "
                f"a port at most {65535 - workers}"
            )
        else:
            problems.extend(_busy_metrics_ports(config))
    if config.store is not None and store_url(config.store).lower().startswith("memory:"):
        problems.append(f"--store {config.store}: {MEMORY_STORE_REFUSAL}")
    if config.namespace is not None:
        problems.extend(_namespace_problems(config.namespace))
    if problems:
        raise CliFailure("; ".join(problems))
    if importlib.util.find_spec("lance") is None:
        raise CliFailure(
            "the demo generates its corpus as a Lance dataset and needs pylance: "
            "pip install 'batchweave[lance]'"
        )


METRICS_ADDR = "127.0.0.1"
"""Where the demo's metrics servers listen (``start_metrics_server``'s default address)."""


def _metrics_ports(config: DemoConfig) -> list[tuple[int, str]]:
    """Every port the demo serves metrics on, with what serves there (``_demo_work``'s slots:
    the reclaimer on ``P``, producer ``i`` on ``P + 1 + i``, then each consumer rank)."""
    port = config.metrics_port
    if port is None:
        return []
    ports = [(port, "the demo's reclaimer")]
    ports += [(port + 1 + i, f"producer {i}") for i in range(config.producers)]
    ranks = config.dp * config.cp
    first_rank = port + 1 + config.producers
    ports += [(first_rank + r, f"consumer rank {r}") for r in range(ranks)]
    return ports


def _port_problem(port: int) -> str | None:
    """Why ``port`` cannot be served on at :data:`METRICS_ADDR` (bound, then closed at once),
    or ``None``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        # As the metrics server binds (http.server sets SO_REUSEADDR): a port some connection
        # left in TIME_WAIT is free for it.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((METRICS_ADDR, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "is in use (another process, or an earlier demo still running, holds it)"
            if exc.errno == errno.EACCES:
                return "needs privileges (a port below 1024)"
            return f"cannot be served on: {exc.strerror or exc}"
    return None


def _free_block(start: int, count: int, tries: int = 20) -> int | None:
    """A port from ``start`` on whose ``count`` ports are all free now, or ``None``."""
    first = start
    for _ in range(tries):
        if first + count - 1 > 65535:
            return None
        taken = [p for p in range(first, first + count) if _port_problem(p) is not None]
        if not taken:
            return first
        first = taken[-1] + 1
    return None


def _busy_metrics_ports(config: DemoConfig) -> list[str]:
    """The metrics ports that cannot be served on, found before anything starts.

    A worker whose port was taken exited with status 1 at its start, which the demo then
    reported as a failed run (exit 1, "a check failed"); and ``start_metrics_server``'s advice
    for a taken port, 0, is a value ``--metrics-port`` refuses.
    """
    ports = _metrics_ports(config)
    busy = [
        f"port {port} (metrics of {role}) {problem}"
        for port, role in ports
        if (problem := _port_problem(port)) is not None
    ]
    if not busy:
        return []
    first, last = ports[0][0], ports[-1][0]
    free = _free_block(max(last + 1, 1024), len(ports))
    hint = f" (now {free}..{free + len(ports) - 1} are)" if free is not None else ""
    return [
        f"--metrics-port {first}: the demo serves metrics on {METRICS_ADDR} ports {first}.."
        f"{last}, and {'; '.join(busy)}; pick a --metrics-port whose {len(ports)} ports from it "
        f"are all free{hint}, or stop what holds the port"
    ]


def _lag_problems(config: DemoConfig) -> list[str]:
    """``--max-lag`` too small for any rank to reach its next checkpoint: a certain stall.

    Each rank keeps one watermark (its last checkpoint's; keep_last 1), so the reclamation
    boundary ``b`` is the slowest rank's last checkpoint. A producer's append blocks while
    ``visible - b > max_lag`` (``LagGate.wait`` in ``_producer/_lag.py``), so steps up to
    ``b + max_lag`` are published and no further. A rank checkpoints after reading the step
    before its next checkpoint, ``b + checkpoint_every - 1``, so max_lag must be at least
    ``checkpoint_every - 1``; with no checkpoint within the run (``checkpoint_every >= total``)
    the boundary stays 0 and the last step, ``total - 1``, must be published. Consumers use the
    producers' mesh, so TGB steps are the ranks' steps.
    """
    if config.producers < 1 or config.checkpoint_every < 1:
        return []  # reported on their own
    total = -(-config.steps // config.producers) * config.producers
    # The highest step producers publish with the boundary at b is b + max_lag.
    if config.checkpoint_every >= total:
        if config.max_lag >= total - 1:  # b = 0: the last step, total - 1, is published
            return []
        return [
            f"--max-lag {config.max_lag} is too small for --checkpoint-every "
            f"{config.checkpoint_every}: no rank checkpoints within the {total} steps, so the "
            f"reclamation boundary stays 0 and producers would stop after step {config.max_lag}; "
            f"use --max-lag {total - 1} or more, or a --checkpoint-every below {total}"
        ]
    if config.max_lag >= config.checkpoint_every - 1:  # step b + checkpoint_every - 1 is published
        return []
    return [
        f"--max-lag {config.max_lag} is below --checkpoint-every {config.checkpoint_every} "
        "minus 1: each rank keeps only its last checkpoint's watermark, producers publish no step "
        "more than --max-lag past the slowest rank's, and no rank could read the steps to its "
        "next checkpoint, so the demo would stall (max_lag must be at least keep_last x "
        f"checkpoint interval, minus 1); use --max-lag {config.checkpoint_every - 1} or more, "
        f"or a --checkpoint-every of at most {config.max_lag + 1}"
    ]


class _Procs:
    """The worker processes; every one is killed on exit, whatever happens."""

    def __init__(self, config_path: Path, log_dir: Path) -> None:
        self.config_path = config_path
        self.log_dir = log_dir
        self.running: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
        self.finished: list[tuple[str, int, int]] = []

    def start(self, role: str, index: int) -> None:
        """Start worker ``role`` ``index``. Call from the main thread only: a worker's
        ``PR_SET_PDEATHSIG`` fires when the *thread* that started it ends, not the process."""
        err = open(self.log_dir / f"{role}-{index}.stderr", "ab")  # noqa: SIM115
        with err:
            self.running[(role, index)] = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "batchweave.cli._demo_work",
                    role,
                    str(self.config_path),
                    str(index),
                    str(os.getpid()),  # the worker ends with this driver, even on SIGKILL
                ],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "LANCE_LOG": "error"},
            )

    def kill(self, role: str, index: int) -> bool:
        proc = self.running.get((role, index))
        if proc is None or proc.poll() is not None:
            return False
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        del self.running[(role, index)]
        return True

    def reap(self) -> list[tuple[str, int, int]]:
        """Collect processes that exited: ``(role, index, returncode)``."""
        done = []
        for key, proc in list(self.running.items()):
            code = proc.poll()
            if code is not None:
                del self.running[key]
                done.append((key[0], key[1], code))
        self.finished.extend(done)
        return done

    def alive(self, role: str) -> int:
        return sum(1 for (r, _), p in self.running.items() if r == role and p.poll() is None)

    def stderr_tail(self, role: str, index: int, lines: int = 5) -> str:
        path = self.log_dir / f"{role}-{index}.stderr"
        if not path.exists():
            return ""
        return "\n".join(path.read_text(errors="replace").strip().splitlines()[-lines:])

    def close(self) -> None:
        for proc in self.running.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        for proc in self.running.values():
            proc.wait()
        self.running.clear()


class _RankLog:
    """Incrementally parsed JSON-lines log of one consumer rank (every incarnation)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pos = 0
        self._partial = b""
        self.records: list[dict[str, Any]] = []
        self.delivered = 0
        """Highest step + 1 delivered by the current incarnation."""

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open("rb") as f:
            f.seek(self._pos)
            chunk = f.read()
        self._pos += len(chunk)
        data = self._partial + chunk
        *lines, self._partial = data.split(b"\n")
        for line in lines:
            if not line.strip():
                continue
            record = json.loads(line)
            self.records.append(record)
            if "digest" in record:
                self.delivered = max(self.delivered, record["step"] + 1)
            elif record.get("event") == "start":
                self.delivered = record["step"]


@dataclass
class _Sampler:
    """Peak stored bytes under the namespace, sampled by a thread."""

    store: ObjectStore
    namespace: str
    peak: int = 0
    current: int = 0
    published: int = 0
    """Bytes of every TGB seen committed (counted by the supervisor)."""
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        total = sum(meta.size for meta in self.store.list(f"{self.namespace}/"))
        self.current = total
        self.peak = max(self.peak, total)

    def loop(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(BatchWeaveError):
                self.sample()
            self.stop.wait(_SAMPLE_INTERVAL)


@dataclass
class _Reclaiming:
    reclaimer: Reclaimer
    passes: int = 0
    deleted_objects: int = 0
    deleted_bytes: int = 0
    errors: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def loop(self) -> None:
        while not self.stop.is_set():
            try:
                report = self.reclaimer.run_once()
                self.passes += 1
                self.deleted_objects += report.objects_deleted
                self.deleted_bytes += report.bytes_deleted
            except BatchWeaveError:
                self.errors += 1
            self.stop.wait(_RECLAIM_INTERVAL)


def _demo_reclaimer(store: ObjectStore, namespace: str) -> Reclaimer:
    """The reclaimer with the demo's deliberately short grace (docs/cli.md).

    Its constructor warns that such a grace is for tests only; in the demo that is the point, so
    the warning (the only thing the constructor logs) is kept out of a first run's output.
    """
    lifecycle_log = logging.getLogger("batchweave.lifecycle")
    level = lifecycle_log.level
    lifecycle_log.setLevel(logging.ERROR)
    try:
        return Reclaimer(store, namespace, grace=_RECLAIM_GRACE)
    finally:
        lifecycle_log.setLevel(level)


def run_demo(config: DemoConfig) -> bool:
    """Run the demo; print the summary; return whether every check passed."""
    _check(config)
    base = _default_base() if config.store is None else Path(tempfile.mkdtemp(prefix="bw-demo-"))
    url = (base / "store").as_uri() if config.store is None else store_url(config.store)
    namespace = config.namespace or f"demo-{uuid.uuid4().hex[:8]}"
    work = base / f"work-{namespace.replace('/', '-')}"
    for sub in ("logs", "checkpoints", "stats"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    try:
        return _run(config, base, url, namespace, work)
    finally:
        # Also after a failure or Ctrl-C: the work directory holds the corpus and the logs.
        if not config.keep:
            shutil.rmtree(work, ignore_errors=True)
            if config.store is not None:
                shutil.rmtree(base, ignore_errors=True)


def _run(config: DemoConfig, base: Path, url: str, namespace: str, work: Path) -> bool:
    """The demo itself, in ``work``: start, supervise, verify, print the summary."""
    console = err_console()
    out = out_console()
    store = open_cli_store(url, config.store_options, writes=True, create=True)
    ManifestLog(store, namespace)  # validates the namespace name
    if any(True for _ in store.list(f"{namespace}/")):
        raise CliFailure(f"namespace {namespace!r} in {store.url} is not empty; pick a new one")

    per_producer = -(-config.steps // config.producers)
    total_steps = per_producer * config.producers
    console.print(
        f"[bold]batchweave demo[/bold]: {config.producers} producer processes, mesh dp={config.dp} "
        f"cp={config.cp} ({config.dp * config.cp} consumer ranks), {total_steps} steps"
    )
    console.print(f"  store      {escape(store.url)}")
    console.print(f"  namespace  {escape(namespace)}")
    started = time.monotonic()
    corpus = work / "corpus.lance"
    tokens = make_corpus(corpus, config.documents, seed=7)
    console.print(
        f"  corpus     {config.documents} documents, {tokens} tokens "
        f"(Lance dataset at {escape(str(corpus))}, {time.monotonic() - started:.1f}s)"
    )
    worker = WorkerConfig(
        store_url=url,
        store_options=config.store_options,
        namespace=namespace,
        corpus=str(corpus),
        work_dir=str(work),
        dp=config.dp,
        cp=config.cp,
        producers=config.producers,
        per_producer=per_producer,
        seq_len=config.seq_len,
        micro_batch=config.micro_batch,
        step_time=config.step_time,
        max_lag=config.max_lag,
        checkpoint_every=config.checkpoint_every,
        metrics_port=config.metrics_port,
    )
    config_path = work / "config.json"
    worker.save(config_path)
    ranks = config.dp * config.cp
    marks = Watermarks(store, namespace)
    for rank in range(ranks):
        marks.record(f"rank-{rank}", 0)  # nothing is reclaimed before every rank checkpoints

    metrics_server = None
    if config.metrics_port is not None:
        metrics_server = start_metrics_server(config.metrics_port)
        console.print(
            f"  metrics    http://127.0.0.1:{config.metrics_port}/metrics (reclaimer), ports "
            f"{config.metrics_port + 1}..{config.metrics_port + config.producers + ranks} (workers)"
        )
    reclaiming = _Reclaiming(track_metrics(_demo_reclaimer(store, namespace)))
    sampler = _Sampler(store, namespace)
    threads = [
        threading.Thread(target=reclaiming.loop, name="demo-reclaimer", daemon=True),
        threading.Thread(target=sampler.loop, name="demo-sampler", daemon=True),
    ]
    procs = _Procs(config_path, work / "logs")
    logs = [_RankLog(work / "logs" / f"rank-{r}.jsonl") for r in range(ranks)]
    events: list[str] = []
    failures: list[str] = []
    run_started = time.monotonic()
    try:
        for t in threads:
            t.start()
        for rank in range(ranks):
            procs.start("consumer", rank)
        for index in range(config.producers):
            procs.start("producer", index)
        _supervise(
            config, store, namespace, procs, logs, sampler, total_steps, events, failures, console
        )
    finally:
        procs.close()
        reclaiming.stop.set()
        sampler.stop.set()
        for t in threads:
            t.join(10)
        if metrics_server is not None:
            metrics_server.close()
    wall = time.monotonic() - run_started
    with contextlib.suppress(BatchWeaveError):
        sampler.sample()

    if not failures:
        console.print("verifying ...")
        failures.extend(_verify_deliveries(worker, logs, total_steps))
        report = verify_namespace(store, namespace)
        failures.extend(f"store: {p}" for p in report.problems[:20])
    _summary(
        out, work, logs, total_steps, wall, sampler, reclaiming, events, report_ok=not failures
    )
    for failure in failures[:30]:
        out.print(f"[red]FAILED[/red] {escape(failure)}")
    ok = not failures
    out.print(
        "[bold green]PASS[/bold green]: exactly-once delivery verified"
        if ok
        else f"[bold red]FAIL[/bold red]: {len(failures)} problems"
    )
    location = str(base / "store") if config.store is None else url
    flags = "".join(
        f" --{name.replace('_', '-')} {value}" for name, value in config.store_options.items()
    )
    out.print(f"inspect it: batchweave inspect {location} {namespace}{flags}", markup=False)
    return ok


def _supervise(
    config: DemoConfig,
    store: ObjectStore,
    namespace: str,
    procs: _Procs,
    logs: list[_RankLog],
    sampler: _Sampler,
    total_steps: int,
    events: list[str],
    failures: list[str],
    console: Console,
) -> None:
    """Watch the run, kill and restart halfway, seal when producers are done."""
    log = ManifestLog(store, namespace)
    killed_producer = killed_consumer = config.no_kill
    sealed = False
    manifest = None
    ranks = len(logs)
    victim_rank = min(1, ranks - 1)
    with Progress(
        TextColumn("{task.description:>10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        disable=not console.is_terminal,
    ) as progress:
        committed = progress.add_task("committed", total=total_steps, status="")
        consumed = progress.add_task("consumed", total=total_steps, status="")
        deadline = time.monotonic() + max(600.0, total_steps * (config.step_time + 0.5))
        last_progress = time.monotonic()
        progress_mark: tuple[object, ...] | None = None
        while True:
            time.sleep(0.1)
            for r in logs:
                r.poll()
            with contextlib.suppress(BatchWeaveError):
                previous = manifest
                manifest = log.latest(manifest) if manifest is not None else log.latest()
                first = 0 if previous is None else previous.next_step
                first = max(first, manifest.base_step)
                for _, desc in log.descriptors(manifest, first, manifest.next_step):
                    sampler.published += desc.bytes
            slowest = min(r.delivered for r in logs)
            next_step = 0 if manifest is None else manifest.next_step
            progress.update(
                committed, completed=next_step, status=f"v{getattr(manifest, 'version', 0)}"
            )
            progress.update(consumed, completed=slowest, status="")
            for role, index, code in procs.reap():
                if code != 0:
                    failures.append(
                        f"{role} {index} exited with status {code}: "
                        f"{procs.stderr_tail(role, index)}"
                    )
            if failures:
                return
            if not killed_producer and next_step >= total_steps // 2:
                killed_producer = True
                _kill_producer(procs, config, events, console)
            if not killed_consumer and slowest >= total_steps // 2:
                killed_consumer = True
                _kill_consumer(procs, victim_rank, logs, events, console)
            if not sealed and procs.alive("producer") == 0:
                manifest, _ = seal_namespace(store, namespace)
                sealed = True
                events.append(
                    f"sealed at version {manifest.version} with {manifest.next_step} steps"
                )
            if sealed and procs.alive("consumer") == 0:
                return
            mark = (next_step, [r.delivered for r in logs], len(procs.finished), sealed)
            if mark != progress_mark:
                last_progress, progress_mark = time.monotonic(), mark
            elif time.monotonic() - last_progress > config.stall_limit:
                failures.append(
                    _stall_report(store, namespace, next_step, logs, config.stall_limit)
                )
                return
            if time.monotonic() > deadline:
                failures.append("the demo did not finish in time")
                return


def _stall_report(
    store: ObjectStore, namespace: str, next_step: int, logs: list[_RankLog], limit: float
) -> str:
    try:
        boundary = str(Watermarks(store, namespace).boundary())
    except BatchWeaveError as exc:
        boundary = f"unknown ({exc})"
    delivered = ", ".join(f"rank {i}: {r.delivered}" for i, r in enumerate(logs))
    return (
        f"no progress for {limit:.0f} s: {next_step} steps committed, steps delivered "
        f"({delivered}), reclamation boundary {boundary}; producers block while committed steps "
        "exceed the boundary plus --max-lag, so a rank whose watermark stopped advancing holds "
        "them back (worker logs are in the work directory)"
    )


def _kill_producer(procs: _Procs, config: DemoConfig, events: list[str], console: Console) -> None:
    for victim in range(config.producers):
        if procs.kill("producer", victim):
            procs.start("producer", victim)
            events.append(f"SIGKILLed producer prep-{victim} halfway and restarted it")
            console.print(f"  [yellow]SIGKILL[/yellow] producer prep-{victim}; restarted")
            return
    events.append("every producer had already finished: none killed")


def _kill_consumer(
    procs: _Procs, rank: int, logs: list[_RankLog], events: list[str], console: Console
) -> None:
    at = logs[rank].delivered
    if procs.kill("consumer", rank):
        procs.start("consumer", rank)
        events.append(f"SIGKILLed consumer rank {rank} after step {at - 1} and restarted it")
        console.print(f"  [yellow]SIGKILL[/yellow] consumer rank {rank} at step {at}; restarted")


def _verify_deliveries(config: WorkerConfig, logs: list[_RankLog], total: int) -> list[str]:
    """Checks 1-4 of the module docstring."""
    failures: list[str] = []
    per_rank: list[dict[int, tuple[int, int, str]]] = []
    for rank, rlog in enumerate(logs):
        effective: dict[int, tuple[int, int, str]] = {}
        before_crash: dict[int, tuple[int, int, str]] = {}
        for record in rlog.records:
            if record.get("event") == "start":
                for step in [s for s in effective if s >= record["step"]]:
                    before_crash[step] = effective.pop(step)
            elif "digest" in record:
                step = record["step"]
                got = (record["producer"], record["offset"], record["digest"])
                if step in effective:
                    failures.append(f"rank {rank}: step {step} delivered twice in one incarnation")
                if step in before_crash and before_crash[step] != got:
                    failures.append(
                        f"rank {rank}: step {step} re-read after the restart differs from before"
                    )
                effective[step] = got
        if sorted(effective) != list(range(total)):
            missing = sorted(set(range(total)) - set(effective))[:10]
            failures.append(f"rank {rank}: steps not delivered exactly once (missing {missing})")
        per_rank.append(effective)
    if failures:
        return failures
    owners: dict[tuple[int, int], list[int]] = defaultdict(list)
    for step in range(total):
        mapping = {(r[step][0], r[step][1]) for r in per_rank}
        if len(mapping) != 1:
            failures.append(f"step {step}: ranks disagree on the TGB: {sorted(mapping)}")
            continue
        owners[mapping.pop()].append(step)
    expected = {(p, o) for p in range(config.producers) for o in range(config.per_producer)}
    if set(owners) != expected:
        lost = sorted(expected - set(owners))[:10]
        extra = sorted(set(owners) - expected)[:10]
        failures.append(f"(producer, offset) set wrong: lost {lost}, unexpected {extra}")
    failures.extend(
        f"{key} delivered at steps {steps}" for key, steps in owners.items() if len(steps) > 1
    )
    sources = {p: demo_source(config, p) for p in range(config.producers)}
    for (producer, offset), steps in sorted(owners.items()):
        digests = expected_digests(config, producer, offset, sources[producer])
        for rank, effective in enumerate(per_rank):
            if effective[steps[0]][2] != digests[rank]:
                failures.append(
                    f"step {steps[0]} rank {rank}: data differs from producer {producer} "
                    f"offset {offset} recomputed from the corpus"
                )
    return failures


def _stats(work: Path, prefix: str) -> list[dict[str, Any]]:
    found = []
    for path in sorted((work / "stats").glob(f"{prefix}-*.json")):
        with contextlib.suppress(ValueError, OSError):
            found.append(json.loads(path.read_text()))
    return found


def _summary(
    out: Console,
    work: Path,
    logs: list[_RankLog],
    total: int,
    wall: float,
    sampler: _Sampler,
    reclaiming: _Reclaiming,
    events: list[str],
    *,
    report_ok: bool,
) -> None:
    producers = _stats(work, "producer")
    consumers = _stats(work, "consumer")
    attempts = sum(p.get("attempts", 0) for p in producers)
    commits = sum(p.get("commits", 0) for p in producers)
    published = sampler.published
    read = sum(c.get("bytes_read", 0) for c in consumers)
    delivered = sum(c.get("bytes_delivered", 0) for c in consumers)
    stall = [c.get("stall_seconds", 0.0) for c in consumers]
    ranks = len(logs)
    # What every rank got: a failed run (a stall, a crashed worker) may have delivered far less
    # than it set out to, and its summary must not claim the whole stream.
    done = min((r.delivered for r in logs), default=0) if not report_ok else total
    table = Table(title="batchweave demo summary", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    if report_ok:
        table.add_row("steps", f"{total} x {ranks} ranks in {wall:.1f}s")
    else:
        table.add_row(
            "steps", f"{done} of {total} delivered to all {ranks} ranks in {wall:.1f}s (failed)"
        )
    table.add_row("throughput", f"{done / wall:.1f} steps/s")
    rate = f"{commits / attempts:.1%} ({commits}/{attempts})" if attempts else "n/a"
    table.add_row("commit success rate", rate)
    table.add_row("read amplification", f"{read / delivered:.3f}" if delivered else "n/a")
    table.add_row(
        "consumer stall time",
        f"{sum(stall):.1f}s total over {ranks} ranks ({sum(stall) / max(wall * ranks, 1e-9):.1%})",
    )
    table.add_row(
        "peak storage",
        f"{human_bytes(sampler.peak)} (published {human_bytes(published)}, now "
        f"{human_bytes(sampler.current)})",
    )
    table.add_row(
        "reclaimed",
        f"{reclaiming.deleted_objects} objects, {human_bytes(reclaiming.deleted_bytes)} "
        f"in {reclaiming.passes} passes",
    )
    for event in events:
        table.add_row("event", escape(event))
    table.add_row("verification", "[green]passed[/green]" if report_ok else "[red]failed[/red]")
    out.print(table)

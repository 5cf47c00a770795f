"""The orchestration of ``bench/peers.py``: see that file for what is measured and how.

Kept apart from the entry script because every rank is a spawned process that re-imports the
entry script: it must stay free of heavy imports so each rank's RSS is its own system's.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _peers_corpus import Corpus
from _peers_run import child_pids, nats_server, run_one, run_ranks
from _report import RESULTS_DIR, Report, parser, percentile
from _servers import BUCKET, StoreSpec, obstore_available, storages

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
IMG = ROOT / "docs" / "img"
SECTIONS = ("Producers", "Consumers", "Lifecycle", "Peers", "Soak")

DEFAULT_STEPS = {"100KB": 48, "1MB": 12}
"""Global steps per corpus: 48 x 256 samples x ~100 KB = ~1.2 GB; 12 x 256 x ~1 MB = ~3.1 GB."""
AVG = {"100KB": 100_000, "1MB": 1_000_000}
WDS_SHARD = 100_000_000
MDS_SHARD = 1 << 26
BW_PREFETCH = 4

READ_COLUMNS = [
    "corpus",
    "storage",
    "system",
    "write s",
    "rank MB/s",
    "slowest rank MB/s",
    "agg MB/s",
    "ttfb s",
    "amp",
    "peak RSS MB",
    "client CPU s/GB",
    "server CPU s/GB",
    "resume ttfb s",
    "resume exact",
    "live producer",
]
LIVE = {
    "batchweave": "yes: consumers follow new manifest versions while producers commit",
    "mosaicml": "no: an MDS dataset is its index.json, written when the writer finishes",
    "webdataset": "no: the shard list is fixed when the dataset is built",
    "nats": "yes (a queue), but only whole-TGB messages keep batches consistent",
}


# -- measurement ---------------------------------------------------------------------------------


def summarize(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-rank and aggregate throughput, ttfb, RSS and CPU of one read phase."""
    go = min(r["go"] for r in ranks)
    rates = [r["bytes"] / 1e6 / max(r["end"] - r["go"], 1e-9) for r in ranks]
    delivered = sum(r["bytes"] for r in ranks)
    lat = [x for r in ranks for x in r["lat"]]
    return {
        "delivered": delivered,
        "rank MB/s": statistics.mean(rates),
        "slowest rank MB/s": min(rates),
        "agg MB/s": delivered / 1e6 / max(max(r["end"] for r in ranks) - go, 1e-9),
        "ttfb s": max(r["first"] - r["go"] for r in ranks),
        "peak RSS MB": max(r["rss"] for r in ranks),
        "client cpu": sum(r["cpu"] for r in ranks),
        "lat p50 ms": percentile(lat, 50) * 1e3,
        "lat p95 ms": percentile(lat, 95) * 1e3,
    }


def resume_exact(full: list[dict[str, Any]], resumed: list[dict[str, Any]], skip: int) -> bool:
    """Whether every rank's resumed sequence equals its uninterrupted sequence after ``skip``."""
    return all(f["ids"][skip:] == r["ids"] for f, r in zip(full, resumed, strict=True))


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


class Bench:
    """One run: every system on every (corpus, storage), results collected as table rows."""

    def __init__(self, args: Any, tmp: Path, specs: dict[str, list[StoreSpec]]) -> None:
        self.args = args
        self.tmp = tmp
        self.specs = specs
        self.rows: list[dict[str, Any]] = []
        self.mq_rows: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.skipped: dict[str, str] = {}

    def log(self, msg: str) -> None:
        print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", flush=True)

    def server(self, storage: str) -> list[int]:
        return child_pids("weed") if storage == "seaweedfs" else []

    def row(
        self,
        corpus: Corpus,
        storage: str,
        system: str,
        write_s: float | None,
        full: list[dict[str, Any]],
        server_cpu: float,
        fetched: int | None,
        resumed: list[dict[str, Any]] | None,
        mid: int,
    ) -> dict[str, Any]:
        s = summarize(full)
        gb = s["delivered"] / 1e9
        expected = corpus.total_bytes
        if s["delivered"] != expected:
            self.notes.append(
                f"{corpus.name}/{storage}/{system} delivered {s['delivered']:,} bytes, the corpus "
                f"holds {expected:,}"
            )
        row = {
            "corpus": corpus.name,
            "storage": storage,
            "system": system,
            "write s": write_s if write_s is not None else "-",
            **{k: s[k] for k in ("rank MB/s", "slowest rank MB/s", "agg MB/s", "ttfb s")},
            "amp": fetched / s["delivered"] if fetched is not None else "n/a",
            "peak RSS MB": s["peak RSS MB"],
            "client CPU s/GB": s["client cpu"] / gb,
            "server CPU s/GB": server_cpu / gb if storage == "seaweedfs" else "-",
            "resume ttfb s": summarize(resumed)["ttfb s"] if resumed else "-",
            "resume exact": (
                ("yes" if resume_exact(full, resumed, mid * corpus.batch) else "NO")
                if resumed
                else "-"
            ),
            "live producer": "yes" if system.startswith("batchweave") else "no",
            "lat p50 ms": s["lat p50 ms"],
            "lat p95 ms": s["lat p95 ms"],
            "_cpu_total": (s["client cpu"] + (server_cpu if storage == "seaweedfs" else 0)) / gb,
        }
        self.rows.append(row)
        self.log(
            f"{corpus.name} {storage} {system}: agg {row['agg MB/s']:.0f} MB/s, ttfb "
            f"{row['ttfb s']:.2f}s, amp {_fmt(row['amp'])}, resume {row['resume exact']}"
        )
        return row

    # -- systems ---------------------------------------------------------------------------------

    def batchweave(self, corpus: Corpus, storage: str) -> None:
        specs = self.specs[storage]
        ns = f"peers-{corpus.name}-{int(time.time())}"
        mid = corpus.steps // 2
        writer = specs[0]
        base = {"corpus": corpus, "ns": ns}
        out, _ = run_one(
            _peers_systems().bw_write, {**base, "spec": writer}, server_pids=self.server(storage)
        )
        self.log(
            f"{corpus.name} {storage} batchweave write ({writer.client}): {out['seconds']:.1f}s"
        )
        for k, spec in enumerate(specs):
            p = {**base, "spec": spec, "mid": mid, "prefetch": BW_PREFETCH}
            full, server = run_ranks(
                _peers_systems().bw_read, p, corpus.ranks, server_pids=self.server(storage)
            )
            resumed = None
            if k == 0:
                states = [r["state"] for r in full]
                resumed, _ = run_ranks(
                    _peers_systems().bw_read,
                    {**p, "mid": None, "states": states},
                    corpus.ranks,
                    server_pids=self.server(storage),
                )
            fetched = sum(r["fetched"] for r in full)
            name = "batchweave" if storage == "file" else f"batchweave/{spec.client}"
            row = self.row(
                corpus,
                storage,
                name,
                out["seconds"] if k == 0 else None,
                full,
                server,
                fetched,
                resumed,
                mid,
            )
            row["write MB/s"] = corpus.total_bytes / 1e6 / out["seconds"]
            row["write client"] = writer.client
        if storage == "seaweedfs" and not self.args.smoke:
            # Latency without read-ahead, for the message-queue comparison (NATS fetches one
            # message at a time).
            full, server = run_ranks(
                _peers_systems().bw_read,
                {**base, "spec": specs[0], "prefetch": 0},
                corpus.ranks,
                server_pids=self.server(storage),
            )
            s = summarize(full)
            self.mq_rows.append(
                {
                    "corpus": corpus.name,
                    "system": f"batchweave/{specs[0].client} (no prefetch)",
                    "storage": storage,
                    "lat p50 ms": s["lat p50 ms"],
                    "lat p95 ms": s["lat p95 ms"],
                    "rank MB/s": s["rank MB/s"],
                    "amp": sum(r["fetched"] for r in full) / s["delivered"],
                    "ingest MB/s": "-",
                }
            )
        specs[0].clean(ns)

    def mosaicml(self, corpus: Corpus, storage: str) -> None:
        mid = corpus.steps // 2
        work = self.tmp / f"mds-{corpus.name}-{storage}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        base: dict[str, Any] = {"corpus": corpus, "shard_bytes": MDS_SHARD}
        if storage == "file":
            out_dir = Path(self.specs["file"][0].root or "") / f"mds-{corpus.name}"
            shutil.rmtree(out_dir, ignore_errors=True)
            write_p = {**base, "out": str(out_dir)}
            read_p: dict[str, Any] = {**base, "remote": None, "local": str(out_dir)}
        else:
            opts = self.specs[storage][0].options
            remote = f"s3://{BUCKET}/mds-{corpus.name}-{int(time.time())}"
            env = {
                "S3_ENDPOINT_URL": opts["endpoint_url"],
                "AWS_ACCESS_KEY_ID": opts["access_key_id"],
                "AWS_SECRET_ACCESS_KEY": opts["secret_access_key"],
                "AWS_DEFAULT_REGION": "us-east-1",
            }
            write_p = {**base, "out": (str(work / "write"), remote), "env": env}
            read_p = {**base, "remote": remote, "env": env}
        try:
            out, _ = run_one(_peers_systems().mds_write, write_p, server_pids=self.server(storage))
            self.log(f"{corpus.name} {storage} mosaicml write: {out['seconds']:.1f}s")
            phases = []
            for phase in ("full", "resume"):
                _clean_mosaic_shm()
                p = {**read_p, "mid": mid if phase == "full" else None}
                if storage != "file":
                    p["local"] = str(work / f"cache-{phase}")
                if phase == "resume":
                    p["states"] = [r["state"] for r in phases[0][0]]
                ranks, server = run_ranks(
                    _peers_systems().mds_read, p, corpus.ranks, server_pids=self.server(storage)
                )
                cached = tree_bytes(Path(p["local"]))
                phases.append((ranks, server, cached))
            (full, server, cached), (resumed, _, _) = phases
            row = self.row(
                corpus, storage, "mosaicml", out["seconds"], full, server, cached, resumed, mid
            )
            row["write MB/s"] = corpus.total_bytes / 1e6 / out["seconds"]
        finally:
            _clean_mosaic_shm()
            shutil.rmtree(work, ignore_errors=True)
            if storage == "file":
                shutil.rmtree(Path(self.specs["file"][0].root or "") / f"mds-{corpus.name}", True)

    def webdataset(self, corpus: Corpus, storage: str) -> None:
        from _peers_systems import wds_shards

        mid = corpus.steps // 2
        work = self.tmp / f"wds-{corpus.name}-{storage}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        shards = wds_shards(corpus, WDS_SHARD)
        names = [f"shard-{k:06d}.tar" for k in range(len(shards))]
        p: dict[str, Any] = {"corpus": corpus, "shard_bytes": WDS_SHARD, "dir": str(work)}
        try:
            if storage == "file":
                urls = [str(work / n) for n in names]
            else:
                opts = self.specs[storage][0].options
                prefix = f"wds-{corpus.name}-{int(time.time())}"
                p["s3"] = {**opts, "bucket": BUCKET}
                p["prefix"] = prefix
            out, _ = run_one(_peers_systems().wds_write, p, server_pids=self.server(storage))
            self.log(f"{corpus.name} {storage} webdataset write: {out['seconds']:.1f}s")
            sizes = [(work / n).stat().st_size for n in names]
            if storage != "file":
                for n in names:
                    (work / n).unlink()
                client = _boto3(self.specs[storage][0].options)
                urls = [
                    client.generate_presigned_url(
                        "get_object",
                        Params={"Bucket": BUCKET, "Key": f"{prefix}/{n}"},
                        ExpiresIn=7200,
                    )
                    for n in names
                ]
            read_p = {"corpus": corpus, "urls": urls}
            full, server = run_ranks(
                _peers_systems().wds_read, read_p, corpus.ranks, server_pids=self.server(storage)
            )
            resumed, _ = run_ranks(
                _peers_systems().wds_read,
                {**read_p, "skip": mid * corpus.batch},
                corpus.ranks,
                server_pids=self.server(storage),
            )
            # split_by_node: rank r streams shards r, r + W, ... end to end.
            fetched = sum(sizes)
            row = self.row(
                corpus, storage, "webdataset", out["seconds"], full, server, fetched, resumed, mid
            )
            row["write MB/s"] = corpus.total_bytes / 1e6 / out["seconds"]
            row["shards"] = len(names)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def nats(self, corpus: Corpus) -> None:
        tgb_bytes = corpus.total_bytes / corpus.steps
        from _peers_run import NATS_MAX_PAYLOAD

        if tgb_bytes > NATS_MAX_PAYLOAD:
            self.mq_rows.append(
                {
                    "corpus": corpus.name,
                    "system": "nats",
                    "storage": "jetstream file",
                    "note": f"not run: one TGB is {tgb_bytes / 1e6:.0f} MB, above nats-server's "
                    f"hard max_payload of {NATS_MAX_PAYLOAD >> 20} MB",
                }
            )
            return
        with nats_server() as server:
            if server is None:
                self.skipped["nats"] = "nats-server is not installed (apt-get install nats-server)"
                return
            url, pid = server
            p = {"corpus": corpus, "url": url, "stream": f"peers{corpus.name}"}
            out, wcpu = run_one(_peers_systems().nats_write, p, server_pids=[pid])
            full, server_cpu = run_ranks(
                _peers_systems().nats_read, p, corpus.ranks, server_pids=[pid]
            )
        s = summarize(full)
        gb = s["delivered"] / 1e9
        self.mq_rows.append(
            {
                "corpus": corpus.name,
                "system": "nats (1 message = 1 TGB)",
                "storage": "jetstream file",
                "ingest MB/s": out["bytes"] / 1e6 / out["seconds"],
                "lat p50 ms": s["lat p50 ms"],
                "lat p95 ms": s["lat p95 ms"],
                "rank MB/s": s["rank MB/s"],
                "agg MB/s": s["agg MB/s"],
                "amp": sum(r["fetched"] for r in full) / s["delivered"],
                "client CPU s/GB": s["client cpu"] / gb,
                "server CPU s/GB": server_cpu / gb,
                "ingest server CPU s": wcpu,
            }
        )
        self.log(f"{corpus.name} nats: ingest {self.mq_rows[-1]['ingest MB/s']:.0f} MB/s")


def _fmt(value: Any) -> str:
    return value if isinstance(value, str) else f"{value:.3f}"


def _peers_systems() -> Any:
    import _peers_systems as mod

    return mod


def _boto3(opts: dict[str, Any]) -> Any:
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=opts["endpoint_url"],
        aws_access_key_id=opts["access_key_id"],
        aws_secret_access_key=opts["secret_access_key"],
        region_name="us-east-1",
    )


def _clean_mosaic_shm() -> None:
    """MosaicML coordinates local ranks through shared memory; drop leftovers between runs."""
    with contextlib.suppress(Exception):
        from _peers_systems import stub_torchvision_users

        stub_torchvision_users()
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()


def unavailable() -> dict[str, str]:
    """Peers that cannot run here, each with the reason (``pip install -e '.[bench]'``)."""
    from _peers_systems import stub_torchvision_users

    stub_torchvision_users()
    out = {}
    for system, module in (
        ("mosaicml", "streaming"),
        ("webdataset", "webdataset"),
        ("nats", "nats"),
    ):
        try:
            importlib.import_module(module)
        except Exception as exc:
            out[system] = f"`import {module}` failed ({type(exc).__name__}: {exc}); not run"
    return out


# -- report ---------------------------------------------------------------------------------------

TARGET_COLUMNS = ["corpus", "storage", "target", "batchweave", "peer", "met"]


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets per (corpus, storage), with BatchWeave's best client."""
    out = []
    for key in sorted({(r["corpus"], r["storage"]) for r in rows}):
        group = [r for r in rows if (r["corpus"], r["storage"]) == key]
        ours = [r for r in group if r["system"].startswith("batchweave")]
        if not ours:
            continue
        bw = max(ours, key=lambda r: r["agg MB/s"])
        peers = {r["system"]: r for r in group if not r["system"].startswith("batchweave")}
        base = {"corpus": key[0], "storage": key[1]}

        def add(
            target: str, ours_v: str, peer_v: str, met: bool, base: dict[str, str] = base
        ) -> None:
            out.append(
                {
                    **base,
                    "target": target,
                    "batchweave": ours_v,
                    "peer": peer_v,
                    "met": "met" if met else "NOT met",
                }
            )

        wds, mds = peers.get("webdataset"), peers.get("mosaicml")
        name = bw["system"]
        if wds:
            add(
                "agg MB/s >= WebDataset",
                f"{bw['agg MB/s']:.0f} ({name})",
                f"{wds['agg MB/s']:.0f}",
                bw["agg MB/s"] >= wds["agg MB/s"],
            )
        if mds:
            add(
                "agg MB/s >= 2.5x MosaicML",
                f"{bw['agg MB/s']:.0f}",
                f"2.5 x {mds['agg MB/s']:.0f} = {2.5 * mds['agg MB/s']:.0f}",
                bw["agg MB/s"] >= 2.5 * mds["agg MB/s"],
            )
        others = [r for r in (wds, mds) if r]
        if others:
            add(
                "ttfb < both",
                f"{bw['ttfb s']:.2f}s",
                ", ".join(f"{r['system']} {r['ttfb s']:.2f}s" for r in others),
                all(bw["ttfb s"] < r["ttfb s"] for r in others),
            )
        if wds:
            add(
                "CPU s/GB (client+server) <= WebDataset",
                f"{bw['_cpu_total']:.2f}",
                f"{wds['_cpu_total']:.2f}",
                bw["_cpu_total"] <= wds["_cpu_total"],
            )
        amp = max(r["amp"] for r in ours)
        add("read amplification <= 1.02", f"{amp:.4f}", "-", amp <= 1.02)
        exact = [r for r in ours if r["resume exact"] != "-"]
        add(
            "exact resume",
            ", ".join(r["resume exact"] for r in exact),
            ", ".join(f"{r['system']} {r['resume exact']}" for r in others),
            all(r["resume exact"] == "yes" for r in exact),
        )
    return out


def summary(rows: list[dict[str, Any]]) -> str:
    """One sentence: how many targets were met, and which were not."""
    missed = [f"{r['target']} ({r['corpus']}, {r['storage']})" for r in rows if r["met"] != "met"]
    text = f"**Targets: {len(rows) - len(missed)} of {len(rows)} met in this run.**"
    return text + (" Not met: " + "; ".join(missed) + "." if missed else "")


def plots(rows: list[dict[str, Any]]) -> list[str]:
    """Bar charts of aggregate MB/s, time to first batch and CPU per GB; returns PNG names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    IMG.mkdir(parents=True, exist_ok=True)
    groups = sorted({(r["corpus"], r["storage"]) for r in rows}, key=lambda g: (g[0] != "100KB", g))
    systems = sorted({r["system"] for r in rows}, key=lambda s: (not s.startswith("batchweave"), s))
    charts = {
        "peers_throughput.png": ("agg MB/s", "aggregate MB/s (8 ranks)"),
        "peers_ttfb.png": ("ttfb s", "time to first batch, slowest rank (s)"),
        "peers_cpu.png": ("_cpu_total", "client + server CPU s per GB delivered"),
    }
    names = []
    for fname, (col, label) in charts.items():
        fig, ax = plt.subplots(figsize=(9, 4))
        width = 0.8 / max(1, len(systems))
        for k, system in enumerate(systems):
            xs, ys = [], []
            for g, group in enumerate(groups):
                match = [
                    r
                    for r in rows
                    if (r["corpus"], r["storage"]) == group and r["system"] == system
                ]
                if match and isinstance(match[0][col], float):
                    xs.append(g + k * width)
                    ys.append(match[0][col])
            ax.bar(xs, ys, width, label=system)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))])
        ax.set_xticklabels([f"{c} / {s}" for c, s in groups])
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(IMG / fname, dpi=110)
        plt.close(fig)
        names.append(fname)
    return names


CITED = [
    "Kafka (cited from the paper, section 7, not measured here; dedicated 3-node Kafka cluster, "
    "16 cores / 64 GB each): end-to-end 0.11 steps/s vs BatchWeave 3.09 steps/s, all-rank step "
    "latency p50/p95 8,811 / 9,534 ms vs 172 / 367 ms (end-to-end run, Figure 5 bottom row).",
    "Kafka consumer read (cited): at 128 consumers and 100 KB slices, 0.061 MB/s per rank vs "
    "BatchWeave 1.61 MB/s (and 1.11 MB/s for dense reads); amplification grows with world size "
    "because every rank downloads the whole TGB.",
    "Kafka ingestion (cited): strict one-TGB-per-message runs succeeded only up to 64 producers at "
    "100 KB and 128 producers at 1000 KB, none at 10000 KB (message-size limits and produce "
    "timeouts); BatchWeave reached 1.42 / 7.03 / 16.0 GB/s at 128 producers, 6.00x / 3.31x / 1.20x "
    "the strongest non-BatchWeave baseline.",
]


PROFILE = [
    "One GET per step (since 2026-11-26): the manifest descriptor carries each object's slice "
    "table (stored lengths and checksums of its slices), so a rank reads its slice without "
    "fetching the TGB footer first. Before, each step was two dependent GETs, the footer of the "
    "new TGB and then the slice: at 100 KB samples 256 footer + 256 slice GETs for 32 steps x 8 "
    "ranks, while WebDataset issues one GET per ~77 MB shard.",
    "On `file://` slices of 1 MiB or more are memory-mapped (`ObjectStore.map_range`), "
    "checksummed in place and decoded as numpy views: no buffer is allocated or filled per step. "
    "Before, a 1 MB-corpus rank read its 32 MB slice as eight parallel 4 MB `pread`s into a fresh "
    "32 MB buffer per step (above glibc's mmap threshold, so each step page-faulted a new "
    "mapping); in a `/tmp` micro-benchmark allocate-and-read ran at 1.9 GB/s and map-plus-crc32c "
    "at 16 GB/s. crc32c now comes from the `crc32c` package, which checksums any buffer in place "
    "with the GIL released (`google-crc32c` took only `bytes`, so other buffers were copied).",
    "On S3 a 32 MB slice is now one range GET (the consumer splits only reads of 64 MiB or more): "
    "in a `/tmp` experiment on SeaweedFS, 8 boto3 ranks spent 1.8 s of client CPU per GB with "
    "4 MiB parts and 0.7 s unsplit.",
    "Profiled with py-spy (2026-11-25, before the changes above; 8 ranks, 100 KB corpus on "
    "SeaweedFS through obstore): about 60% of the rank processes' samples (nearly all of the "
    "non-idle ones) sat inside the obstore `get_range` call, i.e. waiting for SeaweedFS; the "
    "consumer's own Python work was under 10%. On SeaweedFS BatchWeave is bound by the server: "
    "probably (not verified in SeaweedFS's code) serving a range of a 25-256 MB object that "
    "SeaweedFS stores in chunks costs more than WebDataset's whole-object streams, which is "
    "what the server CPU s/GB column shows.",
    "Time to first batch at 100 KB on `file://` is the closest target: every system's first "
    "batch is a few milliseconds of work, and the slowest of 8 processes on 2 cores is mostly "
    "scheduling. Two runs on 2026-11-26 (01:50, 02:00 UTC), before the consumer stopped "
    "starting its prefetch worker inside the first `next()`, measured 26 and 50 ms for "
    "BatchWeave against WebDataset's 21 and 30 ms (the only target missed in each; 23 of 24 "
    "met); the run in the tables above is the first with that change.",
    "The consumer's staggered ramp-up (one more step in flight per two delivered) costs in "
    "short runs such as these (12-48 steps per rank): it is what keeps a fleet of ranks from "
    "bursting the store at start.",
]


def section(
    bench: Bench,
    args: Any,
    corpora: list[Corpus],
    images: list[str],
    when: str | None = None,
    save_dir: Path | None = None,
) -> str:
    notes = bench.notes + [f"{k}: {v}" for k, v in bench.skipped.items()]
    read = Report("peers", READ_COLUMNS, rows=bench.rows, notes=notes)
    tgt = Report("peers_targets", TARGET_COLUMNS, rows=targets(bench.rows))
    write = Report(
        "peers_write",
        ["corpus", "storage", "system", "write s", "write MB/s"],
        rows=[r for r in bench.rows if r["write s"] != "-"],
    )
    mq = Report(
        "peers_mq",
        [
            "corpus",
            "system",
            "storage",
            "ingest MB/s",
            "lat p50 ms",
            "lat p95 ms",
            "rank MB/s",
            "amp",
            "note",
        ],
        rows=bench.mq_rows
        + [
            {
                "corpus": r["corpus"],
                "system": f"{r['system']} (prefetch {BW_PREFETCH})",
                "storage": r["storage"],
                "ingest MB/s": r.get("write MB/s", "-"),
                "lat p50 ms": r["lat p50 ms"],
                "lat p95 ms": r["lat p95 ms"],
                "rank MB/s": r["rank MB/s"],
                "amp": r["amp"],
            }
            for r in bench.rows
            if r["system"].startswith("batchweave") and r["write s"] != "-"
        ],
    )
    sizes = ", ".join(
        f"{c.name}: {c.steps} steps x {c.ranks} ranks x {c.batch} samples = "
        f"{c.n_samples:,} samples, {c.total_bytes / 1e9:.2f} GB"
        for c in corpora
    )
    lines = [
        "## Peers",
        "",
        "BatchWeave side by side with MosaicML Streaming, WebDataset and a message queue on the "
        "same corpus, store and machine, in one run (`nox -s peers`, i.e. `python bench/peers.py`; "
        "issue #8). Generated by `bench/peers.py` on "
        f"{when or time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}; raw numbers in "
        "`bench/results/peers*.json`.",
        "",
        f"Setup: {args.ranks} ranks as separate processes, 32 samples per rank per step, "
        f"sample sizes uniform in [avg/2, 3avg/2]. Corpora: {sizes}. Storages: "
        + ", ".join(args.storages)
        + " (SeaweedFS 4.48 `weed mini` on 127.0.0.1, started by the "
        "benchmark; `file://` reads come from the page cache for every system alike). The machine "
        "has 2 cores shared with other work, so absolute numbers are noisy; all systems ran "
        "back to back in the same run.",
        "",
        "How each system is used: BatchWeave: one producer, TGBs with dp=8/cp=1 (`tensors` codec), "
        f"one `Consumer` per rank (prefetch {BW_PREFETCH}); on SeaweedFS both of the library's S3 "
        "clients (obstore and boto3). MosaicML Streaming: `MDSWriter` (64 MB shards), "
        "`StreamingDataset(batch_size=32, shuffle=False)` per rank with its own partitioning; on "
        "S3 the shards are downloaded to a fresh local cache per run, on `file://` it reads the "
        "shard directory in place. WebDataset: tar shards of at most 100 MB, as many as a "
        "multiple of the rank count, `WebDataset(urls, nodesplitter=split_by_node)`; on S3 "
        "through `curl` on presigned URLs (WebDataset's own `http` opener). Writes are one "
        "process per system.",
        "",
        "Columns: `agg MB/s` = bytes delivered by all ranks / (last rank done - common start); "
        "`ttfb s` = slowest rank's time from start (dataset construction included) to its first "
        "batch; `amp` = bytes fetched from the store / bytes delivered (BatchWeave: every GET and "
        "range GET through a `CountingStore`, manifests and footers included; MosaicML: bytes in "
        "its local shard cache, or the shard files read in place; WebDataset: tar shard bytes "
        "streamed); CPU is user+system seconds after the start (children such as `curl` included) "
        "per GB delivered; server CPU is the SeaweedFS process's. Resume: each system restarts "
        "from the middle (after half of the steps) in fresh processes: BatchWeave "
        "`Consumer.load_state_dict`, MosaicML `StreamingDataset.load_state_dict` with "
        "`state_dict(num_samples, from_beginning=True)`, WebDataset has no resume state so the "
        "rank replays its shards and drops the samples already seen (exact, but it re-reads the "
        "first half). `resume exact` compares the sample ids every rank got after resuming with "
        "the uninterrupted run's.",
        "",
        summary(tgt.rows),
        "",
        "### Read, write and resume",
        "",
        read.markdown(),
        "",
        "### Writes",
        "",
        write.markdown(),
        "",
        "### Targets (issue #8)",
        "",
        tgt.markdown(),
        "",
    ]
    lines += [f"![{n}](img/{n})" for n in images] + [""]
    lines += [
        "### Message-queue baseline",
        "",
        "Kafka cannot be installed here; NATS JetStream (Debian `nats-server` 2.9, file storage, "
        "started by the benchmark on 127.0.0.1) stands in, as in the paper's strict-TGB Kafka "
        "setup: one message carries one whole TGB, the same single producer publishes it (and "
        "waits for the JetStream ack), and each rank's pull consumer fetches every message, "
        "parses the TGB footer and keeps its own slice. `lat` is the time a rank waited for each "
        "batch (NATS: one `fetch(1)`; BatchWeave: one `next()`, with and without prefetch). "
        "`ingest MB/s` for BatchWeave is its producer's write throughput on that store. Both "
        "sides ran one producer: the paper's ingestion gap comes from many producers committing "
        "concurrently (see the Producers section for BatchWeave's scaling), which one NATS "
        "server on this 2-core machine cannot be compared against fairly.",
        "",
        mq.markdown(),
        "",
        *[f"- {c}" for c in CITED],
        "",
        "### Where BatchWeave's time goes",
        "",
        *[f"- {paragraph}" for paragraph in PROFILE],
        "",
        "### Live producers",
        "",
        *[f"- {k}: {v}" for k, v in LIVE.items()],
        "",
        "No live-producer number is given for MosaicML or WebDataset: neither can read data that "
        "arrives during training, so there is nothing to measure.",
        "",
    ]
    if notes:
        lines += ["### Notes", "", *[f"- {n}" for n in notes], ""]
    if when is None:  # a fresh run, not a re-render
        for rep in (read, tgt, write, mq):
            rep.save(save_dir / f"{rep.name}.json" if save_dir is not None else None)
    return "\n".join(lines)


def write_section(text: str) -> None:
    """Replace the ``## Peers`` section of docs/benchmarks.md (creating the file if absent)."""
    if DOC.exists():
        doc = DOC.read_text()
    else:
        doc = "# Benchmarks\n\n" + "".join(f"## {s}\n\n" for s in SECTIONS)
    if "\n## Peers" not in "\n" + doc:
        doc = doc.rstrip("\n") + "\n\n## Peers\n"
    start = ("\n" + doc).index("\n## Peers")
    rest = doc[start + len("## Peers") :]
    nxt = rest.find("\n## ")
    tail = rest[nxt + 1 :] if nxt >= 0 else ""
    DOC.write_text(doc[:start] + text.rstrip("\n") + "\n\n" + tail)


# -- main -----------------------------------------------------------------------------------------


def render(args: Any, corpora: list[Corpus]) -> None:
    """Rewrite the doc section and plots from the JSON of the last run (same arguments)."""
    saved = json.loads((RESULTS_DIR / "peers.json").read_text())
    mq = json.loads((RESULTS_DIR / "peers_mq.json").read_text())["rows"]
    bench = Bench(args, Path("."), {})
    bench.rows = saved["rows"]
    bench.notes = list(saved.get("notes", []))
    bench.mq_rows = [r for r in mq if "(prefetch" not in r["system"]]
    write_section(section(bench, args, corpora, plots(bench.rows), when=saved.get("when")))
    print(f"rewrote the Peers section of {DOC} from {RESULTS_DIR}/peers*.json")


def main() -> None:
    p = parser("BatchWeave side by side with MosaicML Streaming, WebDataset and NATS (issue #8)")
    p.add_argument("--storages", default="file,seaweedfs")
    p.add_argument("--corpora", default="100KB,1MB")
    p.add_argument("--steps", type=json.loads, default=None, help='e.g. {"100KB": 48, "1MB": 6}')
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--systems", default="batchweave,mosaicml,webdataset,nats")
    p.add_argument(
        "--no-docs",
        action="store_true",
        help="leave docs/ and bench/results/ alone: JSON goes next to --out (or nowhere)",
    )
    p.add_argument(
        "--render",
        action="store_true",
        help="measure nothing: rebuild the doc section and plots from bench/results/peers*.json",
    )
    args = p.parse_args()
    steps = dict(DEFAULT_STEPS)
    if args.smoke:
        args.storages, args.ranks, args.no_docs, args.corpora = "file", 2, True, "100KB"
        steps = {"100KB": 4, "1MB": 2}
        AVG.update({"100KB": 20_000, "1MB": 100_000})
    steps.update(args.steps or {})
    args.storages = args.storages.split(",")
    systems = args.systems.split(",")
    corpora = [
        Corpus(name, AVG[name], steps[name], ranks=args.ranks) for name in args.corpora.split(",")
    ]
    if args.render:
        render(args, corpora)
        return
    clients = ("obstore", "boto3") if obstore_available() else ("boto3",)
    started = time.monotonic()
    with (
        tempfile.TemporaryDirectory(prefix="bw-peers-") as tmp,
        storages(args.storages, clients=clients) as specs,
    ):
        bench = Bench(args, Path(tmp), specs)
        bench.skipped.update(unavailable())
        for corpus in corpora:
            for storage in args.storages:
                for system in ("batchweave", "mosaicml", "webdataset"):
                    if system in systems and system not in bench.skipped:
                        getattr(bench, system)(corpus, storage)
            if "nats" in systems and "nats" not in bench.skipped:
                bench.nats(corpus)
    bench.log(f"done in {time.monotonic() - started:.0f}s")
    report = Report("peers", READ_COLUMNS, rows=bench.rows, notes=bench.notes)
    print(report.markdown())
    print(Report("peers_targets", TARGET_COLUMNS, rows=targets(bench.rows)).markdown())
    if args.smoke:
        report.save(args.out or Path(tmp).parent / "bw-peers-smoke.json")
        return
    if args.no_docs:
        if args.out is not None:
            section(bench, args, corpora, [], save_dir=args.out.parent)
            print(f"results in {args.out.parent}")
        return
    text = section(bench, args, corpora, plots(bench.rows))
    write_section(text)
    print(f"wrote the Peers section of {DOC}")


if __name__ == "__main__":
    main()

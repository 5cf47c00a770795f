"""BatchWeave side by side with MosaicML Streaming, WebDataset and a message queue (issue #8).

One synthetic corpus of variable-size samples (``bench/_peers_corpus.py``) is written by each
system to the same store, then read back by ``--ranks`` separate rank processes (default 8) with
a per-rank batch of 32 samples per step, the way each system is meant to be used:

- **batchweave**: one producer writes TGBs with ``dp=8, cp=1`` (slice ``r`` is rank ``r``'s
  32-sample batch, ``tensors`` codec); each rank runs a ``Consumer`` (one range read per slice).
  On SeaweedFS both S3 clients of the library are measured (obstore and boto3).
- **mosaicml**: ``MDSWriter`` shards (its default 64 MB ``size_limit``), read by
  ``StreamingDataset(batch_size=32, shuffle=False)`` in each rank (its own partitioning, shards
  cached to a fresh local directory; on ``file://`` it reads the shard directory in place).
- **webdataset**: tar shards of at most ~100 MB (a multiple of the rank count), read with
  ``WebDataset(urls, nodesplitter=split_by_node)``; on S3 through ``curl`` on presigned URLs.
- **nats** (message-queue baseline, the paper's Kafka setup): one JetStream message carries one
  whole TGB; each rank fetches every message and keeps its slice.

Reported per (corpus, storage, system): write time, per-rank and aggregate MB/s, the slowest rank,
time to first batch, bytes fetched / bytes delivered, peak RSS, client and server CPU seconds per
GB delivered, and a resume from the middle (time to first batch, and whether the resumed sequence
equals the uninterrupted one).

    python bench/peers.py            # default sizes (see DEFAULT_STEPS), writes docs/benchmarks.md
    python bench/peers.py --smoke    # seconds: tiny corpus, 2 ranks, file:// only, no docs
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _peers_bench import main

    main()

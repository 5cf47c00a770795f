"""The two dependent reads of a step (footer, then slice) overlap with other steps' reads.

Each step is a new TGB, so while streaming every step needs a footer read before its slice read.
Once the prefetch window holds several steps, the footer read of a later step must be issued
while an earlier step's slice read is still in flight, not after it.
"""

from __future__ import annotations

import threading

from batchweave import Consumer, MemoryStore, Mesh, Producer
from batchweave._manifest._log import ManifestLog
from batchweave._store._base import Bounded, ByteRange


class _GatedStore(MemoryStore):
    """Holds the slice read of ``gated_key`` until the footer of ``footer_key`` is requested."""

    def __init__(self) -> None:
        super().__init__()
        self.gated_key = ""
        self.gated_footer_offset = -1
        self.footer_key = ""
        self.footer_offset = -1
        self.footer_requested = threading.Event()
        self.overlapped: bool | None = None

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        if key == self.footer_key and isinstance(rng, Bounded) and rng.start == self.footer_offset:
            self.footer_requested.set()
        elif (
            key == self.gated_key
            and isinstance(rng, Bounded)
            and rng.start != self.gated_footer_offset
            and self.overlapped is None
        ):
            # Generous bound: only reached if the footer read is never issued concurrently.
            self.overlapped = self.footer_requested.wait(timeout=10)
        return super().get_range(key, rng)


def test_next_steps_footer_read_overlaps_the_current_steps_slice_read() -> None:
    store = _GatedStore()
    mesh = Mesh(dp=2)
    # slice_table_limit=0: consumers read footers, the two-request path this test is about.
    with Producer(
        store, "run", producer_id="p", mesh=mesh, policy="naive", slice_table_limit=0
    ) as producer:
        for offset in range(4):
            producer.append([bytes([offset, d]) * 64 for d in range(2)], offset=offset)
        producer.seal()
    log = ManifestLog(store, "run")
    manifest = log.latest()
    step1, step2 = (log.descriptor(manifest, s).objects[0] for s in (1, 2))
    store.gated_key = log.key(step1.key)
    store.gated_footer_offset = step1.footer_offset
    store.footer_key = log.key(step2.key)
    store.footer_offset = step2.footer_offset

    # ramp_every=1: the window grows to two steps after the first delivery, so steps 1 and 2
    # are in flight together and step 1's slice read waits for step 2's footer read.
    with Consumer(
        store,
        "run",
        mesh=mesh,
        dp_rank=1,
        prefetch=2,
        ramp_every=1,
        prefetch_min_latency=0,
        max_process_reads=1 << 30,  # however many consumers other tests left open
    ) as consumer:
        got = [data for _, data in consumer]

    assert got == [bytes([offset, 1]) * 64 for offset in range(4)]
    assert store.overlapped is True

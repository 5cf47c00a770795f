"""XXH3-64 end to end: a producer opting in, consumers verifying it, corruption still caught.

The format-level properties (round trips, every byte flip, trailer ids and versions) run for
every algorithm in ``test_format_tgb.py``; this file covers what only a whole namespace shows:
the option reaching every TGB, the 64-bit compact slice tables in the manifest, and consumers
reading and verifying xxh3 objects on the fast (slice table) and footer paths.
"""

from __future__ import annotations

import base64
import json

import pytest
from pydantic import ValidationError

from batchweave import (
    Consumer,
    MemoryStore,
    Mesh,
    ObjectStore,
    Producer,
    encode_tgb,
    read_footer,
)
from batchweave._format import checksum
from batchweave._manifest import SliceTable
from batchweave._manifest._log import ManifestLog

NS = "runs/xxh3"
MESH = Mesh(dp=2, cp=2)
TGBS = 3


def payload(offset: int, index: int) -> bytes:
    return f"{offset}/{index};".encode().ljust(40 + index, b"#")


def produce(store: ObjectStore, *, slice_table_limit: int) -> None:
    with Producer(
        store,
        NS,
        producer_id="p0",
        mesh=MESH,
        policy="naive",
        checksum_algo="xxh3",
        slice_table_limit=slice_table_limit,
    ) as p:
        for offset in range(TGBS):
            p.append([payload(offset, i) for i in range(MESH.slices)], offset=offset)
        p.seal()


def object_key(store: ObjectStore, step: int) -> str:
    log = ManifestLog(store, NS)
    return log.key(log.descriptor(log.latest(), step).objects[0].key)


@pytest.mark.parametrize("slice_table_limit", [32, 0], ids=["slice-table", "footer"])
def test_every_rank_reads_xxh3_data_exactly(store: ObjectStore, slice_table_limit: int) -> None:
    produce(store, slice_table_limit=slice_table_limit)
    for index in range(MESH.slices):
        d, c = divmod(index, MESH.cp)
        with Consumer(store, NS, mesh=MESH, dp_rank=d, cp_rank=c) as consumer:
            got = list(consumer)
        assert got == [(step, payload(step, index)) for step in range(TGBS)]


def test_every_tgb_and_slice_table_uses_xxh3_with_64_bit_checksums() -> None:
    store = MemoryStore()
    produce(store, slice_table_limit=32)
    log = ManifestLog(store, NS)
    manifest = log.latest()
    for step in range(TGBS):
        ref = log.descriptor(manifest, step).objects[0]
        footer = read_footer(store, log.key(ref.key))
        assert (footer.checksum_algo, footer.format_version) == ("xxh3", 2)
        assert [e.checksum for e in footer.slices] == [
            checksum(payload(step, i), "xxh3") for i in range(MESH.slices)
        ]
        table = ref.slices
        assert table is not None
        assert table.checksum_algo == "xxh3"
        assert table.checksums == tuple(e.checksum for e in footer.slices)
        stored = json.loads(table.model_dump_json())
        assert len(base64.b64decode(stored["checksums"])) == 8 * MESH.slices


def test_a_ready_made_tgb_keeps_its_own_algorithm() -> None:
    store = MemoryStore()
    with Producer(
        store, NS, producer_id="p0", mesh=MESH, policy="naive", checksum_algo="xxh3"
    ) as p:
        p.append([payload(0, i) for i in range(MESH.slices)], offset=0)
        built = [payload(1, i) for i in range(MESH.slices)]
        p.append(encode_tgb(built, MESH, checksum_algo="crc32c"), offset=1)
        p.seal()
    algos = [read_footer(store, object_key(store, step)).checksum_algo for step in (0, 1)]
    assert algos == ["xxh3", "crc32c"]
    with Consumer(store, NS, mesh=MESH, dp_rank=1, cp_rank=1) as consumer:
        assert list(consumer) == [(0, payload(0, 3)), (1, payload(1, 3))]


def test_a_slice_table_with_an_unknown_algorithm_asks_for_an_upgrade() -> None:
    # What a future algorithm looks like to this version (and xxh3 to the versions before it).
    store = MemoryStore()
    produce(store, slice_table_limit=32)
    log = ManifestLog(store, NS)
    table = log.descriptor(log.latest(), 0).objects[0].slices
    assert table is not None
    doc = json.loads(table.model_dump_json()) | {"checksum_algo": "xxh4"}
    with pytest.raises(ValidationError, match=r"'xxh4'.*upgrade batchweave"):
        SliceTable.model_validate(doc)

"""The slice table a manifest descriptor may carry: a faithful, validated copy of the footer."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from batchweave import Mesh
from batchweave._format import CHECKSUM_ALGOS, SliceEntry, TgbBuilder, TgbFooter
from batchweave._manifest import SliceTable, TgbObjectRef


@settings(max_examples=60, deadline=None)
@given(
    dp=st.integers(1, 6),
    cp=st.integers(1, 3),
    codec=st.sampled_from(["raw", "tensors"]),
    compression=st.sampled_from([None, "zstd"]),
    algo=st.sampled_from(CHECKSUM_ALGOS),
    data=st.data(),
)
def test_table_entries_equal_the_footer_entries(
    dp: int, cp: int, codec: str, compression: str | None, algo: str, data: st.DataObject
) -> None:
    mesh = Mesh(dp=dp, cp=cp)
    builder = TgbBuilder(mesh, codec=codec, compression=compression, checksum_algo=algo)  # type: ignore[arg-type]
    for i in range(mesh.slices):
        raw = bytes([i % 256]) * data.draw(st.integers(0, 300))
        payload: object = {"x": np.frombuffer(raw, dtype=np.uint8)} if codec == "tensors" else raw
        builder.set_slice(*divmod(i, cp), payload)
    encoded = builder.build()
    table = SliceTable.from_footer(encoded.footer)
    assert table is not None
    assert [table.span(i) for i in range(mesh.slices)] == [
        (e.offset, e.length, e.uncompressed_length, e.checksum) for e in encoded.footer.slices
    ]
    assert table.sample_counts == tuple(e.sample_count for e in encoded.footer.slices)
    assert table.payload_length == encoded.footer_offset
    assert (table.codec, table.compression, table.checksum_algo) == (
        encoded.footer.codec,
        encoded.footer.compression,
        encoded.footer.checksum_algo,
    )
    assert SliceTable.model_validate_json(table.model_dump_json()) == table


def _footer(entries: list[tuple[int, int]]) -> TgbFooter:
    return TgbFooter(
        format_version=1,
        mesh=Mesh(dp=len(entries)),
        codec="raw",
        checksum_algo="crc32c",
        payload_length=max(o + n for o, n in entries),
        slices=tuple(
            SliceEntry(offset=o, length=n, uncompressed_length=n, checksum=0, sample_count=1)
            for o, n in entries
        ),
    )


def test_a_footer_with_gaps_between_slices_gets_no_table() -> None:
    assert SliceTable.from_footer(_footer([(0, 4), (4, 4)])) is not None
    assert SliceTable.from_footer(_footer([(0, 4), (8, 4)])) is None  # padded layout
    assert SliceTable.from_footer(_footer([(2, 4), (6, 4)])) is None  # not from byte 0


BASE = {
    "codec": "raw",
    "checksum_algo": "crc32c",
    "lengths": [3, 4],
    "checksums": [1, 2],
    "sample_counts": [1, 1],
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"checksums": [1]}, "column"),
        ({"sample_counts": [1, 1, 1]}, "column"),
        ({"codec": "pickle"}, "unknown codec"),
        ({"compression": "lz4", "uncompressed_lengths": [3, 4]}, "unknown compression"),
        ({"compression": "zstd"}, "uncompressed_lengths"),
        ({"uncompressed_lengths": [3, 4]}, "uncompressed_lengths"),
        ({"lengths": [3, -4]}, "greater than or equal to 0"),
        ({"checksums": [1, 1 << 32]}, "does not fit crc32c"),
        ({"lengths": []}, "at least 1"),
    ],
)
def test_an_inconsistent_table_is_refused(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        SliceTable.model_validate({**BASE, **change})


def test_a_table_must_match_its_object_reference() -> None:
    table = SliceTable.model_validate(BASE)
    fields = {"key": "k", "size": 100, "footer_length": 9, "footer_checksum": 0}
    TgbObjectRef(**fields, slice_count=2, footer_offset=7, slices=table)
    with pytest.raises(ValidationError, match="2 entries, slice_count is 3"):
        TgbObjectRef(**fields, slice_count=3, footer_offset=7, slices=table)
    with pytest.raises(ValidationError, match="ends at byte 7, the footer starts at 8"):
        TgbObjectRef(**fields, slice_count=2, footer_offset=8, slices=table)


def test_a_wide_table_of_equal_slices_is_compact_on_disk() -> None:
    n = 128
    table = SliceTable(
        codec="raw",
        checksum_algo="crc32c",
        lengths=(100_000,) * n,
        checksums=tuple(range(0xFFFF_FF00, 0xFFFF_FF00 + n)),
        sample_counts=(1,) * n,
    )
    body = json.loads(table.model_dump_json())
    assert body["count"] == n
    assert body["lengths"] == 100_000
    assert body["sample_counts"] == 1
    assert isinstance(body["checksums"], str)
    assert "compression" not in body
    assert "uncompressed_lengths" not in body
    assert len(table.model_dump_json()) < 6 * n + 150  # 4 packed bytes a slice, base64
    assert SliceTable.model_validate_json(table.model_dump_json()) == table


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"checksums": "AAAAAQ=="}, "4 packed bytes, expected 2 slices x 4 bytes"),
        ({"checksums": "not base64!"}, "checksums"),
        ({"count": 3}, "lengths has 2 entries, count is 3"),
        ({"count": 0}, "count must be a positive integer"),
        ({"count": "2"}, "count must be a positive integer"),
        ({"sample_counts": -1}, "greater than or equal to 0"),
    ],
)
def test_an_inconsistent_compact_table_is_refused(change: dict[str, object], message: str) -> None:
    compact = {**BASE, "count": 2, "checksums": "AAAAAQAAAAI=", **change}
    with pytest.raises(ValidationError, match=message):
        SliceTable.model_validate(compact)


def test_compact_and_list_forms_decode_to_the_same_table() -> None:
    compact = {**BASE, "count": 2, "checksums": "AAAAAQAAAAI=", "sample_counts": 1}
    assert SliceTable.model_validate(compact) == SliceTable.model_validate(BASE)

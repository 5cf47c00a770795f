"""Checksums: known vectors, buffer types, and detection of every single-byte error."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchweave._format import CHECKSUM_ALGOS, ChecksumAlgo, checksum, checksum_bits


def test_known_vectors() -> None:
    # CRC-32C check value (RFC 3720 / iSCSI); XXH64 and XXH3-64 of the empty input with seed 0
    # (docs/format.md documents the same values).
    assert checksum(b"123456789", "crc32c") == 0xE3069283
    assert checksum(b"123456789") == 0xE3069283, "crc32c is the default"
    assert checksum(b"", "xxhash64") == 0xEF46DB3751D8E999
    assert checksum(b"", "xxh3") == 0x2D06800538D394C2


def test_every_algorithm_has_a_width() -> None:
    assert {algo: checksum_bits(algo) for algo in CHECKSUM_ALGOS} == {
        "crc32c": 32,
        "xxhash64": 64,
        "xxh3": 64,
    }


@pytest.mark.parametrize("algo", CHECKSUM_ALGOS)
def test_every_buffer_type_gives_the_same_value(algo: ChecksumAlgo) -> None:
    data = bytes(range(256)) * 9000  # > 1 MiB: exercises chunked CRC of non-bytes buffers
    expected = checksum(data, algo)
    assert checksum(bytearray(data), algo) == expected
    assert checksum(memoryview(data), algo) == expected
    assert checksum(memoryview(b"x" + data)[1:], algo) == expected
    assert 0 <= expected < 1 << checksum_bits(algo)


def test_unknown_algorithm_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown checksum algorithm 'md5'"):
        checksum(b"x", "md5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown checksum algorithm"):
        checksum_bits("sha1")  # type: ignore[arg-type]


@settings(max_examples=200)
@given(
    data=st.binary(min_size=1, max_size=300),
    pos=st.integers(min_value=0),
    xor=st.integers(min_value=1, max_value=255),
    algo=st.sampled_from(CHECKSUM_ALGOS),
)
def test_any_single_byte_change_changes_the_checksum(
    data: bytes, pos: int, xor: int, algo: ChecksumAlgo
) -> None:
    flipped = bytearray(data)
    flipped[pos % len(data)] ^= xor
    assert checksum(bytes(flipped), algo) != checksum(data, algo)

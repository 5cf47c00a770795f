"""Checksums for stored bytes: CRC-32C by default, XXH64 and XXH3-64 as 64-bit options.

One place decides which algorithms exist and how they are computed, so TGB slices, TGB footers
and manifests all agree. Values are plain unsigned integers: CRC-32C fits in 32 bits, XXH64 and
XXH3-64 (both seed 0) in 64. XXH3-64 is the cheapest to verify by far (about 4x cheaper than
CRC-32C per byte), which matters to readers whose reads are CPU-bound (page cache, local NVMe).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Final, Literal, get_args

import crc32c
import xxhash

__all__ = [
    "CHECKSUM_ALGOS",
    "DEFAULT_CHECKSUM_ALGO",
    "ChecksumAlgo",
    "checksum",
    "checksum_bits",
]

ChecksumAlgo = Literal["crc32c", "xxhash64", "xxh3"]
"""Name of a checksum algorithm, as stored in footers and manifests."""

CHECKSUM_ALGOS: Final[tuple[ChecksumAlgo, ...]] = get_args(ChecksumAlgo)
DEFAULT_CHECKSUM_ALGO: Final[ChecksumAlgo] = "crc32c"

_BITS: Final[dict[ChecksumAlgo, int]] = {"crc32c": 32, "xxhash64": 64, "xxh3": 64}


# All read any contiguous buffer in place (no copy) and return plain ints; crc32c releases the
# GIL on large buffers, so rank threads verify slices in parallel.
_FUNCTIONS: Final[dict[str, Callable[[bytes | bytearray | memoryview], int]]] = {
    "crc32c": crc32c.crc32c,
    "xxhash64": xxhash.xxh64_intdigest,
    "xxh3": xxhash.xxh3_64_intdigest,
}


def checksum(data: bytes | bytearray | memoryview, algo: ChecksumAlgo = "crc32c") -> int:
    """Return the checksum of ``data`` under ``algo`` as an unsigned integer.

    ``crc32c`` is CRC-32C (Castagnoli, as in iSCSI, ext4 and GCS object hashes); ``xxhash64`` is
    XXH64 with seed 0; ``xxh3`` is XXH3-64 with seed 0 (output stable since xxHash 0.8.0).
    CRC-32C detects every error burst of up to 32 bits; the 64-bit hashes miss a given
    corruption with a probability of about 2^-64.
    """
    try:
        function = _FUNCTIONS[algo]
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {algo!r}; expected one of {CHECKSUM_ALGOS}"
        ) from None
    return function(data)


def checksum_bits(algo: ChecksumAlgo) -> int:
    """Width in bits of ``algo``'s values (32 or 64); a stored value must fit in it."""
    try:
        return _BITS[algo]
    except KeyError:
        raise ValueError(
            f"unknown checksum algorithm {algo!r}; expected one of {CHECKSUM_ALGOS}"
        ) from None

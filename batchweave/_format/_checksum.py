"""Checksums for stored bytes: CRC-32C by default, XXH64 as a faster 64-bit option.

One place decides which algorithms exist and how they are computed, so TGB slices, TGB footers
and (later) manifests all agree. Values are plain unsigned integers: CRC-32C fits in 32 bits,
XXH64 (seed 0) in 64.
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

ChecksumAlgo = Literal["crc32c", "xxhash64"]
"""Name of a checksum algorithm, as stored in footers and manifests."""

CHECKSUM_ALGOS: Final[tuple[ChecksumAlgo, ...]] = get_args(ChecksumAlgo)
DEFAULT_CHECKSUM_ALGO: Final[ChecksumAlgo] = "crc32c"

_BITS: Final[dict[ChecksumAlgo, int]] = {"crc32c": 32, "xxhash64": 64}


# Both read any contiguous buffer in place (no copy); crc32c releases the GIL on large ones, so
# rank threads verify slices in parallel. Both return plain ints.
_FUNCTIONS: Final[dict[str, Callable[[bytes | bytearray | memoryview], int]]] = {
    "crc32c": crc32c.crc32c,
    "xxhash64": xxhash.xxh64_intdigest,
}


def checksum(data: bytes | bytearray | memoryview, algo: ChecksumAlgo = "crc32c") -> int:
    """Return the checksum of ``data`` under ``algo`` as an unsigned integer.

    ``crc32c`` is CRC-32C (Castagnoli, as in iSCSI, ext4 and GCS object hashes); ``xxhash64`` is
    XXH64 with seed 0. Both detect every single-byte error.
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

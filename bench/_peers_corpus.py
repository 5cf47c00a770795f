"""The synthetic corpus every system in ``bench/peers.py`` writes and reads: same bytes for all.

Sample ``i`` has a size drawn uniformly from ``[avg/2, 3*avg/2]`` (seeded) and starts with its id
as 8 little-endian bytes, followed by incompressible bytes cut from a seeded random pool. Readers
recover the id from the payload itself, so comparing sequences (uninterrupted vs resumed) needs no
side channel and any corruption shows up as a wrong id.

Global order: step ``s`` holds samples ``s*W*B ... (s+1)*W*B - 1`` and rank ``r``'s batch in it is
``s*W*B + r*B ...`` (``W`` ranks, ``B`` samples per rank per step): that is exactly a TGB with
``dp=W`` whose slice ``r`` is rank ``r``'s batch.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

_ID = struct.Struct("<Q")
_POOL = 64 << 20


@dataclass(frozen=True)
class Corpus:
    """``steps`` global batches of ``ranks * batch`` samples averaging ``avg_bytes`` each."""

    name: str
    avg_bytes: int
    steps: int
    ranks: int = 8
    batch: int = 32
    seed: int = 42

    @property
    def n_samples(self) -> int:
        return self.steps * self.ranks * self.batch

    @cached_property
    def sizes(self) -> np.ndarray:
        rng = np.random.default_rng(self.seed)
        lo, hi = self.avg_bytes // 2, self.avg_bytes * 3 // 2
        return rng.integers(lo, hi + 1, size=self.n_samples, dtype=np.int64)

    @cached_property
    def _pool(self) -> bytes:
        return np.random.default_rng(self.seed + 1).bytes(_POOL + int(self.sizes.max()))

    @property
    def total_bytes(self) -> int:
        return int(self.sizes.sum())

    def sample(self, i: int) -> bytes:
        size = int(self.sizes[i])
        start = (i * 1_048_573) % _POOL
        return _ID.pack(i) + self._pool[start : start + size - _ID.size]

    def samples(self, start: int = 0) -> Iterator[tuple[int, bytes]]:
        for i in range(start, self.n_samples):
            yield i, self.sample(i)

    def rank_batch(self, step: int, rank: int) -> list[int]:
        """Sample ids of ``rank``'s batch at ``step`` in the TGB layout."""
        first = (step * self.ranks + rank) * self.batch
        return list(range(first, first + self.batch))


def sample_id(payload: bytes | memoryview) -> int:
    """The id stored in a sample's first 8 bytes."""
    return int(_ID.unpack_from(payload, 0)[0])


def pack_batch(samples: list[bytes]) -> dict[str, np.ndarray]:
    """One rank's batch as BatchWeave ``tensors``: the bytes back to back plus offsets."""
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in samples])
    return {"data": np.frombuffer(b"".join(samples), dtype=np.uint8), "offsets": offsets}


def unpack_batch(tensors: dict[str, np.ndarray]) -> list[memoryview]:
    """Zero-copy views of the samples of a decoded batch."""
    data = memoryview(tensors["data"]).cast("B")
    off = tensors["offsets"].tolist()
    return [data[off[k] : off[k + 1]] for k in range(len(off) - 1)]

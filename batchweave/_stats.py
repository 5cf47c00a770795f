"""Small statistics shared by the library's reports (``batchweave check``, the DAC simulator)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["nearest_rank"]


def nearest_rank(sorted_values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (``0 < q <= 1``) of ascending values; NaN when empty.

    The smallest value with at least ``q`` of the values at or below it: an observed value,
    never an interpolation, so a p95 of 20 latencies is the 19th.
    """
    if not sorted_values:
        return math.nan
    return sorted_values[max(0, math.ceil(q * len(sorted_values)) - 1)]

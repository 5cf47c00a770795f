"""The nearest-rank quantile ``batchweave check`` and the DAC simulator report."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from batchweave._stats import nearest_rank


@given(
    st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50),
    st.floats(0.01, 1.0),
)
def test_it_is_the_smallest_value_with_q_of_the_values_at_or_below_it(
    values: list[float], q: float
) -> None:
    ordered = sorted(values)
    got = nearest_rank(ordered, q)
    assert got in ordered
    assert sum(v <= got for v in ordered) >= q * len(ordered)
    assert sum(v < got for v in ordered) < q * len(ordered)


def test_known_ranks_and_empty() -> None:
    twenty = [float(i) for i in range(1, 21)]
    assert nearest_rank(twenty, 0.95) == 19.0
    assert nearest_rank(twenty, 0.5) == 10.0
    assert nearest_rank([3.0], 0.5) == 3.0
    assert math.isnan(nearest_rank([], 0.5))

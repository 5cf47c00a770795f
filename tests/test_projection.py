"""Rank coordinates and the step/slice projection: pure arithmetic, checked exhaustively."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchweave import Mesh, RankCoordinates, coordinates_for_rank, coordinates_from_env
from batchweave._projection import Projection

# ---------------------------------------------------------------------------------------------
# coordinates


def test_default_order_is_tp_fastest_then_cp_dp_pp() -> None:
    mesh = Mesh(dp=4, cp=2)
    coords = [coordinates_for_rank(r, 32, mesh=mesh, tp=2, pp=2) for r in range(32)]
    assert coords[0] == RankCoordinates(0, 32, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=0)
    assert coords[1] == RankCoordinates(1, 32, dp_rank=0, cp_rank=0, tp_rank=1, pp_rank=0)
    assert coords[2] == RankCoordinates(2, 32, dp_rank=0, cp_rank=1, tp_rank=0, pp_rank=0)
    assert coords[4] == RankCoordinates(4, 32, dp_rank=1, cp_rank=0, tp_rank=0, pp_rank=0)
    assert coords[16] == RankCoordinates(16, 32, dp_rank=0, cp_rank=0, tp_rank=0, pp_rank=1)
    assert coords[31] == RankCoordinates(31, 32, dp_rank=3, cp_rank=1, tp_rank=1, pp_rank=1)
    grid = Counter((c.dp_rank, c.cp_rank, c.tp_rank, c.pp_rank) for c in coords)
    assert len(grid) == 32
    assert set(grid.values()) == {1}
    # every (dp, cp) slice is read by exactly its tp x pp peers
    peers = Counter((c.dp_rank, c.cp_rank) for c in coords)
    assert peers == {(d, c): 4 for d in range(4) for c in range(2)}


def test_custom_order() -> None:
    mesh = Mesh(dp=2, cp=2)
    c = coordinates_for_rank(1, 8, mesh=mesh, tp=2, order="dp-tp-cp-pp")
    assert (c.dp_rank, c.tp_rank, c.cp_rank) == (1, 0, 0)
    c = coordinates_for_rank(6, 8, mesh=mesh, tp=2, order="dp-tp-cp-pp")
    assert (c.dp_rank, c.tp_rank, c.cp_rank) == (0, 1, 1)


def test_from_env() -> None:
    mesh = Mesh(dp=2, cp=1)
    c = coordinates_from_env(mesh, tp=2, environ={"RANK": "3", "WORLD_SIZE": "4"})
    assert (c.dp_rank, c.cp_rank, c.tp_rank) == (1, 0, 1)


@pytest.mark.parametrize(
    ("environ", "match"),
    [
        ({}, "RANK is not set"),
        ({"RANK": "0"}, "WORLD_SIZE is not set"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "not an integer"),
        ({"RANK": "0", "WORLD_SIZE": "6"}, "WORLD_SIZE=6 does not match"),
        ({"RANK": "4", "WORLD_SIZE": "4"}, "outside"),
    ],
)
def test_from_env_errors(environ: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        coordinates_from_env(Mesh(dp=2, cp=2), environ=environ)


def test_bad_order() -> None:
    with pytest.raises(ValueError, match="exactly once"):
        coordinates_for_rank(0, 4, mesh=Mesh(dp=4), order="tp-dp-pp")


# ---------------------------------------------------------------------------------------------
# projection: worked examples


def test_identity_projection() -> None:
    p = Projection(stored=Mesh(dp=4, cp=2), consumer=Mesh(dp=4, cp=2))
    loc = p.locate(7, 3, 1)
    assert (loc.tgb_step, loc.replica, loc.slices) == (7, 3, (7,))
    assert p.tgb_span(7) == (7, 8)
    assert p.end_step(10) == 10


def test_dp_doubled_reads_two_tgbs_per_step() -> None:
    p = Projection(stored=Mesh(dp=4, cp=2), consumer=Mesh(dp=8, cp=2))
    assert [p.locate(3, r, 0).tgb_step for r in range(8)] == [6, 6, 6, 6, 7, 7, 7, 7]
    assert [p.locate(3, r, 1).slices for r in range(8)] == [(1,), (3,), (5,), (7,)] * 2
    assert p.tgb_span(3) == (6, 8)
    assert p.end_step(7) == 3  # step 3 needs TGB 7 too
    assert p.end_step(8) == 4


def test_dp_halved_reads_alternate_replicas() -> None:
    p = Projection(stored=Mesh(dp=4, cp=1), consumer=Mesh(dp=2, cp=1))
    assert [(p.locate(s, 0, 0).tgb_step, p.locate(s, 0, 0).replica) for s in range(4)] == [
        (0, 0),
        (0, 2),
        (1, 0),
        (1, 2),
    ]
    assert [p.locate(s, 1, 0).replica for s in range(4)] == [1, 3, 1, 3]
    assert p.end_step(3) == 6


def test_cp_halved_reads_consecutive_chunks() -> None:
    p = Projection(stored=Mesh(dp=2, cp=4), consumer=Mesh(dp=2, cp=2))
    assert p.chunks_per_rank == 2
    assert p.locate(0, 1, 0).slices == (4, 5)
    assert p.locate(0, 1, 1).slices == (6, 7)


def test_cp_must_divide_stored_cp() -> None:
    with pytest.raises(ValueError, match=r"cp=4 must divide the stored cp=2"):
        Projection(stored=Mesh(dp=2, cp=2), consumer=Mesh(dp=2, cp=4))
    with pytest.raises(ValueError, match=r"cp=2 must divide the stored cp=3"):
        Projection(stored=Mesh(dp=2, cp=3), consumer=Mesh(dp=2, cp=2))


def test_locate_rejects_foreign_ranks_and_early_steps() -> None:
    p = Projection(stored=Mesh(dp=4), consumer=Mesh(dp=4), anchor_step=5, anchor_replica=20)
    with pytest.raises(ValueError, match="dp_rank 4"):
        p.locate(5, 4, 0)
    with pytest.raises(ValueError, match="cp_rank 1"):
        p.locate(5, 0, 1)
    with pytest.raises(ValueError, match="precedes"):
        p.locate(4, 0, 0)


def test_rebase_continues_the_data() -> None:
    p = Projection(stored=Mesh(dp=4), consumer=Mesh(dp=4))
    q = p.rebase(10, Mesh(dp=8))
    assert (q.anchor_step, q.anchor_replica) == (10, 40)
    assert q.locate(10, 0, 0).tgb_step == 10
    assert q.locate(11, 7, 0).tgb_step == 13
    assert p.rebase(10, Mesh(dp=4)) is p


# ---------------------------------------------------------------------------------------------
# projection: properties

meshes = st.builds(Mesh, dp=st.integers(1, 8), cp=st.sampled_from([1, 2, 4]))


@st.composite
def projections(draw: st.DrawFn) -> Projection:
    stored = draw(meshes)
    cp = draw(st.sampled_from([c for c in (1, 2, 4) if stored.cp % c == 0]))
    consumer = Mesh(dp=draw(st.integers(1, 8)), cp=cp)
    anchor_step = draw(st.integers(0, 5))
    anchor_replica = draw(st.integers(0, 12))
    return Projection(stored, consumer, anchor_step=anchor_step, anchor_replica=anchor_replica)


def _read_by_all_ranks(p: Projection, steps: range) -> Counter[tuple[int, int]]:
    reads: Counter[tuple[int, int]] = Counter()
    for s in steps:
        for d in range(p.consumer.dp):
            for c in range(p.consumer.cp):
                loc = p.locate(s, d, c)
                assert list(loc.slices) == list(
                    range(loc.slices[0], loc.slices[0] + len(loc.slices))
                )
                reads.update((loc.tgb_step, i) for i in loc.slices)
    return reads


def _all_slices(stored: Mesh, first_replica: int, end_replica: int) -> Counter[tuple[int, int]]:
    """Every slice of global replica slices [first_replica, end_replica), once."""
    return Counter(
        (g // stored.dp, (g % stored.dp) * stored.cp + c)
        for g in range(first_replica, end_replica)
        for c in range(stored.cp)
    )


@settings(max_examples=200, deadline=None)
@given(p=projections(), n=st.integers(0, 12))
def test_every_slice_read_exactly_once(p: Projection, n: int) -> None:
    """All ranks over n logical steps read each slice of the covered replicas exactly once."""
    reads = _read_by_all_ranks(p, range(p.anchor_step, p.anchor_step + n))
    end = p.anchor_replica + n * p.consumer.dp
    assert reads == _all_slices(p.stored, p.anchor_replica, end)


@pytest.mark.parametrize(("dp", "cp"), [(8, 2), (2, 2), (4, 1), (8, 1), (2, 1)])
def test_resharding_from_4x2_covers_whole_tgbs(dp: int, cp: int) -> None:
    """DP 4->8 / 4->2 and CP 2->1: the TGBs covered are read completely, each slice once."""
    p = Projection(stored=Mesh(dp=4, cp=2), consumer=Mesh(dp=dp, cp=cp))
    tgbs = 8
    steps = p.end_step(tgbs)
    assert steps == tgbs * 4 // dp
    reads = _read_by_all_ranks(p, range(steps))
    assert reads == Counter((t, i) for t in range(tgbs) for i in range(8))


@settings(max_examples=200, deadline=None)
@given(p=projections(), committed=st.integers(0, 20), s=st.integers(0, 30))
def test_end_step_is_the_first_incomplete_step(p: Projection, committed: int, s: int) -> None:
    step = p.anchor_step + s
    first, end = p.tgb_span(step)
    assert (
        first
        == p.first_tgb_step(step)
        == min(p.locate(step, r, 0).tgb_step for r in range(p.consumer.dp))
    )
    assert (end <= committed) == (step < p.end_step(committed))


@settings(max_examples=200, deadline=None)
@given(p=projections(), k=st.integers(0, 6), dp=st.integers(1, 8), n=st.integers(0, 8))
def test_rebase_neither_skips_nor_repeats(p: Projection, k: int, dp: int, n: int) -> None:
    """Steps before the switch under the old mesh plus after it under the new one read a
    contiguous run of replica slices, each slice once."""
    switch = p.anchor_step + k
    q = p.rebase(switch, Mesh(dp=dp, cp=p.consumer.cp))
    reads = _read_by_all_ranks(p, range(p.anchor_step, switch))
    reads += _read_by_all_ranks(q, range(switch, switch + n))
    end = q.global_replica(switch, 0) + n * dp
    assert q.global_replica(switch, 0) == p.anchor_replica + k * p.consumer.dp
    assert reads == _all_slices(p.stored, p.anchor_replica, end)

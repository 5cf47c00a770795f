"""Resharding and resuming through the topology projection neither skip nor repeat a slice.

Pure properties of :class:`~batchweave._projection.Projection` over random meshes, anchors and
heads of the stream, then the same promises end to end through :class:`~batchweave.Consumer`
(a namespace read by one mesh, resumed by another at any step, and the trailing partial step
picked up by a third). Then what a consumer is handed: garbage resume states are refused naming
the problem (integral floats, numpy and string ints still load), a state of another namespace or
a foreign ``cp`` is handled, a sealed stream ending mid-step warns once naming what is left, and
a reclaimed step names the first readable logical step.
"""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_consumer import parse, produce, take

import batchweave as bw
from batchweave import Consumer, ConsumerError, MemoryStore, Mesh, NamespaceMismatch
from batchweave._manifest._log import Committed, ManifestLog
from batchweave._projection import Projection, resume_anchor

# -- pure projection properties ----------------------------------------------------------------

STORED_CP = (1, 2, 3, 4, 6)


@st.composite
def meshes_for(draw: st.DrawFn, stored: Mesh, max_dp: int = 12) -> Mesh:
    """A consumer mesh that can read ``stored``: any dp, a cp dividing the stored cp."""
    cp = draw(st.sampled_from([c for c in range(1, stored.cp + 1) if stored.cp % c == 0]))
    return Mesh(dp=draw(st.integers(1, max_dp)), cp=cp)


@st.composite
def projections(draw: st.DrawFn) -> Projection:
    stored = Mesh(dp=draw(st.integers(1, 9)), cp=draw(st.sampled_from(STORED_CP)))
    return Projection(
        stored,
        draw(meshes_for(stored)),
        anchor_step=draw(st.integers(0, 1 << 40)),
        anchor_replica=draw(st.integers(0, 60)),
    )


def _ranks(mesh: Mesh) -> Iterator[tuple[int, int]]:
    return ((d, c) for d in range(mesh.dp) for c in range(mesh.cp))


def _reads(p: Projection, steps: range) -> Counter[tuple[int, int]]:
    """``(tgb_step, slice)`` pairs read by every consumer rank over ``steps``."""
    reads: Counter[tuple[int, int]] = Counter()
    for s in steps:
        for d, c in _ranks(p.consumer):
            reads.update((loc.tgb_step, i) for loc in [p.locate(s, d, c)] for i in loc.slices)
    return reads


def _slices(stored: Mesh, replicas: range) -> Counter[tuple[int, int]]:
    """Every slice of the global replica slices ``replicas``, once."""
    return Counter(
        (g // stored.dp, (g % stored.dp) * stored.cp + c)
        for g in replicas
        for c in range(stored.cp)
    )


@settings(max_examples=300, deadline=None)
@given(p=projections(), committed=st.integers(0, 14))
def test_complete_steps_and_the_undelivered_rest_partition_the_committed_stream(
    p: Projection, committed: int
) -> None:
    """At a head of ``committed`` TGBs, the steps before ``end_step`` read every slice of the
    replicas from the anchor on once, and what they leave is ``undelivered``: fewer than one
    step's replicas, every committed one."""
    end = p.end_step(committed)
    left = p.undelivered(committed)
    reads = _reads(p, range(p.anchor_step, end))
    assert reads == _slices(p.stored, range(p.anchor_replica, left.start))
    assert len(left) < p.consumer.dp
    assert left.stop == max(left.start, committed * p.stored.dp)
    if committed * p.stored.dp >= p.anchor_replica:
        assert left.start + len(left) == committed * p.stored.dp
    # a step is complete exactly when its last TGB is committed
    assert p.tgb_span(end)[1] > committed
    if end > p.anchor_step:
        assert p.tgb_span(end - 1)[1] <= committed


@settings(max_examples=300, deadline=None)
@given(p=projections(), base=st.integers(0, 20))
def test_first_step_from_is_the_first_step_clear_of_reclaimed_tgbs(
    p: Projection, base: int
) -> None:
    s = p.first_step_from(base)
    assert s >= p.anchor_step
    assert p.first_tgb_step(s) >= base
    if s > p.anchor_step:
        assert p.first_tgb_step(s - 1) < base


@settings(max_examples=200, deadline=None)
@given(data=st.data(), switches=st.integers(1, 4))
def test_a_chain_of_resizes_reads_each_slice_once(data: st.DataObject, switches: int) -> None:
    """DP and CP changed several times, each at a random step (not a multiple of any ratio):
    the steps of all the meshes together read one contiguous run of replica slices."""
    stored = Mesh(dp=data.draw(st.integers(1, 8)), cp=data.draw(st.sampled_from(STORED_CP)))
    p = Projection(stored, data.draw(meshes_for(stored)))
    start = p.anchor_step
    reads: Counter[tuple[int, int]] = Counter()
    for _ in range(switches):
        step = start + data.draw(st.integers(0, 5))
        reads += _reads(p, range(start, step))
        q = p.rebase(step, data.draw(meshes_for(stored)))
        # what a consumer state saved at ``step`` re-anchors to, with any mesh
        assert (q.anchor_step, q.anchor_replica) == resume_anchor(
            step,
            dp=p.consumer.dp,
            anchor_step=p.anchor_step,
            anchor_replica=p.anchor_replica,
            new_dp=q.consumer.dp,
        )
        assert q.global_replica(step, 0) == p.global_replica(step, 0)
        p, start = q, step
    end = start + data.draw(st.integers(0, 4))
    reads += _reads(p, range(start, end))
    assert reads == _slices(stored, range(0, p.global_replica(end, 0)))


def test_huge_steps_are_exact() -> None:
    """Python ints do not overflow, but nothing may go through a float either."""
    p = Projection(Mesh(dp=4, cp=2), Mesh(dp=8, cp=1), anchor_step=2**62, anchor_replica=2**63 + 3)
    step = 2**62 + 2**61 + 1
    g = 2**63 + 3 + (2**61 + 1) * 8 + 7
    assert p.locate(step, 7, 0) == (g // 4, g % 4, ((g % 4) * 2, (g % 4) * 2 + 1))
    assert p.end_step(g // 4 + 1) == step + 1
    assert g % 4 == 2  # replica 0 of the step reads replica slice g - 7 of TGB g // 4 - 2
    assert p.first_step_from(g // 4) == step + 1


def test_resume_anchor_refuses_a_step_before_the_anchor() -> None:
    with pytest.raises(ValueError, match="step 3 precedes the anchor step 4"):
        resume_anchor(3, dp=2, anchor_step=4, anchor_replica=8, new_dp=4)


def test_coordinates_are_plain_ints_and_a_fractional_rank_is_refused() -> None:
    """Before: ``coordinates_for_rank`` returned NumPy-integer coordinates for NumPy ranks
    (which no JSON or ``weights_only`` checkpoint takes) and float ones for ``2.0``."""
    c = bw.coordinates_for_rank(np.int64(5), np.int64(8), mesh=Mesh(dp=4, cp=2))
    assert (c.dp_rank, c.cp_rank) == (2, 1)
    assert all(type(v) is int for v in (c.rank, c.world_size, c.dp_rank, c.cp_rank, c.tp_rank))
    with pytest.raises(TypeError, match="rank must be an integer"):
        bw.coordinates_for_rank(2.0, 4, mesh=Mesh(dp=4))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="tp must be an integer"):
        bw.coordinates_for_rank(0, 4, mesh=Mesh(dp=2), tp=2.0)  # type: ignore[arg-type]


# -- end to end through consumers --------------------------------------------------------------

STORED = (Mesh(dp=4, cp=2), Mesh(dp=3, cp=1), Mesh(dp=2, cp=4), Mesh(dp=1, cp=2))
TGBS = 5  # odd: a doubled DP leaves a partial step at the end


@pytest.fixture(scope="module")
def streams() -> MemoryStore:
    """Namespace ``s{i}``: ``TGBS`` sealed TGBs of ``STORED[i]`` (step t holds offset t)."""
    store = MemoryStore()
    for i, mesh in enumerate(STORED):
        produce(store, f"s{i}", mesh, tgbs=TGBS)
    return store


def _delivered(got: list[tuple[int, Any]], stored_cp: int, mesh: Mesh, cp_rank: int) -> list[Any]:
    """The ``(offset, d, c)`` slices of ``got``, checking each step holds one replica's chunks
    ``cp_rank * k ..`` in chunk order."""
    out = []
    k = stored_cp // mesh.cp
    for _, data in got:
        chunks = [parse(x) for x in (data if isinstance(data, list) else [data])]
        assert len({x[:3] for x in chunks}) == 1
        assert [x[3] for x in chunks] == list(range(cp_rank * k, (cp_rank + 1) * k))
        out += [x[1:] for x in chunks]
    return out


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data(), i=st.integers(0, len(STORED) - 1))
def test_read_resharded_resume_resharded_then_collect_the_rest(
    streams: MemoryStore, data: st.DataObject, i: int
) -> None:
    """Mesh A reads k steps on every rank; mesh B resumes from any rank's state and reads to
    the sealed end; a dp=1 consumer resumed from B's final state reads what B could not (the
    trailing partial step). Together: every slice of the stream exactly once, all ranks of a
    mesh agreeing on the steps."""
    stored, ns = STORED[i], f"s{i}"
    a = data.draw(meshes_for(stored, max_dp=7), label="mesh A")
    b = data.draw(meshes_for(stored, max_dp=7), label="mesh B")
    k = data.draw(st.integers(0, Projection(stored, a).end_step(TGBS)), label="k")
    seen: Counter[tuple[int, int, int]] = Counter()
    states = []
    for d, c in _ranks(a):
        with Consumer(streams, ns, mesh=a, dp_rank=d, cp_rank=c) as con:
            got = take(con, k)
            states.append(con.state_dict())
        assert [s for s, _ in got] == list(range(k))
        seen.update(_delivered(got, stored.cp, a, c))
    state = states[data.draw(st.integers(0, len(states) - 1), label="state of rank")]
    end_b = None
    finals = []
    for d, c in _ranks(b):
        with Consumer(streams, ns, mesh=b, dp_rank=d, cp_rank=c) as con:
            con.load_state_dict(state)
            got = take(con)
            finals.append(con.state_dict())
        steps = [s for s, _ in got]
        end_b = k + len(steps) if end_b is None else end_b
        assert steps == list(range(k, end_b))
        seen.update(_delivered(got, stored.cp, b, c))
    assert all(f == {**finals[0], "dp_rank": f["dp_rank"], "cp_rank": f["cp_rank"]} for f in finals)
    rest = Mesh(dp=1, cp=1)
    with Consumer(streams, ns, mesh=rest, dp_rank=0) as con:
        con.load_state_dict(finals[-1])
        got = take(con)
    assert len(got) < b.dp  # fewer replicas than one step of B
    seen.update(_delivered(got, stored.cp, rest, 0))
    everything = Counter(
        (t, d, c) for t in range(TGBS) for d in range(stored.dp) for c in range(stored.cp)
    )
    assert seen == everything


def test_stride_readers_resuming_with_another_dp_re_anchor_once_then_shift() -> None:
    """The recipe documented for stride readers (what ``WeaveLoader`` does): re-anchor the job's
    state once, then shift the re-anchored state to each reader. The three readers of each rank
    together deliver the steps an unstrided consumer would, and all ranks every slice once."""
    store = MemoryStore()
    stored = Mesh(dp=2)
    produce(store, "run", stored, tgbs=9)
    with Consumer(store, "run", mesh=stored, dp_rank=0) as first:
        take(first, 3)  # replica slices 0..5
        job_state = first.state_dict()
    new, workers = Mesh(dp=3), 3
    seen: Counter[tuple[int, int, int]] = Counter()
    for d in range(new.dp):
        with Consumer(store, "run", mesh=new, dp_rank=d) as plain:
            plain.load_state_dict(job_state)
            expected = take(plain)
            shifted = plain.state_dict()
        shifted = {**shifted, "step": job_state["step"]}
        got: list[tuple[int, Any]] = []
        for w in range(workers):
            reader = Consumer(store, "run", mesh=new, dp_rank=d, start_step=w, stride=workers)
            with reader:
                reader.load_state_dict({**shifted, "step": shifted["step"] + w})
                got += take(reader)
        assert sorted(got) == expected
        seen.update(parse(x)[1:] for _, x in got)
    assert seen == Counter((t, d, 0) for t in range(3, 9) for d in range(2))


# -- resume states, sealed ends and reclaimed steps --------------------------------------------


@pytest.fixture
def run() -> MemoryStore:
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2), tgbs=6)
    return store


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"step": 2.5}, "not an integer"),
        ({"step": True}, "bool"),
        ({"anchor_replica": 1.5}, "not an integer"),
        ({"dp": 2**21}, r"dp=2097152, cp=1 is not a mesh"),
        ({"cp": 0}, "is not a mesh"),
        ({"step": 1, "anchor_step": 2}, "step 1 precedes anchor_step 2"),
        ({"anchor_replica": -2}, "anchor_replica -2 is negative"),
    ],
)
def test_garbage_state_values_are_refused_naming_the_problem(
    run: MemoryStore, change: dict[str, Any], problem: str
) -> None:
    """Before: ``int()`` resumed a state with step 2.5 at step 2 (a step delivered twice),
    accepted ``True`` as step 1 and a dp no mesh can have (the consumer then waited for
    replica slices that never come), and "inconsistent" states did not say what was wrong."""
    c = Consumer(run, "run", mesh=Mesh(dp=2), dp_rank=0)
    take(c, 1)
    state = {**c.state_dict(), "step": 3, **change}
    with pytest.raises(ConsumerError, match=problem):
        c.load_state_dict(state)
    with pytest.raises(ConsumerError, match=problem):
        c.resume_tgb_step(state)
    assert [s for s, _ in c] == [1, 2, 3, 4, 5]  # a refused state changes nothing
    c.close()


def test_integral_floats_numpy_and_string_ints_still_load(run: MemoryStore) -> None:
    c = Consumer(run, "run", mesh=Mesh(dp=2), dp_rank=1)
    state = {**c.state_dict(), "namespace_id": ""}
    c.load_state_dict({**state, "step": 4.0, "dp": np.int64(2), "cp": "1"})
    assert [s for s, _ in c] == [4, 5]
    c.close()


def test_resume_tgb_step_refuses_a_state_of_another_namespace(run: MemoryStore) -> None:
    """Before: ``resume_tgb_step`` (what ``checkpoint_hook`` records as the watermark) took a
    state of another namespace and returned a step of this one's, while ``load_state_dict``
    refused the same state."""
    produce(run, "other", Mesh(dp=2), tgbs=2)
    with Consumer(run, "other", mesh=Mesh(dp=2), dp_rank=0) as other:
        take(other, 1)
        foreign = other.state_dict()
    c = Consumer(run, "run", mesh=Mesh(dp=2), dp_rank=0)
    with pytest.raises(NamespaceMismatch, match="belongs to namespace 'other'"):
        c.resume_tgb_step(foreign)
    assert c.resume_tgb_step({**foreign, "namespace_id": "", "namespace": ""}) == 1
    c.close()


def test_resume_tgb_step_of_a_state_with_a_foreign_cp_is_its_first_tgb() -> None:
    """Before: a state whose cp does not divide the stored cp (or whose dp is above the mesh
    limit) made ``resume_tgb_step`` raise a bare ``ValueError`` from the projection; the first
    TGB a state resumes at does not depend on cp."""
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2, cp=2), tgbs=6)
    c = Consumer(store, "run", mesh=Mesh(dp=4, cp=1), dp_rank=3)
    state = {**c.state_dict(), "dp": 2, "cp": 4, "step": 3}
    assert c.resume_tgb_step(state) == 3
    c.load_state_dict({**state, "cp": 2})
    assert c.resume_tgb_step() == 3
    c.close()


def test_a_sealed_stream_ending_mid_step_warns_once_naming_what_is_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: DP doubled over an odd number of TGBs ended with an INFO line ("sealed stream
    ends before step 2"), never saying that the last TGB was dropped or how to read it."""
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2), tgbs=5)
    c = Consumer(store, "run", mesh=Mesh(dp=4), dp_rank=0)
    with caplog.at_level(logging.INFO, logger="batchweave.consumer"):
        assert [s for s, _ in c] == [0, 1]
        with pytest.raises(StopIteration):
            next(c)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert (
        "sealed stream ends before step 2: its last 2 replica slice(s) (global replica slices "
        "8..9, in TGB steps 4..4) are fewer than the 4 one step needs with consumer mesh "
        "(dp=4, cp=1)" in warnings[0]
    )
    assert "dp that divides 2" in warnings[0]
    # the way out the warning names: resume from the state with such a dp
    rest = Consumer(store, "run", mesh=Mesh(dp=2), dp_rank=1)
    rest.load_state_dict(c.state_dict())
    # the logical step counter goes on at 2; replica slice 9 is rank 1's
    assert [(s, parse(x)) for s, x in rest] == [(2, (0, 4, 1, 0))]
    c.close()
    rest.close()


def test_a_sealed_stream_ending_on_a_step_boundary_does_not_warn(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2), tgbs=4)
    with caplog.at_level(logging.INFO, logger="batchweave.consumer"):
        assert [s for s, _ in Consumer(store, "run", mesh=Mesh(dp=4), dp_rank=3)] == [0, 1]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("sealed stream ends before step 2" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    ("dp", "anchored", "readable", "how"),
    [
        (4, False, 2, r"Consumer\(start_step=2\)"),  # DP doubled: TGBs 4, 5 are step 2
        (1, False, 8, r"Consumer\(start_step=8\)"),  # DP halved: TGB 4 is steps 8, 9
        (3, True, 3, "state_dict\\(\\) with its step set to 3"),
    ],
)
def test_a_reclaimed_step_names_the_first_readable_logical_step(
    dp: int, anchored: bool, readable: int, how: str
) -> None:
    """Before: the error suggested ``Consumer(start_step=...)`` without a value, and the only
    number it gave was the TGB ``base_step``, which is not the logical step to start at once
    the consumer's DP differs from the stored one (4 would skip data with DP doubled)."""
    store = MemoryStore()
    produce(store, "run", Mesh(dp=2), tgbs=8)
    c = Consumer(store, "run", mesh=Mesh(dp=dp), dp_rank=0)
    if anchored:  # a state from dp=2 at step 1 (replica slice 2), resumed with dp=3
        c.load_state_dict({**c.state_dict(), "dp": 2, "step": 1})
    log = ManifestLog(store, "run")
    assert isinstance(log.commit(log.latest(), base_step=4), Committed)
    with pytest.raises(bw.StepReclaimed, match=f"can still read is step {readable}: .*{how}"):
        next(c)
    c.close()
    if not anchored:
        fresh = Consumer(store, "run", mesh=Mesh(dp=dp), dp_rank=0, start_step=readable)
        assert next(fresh)[0] == readable
        fresh.close()


@pytest.mark.parametrize(
    ("saved_dp", "new_dp", "resized_first"), [(1, 4, False), (2, 2, True), (2, 3, True)]
)
def test_following_the_advice_of_a_refused_load_resumes_at_the_first_unreclaimed_tgb(
    saved_dp: int, new_dp: int, resized_first: bool
) -> None:
    """Before: the advice of a refused ``load_state_dict()`` gave a step in the numbering of
    the re-anchored consumer, which the refused load had rolled back, and called it "this
    consumer's state_dict()": followed, it skipped TGBs 10-19 (dp 1 -> 4), or 12-15 for a
    checkpoint anchored by an earlier resize. Now it names a step of the loaded state."""
    store = MemoryStore()
    produce(store, "run", Mesh(dp=1), tgbs=40)
    with Consumer(store, "run", mesh=Mesh(dp=1), dp_rank=0) as first:
        [next(first) for _ in range(3)]
        ckpt = first.state_dict()
    if resized_first:  # a checkpoint of a run that was itself resized from dp=1
        with Consumer(store, "run", mesh=Mesh(dp=saved_dp), dp_rank=0) as mid:
            mid.load_state_dict(ckpt)
            [next(mid) for _ in range(2)]
            ckpt = mid.state_dict()
    base = 12
    log = ManifestLog(store, "run")
    assert isinstance(log.commit(log.latest(), base_step=base), Committed)
    refused = Consumer(store, "run", mesh=Mesh(dp=new_dp), dp_rank=0)
    with pytest.raises(bw.StepReclaimed, match="the state was not loaded") as info:
        refused.load_state_dict(ckpt)
    refused.close()
    match = re.search(r"set the step of the state you loaded to (\d+)", str(info.value))
    assert match, info.value
    state = {**ckpt, "step": int(match.group(1))}
    seen = []
    for d in range(new_dp):
        with Consumer(store, "run", mesh=Mesh(dp=new_dp), dp_rank=d) as c:
            c.load_state_dict(state)
            seen += [parse(x)[1] for _, x in c]
    # A step of the saved run covers saved_dp replica slices (TGBs here, stored dp=1), so the
    # first readable one may start up to saved_dp - 1 TGBs past the base step.
    assert base <= min(seen) < base + saved_dp
    assert sorted(seen) == list(range(min(seen), min(seen) + len(seen)))  # no gap, no repeat
    assert max(seen) > 40 - 1 - new_dp  # only the trailing partial step is missing


def test_resume_tgb_step_refuses_garbage_before_the_namespace_exists() -> None:
    # Before: with no namespace yet it returned 0 without looking at the state, so a
    # checkpoint hook recorded a watermark from a state load_state_dict would refuse.
    empty = MemoryStore("none-yet")
    c = Consumer(empty, "run", mesh=Mesh(dp=2), dp_rank=0)
    good = {**c.state_dict(), "step": 3}
    assert c.resume_tgb_step(good) == 0
    with pytest.raises(ConsumerError, match="step"):
        c.resume_tgb_step({**good, "step": 2.5})
    c.close()

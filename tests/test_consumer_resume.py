"""Consumer checkpoints: state_dict/load_state_dict resume exactly, also across resharding."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_consumer import parse, produce, take

from batchweave import (
    Consumer,
    ConsumerError,
    MemoryStore,
    Mesh,
    NamespaceMismatch,
    NamespaceNotFound,
    StepReclaimed,
)
from batchweave._manifest._log import Committed, ManifestLog

STORED = Mesh(dp=4, cp=2)
TGBS = 12


@pytest.fixture(scope="module")
def store() -> MemoryStore:
    s = MemoryStore()
    produce(s, "run", STORED, producers=2, tgbs=TGBS // 2)
    produce(s, "other", Mesh(dp=4, cp=2), tgbs=2)
    return s


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    k=st.integers(0, TGBS),
    prefetch=st.integers(0, 4),
    rank=st.tuples(st.integers(0, 3), st.integers(0, 1)),
)
def test_resume_yields_exactly_what_an_uninterrupted_run_yields(
    store: MemoryStore, k: int, prefetch: int, rank: tuple[int, int]
) -> None:
    kw: dict[str, Any] = {"mesh": STORED, "dp_rank": rank[0], "cp_rank": rank[1]}
    with Consumer(store, "run", **kw) as c:
        reference = list(c)
    assert len(reference) == TGBS
    with Consumer(store, "run", prefetch=prefetch, ramp_every=1, **kw) as a:
        head = take(a, k)
        state = a.state_dict()  # taken while later steps are prefetched and undelivered
    assert head == reference[:k]
    assert state["step"] == k
    assert all(isinstance(v, int | str) for v in state.values())
    with Consumer(store, "run", prefetch=prefetch, **kw) as b:
        b.load_state_dict(state)
        assert list(b) == reference[k:]


def test_load_state_dict_rewinds_a_live_consumer(store: MemoryStore) -> None:
    c = Consumer(store, "run", mesh=STORED, dp_rank=2, cp_rank=1)
    first = take(c, 2)
    state = c.state_dict()
    later = take(c, 5)
    c.load_state_dict(state)
    assert take(c, 5) == later
    assert [s for s, _ in first + later] == list(range(7))
    c.close()


@pytest.mark.parametrize("new_dp", [8, 2, 1])
@pytest.mark.parametrize("k", [0, 3, 5])
def test_resume_with_another_dp_continues_the_data(store: MemoryStore, new_dp: int, k: int) -> None:
    """4 ranks read k steps; resumed as new_dp ranks, every slice is read exactly once."""
    seen: Counter[tuple[int, int, int, int]] = Counter()
    states = []
    for d in range(4):
        with Consumer(store, "run", mesh=Mesh(dp=4, cp=2), dp_rank=d, cp_rank=1) as c:
            got = take(c, k)
            states.append(c.state_dict())
        seen.update(parse(data) for _, data in got)
    steps: set[tuple[int, ...]] = set()
    for d in range(new_dp):
        with Consumer(store, "run", mesh=Mesh(dp=new_dp, cp=2), dp_rank=d, cp_rank=1) as c:
            c.load_state_dict(states[d % 4])  # any rank's state: all are at the same step
            got = list(c)
        steps.add(tuple(s for s, _ in got))
        seen.update(parse(data) for _, data in got)
    # the logical step counter continues at k, and all new ranks agree on the steps
    (resumed,) = steps
    assert resumed[:1] in ((k,), ())
    assert resumed == tuple(range(k, k + len(resumed)))
    # the replica slices read form a prefix of the stream, each read exactly once: nothing
    # skipped, nothing repeated (a trailing partial step of fewer than new_dp replicas is not
    # delivered)
    covered = k * 4 + len(resumed) * new_dp
    assert 0 <= TGBS * 4 - covered < new_dp
    assert set(seen.values()) == {1}
    log = ManifestLog(store, "run")
    m = log.latest()
    descs = [log.descriptor(m, t) for t in range(TGBS)]
    expected = {
        (int(descs[g // 4].producer_id[1:]), descs[g // 4].offset, g % 4, 1) for g in range(covered)
    }
    assert set(seen) == expected


def test_resume_with_halved_cp_delivers_chunk_lists(store: MemoryStore) -> None:
    with Consumer(store, "run", mesh=STORED, dp_rank=1, cp_rank=0) as c:
        take(c, 4)
        state = c.state_dict()
    with Consumer(store, "run", mesh=Mesh(dp=4, cp=1), dp_rank=1) as c:
        c.load_state_dict(state)
        step, chunks = next(c)
    assert step == 4
    assert [parse(x)[2:] for x in chunks] == [(1, 0), (1, 1)]


def test_state_from_another_namespace_is_refused(store: MemoryStore) -> None:
    with Consumer(store, "other", mesh=STORED, dp_rank=0, cp_rank=0) as c:
        next(c)
        state = c.state_dict()
    c = Consumer(store, "run", mesh=STORED, dp_rank=0, cp_rank=0)
    with pytest.raises(NamespaceMismatch, match=r"belongs to namespace 'other'"):
        c.load_state_dict(state)


def _copied_namespace_and_a_state_of_the_original() -> tuple[MemoryStore, dict[str, Any]]:
    """A store holding ``run`` (3 TGBs) and ``run-copy``, a copy of it under another prefix
    (same namespace id), and the state of a consumer of ``run`` after one step."""
    s = MemoryStore()
    produce(s, "run", STORED, tgbs=3)
    for meta in list(s.list("run/")):
        s.put("run-copy/" + meta.key.removeprefix("run/"), s.get(meta.key))
    with Consumer(s, "run", mesh=STORED, dp_rank=0, cp_rank=0) as c:
        next(c)
        return s, c.state_dict()


def test_state_of_a_copied_namespace_is_refused_by_name_unless_renamed_on_purpose() -> None:
    """A backup copied to another prefix keeps its namespace id: before, the state of ``run``
    loaded silently into ``run-copy`` (whose steps hold other data once the two diverge)."""
    s, state = _copied_namespace_and_a_state_of_the_original()
    with Consumer(s, "run-copy", mesh=STORED, dp_rank=0, cp_rank=0) as copy:
        copy.open()
        assert copy.namespace_id == state["namespace_id"]  # the ids alone agree
        with pytest.raises(NamespaceMismatch) as info:
            copy.load_state_dict(state)
        message = str(info.value)
        assert "namespace 'run'" in message
        assert "namespace 'run-copy'" in message
        assert "state[\"namespace\"] = 'run-copy'" in message
        assert copy.state_dict()["step"] == 0  # a refused state changes nothing
        copy.load_state_dict({**state, "namespace": "run-copy"})  # moved or renamed: on purpose
        assert copy.state_dict()["step"] == 1
        legacy = {k: v for k, v in state.items() if k != "namespace"}  # a state without a name
        copy.load_state_dict(legacy)
        assert copy.state_dict()["step"] == 1


def test_resume_tgb_step_refuses_a_copied_namespace_state_as_load_state_dict_does() -> None:
    """Before: ``resume_tgb_step`` (the step ``checkpoint_hook`` records) compared namespace ids
    only, so it took the state of ``run`` in ``run-copy`` (same id), which ``load_state_dict``
    refuses: the watermark would protect steps of a namespace the state never read."""
    s, state = _copied_namespace_and_a_state_of_the_original()
    for opened in (False, True):
        with Consumer(s, "run-copy", mesh=STORED, dp_rank=0, cp_rank=0) as copy:
            if opened:
                copy.open()
            with pytest.raises(NamespaceMismatch) as info:
                copy.resume_tgb_step(state)
            message = str(info.value)
            assert "namespace 'run'" in message
            assert "namespace 'run-copy'" in message
            assert "state[\"namespace\"] = 'run-copy'" in message
            assert copy.resume_tgb_step({**state, "namespace": "run-copy"}) == 1  # on purpose
            legacy = {k: v for k, v in state.items() if k != "namespace"}  # no name recorded
            assert copy.resume_tgb_step(legacy) == 1
    with Consumer(s, "missing", mesh=STORED, dp_rank=0, cp_rank=0) as absent:
        with pytest.raises(NamespaceMismatch, match="belongs to namespace 'run'"):
            absent.resume_tgb_step(state)  # refused by name even where nothing exists yet
        assert absent.resume_tgb_step({**state, "namespace": "missing"}) == 0


def test_state_for_a_missing_namespace_is_refused(store: MemoryStore) -> None:
    with Consumer(store, "run", mesh=STORED, dp_rank=0, cp_rank=0) as c:
        next(c)
        state = c.state_dict()
    with pytest.raises(NamespaceNotFound):
        Consumer(MemoryStore(), "run", mesh=STORED, dp_rank=0, cp_rank=0).load_state_dict(state)


@pytest.mark.parametrize(
    "change",
    [{"format": 2}, {"step": -1}, {"dp": 0}, {"anchor_step": 9}, {"namespace_id": None}],
)
def test_malformed_state_is_refused(store: MemoryStore, change: dict[str, Any]) -> None:
    c = Consumer(store, "run", mesh=STORED, dp_rank=0, cp_rank=0)
    state = {**c.state_dict(), "step": 3, **change}
    if change.get("namespace_id", "") is None:
        del state["namespace_id"]
    with pytest.raises(ConsumerError):
        c.load_state_dict(state)


def test_resuming_below_the_reclaimed_boundary_is_refused() -> None:
    store = MemoryStore()
    mesh = Mesh(dp=2)
    produce(store, "run", mesh, tgbs=6)
    c = Consumer(store, "run", mesh=mesh, dp_rank=0)
    take(c, 2)
    state = c.state_dict()
    log = ManifestLog(store, "run")
    assert isinstance(log.commit(log.latest(), base_step=4), Committed)
    c.close()
    with pytest.raises(StepReclaimed, match=r"step 2 needs TGB step 2.*below 4"):
        Consumer(store, "run", mesh=mesh, dp_rank=0).load_state_dict(state)
    with pytest.raises(StepReclaimed, match=r"step 0 needs TGB step 0.*start_step"):
        next(Consumer(store, "run", mesh=mesh, dp_rank=0))
    assert [s for s, _ in Consumer(store, "run", mesh=mesh, dp_rank=1, start_step=4)] == [4, 5]


@pytest.mark.parametrize("regrown", [False, True])
def test_a_reader_behind_the_head_meets_a_restored_older_copy_as_history_gone_back(
    tmp_path: Any, regrown: bool
) -> None:
    # An older copy restored over the prefix (the newer TGB objects gone with it): the next
    # read found its object missing and raised ObjectGone with the advice for an object
    # deleted by hand; the history that went back is what happened.
    import shutil

    from batchweave import FileStore, FormatError, Mesh, Producer

    root, backup = tmp_path / "store", tmp_path / "backup"
    store = FileStore(root)
    mesh = Mesh(dp=1)

    def publish(end: int) -> None:
        with Producer(store, "job", producer_id="a", mesh=mesh) as producer:
            for offset in range(producer.resume_offset, end):
                producer.append([f"a:{offset}".encode()], offset=offset)

    publish(5)
    shutil.copytree(root, backup)
    publish(40)
    consumer = Consumer(store, "job", mesh=mesh, dp_rank=0, timeout=5, prefetch=1)
    got = [bytes(next(consumer)[1]) for _ in range(3)]
    assert got == [b"a:0", b"a:1", b"a:2"]
    shutil.rmtree(root / "job")
    shutil.copytree(backup / "job", root / "job")
    if regrown:
        publish(40)  # producers restarted on the restored history

    def read_on() -> None:
        for _, data in consumer:
            got.append(bytes(data))

    with pytest.raises(FormatError, match=r"the newest this client saw .* is gone|was rewritten"):
        read_on()
    consumer.close()
    assert len(got) < 40  # never the restored history's other TGBs as if nothing happened

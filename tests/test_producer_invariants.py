"""Hypothesis state machine: producers, zombies, crashes, restarts and ambiguous writes.

Several producer incarnations share one in-memory store through a fault-injecting wrapper; two
producer ids each may have several live incarnations at once (the older ones are zombies). After
every step the committed history is checked against the commit protocol's invariants:

- a committed TGB is never lost: every version's step list extends its parent's;
- no ``(producer_id, offset)`` appears twice, and each producer's offsets increase with steps;
- steps are dense and never reassigned, and independent readers agree on step -> TGB;
- nothing is visible before it exists: a manifest is only ever written after every TGB object it
  references was fully uploaded (audited at the moment of each conditional PUT);
- each producer's committed offset equals its last committed TGB's offset (exactly-once resume);
- retiring a producer id ends its stream: its incarnations running then commit nothing more
  (``ProducerRetired``, or ``ProducerFenced`` once the id starts again), and a later start of
  the id begins a new stream, with higher epochs, whose offsets start again.
"""

from __future__ import annotations

from fake_time import FakeTime
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from batchweave import (
    Mesh,
    Producer,
    ProducerError,
    ProducerFenced,
    ProducerRetired,
    PutMode,
    StoreWrapper,
    retire_producers,
)
from batchweave._errors import AmbiguousWriteError, TransientStoreError
from batchweave._manifest._codec import decode_manifest
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import Manifest
from batchweave._store._memory import MemoryStore
from batchweave._store._wrappers import FaultInjectingStore

MESH = Mesh(dp=2, cp=1)
NS = "sm"
PIDS = ("a", "b", "c")
TAIL_BOUNDS = {"a": {"tail_limit": 3}, "b": {"tail_bytes_limit": 700}, "c": {}}
"""Small tails, so commits roll into segments: "a" by count, "b" by bytes (two descriptors)."""

TgbKey = tuple[str, int, int, str]
"""``(producer_id, epoch, offset, object key)`` of one committed TGB."""


class AuditingStore(StoreWrapper):
    """Memory store that checks, at each manifest create, that every referenced TGB exists."""

    def __init__(self) -> None:
        super().__init__(MemoryStore())
        self.violations: list[str] = []
        self._log = ManifestLog(self.inner, NS)

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        if mode is PutMode.CREATE and key.startswith(f"{NS}/_manifests/"):
            manifest = decode_manifest(bytes(data), key=key)
            for step, desc in self._log.descriptors(manifest, 0, manifest.next_step):
                for ref in desc.objects:
                    try:
                        size = self.inner.head(self._log.key(ref.key)).size
                    except FileNotFoundError:
                        self.violations.append(f"{key} references missing {ref.key} at {step}")
                        continue
                    if size != ref.size:
                        self.violations.append(f"{key}: {ref.key} is {size} B, not {ref.size}")
        self.inner.put(key, data, mode=mode)


class Incarnation:
    """One Producer object and what the test appended through it."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer
        self.pid = producer.producer_id
        self.epoch = producer.epoch
        self.next_offset = producer.resume_offset
        self.appended: list[int] = []
        self.fenced = False
        self.retired = False
        """Its id was retired while it ran: it must stop with ProducerRetired."""

    def check_stopped_by(self, newest: Incarnation, exc: ProducerError) -> None:
        """Being stopped by ``exc`` must be legitimate: a zombie, or an id retired meanwhile."""
        if isinstance(exc, ProducerRetired):
            assert self.retired, exc
        else:
            assert newest is not self or self.retired, exc

    def __repr__(self) -> str:
        return f"Incarnation({self.pid}@{self.epoch})"


def _has_live(machine: ProducerMachine) -> bool:
    return bool(machine.live)


PICK = st.integers(0, 7)
"""Chooses a live incarnation (index modulo the number alive)."""


class ProducerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.audit = AuditingStore()
        self.store = FaultInjectingStore(self.audit)
        self.time = FakeTime()
        self.live: list[Incarnation] = []
        self.newest: dict[str, Incarnation] = {}
        self.retirements: dict[str, list[tuple[int, int, int]]] = {}
        """Id -> per retirement: (version that retired it, its committed TGB count then, the
        highest epoch any of its incarnations had)."""
        self.seen: dict[int, TgbKey] = {}
        """Every step -> TGB ever observed; a step must never map to another TGB."""
        self.checked_version = -1
        self.checked_steps: list[TgbKey] = []
        self.reader = ManifestLog(self.audit.inner, NS)

    # -- rules -----------------------------------------------------------------------------

    def _start(self, pid: str) -> Incarnation:
        before = self._latest()
        expected = 0
        if before is not None and pid in before.producers:
            off = before.producers[pid].offset
            expected = 0 if off is None else off + 1
        producer = Producer(
            self.store,
            NS,
            producer_id=pid,
            mesh=MESH,
            policy="naive",
            upload_threads=2,
            **TAIL_BOUNDS[pid],  # type: ignore[arg-type]
            max_retries=1000,  # scripted faults pile up; every transient failure is survivable
            clock=self.time.clock,
            wall_clock=self.time.wall,
            sleep=self.time.sleep,
        )
        inc = Incarnation(producer)
        if any(other.pid == pid for other in self.live):
            # A running older incarnation may commit between reading `before` and the epoch
            # bump, but only upwards.
            assert inc.next_offset >= expected
        else:
            # Exactly-once restart: resume right after the last committed offset.
            assert inc.next_offset == expected
        previous = self.newest.get(pid)
        if previous is not None:
            assert inc.epoch > previous.epoch
        self.newest[pid] = inc
        self.live.append(inc)
        return inc

    @initialize()
    def start_first(self) -> None:
        self._start("a")

    @precondition(lambda self: len(self.live) < 5)
    @rule(pid=st.sampled_from(PIDS))
    def start(self, pid: str) -> None:
        """Start (or restart) a producer id; a still-running older incarnation becomes a zombie."""
        if pid in self.retirements:
            event("start of a retired id")
        if pid in self.newest and self.newest[pid] in self.live:
            event("start while an older incarnation runs (zombie)")
        self._start(pid)

    def _pick(self, which: int) -> Incarnation:
        return self.live[which % len(self.live)]

    @precondition(_has_live)
    @rule(which=PICK, count=st.integers(1, 4), skip=st.integers(0, 2))
    def append(self, which: int, count: int, skip: int) -> None:
        inc = self._pick(which)
        for _ in range(count):
            offset = inc.next_offset + skip
            try:
                inc.producer.append([f"{inc.pid}{offset}".encode(), b"x"], offset=offset)
            except ProducerFenced as exc:
                inc.check_stopped_by(self.newest[inc.pid], exc)
                inc.fenced = True
                return
            inc.appended.append(offset)
            inc.next_offset = offset + 1

    @precondition(_has_live)
    @rule(which=PICK)
    def flush(self, which: int) -> None:
        inc = self._pick(which)
        try:
            inc.producer.flush(timeout=30)
        except ProducerFenced as exc:
            inc.check_stopped_by(self.newest[inc.pid], exc)
            event("retired id fenced at flush" if inc.retired else "zombie fenced at flush")
            inc.fenced = True
            return
        # Flushed: everything this incarnation appended is committed.
        committed = self._committed_by(inc)
        assert committed == inc.appended, (inc, committed, inc.appended)

    @precondition(_has_live)
    @rule(which=PICK)
    def crash(self, which: int) -> None:
        """Abandon the process: threads stop, nothing pending is drained."""
        inc = self._pick(which)
        inc.producer.abort()
        self.live.remove(inc)
        committed = self._committed_by(inc)
        assert committed == inc.appended[: len(committed)], (inc, committed)

    @precondition(_has_live)
    @rule(which=PICK)
    def close(self, which: int) -> None:
        inc = self._pick(which)
        try:
            inc.producer.close()
        except ProducerError as exc:
            event("zombie fenced at close")
            inc.check_stopped_by(self.newest[inc.pid], exc)
            assert inc.fenced or inc.retired or inc.producer.stats().pending > 0
        else:
            assert self._committed_by(inc) == inc.appended
        self.live.remove(inc)

    @rule(pid=st.sampled_from(PIDS))
    def retire(self, pid: str) -> None:
        """An operator retires an id, while its incarnations may be committing."""
        report = retire_producers(
            self.audit,  # no scripted faults: retirement itself is not under test for those
            NS,
            idle_for=1e-9,
            producer_ids=[pid],
            wall_clock=lambda: self.time.wall() + 1.0,
            sleep=self.time.sleep,
        )
        if not report.retired:
            assert pid in report.unknown
            return
        event(
            "retired an id with a live incarnation"
            if any(inc.pid == pid for inc in self.live)
            else "retired an id"
        )
        assert report.version is not None
        committed = self.reader.read(report.version)
        assert pid not in committed.producers
        count = sum(1 for key in self._steps(self.reader, committed) if key[0] == pid)
        ceiling = self.newest[pid].epoch if pid in self.newest else -1
        self.retirements.setdefault(pid, []).append((report.version, count, ceiling))
        for inc in self.live:
            if inc.pid == pid:
                inc.retired = True

    @rule(landed=st.booleans(), times=st.integers(1, 3))
    def ambiguous_manifest_writes(self, landed: bool, times: int) -> None:
        """The next manifest PUTs lose their response (having landed, or not)."""
        self.store.fail_next(
            "put", AmbiguousWriteError, landed=landed, times=times, key_prefix=f"{NS}/_manifests/"
        )

    @rule(read_back_fails=st.booleans())
    def lost_commit_response(self, read_back_fails: bool) -> None:
        """The next manifest PUT lands but its outcome is not learned: the producer must find
        its own TGBs in the history it rebases onto and not commit them again."""
        if read_back_fails:
            self.store.fail_next("put", AmbiguousWriteError, landed=True, key_prefix=f"{NS}/_man")
            self.store.fail_next("get_range", TransientStoreError, key_prefix=f"{NS}/_manifests/")
        else:
            # A failure reported as transient although the write landed (a mislabelled 5xx).
            self.store.fail_next("put", TransientStoreError, landed=True, key_prefix=f"{NS}/_man")

    @rule(times=st.integers(1, 3))
    def transient_failures(self, times: int) -> None:
        """The next data uploads and manifest reads fail transiently."""
        self.store.fail_next("put", TransientStoreError, times=times, key_prefix=f"{NS}/data/")
        self.store.fail_next(
            "get_range", TransientStoreError, times=times, key_prefix=f"{NS}/_manif"
        )

    # -- invariants ------------------------------------------------------------------------

    def _latest(self) -> Manifest | None:
        versions = list(self.reader.versions())
        return self.reader.read(versions[-1]) if versions else None

    def _steps(self, log: ManifestLog, manifest: Manifest) -> list[TgbKey]:
        out: list[TgbKey] = []
        for step, d in log.descriptors(manifest, 0, manifest.next_step):
            assert step == len(out), f"step {step} out of order in version {manifest.version}"
            out.append((d.producer_id, d.epoch, d.offset, d.objects[0].key))
        return out

    def _committed_by(self, inc: Incarnation) -> list[int]:
        latest = self._latest()
        assert latest is not None
        return [
            off
            for pid, epoch, off, _ in self._steps(self.reader, latest)
            if pid == inc.pid and epoch == inc.epoch
        ]

    @invariant()
    def history_is_consistent(self) -> None:
        assert not self.audit.violations, self.audit.violations
        versions = list(self.reader.versions())
        if not versions:
            return
        assert versions == list(range(versions[0], versions[-1] + 1)), "version gap"
        previous = self.checked_steps
        for version in versions:
            if version <= self.checked_version:
                continue
            manifest = self.reader.read(version)
            steps = self._steps(self.reader, manifest)
            # Never lost, never reassigned: the parent's steps are a prefix of this version's.
            assert steps[: len(previous)] == previous, f"version {version} rewrote history"
            for step, tgb in enumerate(steps):
                assert self.seen.setdefault(step, tgb) == tgb, f"step {step} reassigned"
            # No (producer, offset) twice in a stream; a stream's offsets increase with steps. A
            # retirement ends the id's stream: what follows comes from later starts only.
            last: dict[str, int] = {}
            position: dict[str, int] = {}
            for pid, epoch, off, _ in steps:
                at = position.get(pid, 0)
                ended = [r for r in self.retirements.get(pid, []) if r[1] <= at]
                if any(count == at for _, count, _ in ended):
                    last.pop(pid, None)  # the first step of a new stream
                ceiling = max((c for _, _, c in ended), default=-1)
                assert epoch > ceiling, f"{pid} epoch {epoch} committed after its retirement"
                assert off > last.get(pid, -1), f"{pid} offset {off} repeated or out of order"
                last[pid] = off
                position[pid] = at + 1
            for pid, retirements in self.retirements.items():
                if any(v <= version and c == position.get(pid, 0) for v, c, _ in retirements):
                    last.pop(pid, None)  # retired, and its new stream has committed nothing
            # The resumption state matches the TGB list (exactly-once restart).
            for pid, state in manifest.producers.items():
                assert state.offset == last.get(pid), (version, pid, state.offset, last)
            previous = steps
            self.checked_version = version
        self.checked_steps = previous
        # An independent reader (fresh caches) sees the same step -> TGB mapping.
        fresh = ManifestLog(self.audit.inner, NS)
        assert self._steps(fresh, fresh.read(self.checked_version)) == self.checked_steps

    def teardown(self) -> None:
        for inc in self.live:
            inc.producer.abort()
        self.live.clear()


ProducerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestProducerInvariants = ProducerMachine.TestCase

"""A hypothesis state machine over the manifest log: interleaved commits, faults, reclamation.

Several clients (each its own ``ManifestLog``, producer id and stale local view) append offsets and
commit with the simple rebase loop a producer uses. Conditional PUTs fail in every way the store
can report (lands then times out, lands then 412, never lands, 409); a reclaimer raises
``base_step`` and deletes old versions superseded more than its grace ago, as ``Reclaimer``
does. Time is a fake clock every client reads, moved on by ``wait`` between any two steps (a
paused process). After every step the invariants of docs/protocol.md are checked against a
model of everything ever observed.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from manifest_helpers import FaultyPutStore, descriptor

from batchweave import (
    AmbiguousWriteError,
    ConcurrentWriteConflict,
    MemoryStore,
    Mesh,
    ObjectExists,
)
from batchweave._manifest import (
    Committed,
    Manifest,
    ManifestLog,
    TgbDescriptor,
    manifest_key,
)
from batchweave._manifest._log import LISTED_TRUST_SECONDS, PROBE_TRUST_SECONDS

NS = "runs/sm"
CLIENTS = ("a", "b", "c")
BYTE_BOUND_CLIENT = "b"
TAIL_BYTES_LIMIT = 1000
"""Client b rolls on bytes (at the fourth of these descriptors), not on its count."""
FAULTS = ("ok", "landed-ambiguous", "landed-412", "lost-ambiguous", "409")
GRACES = (5.0, 2 * PROBE_TRUST_SECONDS)
"""The reclaimer's grace: the demo's, and the least it runs with without a warning."""
PAUSES = (
    0.5,
    LISTED_TRUST_SECONDS + 0.01,
    *(g + d for g in GRACES for d in (-0.5, 0.5)),
    PROBE_TRUST_SECONDS + 0.5,
    10 * max(GRACES),
)
"""Between any two steps: around the trust in a listing, the graces and the probe's trust."""


class ManifestMachine(RuleBasedStateMachine):
    @initialize(grace=st.sampled_from(GRACES))
    def setup(self, grace: float) -> None:
        self.grace = grace
        self.inner = MemoryStore()
        self.now = 1_000_000.0
        self.first_seen: dict[int, float] = {0: self.now}
        """Manifest version -> the clock when an invariant first saw it (rules add at most one)."""
        self.fault = "ok"
        self.store = FaultyPutStore(self.inner, self._fault)
        ManifestLog(self.store, NS, clock=self._clock, monotonic=self._clock).create_or_open(
            Mesh(dp=2)
        )
        # The first client merges segments after its commits (as a Producer does), the others
        # inside them (as the reclaimer and tools do): both kinds interleave on one history.
        # Client b bounds its tail by bytes with a count limit it never reaches, so rolls of
        # both kinds interleave too.
        self.logs = {
            c: ManifestLog(
                self.store,
                NS,
                tail_limit=12 if c == BYTE_BOUND_CLIENT else 3,
                tail_bytes_limit=TAIL_BYTES_LIMIT if c == BYTE_BOUND_CLIENT else None,
                max_segment_tgbs=12,
                deferred_merges=c == CLIENTS[0],
                clock=self._clock,
                monotonic=self._clock,
            )
            for c in CLIENTS
        }
        self.bases: dict[str, Manifest] = {c: self.logs[c].latest() for c in CLIENTS}
        self.next_offset = dict.fromkeys(CLIENTS, 0)
        self.pending: dict[str, list[TgbDescriptor]] = {c: [] for c in CLIENTS}
        self.steps: dict[int, tuple[str, int]] = {}
        """Every step -> (producer, offset) ever observed by any reader."""
        self.confirmed: set[tuple[str, int]] = set()
        """TGBs whose commit returned Committed."""

    def _clock(self) -> float:
        return self.now

    def _fault(self, key: str) -> tuple[bool, Exception | None]:
        fault, self.fault = self.fault, "ok"
        if fault == "landed-ambiguous":
            return True, AmbiguousWriteError("simulated timeout after the body was sent")
        if fault == "landed-412":
            return True, ObjectExists("simulated SDK retry of a landed PUT")
        if fault == "lost-ambiguous":
            return False, AmbiguousWriteError("simulated reset before the store saw it")
        if fault == "409":
            return False, ConcurrentWriteConflict("simulated 409")
        return True, None

    @rule(client=st.sampled_from(CLIENTS), n=st.integers(1, 3))
    def append(self, client: str, n: int) -> None:
        for _ in range(n):
            self.pending[client].append(descriptor(client, self.next_offset[client]))
            self.next_offset[client] += 1

    @precondition(lambda self: any(self.pending.values()))
    @rule(client=st.sampled_from(CLIENTS), fault=st.sampled_from(FAULTS), refresh=st.booleans())
    def commit(self, client: str, fault: str, refresh: bool) -> None:
        if not self.pending[client]:
            return
        log = self.logs[client]
        if refresh:  # as a Producer's attempt does: the newest version, then the commit
            self._rebase(client, log.latest(self.bases[client]))
            if not self.pending[client]:
                return
        self.fault = fault
        batch = list(self.pending[client])
        result = log.commit(self.bases[client], append=batch)
        self.fault = "ok"
        if isinstance(result, Committed):
            if client == BYTE_BOUND_CLIENT:
                tail = result.manifest.tail
                assert sum(len(d.model_dump_json()) for d in tail) < TAIL_BYTES_LIMIT
            self.confirmed.update((d.producer_id, d.offset) for d in batch)
            self.pending[client] = []
            self.bases[client] = result.manifest
            if log.deferred_merges:
                log.prepare_merge(result.manifest)
            return
        self._rebase(client, result.winner or log.latest(self.bases[client]))

    def _rebase(self, client: str, manifest: Manifest) -> None:
        self.bases[client] = manifest
        state = manifest.producers.get(client)
        if state is not None and state.offset is not None:
            self.pending[client] = [d for d in self.pending[client] if d.offset > state.offset]

    @rule(client=st.sampled_from(CLIENTS))
    def refresh(self, client: str) -> None:
        self._rebase(client, self.logs[client].latest(self.bases[client]))

    @rule(seconds=st.sampled_from(PAUSES))
    def wait(self, seconds: float) -> None:
        self.now += seconds

    @rule(fraction=st.floats(0, 1), keep=st.integers(1, 3))
    def reclaim(self, fraction: float, keep: int) -> None:
        log = ManifestLog(
            self.store,
            NS,
            tail_limit=3,
            max_segment_tgbs=12,
            clock=self._clock,
            monotonic=self._clock,
        )
        head = log.latest()
        boundary = head.base_step + int((head.next_step - head.base_step) * fraction)
        result = log.commit(head, base_step=boundary)
        if isinstance(result, Committed):
            head = result.manifest
            self.first_seen[head.version] = self.now
        # Oldest first, only versions superseded more than the grace ago.
        old = [
            v
            for v in log.versions()
            if v <= head.version - keep and self.first_seen[v + 1] <= self.now - self.grace
        ]
        self.inner.delete_many(log.key(manifest_key(v)) for v in old)

    @invariant()
    def history_is_consistent(self) -> None:
        reader = ManifestLog(self.inner, NS)
        head = reader.latest()
        for version in reader.versions():
            self.first_seen.setdefault(version, self.now)
            m = reader.read(version)
            for step, d in reader.descriptors(m, m.base_step, m.next_step):
                seen = self.steps.setdefault(step, (d.producer_id, d.offset))
                assert seen == (d.producer_id, d.offset), f"step {step} reassigned in v{version}"
        # Steps are dense: every rule adds at most one version and invariants run after each,
        # so every step ever committed was observed before any reclamation could hide it.
        assert set(self.steps) == set(range(head.next_step))
        # No (producer, offset) twice.
        assert len(set(self.steps.values())) == len(self.steps)
        # Confirmed commits are visible (or were reclaimed, which they could only be once seen).
        assert self.confirmed <= set(self.steps.values())

    @invariant()
    def nothing_is_lost_or_pending_twice(self) -> None:
        published = set(self.steps.values())
        for client in CLIENTS:
            pending = {(client, d.offset) for d in self.pending[client]}
            assert not pending & published, "a committed TGB is still pending: it would repeat"
            for offset in range(self.next_offset[client]):
                assert (client, offset) in published | pending, (client, offset)


ManifestMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None
)
TestManifestMachine = ManifestMachine.TestCase

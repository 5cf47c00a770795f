"""``batchweave check STORE``: can this store carry BatchWeave, and how fast does it answer?

Everything happens under one scratch prefix, ``_batchweave/check-<uuid>/`` below the store URL's
prefix, which is removed at the end, also after a failure, Ctrl-C or SIGTERM; no other key is
read or written. An endpoint that stops answering (unreachable, or a request that timed out) is
no failed check: the run stops at once, without a cleanup that would wait for it as long again,
and the error names the prefix to delete (see :func:`check_store`). Each named check is one row
(ok/FAIL and a one-line detail); a check BatchWeave does not rely on is reported as ``warn`` and
never fails the store. Then small requests are timed (p50/p95) and the commit's fragile window
that DAC will measure is derived from them (``docs/dac.md``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchweave._errors import (
    AmbiguousWriteError,
    ConcurrentWriteConflict,
    ConditionalWritesUnsupported,
    ObjectExists,
    ObjectNotFound,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
)
from batchweave._policy import DEFAULT_CONFLICT_BUDGET, DEFAULT_DUTY_BUDGET, dac_gap
from batchweave._stats import nearest_rank
from batchweave._store._base import Bounded, ByteRange, ObjectStore, Offset, PutMode, Suffix
from batchweave._store._open import PROBE_FIRST, probe_conditional_writes
from batchweave._store._s3_location import S3Location
from batchweave.cli._common import deferred_interrupt, one_line

__all__ = [
    "DEFAULT_REQUESTS",
    "SCRATCH_PREFIX",
    "CheckResult",
    "DacEstimate",
    "Latency",
    "StoreCheckReport",
    "check_store",
    "render_check",
]

SCRATCH_PREFIX = "_batchweave/check-"
"""Keys of a check live under ``_batchweave/check-<uuid>/`` (removed at the end)."""

DEFAULT_REQUESTS = 20
"""Requests per latency measurement (``--requests``)."""

RACE_THREADS = 8
"""Threads that create the same key at once in the race check."""

RACE_ROUNDS = 2
"""Rounds of the race, each on a fresh key."""

SMALL_BYTES = 1024
LARGE_BYTES = 100 * 1024
LIST_KEYS = 12

_CONDITIONAL_ADVICE = (
    "enable conditional writes or upgrade the store to a release that enforces If-None-Match: * "
    "(AWS S3 does; MinIO, Ceph RGW and SeaweedFS releases that do exist), or use another store"
)


@dataclass(frozen=True)
class CheckResult:
    """One named check: whether it passed and a one-line detail (what is wrong and what to do)."""

    name: str
    ok: bool
    detail: str
    required: bool = True
    """False for a property BatchWeave does not rely on: shown as ``warn``, never a failure."""

    @property
    def status(self) -> str:
        """``ok``, ``FAIL`` (a required check failed) or ``warn``."""
        return "ok" if self.ok else "FAIL" if self.required else "warn"


@dataclass(frozen=True)
class Latency:
    """p50/p95 of ``requests`` timed requests of one kind, in milliseconds."""

    operation: str
    requests: int
    p50_ms: float | None
    p95_ms: float | None
    error: str | None = None
    """Why it could not be measured (the request failed)."""


@dataclass(frozen=True)
class DacEstimate:
    """What DAC will see on this store, from the measured p50s (``docs/dac.md``)."""

    window_ms: float
    """The fragile window ``W``: a commit's probe (GET of the next version) + conditional PUT."""
    lone_producer_period_ms: float
    """``W + dac_gap(W, 1)``: a lone producer's attempt period with the default budgets."""
    namespace_commits_per_second: float
    """``(1 - eps) k / W``: the namespace's commit rate whatever the number of producers."""
    summary: str


@dataclass(frozen=True)
class StoreCheckReport:
    """Everything ``batchweave check`` found; ``ok`` when every required check passed."""

    store: str
    scratch: str
    checks: list[CheckResult]
    latency: list[Latency] = field(default_factory=list)
    dac: DacEstimate | None = None

    @property
    def failed(self) -> list[CheckResult]:
        """The required checks that failed."""
        return [c for c in self.checks if c.required and not c.ok]

    @property
    def ok(self) -> bool:
        """Whether every required check passed."""
        return not self.failed

    def as_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data (``--json``)."""
        return {
            "store": self.store,
            "scratch": self.scratch,
            "ok": self.ok,
            "failed": [c.name for c in self.failed],
            "checks": [{**asdict(c), "status": c.status} for c in self.checks],
            "latency": [asdict(x) for x in self.latency],
            "dac": None if self.dac is None else asdict(self.dac),
        }


class _Failed(Exception):
    """A check found the store wrong: the message says what and what to do."""


def _stopped_answering(exc: BaseException) -> bool:
    """Whether ``exc`` says the endpoint is out of reach or stopped answering, not that the
    store did something wrong: ``StoreUnavailable``, ``StoreTimeout``, or a write whose last
    attempt timed out (``AmbiguousWriteError.timed_out``). The check stops at the first one."""
    if isinstance(exc, StoreUnavailable | StoreTimeout):
        return True
    return isinstance(exc, AmbiguousWriteError) and exc.timed_out


class _Run:
    """The store, the scratch prefix and every key written under it."""

    def __init__(self, store: ObjectStore, scratch: str, clock: Callable[[], float]) -> None:
        self.store = store
        self.scratch = scratch
        self.clock = clock
        self.written: set[str] = set()
        self.landed = False
        """Whether objects of this check may exist: set once its first create went through."""
        seed = random.Random(scratch)
        self.payload = seed.randbytes(LARGE_BYTES)
        self.small = seed.randbytes(SMALL_BYTES)

    def key(self, name: str) -> str:
        key = self.scratch + name
        self.written.add(key)
        return key

    @property
    def object_key(self) -> str:
        """The 100 KB object the read checks and the GET timing use."""
        return self.key("object")


def _expect_missing(what: str, call: Callable[[], object]) -> None:
    try:
        call()
    except ObjectNotFound:
        return
    raise _Failed(
        f"{what} of a key that does not exist did not raise ObjectNotFound: the store answers "
        "for absent objects (a proxy or cache in front of it?); BatchWeave tells a missing "
        "manifest version from a present one this way"
    )


# -- the checks ---------------------------------------------------------------------------------


def _conditional_create(run: _Run) -> str:
    """``PutMode.CREATE`` twice, exactly as ``open_store``'s probe: the second must fail."""
    key = run.key("create")
    store = run.store
    try:
        probe_conditional_writes(store, key, delete=False)
    except ConditionalWritesUnsupported as exc:
        run.landed = True
        text = one_line(exc)
        raise _Failed(text if "upgrade" in text else f"{text}; {_CONDITIONAL_ADVICE}") from exc
    run.landed = True
    if store.get(key) != PROBE_FIRST:
        raise _Failed(
            "the second create raised ObjectExists but replaced the object: the store does not "
            f"enforce If-None-Match: * atomically; {_CONDITIONAL_ADVICE}"
        )
    return "a second PutMode.CREATE of the key raised ObjectExists; the first object stayed"


def _overwrite(run: _Run) -> str:
    key = run.key("overwrite")
    run.store.put(key, b"first")
    try:
        run.store.put(key, b"second")
    except ObjectExists as exc:
        raise _Failed(
            "a plain PUT over an existing object raised ObjectExists: the store treats every PUT "
            "as create-only; BatchWeave overwrites objects (watermarks), check the server's or "
            "bucket's write policy (object lock, WORM)"
        ) from exc
    got = run.store.get(key)
    if got != b"second":
        raise _Failed(
            f"after an overwrite GET returned {got[:20]!r}, not the new bytes: the store (or a "
            "cache in front of it) serves stale reads; BatchWeave needs read-after-write "
            "consistency"
        )
    return "PutMode.OVERWRITE replaced the object; GET returned the new bytes"


def _get(run: _Run) -> str:
    key = run.object_key
    run.store.put(key, run.payload)
    got = run.store.get(key)
    if got != run.payload:
        raise _Failed(
            f"GET of a {LARGE_BYTES:,}-byte object returned {len(got):,} other bytes: the store "
            "(or a proxy) alters objects; BatchWeave's checksums would refuse every TGB"
        )
    _expect_missing("GET", lambda: run.store.get(run.key("absent")))
    return f"{LARGE_BYTES // 1024} KB object read back intact; a missing key is ObjectNotFound"


def _compare_ranges(run: _Run, ranges: Sequence[ByteRange], header: Callable[[Any], str]) -> None:
    size = len(run.payload)
    for rng in ranges:
        got = run.store.get_range(run.object_key, rng)
        if isinstance(rng, Bounded):
            want = run.payload[rng.start : rng.end]
        elif isinstance(rng, Offset):
            want = run.payload[rng.start :]
        else:
            want = run.payload[max(0, size - rng.length) :]
        if got != want:
            raise _Failed(
                f"GET with Range: {header(rng)} of a {size:,}-byte object returned {len(got):,} "
                f"bytes, not the {len(want):,} expected: the store (or a proxy) mishandles Range "
                "headers; BatchWeave reads slices and TGB footers with ranged GETs"
            )


def _ranged_get(run: _Run) -> str:
    size = len(run.payload)

    def header(rng: Bounded | Offset) -> str:
        end = "" if isinstance(rng, Offset) else str(rng.end - 1)
        return f"bytes={rng.start}-{end}"

    ranges: list[ByteRange] = [
        Bounded(1000, 5000),
        Offset(size - 777),
        Bounded(size - 10, size + 100),
        Bounded(size + 5, size + 10),
    ]
    _compare_ranges(run, ranges, header)
    return "bytes=a-b, bytes=a- and ranges past the end return the right bytes"


def _suffix_range(run: _Run) -> str:
    size = len(run.payload)
    _compare_ranges(run, [Suffix(64), Suffix(size + 100)], lambda rng: f"bytes=-{rng.length}")
    return "bytes=-n returns the object's last n bytes (all of it when n exceeds the size)"


def _get_range_into(run: _Run) -> str:
    size = len(run.payload)
    buffer = bytearray(4096)
    for start, want in ((1000, 4096), (size - 100, 100)):
        count = run.store.get_range_into(run.object_key, start, memoryview(buffer))
        if count != want or buffer[:count] != run.payload[start : start + want]:
            raise _Failed(
                f"get_range_into from byte {start:,} filled {count:,} bytes, not the {want:,} "
                "expected: large slice reads would be wrong; check the ranged get row and the "
                "store's Range support"
            )
    return "fills a buffer from an offset; returns fewer bytes only at the object's end"


def _head(run: _Run) -> str:
    meta = run.store.head(run.object_key)
    if meta.size != len(run.payload):
        raise _Failed(
            f"HEAD reported {meta.size:,} bytes for a {len(run.payload):,}-byte object: the "
            "store's metadata is wrong; BatchWeave sizes footers and reclaimed bytes from it"
        )
    _expect_missing("HEAD", lambda: run.store.head(run.key("absent")))
    return "size matches; a missing key is ObjectNotFound"


def _list(run: _Run) -> str:
    directory = run.scratch + "list/"
    keys = [run.key(f"list/v-{i:010d}") for i in range(LIST_KEYS)]
    for key in keys:  # in sorted order, as manifest versions are written
        run.store.put(key, key.encode())
    cases: list[tuple[str, str, str | None, list[str]]] = [
        ("LIST of the directory", directory, None, keys),
        (f"LIST with start_after={keys[4]!r}", directory, keys[4], keys[5:]),
        ("LIST with a longer prefix", keys[0][:-1], None, keys[:10]),
        ("LIST with prefix and start_after", keys[0][:-1], keys[7], keys[8:10]),
    ]
    for what, prefix, start_after, want in cases:
        listed = list(run.store.list(prefix, start_after=start_after))
        got = [m.key for m in listed]
        if got != want:
            order = "in another order" if sorted(got) == want else f"{len(got)} keys"
            raise _Failed(
                f"{what} gave {order} where {len(want)} keys in byte order were expected "
                f"(first {got[:3]}): BatchWeave finds the newest manifest version by listing "
                "one directory in key order after a start key (docs/protocol.md); this store "
                "cannot carry it"
            )
        sizes = {m.key: m.size for m in listed}
        wrong = [k for k in want if sizes[k] != len(k.encode())]
        if wrong:
            raise _Failed(f"{what} reported wrong sizes for {wrong[:3]}: listing metadata is wrong")
    return (
        f"{LIST_KEYS} keys written in order list back in order; prefix and start_after filter "
        "correctly"
    )


def _list_across_directories(run: _Run) -> str:
    """Bytewise order across directory levels: BatchWeave's layout does not rely on it."""
    keys = [run.key("order/a-b"), run.key("order/a/c")]  # '-' < '/' bytewise
    for key in keys:
        run.store.put(key, b"x")
    got = [m.key for m in run.store.list(run.scratch + "order/")]
    if got != keys:
        shown = [k.removeprefix(run.scratch) for k in got]
        raise _Failed(
            f"lists {shown} (bytewise: {[k.removeprefix(run.scratch) for k in keys]}): keys "
            "under a directory come before siblings that "
            "sort lower bytewise (file-system walk order, as SeaweedFS does); BatchWeave's "
            "layout does not rely on it (docs/store.md, Known server deviations)"
        )
    return "bytewise across directory levels, as AWS S3 lists"


def _delete(run: _Run) -> str:
    key = run.key("delete")
    run.store.put(key, b"x")
    run.store.delete_many([key])
    _expect_missing("HEAD after DELETE", lambda: run.store.head(key))
    if any(m.key == key for m in run.store.list(run.scratch + "delete")):
        raise _Failed(
            "a deleted object is still listed: the store's listing lags deletes; the reclaimer "
            "would count deleted objects again"
        )
    return "a deleted object is gone from HEAD and LIST"


def _delete_missing(run: _Run) -> str:
    run.store.delete_many([run.key("never-written")])
    return "deleting a key that does not exist is not an error"


def _create_race(run: _Run, threads: int, rounds: int) -> str:
    for round_ in range(rounds):
        key = run.key(f"race/{round_:02d}")
        barrier = threading.Barrier(threads)
        payloads = [f"{key} writer {i}".encode() for i in range(threads)]

        def attempt(payload: bytes, key: str = key, barrier: threading.Barrier = barrier) -> str:
            barrier.wait(timeout=60)
            try:
                run.store.put(key, payload, mode=PutMode.CREATE)
            except (ObjectExists, ConcurrentWriteConflict):
                return "lost"
            except AmbiguousWriteError as exc:
                if exc.timed_out:
                    raise  # the endpoint stopped answering: no outcome to decide
                return "ambiguous"  # decided below by reading the object back
            return "won"

        outcomes = _on_threads([functools.partial(attempt, p) for p in payloads])
        stored = run.store.get(key)
        winners = [
            p
            for p, outcome in zip(payloads, outcomes, strict=True)
            if outcome == "won" or (outcome == "ambiguous" and p == stored)
        ]
        if len(winners) != 1:
            raise _Failed(
                f"round {round_ + 1}: {len(winners)} of {threads} concurrent creates of one key "
                "succeeded: the store does not enforce If-None-Match: * atomically, so concurrent "
                f"commits would overwrite each other; {_CONDITIONAL_ADVICE}"
            )
        if stored != winners[0]:
            raise _Failed(
                f"round {round_ + 1}: the object holds another writer's bytes than the one "
                "create that succeeded: the store does not enforce If-None-Match: * atomically; "
                f"{_CONDITIONAL_ADVICE}"
            )
    return (
        f"{rounds} rounds of {threads} threads: exactly one create won each, the others got "
        "ObjectExists"
    )


def _on_threads(calls: Sequence[Callable[[], str]]) -> list[str]:
    """Run each call on a thread of its own; their results in order, or the first error.

    Daemon threads, not a ``ThreadPoolExecutor``: a Ctrl-C or SIGTERM while they wait for a
    silent endpoint interrupts the join at once, and the process may exit without waiting for
    them (the interpreter joins an executor's threads at exit, as long as their requests take).
    """
    results: list[str | BaseException] = ["" for _ in calls]

    def work(index: int) -> None:
        try:
            results[index] = calls[index]()
        except BaseException as exc:
            results[index] = exc

    threads = [
        threading.Thread(target=work, args=(i,), name=f"batchweave-check-{i}", daemon=True)
        for i in range(len(calls))
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    outcomes: list[str] = []
    for result in results:
        if isinstance(result, BaseException):
            raise result
        outcomes.append(result)
    return outcomes


# -- latency ------------------------------------------------------------------------------------


def _time(run: _Run, operation: str, requests: int, call: Callable[[int], object]) -> Latency:
    seconds: list[float] = []
    try:
        for i in range(requests):
            start = run.clock()
            call(i)
            seconds.append(run.clock() - start)
    except StoreError as exc:
        if _stopped_answering(exc):
            raise
        return Latency(operation, len(seconds), None, None, error=one_line(exc))
    seconds.sort()
    return Latency(
        operation,
        requests,
        round(nearest_rank(seconds, 0.5) * 1000, 3),
        round(nearest_rank(seconds, 0.95) * 1000, 3),
    )


def _missing_get(store: ObjectStore, key: str) -> None:
    try:
        store.get(key)
    except ObjectNotFound:
        return


PROBE_GET = "GET missing key (commit probe)"
CONDITIONAL_PUT = f"conditional PUT {SMALL_BYTES // 1024} KB"


def _latency_plan(run: _Run) -> list[tuple[str, Callable[[int], object]]]:
    store = run.store
    put_key, absent = run.key("latency/put"), run.key("latency/absent")
    return [
        (f"PUT {SMALL_BYTES // 1024} KB", lambda i: store.put(put_key, run.small)),
        (
            CONDITIONAL_PUT,
            lambda i: store.put(run.key(f"latency/create-{i:06d}"), run.small, mode=PutMode.CREATE),
        ),
        (f"GET {LARGE_BYTES // 1024} KB", lambda i: store.get(run.object_key)),
        (PROBE_GET, lambda i: _missing_get(store, absent)),
        ("HEAD", lambda i: store.head(run.object_key)),
        (
            f"LIST {LIST_KEYS} keys",
            lambda i: sum(1 for _ in store.list(run.scratch + "list/")),
        ),
    ]


def _dac_estimate(latency: Sequence[Latency]) -> DacEstimate | None:
    """W and the commit rates docs/dac.md derives from it, with the default budgets."""
    p50 = {x.operation: x.p50_ms for x in latency}
    probe, put = p50.get(PROBE_GET), p50.get(CONDITIONAL_PUT)
    if probe is None or put is None or probe + put <= 0:
        return None
    window = (probe + put) / 1000
    period = window + dac_gap(window, 1)
    k = -math.log1p(-DEFAULT_CONFLICT_BUDGET)
    rate = (1 - DEFAULT_CONFLICT_BUDGET) * k / window
    summary = (
        f"DAC (docs/dac.md): fragile window W ~ commit probe + conditional PUT = "
        f"{window * 1000:.1f} ms at p50 on an idle store (more under a data load); with the "
        f"default budgets (conflict {DEFAULT_CONFLICT_BUDGET:g}, duty {DEFAULT_DUTY_BUDGET:g}) "
        f"a lone producer commits at most every {period * 1000:.0f} ms (W / duty) and a "
        f"namespace about {rate:.1f} commits/s whatever the number of producers "
        "((1 - eps) k / W, k = -ln(1 - eps))"
    )
    return DacEstimate(round(window * 1000, 3), round(period * 1000, 3), round(rate, 3), summary)


# -- the run ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _answering_within_probe_timeout(store: ObjectStore) -> Iterator[ObjectStore]:
    """``store`` as its conditional-write probe sees it: an S3 store through a client that waits
    at most ``probe_timeout`` for each answer and does not retry a request that timed out.

    For the cleanup, which also runs after Ctrl-C or SIGTERM, when the interrupted request may
    have been waiting for an endpoint that stopped answering: through the store's own client
    (``read_timeout`` x ``max_attempts``, 60 s x 5 in the CLI) it kept the command waiting for
    minutes per request after the signal.
    """
    view = store._probe_view() if isinstance(store, S3Location) else None
    try:
        yield store if view is None else view
    finally:
        if view is not None:
            view.close()


def _cleanup(run: _Run, *, outage_raises: bool = False, quick: bool = False) -> CheckResult:
    """Delete everything under the scratch prefix and confirm nothing is left.

    With ``outage_raises``, an endpoint that stopped answering (:func:`_stopped_answering`)
    is raised as :func:`_endpoint_lost` instead of being the cleanup's failed row. ``quick``
    (after a failure or an interrupt) waits at most ``probe_timeout`` per request
    (:func:`_answering_within_probe_timeout`); the cleanup of a run that went well is one of
    its checks and gets the store's own timeouts, as every other check.
    """
    view = (
        _answering_within_probe_timeout(run.store) if quick else contextlib.nullcontext(run.store)
    )
    try:
        with view as store:
            keys = set(run.written)
            keys.update(m.key for m in store.list(run.scratch))
            store.delete_many(sorted(keys))
            left = [m.key for m in store.list(run.scratch)]
    except StoreError as exc:
        if outage_raises and _stopped_answering(exc):
            raise _endpoint_lost(run, exc) from exc
        return CheckResult(
            "cleanup",
            False,
            f"removing {run.scratch} failed: {one_line(exc)}; delete the objects under that "
            "prefix by hand",
        )
    if left:
        return CheckResult(
            "cleanup",
            False,
            f"{len(left)} objects are still listed under {run.scratch} after deleting them "
            f"({left[:3]}): delete them by hand",
        )
    return CheckResult("cleanup", True, f"removed the {len(keys)} objects under {run.scratch}")


def _run_check(
    run: _Run, name: str, check: Callable[[_Run], str], required: bool, *, first: bool
) -> CheckResult:
    """One check's row. A store error is the check's failure, except an endpoint that stopped
    answering (:func:`_stopped_answering`) and any error of the ``first`` check (credentials,
    bucket, endpoint): the store could not be checked at all, and :func:`check_store` raises
    it."""
    try:
        detail = check(run)
    except _Failed as exc:
        return CheckResult(name, False, str(exc), required)
    except StoreError as exc:
        if first or _stopped_answering(exc):
            raise
        return CheckResult(name, False, one_line(exc), required)
    return CheckResult(name, True, detail, required)


def _endpoint_lost(run: _Run, exc: StoreError) -> StoreError:
    """The error ending a check whose endpoint stopped answering (``exc``), naming the scratch
    prefix left behind: ``StoreUnavailable`` stays one, a timeout is a ``StoreTimeout``."""
    text = str(exc) if isinstance(exc, StoreUnavailable | StoreTimeout) else one_line(exc)
    where = (
        f"the check stopped at the first request the endpoint did not answer; objects of this "
        f"check may remain under {run.scratch} in {run.store.url}: delete them once the store "
        "answers"
    )
    if isinstance(exc, StoreUnavailable):
        return StoreUnavailable(f"{text} ({where})")
    return StoreTimeout(f"{text} ({where})")


@contextlib.contextmanager
def _removed_on_failure(run: _Run) -> Iterator[None]:
    """Remove the scratch prefix if the body raises or is interrupted, then let the error go on.

    Not after the endpoint stopped answering (:func:`_stopped_answering`): the cleanup would
    wait for it as long again, so the error names the prefix instead (when something may have
    been written). Nor after a store error before the first create landed (credentials that
    cannot write): there is nothing to remove. After Ctrl-C or SIGTERM the cleanup waits at
    most ``probe_timeout`` per request (:func:`_answering_within_probe_timeout`): the signal
    may have interrupted a request to an endpoint that stopped answering.
    """
    try:
        yield
    except StoreError as exc:
        if _stopped_answering(exc):
            # A timed-out write may have landed even before the first create was confirmed.
            if run.landed or not isinstance(exc, StoreUnavailable):
                raise _endpoint_lost(run, exc) from exc
            raise
        if not run.landed:
            raise
        _clean_up_and_warn(run)
        raise
    except BaseException:
        # Failed or interrupted (Ctrl-C, SIGTERM).
        _clean_up_and_warn(run)
        raise


def _clean_up_and_warn(run: _Run) -> None:
    """The cleanup after a failure or an interrupt; a failed cleanup is a warning naming the
    prefix. A Ctrl-C or SIGTERM during it is deferred to its end; a second one stops it at once.
    """
    with deferred_interrupt() as interrupted:
        outcome = _cleanup(run, quick=True)
    if not outcome.ok:
        click.echo(f"batchweave: warning: {outcome.detail}", err=True)
    interrupted()


def check_store(
    store: ObjectStore,
    *,
    requests: int = DEFAULT_REQUESTS,
    progress: Callable[[int, int], None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    race_threads: int = RACE_THREADS,
    race_rounds: int = RACE_ROUNDS,
) -> StoreCheckReport:
    """Run every check and latency measurement against ``store`` under a fresh scratch prefix.

    ``progress(done, total)`` is called after each step. The scratch prefix is removed at the
    end, also when a check raises or the run is interrupted. An endpoint that stops answering
    ends the run at its first such request, cleanup included: ``StoreUnavailable`` (unreachable)
    or ``StoreTimeout`` (a request, or a write, that timed out), raised without a cleanup, which
    would wait for the endpoint as long again; the message names the scratch prefix if objects
    may have been written. Any error of the first check other than ignored conditional writes
    (missing credentials or bucket, credentials that cannot read, an endpoint that is no object
    store) is raised after the cleanup. Either way the store could not be checked, which is not
    the same as failing a check.
    """
    if requests < 1:
        raise ValueError(f"requests must be at least 1, got {requests}")
    run = _Run(store, f"{SCRATCH_PREFIX}{uuid.uuid4().hex}/", clock)
    checks: list[tuple[str, Callable[[_Run], str], bool]] = [
        ("conditional create", _conditional_create, True),
        ("overwrite", _overwrite, True),
        ("get", _get, True),
        ("ranged get", _ranged_get, True),
        ("suffix range", _suffix_range, True),
        ("get_range_into", _get_range_into, True),
        ("head", _head, True),
        ("list order and start_after", _list, True),
        ("list order across directories", _list_across_directories, False),
        ("delete", _delete, True),
        ("delete missing", _delete_missing, True),
        ("concurrent create race", lambda r: _create_race(r, race_threads, race_rounds), True),
    ]
    plan = _latency_plan(run)
    total = len(checks) + len(plan) + 1
    done = 0

    def step() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    results: list[CheckResult] = []
    latency: list[Latency] = []
    with _removed_on_failure(run):
        for index, (name, check, required) in enumerate(checks):
            results.append(_run_check(run, name, check, required, first=index == 0))
            step()
        for operation, call in plan:
            latency.append(_time(run, operation, requests, call))
            step()
    results.append(_cleanup(run, outage_raises=True))
    step()
    conditional_ok = results[0].ok
    return StoreCheckReport(
        store=store.url,
        scratch=run.scratch,
        checks=results,
        latency=latency,
        dac=_dac_estimate(latency) if conditional_ok else None,
    )


# -- output -------------------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f} ms" if value >= 1 else f"{value:.2f} ms"


def render_check(report: StoreCheckReport, out: Console) -> None:
    """Print the checks table, the latency table, the DAC line and the verdict."""
    colours = {"ok": "green", "FAIL": "red", "warn": "yellow"}
    table = Table(title=f"check {escape(report.store)}", title_justify="left")
    table.add_column("check", style="bold")
    table.add_column("result")
    table.add_column("detail")
    for c in report.checks:
        table.add_row(c.name, f"[{colours[c.status]}]{c.status}[/]", escape(c.detail))
    out.print(table)
    if report.latency:
        lat = Table(title="latency", title_justify="left")
        lat.add_column("request", style="bold")
        lat.add_column("p50", justify="right")
        lat.add_column("p95", justify="right")
        lat.add_column("requests", justify="right")
        for x in report.latency:
            if x.error is not None:
                lat.add_row(x.operation, "-", "-", f"failed: {escape(x.error)}")
            else:
                lat.add_row(x.operation, _ms(x.p50_ms), _ms(x.p95_ms), str(x.requests))
        out.print(lat)
    if report.dac is not None:
        out.print(escape(report.dac.summary))
    for c in report.failed:
        out.print(f"[red]FAIL[/red] {escape(c.name)}: {escape(c.detail)}")
    if report.ok:
        out.print(f"[green]OK[/green]: {escape(report.store)} can carry BatchWeave")
    else:
        names = ", ".join(c.name for c in report.failed)
        out.print(
            f"[red]FAILED[/red]: {len(report.failed)} required check(s) failed ({escape(names)}); "
            f"{escape(report.store)} cannot carry BatchWeave as it is"
        )

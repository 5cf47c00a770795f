"""Stores that wrap another store: a pass-through base, request counting and fault injection.

All are plain :class:`ObjectStore` implementations, so anything that takes a store can be
measured (``CountingStore``: how many requests and bytes did this operation cost?) or stressed
(``FaultInjectingStore``: does the commit protocol survive timeouts, ambiguous PUTs, latency?).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import threading
import time
import typing
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn

from batchweave._checks import as_count
from batchweave._errors import AmbiguousWriteError, ObjectExists, TransientStoreError
from batchweave._store._base import (
    Bounded,
    ByteRange,
    ObjectMeta,
    ObjectStore,
    PutMode,
    check_keys,
    check_mode,
    check_range,
    check_store,
    checked_keys,
    validate_key,
)

__all__ = ["CountingStore", "FaultInjectingStore", "StoreCounts", "StoreWrapper"]

LIST_PAGE_SIZE = 1000
"""Keys per LIST page assumed when converting listed entries into S3 LIST requests."""


class StoreWrapper(ObjectStore):
    """Passes the six core calls through to ``inner``; subclass it and override what you intercept.

    ``put_parts``, ``put_if_absent``, ``get_range_into`` and ``map_range`` are deliberately not
    forwarded: the :class:`ObjectStore` defaults call this wrapper's ``put`` and ``get_range``
    (``map_range`` declines), so a subclass that intercepts ``put`` or ``get_range`` sees every
    write and range read. A subclass that changes no reads can forward the fast paths itself
    (``return self.inner.map_range(key, start, end)``) to keep, say, a file store's ``mmap``.

    Tests and tools wrap stores to gate, observe or break single operations; this base keeps the
    other six methods out of each wrapper.
    """

    def __init__(self, inner: ObjectStore) -> None:
        check_store(inner)
        self.inner = inner
        self.url = inner.url

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.inner.put(key, data, mode=mode)

    def get(self, key: str) -> bytes:
        return self.inner.get(key)

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        return self.inner.get_range(key, rng)

    def head(self, key: str) -> ObjectMeta:
        return self.inner.head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        return self.inner.list(prefix, start_after=start_after)

    def delete_many(self, keys: Iterable[str]) -> None:
        check_keys(keys)
        self.inner.delete_many(keys)

    def close(self) -> None:
        self.inner.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


_UNSET: typing.Any = object()
"""No such argument in this call (``None`` is an argument a check must refuse)."""


def _check_call(key: str, *, mode: object = _UNSET, rng: object = _UNSET) -> None:
    """Refuse what every store refuses before any request: the key, ``put``'s ``mode``, a range.

    The wrappers check first, so a call that can never reach ``inner`` is neither counted as a
    request (:class:`CountingStore`) nor failed by an injected fault (:class:`FaultInjectingStore`,
    which would turn ``InvalidKey`` into a retryable error and spend a scripted fault on it).
    """
    validate_key(key)
    if mode is not _UNSET:
        check_mode(mode)
    if rng is not _UNSET:
        check_range(rng)


@dataclass(frozen=True)
class StoreCounts:
    """Requests and bytes by operation, as counted by :class:`CountingStore`.

    Failed requests count too: a GET that raised ``ObjectNotFound`` still cost a round trip.
    ``list_pages`` is the number of LIST requests an S3 backend issues for what was consumed
    (1,000 keys per page); ``deletes`` counts ``DeleteObjects`` requests the same way.
    """

    puts: int = 0
    conditional_puts: int = 0
    put_bytes: int = 0
    gets: int = 0
    get_bytes: int = 0
    range_gets: int = 0
    range_bytes: int = 0
    heads: int = 0
    lists: int = 0
    list_pages: int = 0
    listed: int = 0
    deletes: int = 0
    deleted_keys: int = 0

    @property
    def requests(self) -> int:
        """Every request: puts, gets, range gets, heads, list pages and delete batches."""
        return self.puts + self.gets + self.range_gets + self.heads + self.list_pages + self.deletes

    @property
    def reads(self) -> int:
        """Object reads (whole and ranged): the number that read-amplification budgets count."""
        return self.gets + self.range_gets

    @property
    def bytes_read(self) -> int:
        """Payload bytes returned by ``get`` and ``get_range``."""
        return self.get_bytes + self.range_bytes

    def __sub__(self, other: StoreCounts) -> StoreCounts:
        return StoreCounts(
            **{
                f.name: getattr(self, f.name) - getattr(other, f.name)
                for f in dataclasses.fields(self)
            }
        )


class CountingStore(StoreWrapper):
    """Counts every request and byte that passes through to ``inner``. Thread-safe.

    ``snapshot()`` returns the totals; subtract two snapshots to measure one operation. A call
    refused before any request (an invalid key, a ``mode`` that is no ``PutMode``, a range that
    is no ``ByteRange``) is not counted: no request was sent.
    """

    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(inner)
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {}

    def _add(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                self._counts[name] = self._counts.get(name, 0) + delta

    def snapshot(self) -> StoreCounts:
        """The totals so far."""
        with self._lock:
            return StoreCounts(**self._counts)

    def reset(self) -> None:
        """Set every counter back to zero."""
        with self._lock:
            self._counts.clear()

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        _check_call(key, mode=mode)
        self._count_put(memoryview(data).nbytes, mode)
        self.inner.put(key, data, mode=mode)

    def put_parts(
        self,
        key: str,
        parts: Sequence[bytes | memoryview],
        *,
        mode: PutMode = PutMode.OVERWRITE,
    ) -> None:
        """One PUT of the parts' total size, passed on as parts (no join on the way)."""
        _check_call(key, mode=mode)
        self._count_put(sum(memoryview(p).nbytes for p in parts), mode)
        self.inner.put_parts(key, parts, mode=mode)

    def _count_put(self, nbytes: int, mode: PutMode) -> None:
        self._add(puts=1, conditional_puts=int(mode is PutMode.CREATE), put_bytes=nbytes)

    def get(self, key: str) -> bytes:
        _check_call(key)
        self._add(gets=1)
        data = self.inner.get(key)
        self._add(get_bytes=len(data))
        return data

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        _check_call(key, rng=rng)  # a refused argument is no request
        self._add(range_gets=1)
        data = self.inner.get_range(key, rng)
        self._add(range_bytes=len(data))
        return data

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        _check_call(key, rng=Bounded(start, start))  # Bounded refuses a bad start
        self._add(range_gets=1)
        n = self.inner.get_range_into(key, start, buffer)
        self._add(range_bytes=n)
        return n

    def map_range(self, key: str, start: int, end: int) -> memoryview | None:
        view = self.inner.map_range(key, start, end)
        if view is not None:
            self._add(range_gets=1, range_bytes=len(view))
        return view

    def head(self, key: str) -> ObjectMeta:
        _check_call(key)
        self._add(heads=1)
        return self.inner.head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self._add(lists=1, list_pages=1)
        for n, meta in enumerate(self.inner.list(prefix, start_after=start_after)):
            if n and n % LIST_PAGE_SIZE == 0:
                self._add(list_pages=1)
            self._add(listed=1)
            yield meta

    def delete_many(self, keys: Iterable[str]) -> None:
        materialized = checked_keys(keys)  # a batch with an invalid key deletes nothing
        if materialized:
            pages = -(-len(materialized) // LIST_PAGE_SIZE)
            self._add(deletes=pages, deleted_keys=len(materialized))
        self.inner.delete_many(materialized)


Op = Literal["put", "get", "get_range", "head", "list", "delete_many"]
_OPS: tuple[Op, ...] = typing.get_args(Op)
"""The operations :meth:`FaultInjectingStore.fail_next` can fail: the methods it intercepts."""
_OP_ALIASES = {
    "put_if_absent": "put",
    "put_parts": "put",
    "get_range_into": "get_range",
    "delete": "delete_many",
}
"""Methods that are not an op of their own, and the op that covers them."""
ErrorFactory = Callable[[], BaseException] | BaseException
"""An exception instance, or a zero-argument callable (e.g. an exception class) making one."""


@dataclass
class _ScriptedFault:
    error: ErrorFactory | None
    landed: bool
    key_prefix: str


def _named(keys: Sequence[str]) -> str:
    """The key of a call, or the size and first key of a batch, for an injected error."""
    if len(keys) == 1:
        return repr(keys[0])
    return f"{len(keys)} keys ({keys[0]!r}, ...)"


def _check_latency(latency: float | tuple[float, float]) -> None:
    """Refuse a latency ``time.sleep`` would refuse only when the fault is injected."""
    if isinstance(latency, tuple):
        if not (
            len(latency) == 2
            and all(math.isfinite(x) for x in latency)
            and 0 <= latency[0] <= latency[1]
        ):
            raise ValueError(
                "latency must be a (low, high) pair of finite seconds with 0 <= low <= high, "
                f"got {latency!r}"
            )
    elif not (math.isfinite(latency) and latency >= 0):
        raise ValueError(
            f"latency must be a finite number of seconds >= 0 or a (low, high) pair, "
            f"got {latency!r}"
        )


class FaultInjectingStore(StoreWrapper):
    """Injects latency and failures in front of ``inner``, reproducibly from ``seed``.

    Random faults, each decided per call with the seeded RNG:

    - ``latency``: seconds slept before every call (a float, or ``(low, high)`` for uniform;
      finite, ``0 <= low <= high``);
    - ``transient_error_rate``: the call fails with ``TransientStoreError`` before reaching
      ``inner`` (nothing was written);
    - ``ambiguous_put_rate``: a put reaches ``inner`` (the write lands, or loses the create race)
      and then ``AmbiguousWriteError`` is raised, as when a response is lost;
    - ``failed_put_after_delay_rate``: a put sleeps ``failed_put_delay`` seconds, does *not*
      write, and raises ``AmbiguousWriteError`` or ``TransientStoreError`` (a timed-out request
      that never landed).

    Scripted faults (:meth:`fail_next`) run first, in order, and make a test deterministic.
    ``sleep`` is injectable so tests need not wait for real. ``injected`` counts faults by kind.
    """

    def __init__(
        self,
        inner: ObjectStore,
        *,
        seed: int = 0,
        latency: float | tuple[float, float] = 0.0,
        transient_error_rate: float = 0.0,
        ambiguous_put_rate: float = 0.0,
        failed_put_after_delay_rate: float = 0.0,
        failed_put_delay: float = 1.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        for name, rate in (
            ("transient_error_rate", transient_error_rate),
            ("ambiguous_put_rate", ambiguous_put_rate),
            ("failed_put_after_delay_rate", failed_put_after_delay_rate),
        ):
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"{name} must be within [0, 1], got {rate}")
        if not (math.isfinite(failed_put_delay) and failed_put_delay >= 0):
            raise ValueError(
                "failed_put_delay must be a finite number of seconds >= 0, "
                f"got {failed_put_delay!r}"
            )
        _check_latency(latency)
        super().__init__(inner)
        self._latency = latency
        self._transient = transient_error_rate
        self._ambiguous = ambiguous_put_rate
        self._failed_after_delay = failed_put_after_delay_rate
        self._failed_delay = failed_put_delay
        self._sleep = sleep
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._scripted: dict[str, deque[_ScriptedFault]] = {}
        self.injected: dict[str, int] = {}
        """Faults injected so far, by kind (``transient``, ``ambiguous_put``, ...)."""

    def fail_next(
        self,
        op: Op,
        error: ErrorFactory | None = None,
        *,
        landed: bool = False,
        times: int = 1,
        key_prefix: str = "",
    ) -> None:
        """Make the next ``times`` calls of ``op`` (on keys starting with ``key_prefix``) fail.

        ``error`` defaults to ``AmbiguousWriteError`` for ``put`` and ``TransientStoreError``
        otherwise. With ``landed=True`` the call first reaches ``inner`` (the write or delete
        happens) and the error is raised afterwards.

        ``op`` is ``put``, ``get``, ``get_range``, ``head``, ``list`` or ``delete_many``; anything
        else raises ``ValueError`` (a fault scripted for an op that never runs would let a test
        pass without injecting anything).
        ``put_if_absent`` and ``put_parts`` are ``put`` calls here, and ``get_range_into`` a
        ``get_range``: script those ops. Keys are the store's full keys, which for BatchWeave's
        own objects begin with the namespace (``key_prefix=f"{namespace}/_manifests/"``).
        A ``delete_many`` batch matches if any of its keys does. ``times`` must be at least 1.
        Calls refused before any request (an invalid key or argument) and empty ``delete_many``
        batches are no calls here: they raise their own error and leave the faults scripted.
        """
        if op not in _OPS:
            covered = _OP_ALIASES.get(op) if isinstance(op, str) else None
            hint = f"; use {covered!r}, which covers {op}" if covered else ""
            raise ValueError(
                f"fail_next: unknown op {op!r}{hint}; expected one of {', '.join(map(repr, _OPS))}"
            )
        count = as_count("times", times, 1)  # times=0 would script nothing, silently
        with self._lock:
            queue = self._scripted.setdefault(op, deque())
            queue.extend(_ScriptedFault(error, landed, key_prefix) for _ in range(count))

    def _count(self, kind: str) -> None:
        self.injected[kind] = self.injected.get(kind, 0) + 1

    def _roll(self, rate: float) -> bool:
        return rate > 0.0 and self._rng.random() < rate

    def _before(self, op: Op, *keys: str) -> _ScriptedFault | None:
        """Apply latency and pick the fault for this call on ``keys`` (a batch matches if any
        of its keys does)."""
        with self._lock:
            fault = None
            queue = self._scripted.get(op)
            if queue:
                fault = next(
                    (f for f in queue if any(k.startswith(f.key_prefix) for k in keys)), None
                )
                if fault is not None:
                    queue.remove(fault)
                    self._count(f"scripted_{op}")
            if isinstance(self._latency, tuple):
                delay = self._rng.uniform(*self._latency)
            else:
                delay = self._latency
            transient = fault is None and self._roll(self._transient)
            if transient:
                self._count("transient")
        if delay > 0:
            self._sleep(delay)
        if transient:
            raise TransientStoreError(
                f"injected transient failure: {op} {_named(keys)} in {self.url}"
            )
        return fault

    def _raise(self, fault: _ScriptedFault, op: Op, *keys: str) -> NoReturn:
        error = fault.error
        if error is None:
            cls = AmbiguousWriteError if op == "put" else TransientStoreError
            error = cls(f"injected failure: {op} {_named(keys)} in {self.url}")
        raise error if isinstance(error, BaseException) else error()

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        _check_call(key, mode=mode)  # an invalid call fails as in any store, spending no fault
        fault = self._before("put", key)
        if fault is not None:
            if fault.landed:
                with contextlib.suppress(ObjectExists):
                    self.inner.put(key, data, mode=mode)
            self._raise(fault, "put", key)
        with self._lock:
            ambiguous = self._roll(self._ambiguous)
            failed = not ambiguous and self._roll(self._failed_after_delay)
            failed_cls = AmbiguousWriteError if self._rng.random() < 0.5 else TransientStoreError
            if ambiguous:
                self._count("ambiguous_put")
            if failed:
                self._count("failed_put_after_delay")
        if failed:
            self._sleep(self._failed_delay)
            raise failed_cls(f"injected timeout (not written): put {key!r} in {self.url}")
        if ambiguous:
            try:
                self.inner.put(key, data, mode=mode)
            except ObjectExists as exc:
                raise AmbiguousWriteError(
                    f"injected lost response: put {key!r} in {self.url}"
                ) from exc
            raise AmbiguousWriteError(
                f"injected lost response (written): put {key!r} in {self.url}"
            )
        self.inner.put(key, data, mode=mode)

    def _read_op(self, op: Op, key: str) -> None:
        fault = self._before(op, key)
        if fault is not None:
            self._raise(fault, op, key)

    def get(self, key: str) -> bytes:
        _check_call(key)
        self._read_op("get", key)
        return self.inner.get(key)

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        _check_call(key, rng=rng)  # before a scripted fault is spent on a call that cannot run
        self._read_op("get_range", key)
        return self.inner.get_range(key, rng)

    def head(self, key: str) -> ObjectMeta:
        _check_call(key)
        self._read_op("head", key)
        return self.inner.head(key)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self._read_op("list", prefix)
        yield from self.inner.list(prefix, start_after=start_after)

    def delete_many(self, keys: Iterable[str]) -> None:
        materialized = checked_keys(keys)
        if not materialized:
            return  # no request: neither a fault nor latency
        fault = self._before("delete_many", *materialized)
        if fault is not None:
            if fault.landed:
                self.inner.delete_many(materialized)
            self._raise(fault, "delete_many", *materialized)
        self.inner.delete_many(materialized)

"""Reading a rank's slices of one TGB: footers, range reads, mapping, parallel parts, retries.

:class:`SliceReader` turns a TGB descriptor and the slices a rank owns into decoded data with as
few requests as it can: one cached footer read per object whose manifest entry has no slice
table, one range read per run of slices stored back to back, a mapping instead of a copy for
huge reads on stores that can map, and parallel part reads for huge reads elsewhere. Transient
errors are retried within the step's :class:`Budget`; outages are waited out.

Separate from :class:`~batchweave._consumer._core.Consumer`, which decides *which* step to read
and when (its manifest, projection and read-ahead window): this module only knows how to read
the bytes of a step once it is located.
"""

from __future__ import annotations

import functools
import logging
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from batchweave._consumer._prefetch import SingleFlightCache, Workers, gather
from batchweave._consumer._stats import Counters
from batchweave._errors import (
    ChecksumMismatch,
    ConsumerError,
    FormatError,
    ObjectNotFound,
    StoreUnavailable,
    TransientStoreError,
)
from batchweave._format._checksum import checksum
from batchweave._format._tgb import TRAILER_SIZE, SliceEntry, SliceSpan, TgbFooter
from batchweave._format._tgb_read import decode_entry, parse_footer
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import SliceTable, TgbDescriptor, TgbObjectRef
from batchweave._outage import OutageLog, no_answer
from batchweave._projection import SliceLocation
from batchweave._store._base import Bounded, ObjectStore

__all__ = ["READ_RETRYABLE", "Budget", "ObjectGone", "ReadOptions", "SliceReader", "closed_error"]

_log = logging.getLogger("batchweave.consumer")

READ_RETRYABLE: Final = (TransientStoreError, StoreUnavailable)
"""Store errors after which a consumer's read is tried again: a range read here, a manifest
poll in :class:`~batchweave._consumer._core.Consumer`. Other errors are final."""

_T = TypeVar("_T")

# The trailer starts with the footer length, a little-endian u64 (docs/format.md).
_U64: Final = struct.Struct("<Q")

_RESTORE: Final = "restore it, or resume past this step"
"""What to do about a committed object that is no longer what the manifest recorded."""

# Every step creates a budget, but only failed reads spend one: a lock shared by all budgets
# costs nothing, a lock per budget would be created on every step.
_BUDGET_LOCK: Final = threading.Lock()
_UNPROVEN_ALLOCATION: Final = 1 << 30
"""Largest buffer a split read allocates before the object has shown it holds the range (its
last part read whole): larger claims read that part first."""


class ObjectGone(ConsumerError):
    """A read found its object missing (its cause is the store's :class:`ObjectNotFound`).

    Raised by :meth:`SliceReader.retrying` (made with :meth:`reading`), which cannot tell why:
    the :class:`~batchweave._consumer._core.Consumer` reading the step asks the namespace and
    raises :class:`~batchweave.StepReclaimed` instead if a reclamation pass deleted the step.
    Made from its message alone, as exceptions are (pickled, or re-raised by a DataLoader), it
    works as any other.
    """

    what: str = ""
    """The read that found the object gone (step, object, slices); empty if unknown."""

    @classmethod
    def reading(cls, what: str) -> ObjectGone:
        """The error of the read ``what``."""
        error = cls(
            f"{what}: the object is gone although the namespace still lists its step: deleted "
            "by hand, or by a reclaimer as an orphan (a grace shorter than a producer's "
            "upload-to-commit time); run `batchweave verify`, and resume from a later "
            "checkpoint"
        )
        error.what = what
        return error


class Budget:
    """The retries one step may still spend, shared by all of its reads."""

    __slots__ = ("_left", "limit")

    def __init__(self, retries: int) -> None:
        self.limit = retries
        self._left = retries

    def spend(self) -> int | None:
        """Take one retry; return how many were used so far, or ``None`` if none is left."""
        with _BUDGET_LOCK:
            if self._left <= 0:
                return None
            self._left -= 1
            return self.limit - self._left


@dataclass(frozen=True)
class ReadOptions:
    """How a :class:`SliceReader` reads and retries: the consumer's options of these names."""

    map_threshold: int
    """Reads of at least this many bytes are mapped instead of copied, on stores that can map."""
    split_threshold: int
    """Reads of at least this many bytes (and more than ``part_size``) are read in parts."""
    part_size: int
    """Bytes per part of a split read."""
    retry_backoff: float
    """Seconds slept before the first retry of a failed read; doubled per retry."""
    max_retry_backoff: float
    """The longest sleep before a retry, in seconds."""


class SliceReader:
    """Reads and decodes slices of one namespace's TGB objects for one consumer.

    Owns the cache of the last ``footer_cache`` parsed footers. Shares the consumer's counters,
    outage log and worker threads (parallel reads run there). Once :meth:`close` is called, a
    failed read raises instead of being retried.
    """

    def __init__(
        self,
        store: ObjectStore,
        log: ManifestLog,
        *,
        counters: Counters,
        outage: OutageLog,
        pool: Workers,
        footer_cache: int,
        options: ReadOptions,
        sleep: Callable[[float], None],
    ) -> None:
        self._store = store
        self._log = log
        self._counters = counters
        self._outage = outage
        self._pool = pool
        self._footers: SingleFlightCache[str, TgbFooter] = SingleFlightCache(footer_cache)
        self.options = options
        self._sleep = sleep
        self._closed_consumer: str | None = None
        """The closed consumer's ``repr`` once :meth:`close` was called, for the error."""

    def close(self, consumer: str) -> None:
        """Retry nothing more: a read that fails from now on raises :class:`ConsumerError`
        naming ``consumer`` (the closing consumer's ``repr``). Also stops a read-ahead job that
        waits out an outage. Drops the cached footers."""
        self._closed_consumer = consumer
        self._footers.close()

    def read(
        self, what: str, desc: TgbDescriptor, loc: SliceLocation, budget: Budget
    ) -> tuple[Any, int, bool]:
        """This rank's slices ``loc`` of the TGB ``desc``, decoded: ``(data, stored bytes, one
        object)``; the last is False when several objects held them, read by pool threads."""
        data: Any
        if len(loc.slices) == 1:  # the common case: nothing to group by object or into runs
            index = loc.slices[0]
            data, nbytes = self.read_slice(what, _object_holding(desc, index, what), index, budget)
            one_object = True
        else:
            groups = _group_by_object(desc, loc, what)
            one_object = len(groups) == 1
            if one_object:  # one object holds the rank's slices: no jobs to gather
                data, nbytes = self.read_object_slices(what, *groups[0], budget)
            else:
                results = gather(
                    self._pool,
                    [
                        functools.partial(self.read_object_slices, what, ref, idx, budget)
                        for ref, idx in groups
                    ],
                )
                data = [value for values, _ in results for value in values]
                nbytes = sum(n for _, n in results)
        return data, nbytes, one_object

    def read_slice(
        self, step_what: str, ref: TgbObjectRef, index: int, budget: Budget
    ) -> tuple[Any, int]:
        """Slice ``index`` (numbered within the TGB) of ``ref``'s object, decoded, and its stored
        bytes: :meth:`read_object_slices` for one slice, without building runs of slices."""
        key = self._log.key(ref.key)
        what = f"{step_what}, object {key!r}"
        entry: SliceEntry | SliceSpan
        if ref.slices is not None:
            layout: SliceTable | TgbFooter = ref.slices
            entry = ref.slices.span(index - ref.first_slice)
        else:
            layout = self._layout(key, ref, what, budget)
            entry = layout.slices[index - ref.first_slice]
        where = f"{what}, slice {index}"
        buf = self._read_range(key, entry.offset, entry.offset + entry.length, where, budget)
        # Checksums and raw decoding take bytes without a copy.
        raw = buf if isinstance(buf, bytes) else memoryview(buf)
        return decode_entry(raw, entry, layout, where=where), entry.length

    def read_object_slices(
        self, step_what: str, ref: TgbObjectRef, indices: list[int], budget: Budget
    ) -> tuple[list[Any], int]:
        """Slices ``indices`` (numbered within the TGB) of ``ref``'s object, decoded, and their
        stored bytes: one range read per run of slices stored back to back."""
        key = self._log.key(ref.key)
        what = f"{step_what}, object {key!r}"
        layout = ref.slices if ref.slices is not None else self._layout(key, ref, what, budget)
        values: list[Any] = []
        nbytes = 0
        for run in _runs(layout, ref.first_slice, indices):
            (first_index, first), (_, last) = run[0], run[-1]
            start, end = first.offset, last.offset + last.length
            if len(run) == 1:
                where = f"{what}, slice {first_index}"
            else:
                where = f"{what}, slices {', '.join(str(i) for i, _ in run)}"
            buf = self._read_range(key, start, end, where, budget)
            if isinstance(buf, bytes) and len(run) == 1:
                # Checksums and raw decoding take bytes without a copy.
                values.append(decode_entry(buf, first, layout, where=where))
            else:
                view = memoryview(buf)
                for i, entry in run:
                    raw = view[entry.offset - start : entry.offset - start + entry.length]
                    values.append(decode_entry(raw, entry, layout, where=f"{what}, slice {i}"))
            nbytes += end - start
        return values, nbytes

    def _layout(self, key: str, ref: TgbObjectRef, what: str, budget: Budget) -> TgbFooter:
        """The footer of ``ref``'s object, from the cache or fetched (the manifest has no table)."""
        try:
            footer, hit = self._footers.get(
                key,
                lambda: self.retrying(budget, f"{what}, footer", self._footer, key, ref),
            )
        except FormatError as exc:
            raise type(exc)(f"{what}, footer: {exc}") from exc
        self._counters.add(footer_cache_hits=1 if hit else 0)
        if len(footer.slices) != ref.slice_count:
            raise FormatError(
                f"{what}: the manifest records {ref.slice_count} slices in the object, its footer "
                f"{len(footer.slices)}; the object was replaced after it was committed: {_RESTORE}"
            )
        return footer

    def _footer(self, key: str, ref: TgbObjectRef) -> TgbFooter:
        """Fetch ``ref``'s footer and trailer with one exact range read and verify both."""
        want = ref.footer_length + TRAILER_SIZE
        buf = self._get(key, ref.footer_offset, ref.footer_offset + want)
        self._counters.add(footer_reads=1)
        if len(buf) != want:
            raise FormatError(
                f"object {key!r} is truncated: expected footer and trailer at bytes "
                f"[{ref.footer_offset}, {ref.footer_offset + want}), got {len(buf)} bytes; "
                f"{_RESTORE}"
            )
        footer = parse_footer(buf, key=key)  # verifies the trailer's checksum over the footer
        (footer_length,) = _U64.unpack_from(buf, len(buf) - TRAILER_SIZE)
        if footer_length != ref.footer_length or footer.payload_length != ref.footer_offset:
            raise FormatError(
                f"object {key!r}: the manifest locates its footer at [{ref.footer_offset}, "
                f"+{ref.footer_length}), the object at [{footer.payload_length}, "
                f"+{footer_length}); the object was replaced after it was committed: {_RESTORE}"
            )
        computed = checksum(buf[: ref.footer_length], footer.checksum_algo)
        if computed != ref.footer_checksum:
            raise ChecksumMismatch(
                f"object {key!r}: its footer's {footer.checksum_algo} checksum is {computed:#x}, "
                f"the manifest recorded {ref.footer_checksum:#x}; the object was replaced or "
                f"damaged after it was committed: {_RESTORE}"
            )
        return footer

    def _read_range(
        self, key: str, start: int, end: int, where: str, budget: Budget
    ) -> bytes | bytearray | memoryview:
        """Bytes ``[start, end)`` of ``key``: mapped, one range read, or parallel parts.

        ``where`` names the slices read in errors: a format error (a truncated object) is
        raised again with it in front.
        """
        length = end - start
        if length == 0:
            return b""
        options = self.options
        try:
            if length >= options.map_threshold:
                mapped = self.retrying(budget, where, self._map, key, start, end)
                if mapped is not None:
                    return mapped
            if length < options.split_threshold or length <= options.part_size:
                data = self.retrying(budget, where, self._get, key, start, end)
                if len(data) != length:
                    raise _truncated(key, start, end, len(data))
                return data
            last, tail = end, b""
            if length > _UNPROVEN_ALLOCATION:
                # The range comes from a slice table nothing has checked against the object yet
                # (the manifest's, when no footer is read): a damaged or forged one can claim
                # gigabytes. The last part is read first, and the whole buffer is allocated only
                # once it came back whole, proving the object holds the range: a short one is a
                # FormatError, never a huge allocation. Same parts, same request count, but one
                # part's round trip before the others, so only above that size.
                last = start + (length - 1) // options.part_size * options.part_size
                tail = self.retrying(budget, where, self._get, key, last, end)
                if len(tail) != end - last:
                    raise _claims_too_much(key, start, end, last, len(tail))
            buf = bytearray(length)
            view = memoryview(buf)
            view[last - start :] = tail
            del tail

            def part(lo: int, hi: int) -> None:
                target = view[lo - start : hi - start]
                self.retrying(budget, where, self._get_into, key, lo, target)

            bounds = range(start, last, options.part_size)
            gather(
                self._pool,
                [functools.partial(part, a, min(a + options.part_size, end)) for a in bounds],
            )
            return buf
        except FormatError as exc:
            raise type(exc)(f"{where}: {exc}") from exc

    def _map(self, key: str, start: int, end: int) -> memoryview | None:
        view = self._store.map_range(key, start, end)
        if view is not None:
            self._counters.read_returned(len(view))
            if len(view) != end - start:
                raise _truncated(key, start, end, len(view))
        return view

    def _get_into(self, key: str, start: int, target: memoryview) -> None:
        try:
            n = self._store.get_range_into(key, start, target)
        except BaseException:
            self._counters.read_failed()
            raise
        self._counters.read_returned(n)
        if n != len(target):
            raise _truncated(key, start, start + len(target), n)

    def _get(self, key: str, start: int, end: int) -> bytes:
        """Bytes ``[start, end)`` of ``key`` with one range read (fewer at the object's end)."""
        try:
            data = self._store.get_range(key, Bounded(start, end))
        except BaseException:
            self._counters.read_failed()
            raise
        self._counters.read_returned(len(data))
        return data

    def retrying(self, budget: Budget, what: str, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, retried on transient store errors within ``budget`` and through
        outages; ``what`` names the read in errors and logs."""
        attempt = 0
        while True:
            try:
                result = fn(*args)
                self._outage.recovered()
                return result
            except StoreUnavailable as exc:
                # An outage does not spend the step's budget: the read is retried until the
                # store is back (``docs/guarantees.md``, "Outages").
                self._outage.failed(f"reading {what}", exc)
            except READ_RETRYABLE as exc:
                if no_answer(exc):  # a hung store: warn (once per outage), as when unreachable
                    self._outage.failed(f"reading {what}", exc)
                used = budget.spend()
                if used is None:
                    raise ConsumerError(
                        f"{what}: read failed and the step's retry budget ({budget.limit}) is "
                        f"spent (next() retries the step from scratch; a flaky store may need "
                        f"a larger retry_budget); last error: {exc}"
                    ) from exc
                _log.debug("%s: %s; retry %d", what, exc, used)
            except ObjectNotFound as exc:
                # The consumer asks the namespace whether the step was reclaimed.
                raise ObjectGone.reading(what) from exc
            if self._closed_consumer is not None:
                raise closed_error(self._closed_consumer, f"retrying {what}")
            self._counters.add(retries=1)
            # The exponent is capped: an outage can last thousands of retries, and 2.0**1024
            # overflows a float.
            backoff = self.options.retry_backoff * 2.0 ** min(attempt, 30)
            self._sleep(min(self.options.max_retry_backoff, backoff))
            attempt += 1


def closed_error(consumer: str, doing: str) -> ConsumerError:
    """The error of a closed consumer (``consumer`` is its ``repr``) that was ``doing`` this."""
    return ConsumerError(f"{consumer} was closed while {doing}")


def _truncated(key: str, start: int, end: int, got: int) -> FormatError:
    return FormatError(
        f"object {key!r} is truncated: bytes [{start}, {end}) requested, {got} returned; {_RESTORE}"
    )


def _claims_too_much(key: str, start: int, end: int, last: int, got: int) -> FormatError:
    """The error of a split read of ``[start, end)`` whose last part ``[last, end)`` returned
    only ``got`` bytes: the object is smaller than the slice table says."""
    return FormatError(
        f"object {key!r} is smaller than its slice table says: the table places "
        f"{end - start} bytes at [{start}, {end}), but reading the last part [{last}, {end}) "
        f"returned {got} bytes (nothing was allocated for the claimed size); the object was "
        f"truncated or replaced after it was committed, or the slice table is damaged: {_RESTORE}"
    )


def _object_holding(desc: TgbDescriptor, index: int, what: str) -> TgbObjectRef:
    """The object of ``desc`` holding slice ``index`` (numbered within the TGB)."""
    for ref in desc.objects:
        if ref.first_slice <= index < ref.first_slice + ref.slice_count:
            return ref
    raise FormatError(f"{what}: no object of the TGB holds slice {index}")


def _group_by_object(
    desc: TgbDescriptor, loc: SliceLocation, what: str
) -> list[tuple[TgbObjectRef, list[int]]]:
    """Split ``loc.slices`` by the object holding each, keeping their order."""
    groups: list[tuple[TgbObjectRef, list[int]]] = []
    for index in loc.slices:
        ref = _object_holding(desc, index, what)
        if groups and groups[-1][0] is ref:
            groups[-1][1].append(index)
        else:
            groups.append((ref, [index]))
    return groups


def _runs(
    layout: SliceTable | TgbFooter, first_slice: int, indices: list[int]
) -> list[list[tuple[int, SliceEntry | SliceSpan]]]:
    """Slices ``indices`` (numbered within the TGB) of an object with their entries in its
    layout, in runs of slices stored back to back: one range read per run."""
    entry: Callable[[int], SliceEntry | SliceSpan] = (
        layout.slices.__getitem__ if isinstance(layout, TgbFooter) else layout.span
    )
    runs: list[list[tuple[int, SliceEntry | SliceSpan]]] = []
    run_end = -1  # where the last run's bytes end; no slice starts at -1
    for index in indices:
        cur = entry(index - first_slice)
        if cur.offset == run_end:
            runs[-1].append((index, cur))
        else:
            runs.append([(index, cur)])
        run_end = cur.offset + cur.length
    return runs

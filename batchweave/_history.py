"""Batch membership history: which producer's data every rank read at every step.

One row per ``(step, dp, cp)`` slice of the committed history (steps ``base_step ..
next_step - 1`` of the newest manifest): the producer, its epoch and source offset, the object and
the slice's stored bytes and sample count, and the slice's sample ids when the producer recorded
them. Tools (``batchweave export``, :func:`batchweave.lance.export_history`) turn the rows into a
Lance dataset or a Parquet file for auditing ("which documents trained step 1234 on rank 5?").

Sample ids are a producer convention, not part of the TGB format: a producer that puts
``{SAMPLE_IDS_KEY: sample_ids_metadata(ids)}`` into a TGB's metadata (``ids`` holds one list per
slice, in ``(d, c)`` order) gets them exported. The key, the helper and the validator live in
:mod:`batchweave._format._sample_ids`, so the encoder refuses a malformed value before upload
with the same rules this module reads it back with.
"""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from batchweave._checks import MAX_INT64, as_count
from batchweave._errors import (
    ChecksumMismatch,
    FormatError,
    ObjectNotFound,
    StepReclaimed,
    StoreError,
)
from batchweave._format._checksum import checksum
from batchweave._format._sample_ids import SAMPLE_IDS_KEY, parse_sample_ids, sample_ids_metadata
from batchweave._format._tgb import TRAILER_SIZE, TgbFooter
from batchweave._format._tgb_read import parse_footer
from batchweave._manifest._log import ManifestLog, check_tiling
from batchweave._manifest._models import Manifest, TgbDescriptor, TgbObjectRef
from batchweave._manifest._segments import find_segment
from batchweave._store._base import Bounded, ObjectStore

__all__ = [
    "MEMBERSHIP_SCHEMA",
    "SAMPLE_IDS_KEY",
    "MembershipRow",
    "base_step_now",
    "iter_membership",
    "membership_batches",
    "read_object_footer",
    "sample_ids_metadata",
    "write_parquet",
]


@dataclass(frozen=True)
class MembershipRow:
    """One slice of one committed step."""

    step: int
    dp: int
    cp: int
    producer_id: str
    epoch: int
    offset: int
    key: str
    """Object key relative to the namespace."""
    bytes: int
    """Stored bytes of the slice (what the rank's range read fetches)."""
    samples: int
    sample_ids: tuple[str, ...] | None
    """The slice's sample ids when the producer recorded them, else ``None``."""


def _sample_ids(footer: TgbFooter, key: str) -> list[tuple[str, ...]] | None:
    raw = footer.metadata.get(SAMPLE_IDS_KEY)
    if raw is None:
        return None
    try:
        return parse_sample_ids(raw, len(footer.slices))
    except ValueError as exc:
        raise FormatError(f"object {key!r}: {exc}") from exc


def _found_size(store: ObjectStore, key: str, recorded: int) -> str:
    """The size of object ``key`` for a message: at least ``recorded + 1`` bytes (a read found
    a byte past ``recorded``), exactly when a HEAD says."""
    try:
        size = store.head(key).size
    except StoreError:  # only for the message: the object is too long whatever HEAD says
        return f"at least {recorded + 1}"
    return str(size) if size > recorded else f"at least {recorded + 1}"


def read_object_footer(store: ObjectStore, key: str, ref: TgbObjectRef) -> TgbFooter:
    """Fetch object ``key``'s footer with one range read and check it against ``ref``.

    Verifies the trailer's footer checksum, the manifest's ``footer_checksum`` of the footer
    bytes, that footer plus trailer end exactly at the recorded object size and that the object
    ends there too (the read asks for one byte more, which must not exist: bytes appended to an
    object are damage the format's own reader refuses), and that the object holds the recorded
    number of slices. Raises :class:`FormatError` (or :class:`ChecksumMismatch`) naming the
    object.
    """
    end = ref.footer_offset + ref.footer_length + TRAILER_SIZE
    if end != ref.size:
        raise FormatError(
            f"object {key!r}: the manifest records size {ref.size} but footer and trailer end "
            f"at byte {end}"
        )
    buf = store.get_range(key, Bounded(ref.footer_offset, end + 1))
    if len(buf) > end - ref.footer_offset:
        raise FormatError(
            f"object {key!r} is longer than the manifest records: {ref.size} bytes recorded, "
            f"{_found_size(store, key, ref.size)} found; the object was damaged (bytes "
            "appended) or replaced"
        )
    if len(buf) != end - ref.footer_offset:
        raise FormatError(
            f"object {key!r} is truncated: the manifest records {ref.size} bytes, but reading "
            f"its footer (bytes {ref.footer_offset}..{end - 1}) returned {len(buf)}; the object "
            "was damaged or replaced"
        )
    footer = parse_footer(buf, key=key)
    computed = checksum(buf[: ref.footer_length], footer.checksum_algo)
    if computed != ref.footer_checksum:
        raise ChecksumMismatch(
            f"object {key!r}: footer {footer.checksum_algo} checksum {computed:#x} differs from "
            f"the manifest's {ref.footer_checksum:#x}; the object was replaced or damaged"
        )
    if footer.payload_length != ref.footer_offset:
        raise FormatError(
            f"object {key!r}: the footer follows {footer.payload_length} payload bytes, the "
            f"manifest says {ref.footer_offset}"
        )
    if len(footer.slices) != ref.slice_count:
        raise FormatError(
            f"object {key!r}: the manifest records {ref.slice_count} slices, the footer "
            f"{len(footer.slices)}"
        )
    return footer


def base_step_now(log: ManifestLog, default: int) -> int:
    """The newest version's ``base_step`` (a reclamation pass may have moved it while a reader
    worked), or ``default`` if that version is damaged: the damage is the problem to report."""
    try:
        return log.latest().base_step
    except FormatError:
        return default


def _raise_if_reclaimed(
    log: ManifestLog, manifest: Manifest, step: int, first: int, last: int
) -> None:
    """Raise :class:`StepReclaimed` if ``step``'s object is missing because a reclamation pass
    moved ``base_step`` past it while the history was being read (reclaimers run at any time)."""
    base = base_step_now(log, default=-1)
    if step < base:
        raise StepReclaimed(
            f"steps {step}..{min(base, last) - 1} were reclaimed while the history was being "
            f"read (base_step moved from {manifest.base_step} to {base}); the export is "
            f"incomplete and was not written. Export again: its steps now start at {base} "
            f"(steps {first}..{base - 1} are gone); to keep steps, hold a watermark at or below "
            "the first step you need while exporting"
        )


def _descriptors(
    log: ManifestLog, manifest: Manifest, first: int, last: int
) -> Iterator[tuple[int, TgbDescriptor]]:
    """``log.descriptors(manifest, first, last)``, a missing segment explained: reclaimed
    meanwhile (:class:`StepReclaimed`), merged into a newer one by a commit since ``manifest``
    (read again), or deleted by hand (the namespace is damaged)."""
    missing = first  # the step the next descriptor is for
    rows = log.descriptors(manifest, first, last)
    while True:
        try:
            step, desc = next(rows)
        except StopIteration:
            return
        except ObjectNotFound as exc:
            _raise_if_reclaimed(log, manifest, missing, first, last)
            latest = log.latest(manifest)
            held = find_segment(manifest.segments, missing)
            if held in latest.segments:
                raise ObjectNotFound(log.missing_segment(latest, held)) from exc
            raise ObjectNotFound(
                f"segment {log.key(held.key)!r} (TGB steps {held.first_step}.."
                f"{held.end_step - 1}) was merged into a newer one while the history was being "
                f"read (manifest version {manifest.version}, now {latest.version}); nothing was "
                "written: export again"
            ) from exc
        yield step, desc
        missing = step + 1


def iter_membership(
    store: ObjectStore,
    namespace: str,
    *,
    manifest: Manifest | None = None,
    start: int | None = None,
    stop: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[MembershipRow]:
    """Rows for steps ``start .. stop - 1`` (default: every readable step), in step order.

    Costs one footer range read per TGB object (slices are not read). ``manifest`` defaults to
    the namespace's newest version. ``progress(done, total)`` is called as steps are read.
    Raises :class:`StepReclaimed` for a ``start`` below ``base_step`` and when a reclamation
    pass deletes steps not yet read (a partial history would pass for the whole one).
    """
    start = None if start is None else as_count("start", start, 0)  # not "5", True or -1
    stop = None if stop is None else as_count("stop", stop, 0)
    log = ManifestLog(store, namespace)
    if manifest is None:
        manifest = log.create_or_open()
    if start is not None and start < manifest.base_step:
        raise StepReclaimed(
            f"start {start} is below base_step {manifest.base_step} of namespace {namespace!r}: "
            f"steps 0..{manifest.base_step - 1} were reclaimed and their membership is gone; "
            f"start at {manifest.base_step} or later, or omit start"
        )
    first = manifest.base_step if start is None else start
    last = manifest.next_step if stop is None else min(stop, manifest.next_step)
    cp = manifest.mesh.cp
    total = max(0, last - first)
    for done, (step, desc) in enumerate(_descriptors(log, manifest, first, last), 1):
        check_tiling(desc, manifest, step, repr(namespace))
        for ref in desc.objects:
            key = log.key(ref.key)
            try:
                footer = read_object_footer(store, key, ref)
            except ObjectNotFound:
                _raise_if_reclaimed(log, manifest, step, first, last)
                raise
            ids = _sample_ids(footer, key)
            for j, entry in enumerate(footer.slices):
                d, c = divmod(ref.first_slice + j, cp)
                yield MembershipRow(
                    step=step,
                    dp=d,
                    cp=c,
                    producer_id=desc.producer_id,
                    epoch=desc.epoch,
                    offset=desc.offset,
                    key=ref.key,
                    bytes=entry.length,
                    samples=entry.sample_count,
                    sample_ids=None if ids is None else ids[j],
                )
        if progress is not None:
            progress(done, total)


MEMBERSHIP_SCHEMA = pa.schema(
    [
        pa.field("step", pa.int64(), nullable=False),
        pa.field("dp", pa.int32(), nullable=False),
        pa.field("cp", pa.int32(), nullable=False),
        pa.field("producer_id", pa.string(), nullable=False),
        pa.field("epoch", pa.int64(), nullable=False),
        pa.field("offset", pa.int64(), nullable=False),
        pa.field("key", pa.string(), nullable=False),
        pa.field("bytes", pa.int64(), nullable=False),
        pa.field("samples", pa.int64(), nullable=False),
        pa.field("sample_ids", pa.list_(pa.string())),
    ]
)
"""Columns of an exported membership history (Lance dataset or Parquet file)."""


def _too_large(rows: list[MembershipRow], exc: Exception) -> FormatError:
    """The error of ``rows`` that Arrow refused (``exc``): a value beyond its 64-bit column,
    which no producer writes (offsets and sample counts are checked), named with its step."""
    for row in rows:
        for name in ("epoch", "offset", "bytes", "samples"):
            value = getattr(row, name)
            if not -MAX_INT64 - 1 <= value <= MAX_INT64:
                return FormatError(
                    f"step {row.step}, slice ({row.dp}, {row.cp}): {name} {value} does not fit "
                    "the history's 64-bit column; the manifest was not written by this "
                    f"BatchWeave (its producers write at most 2**63 - 1). Export a window "
                    f"without step {row.step} (start/stop)"
                )
    return FormatError(f"the membership history cannot be written as Arrow: {exc}")


BATCH_SAMPLE_ID_BYTES = 256 << 20
"""Sample-id bytes after which :func:`membership_batches` ends a batch before ``batch_rows``.

``sample_ids`` is ``list<string>``, whose offsets are 32-bit: a batch must hold under 2 GiB of
id text and under 2**31 ids (a row-count cut alone let 8,192 rows of long ids overflow it, a raw
pyarrow ``TypeError``). Each id counts its UTF-8 bytes plus 4 (its offset); a batch ends once
its ids reach this budget, and the row that reached it adds at most one footer's worth of text
and ids (``MAX_FOOTER_LENGTH``, 256 MiB of JSON, never shorter than the UTF-8 it holds), so no
batch comes near either limit. The schema is unchanged: only batch boundaries move."""


def _sample_id_bytes(ids: tuple[str, ...] | None) -> int:
    """What ``ids`` add to a batch's ``sample_ids`` column: their UTF-8 bytes, 4 per offset."""
    if ids is None:
        return 0
    return sum(len(i) if i.isascii() else len(i.encode("utf-8")) for i in ids) + 4 * len(ids)


def membership_batches(
    store: ObjectStore,
    namespace: str,
    *,
    start: int | None = None,
    stop: int | None = None,
    batch_rows: int = 8192,
    progress: Callable[[int, int], None] | None = None,
) -> Iterator[pa.RecordBatch]:
    """:func:`iter_membership` as Arrow record batches of at most ``batch_rows`` rows, ended
    early once their sample ids reach :data:`BATCH_SAMPLE_ID_BYTES` (Arrow's 32-bit string
    offsets hold under 2 GiB per batch)."""
    names = MEMBERSHIP_SCHEMA.names
    buffer: list[MembershipRow] = []
    id_bytes = 0

    def flush() -> pa.RecordBatch:
        columns = {name: [getattr(row, name) for row in buffer] for name in names}
        columns["sample_ids"] = [
            None if row.sample_ids is None else list(row.sample_ids) for row in buffer
        ]
        rows = list(buffer)
        buffer.clear()
        try:
            return pa.RecordBatch.from_pydict(columns, schema=MEMBERSHIP_SCHEMA)
        except (OverflowError, pa.ArrowInvalid) as exc:
            raise _too_large(rows, exc) from exc

    for row in iter_membership(store, namespace, start=start, stop=stop, progress=progress):
        buffer.append(row)
        id_bytes += _sample_id_bytes(row.sample_ids)
        if len(buffer) >= batch_rows or id_bytes >= BATCH_SAMPLE_ID_BYTES:
            id_bytes = 0
            yield flush()
    if buffer:
        yield flush()


def write_parquet(
    store: ObjectStore,
    namespace: str,
    path: str,
    *,
    start: int | None = None,
    stop: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write the membership history to the Parquet file ``path``; return the row count.

    The file appears only complete: rows go to a temporary file next to ``path``, renamed over
    it at the end. An export that fails midway (a damaged object, a store error) leaves no
    truncated file that would pass for the whole history. ``progress(done, total)`` is called
    as steps are read.
    """
    rows = 0
    partial = f"{path}.partial-{uuid.uuid4().hex[:8]}"
    try:
        with pq.ParquetWriter(partial, MEMBERSHIP_SCHEMA) as writer:
            batches = membership_batches(
                store, namespace, start=start, stop=stop, progress=progress
            )
            for batch in batches:
                writer.write_batch(batch)
                rows += batch.num_rows
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(partial)
        raise
    return rows

"""Lance integration: a resumable producer-side source, and the membership-history export.

:class:`LanceSource` samples batches of rows from a Lance dataset with batched random access
(``LanceDataset.take``): batch ``offset`` is a pure function of the dataset, the seed, the shard
and ``offset``, so a producer restarted at ``Producer.resume_offset`` re-creates exactly the
batches it had not committed yet (exactly-once from source to training step)::

    source = LanceSource("corpus.lance", rows_per_batch=64, seed=7, shard=i, num_shards=n)
    with bw.Producer(
        store, "run-1", producer_id=f"prep-{i}", mesh=mesh, source=source.source_id
    ) as p:
        for offset, table in source.iter_from(p.resume_offset, stop=1000):
            p.append(pack(table), offset=offset)

:func:`export_history` writes which producer batch (and which sample ids) every rank read at
every step into a Lance dataset. Requires ``pylance`` (``pip install batchweave[lance]``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

try:
    import lance
except ImportError as exc:
    raise ImportError(
        f"batchweave.lance needs pylance, which provides the 'lance' module ({exc}): "
        "pip install 'batchweave[lance]'",
        name=exc.name,
    ) from exc
import numpy as np
import pyarrow as pa

from batchweave._checks import as_count, as_int
from batchweave._history import MEMBERSHIP_SCHEMA, membership_batches
from batchweave._interrupts import deferred_interrupt
from batchweave._manifest._models import MAX_SOURCE_LENGTH
from batchweave._store._base import ObjectStore

__all__ = ["LanceSource", "export_history"]


class LanceSource:
    """Deterministic, resumable batches of rows from a Lance dataset.

    The shard's rows (``shard, shard + num_shards, ...`` of the dataset's row positions) are
    visited epoch after epoch, each epoch in its own seeded permutation (or in order with
    ``shuffle=False``); batch ``offset`` holds positions ``offset * rows_per_batch ...`` of that
    endless sequence, so every row of the shard appears exactly once per epoch. With ``epochs``
    set, the sequence ends after that many epochs (the last batch may be shorter).

    The permutation is built from primitives whose output NumPy keeps stable across releases
    (``SeedSequence`` and the raw ``PCG64`` stream, then a stable sort), not from
    ``Generator.permutation``, whose stream NumPy may change: a producer restarted under another
    NumPy version still maps every offset to the same rows.

    ``dataset`` is a path/URI (opened with ``storage_options``) or an open ``LanceDataset``;
    ``columns`` limits the columns read. Offsets map to row positions of one dataset version,
    :attr:`version` (the newest when the source is built, unless ``version=`` pins one): a
    restarted producer must pass that same ``version=``, or its resumed offsets read other rows
    once the dataset has changed. A read finding the dataset object moved to another version
    (``insert`` or ``checkout_latest`` on :attr:`dataset`) raises ``RuntimeError``; an open
    dataset passed in is copied, so the caller's later changes to it do not reach the source.
    :attr:`source_id` names all of that for ``Producer(source=...)``, which then refuses a
    restart whose offsets would read other rows.

    Blob columns (Lance's blob encoding) come back as their bytes (``large_binary``, read with
    ``read_blobs``): ``take`` alone returns only their descriptors.
    """

    def __init__(
        self,
        dataset: str | os.PathLike[str] | lance.LanceDataset,
        *,
        rows_per_batch: int,
        seed: int = 0,
        shard: int = 0,
        num_shards: int = 1,
        shuffle: bool = True,
        epochs: int | None = None,
        columns: Sequence[str] | None = None,
        version: int | None = None,
        storage_options: dict[str, str] | None = None,
    ) -> None:
        # Checked here: a bad value would otherwise fail at the first take(), after the
        # producer fed by this source has started.
        rows_per_batch, seed = as_int("rows_per_batch", rows_per_batch), as_int("seed", seed)
        shard, num_shards = as_int("shard", shard), as_int("num_shards", num_shards)
        if epochs is not None:
            epochs = as_int("epochs", epochs)
        if version is not None:
            version = as_count("version", version, 0)  # -1 overflowed inside Lance
        if rows_per_batch < 1:
            raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if not 0 <= shard < num_shards:
            raise ValueError(f"need 0 <= shard < num_shards, got shard {shard} of {num_shards}")
        if epochs is not None and epochs < 1:
            raise ValueError(f"epochs must be >= 1 or None, got {epochs}")
        if columns is not None and (isinstance(columns, str) or not columns):
            raise ValueError(
                f"columns must be a non-empty list of column names (None reads all), got "
                f"{columns!r}"
            )
        self.dataset = _open(dataset, version, storage_options)
        self.version: int = self.dataset.version
        """The dataset version whose row positions the offsets map to: pass it as ``version=``
        when the producer restarts."""
        self.rows_per_batch = rows_per_batch
        self.seed = seed
        self.shard = shard
        self.num_shards = num_shards
        self.shuffle = shuffle
        self.epochs = epochs
        self.columns = None if columns is None else list(columns)
        if self.columns is not None:
            self._check_columns(self.columns)
        wanted = self.dataset.schema.names if self.columns is None else self.columns
        self._blob_columns = [
            path for name in wanted for path in _blob_paths(self.dataset.schema, name)
        ]
        total = self.dataset.count_rows()
        self._rows_per_epoch = len(range(shard, total, num_shards))
        if self._rows_per_epoch == 0:
            raise ValueError(
                f"shard {shard} of {num_shards} of dataset {self._shown_uri!r} (version "
                f"{self.version}, {total} rows) holds no rows; use at most {total} shards"
                if total
                else f"dataset {self._shown_uri!r} (version {self.version}) has no rows"
            )
        self._perm_cache: tuple[int, np.ndarray] | None = None

    def _check_columns(self, columns: list[str]) -> None:
        try:
            # Lance resolves the names without reading data; an unknown one passed to
            # take() panics in Rust instead of raising.
            self.dataset.scanner(columns=columns, limit=0).projected_schema  # noqa: B018
        except (ValueError, OSError) as exc:
            raise ValueError(
                f"columns {columns} of dataset {self._shown_uri!r}: "
                f"{_scrubbed(str(exc), self.dataset.uri)}; the dataset has columns "
                f"{self.dataset.schema.names}"
            ) from None

    @property
    def _shown_uri(self) -> str:
        """The dataset's URI for messages and the repr: without user info or query, which can
        hold credentials (``s3://KEY:SECRET@bucket/...``, ``?x-amz-security-token=...``)."""
        return _uri_identity(self.dataset.uri)

    def __repr__(self) -> str:
        return (
            f"LanceSource({self._shown_uri!r}, version={self.version}, "
            f"rows_per_batch={self.rows_per_batch}, seed={self.seed}, "
            f"shard={self.shard}/{self.num_shards})"
        )

    @property
    def source_id(self) -> str:
        """What this source's offsets mean, for ``Producer(source=source.source_id)``.

        Names everything that fixes the rows of batch ``offset``: the dataset (its URI, a local
        path made absolute, without user info or query), :attr:`version`, ``rows_per_batch``,
        ``shuffle`` and its ``seed`` (``seed=-`` without shuffling, where it orders nothing),
        ``shard``/``num_shards``, ``epochs`` and ``columns``. Equal for sources built with the
        same arguments on the same version, so a producer restarted on another dataset version
        (or shard, seed...) raises :class:`~batchweave.SourceMismatch` instead of publishing
        other rows under the offsets it resumes at. At most 1024 characters: a longer one ends
        with a digest of the whole.
        """
        shuffle = bool(self.shuffle)
        columns = None if self.columns is None else [str(c) for c in self.columns]
        text = (
            f"lance:{self._shown_uri!r} version={self.version} "
            f"rows_per_batch={self.rows_per_batch} seed={self.seed if shuffle else '-'} "
            f"shuffle={shuffle} shard={self.shard}/{self.num_shards} epochs={self.epochs} "
            f"columns={columns!r}"
        )
        if len(text) <= MAX_SOURCE_LENGTH:
            return text
        suffix = f"... sha256={hashlib.sha256(text.encode()).hexdigest()}"
        return text[: MAX_SOURCE_LENGTH - len(suffix)] + suffix

    @property
    def rows_per_epoch(self) -> int:
        """Rows of this shard (each is read once per epoch)."""
        return self._rows_per_epoch

    @property
    def num_batches(self) -> int | None:
        """Number of batches before the end (``None``: endless, no ``epochs`` given)."""
        if self.epochs is None:
            return None
        return -(-self.rows_per_epoch * self.epochs // self.rows_per_batch)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._perm_cache is not None and self._perm_cache[0] == epoch:
            return self._perm_cache[1]
        n = self.rows_per_epoch
        if self.shuffle:
            # Sorting independent 64-bit keys is a uniform permutation (ties, about n^2 / 2^65,
            # keep their index order); the keys are the raw PCG64 stream of a SeedSequence,
            # both of which NumPy keeps stable across releases. Distinct keys have one sorted
            # order, so the faster unstable sort gives it; a stable sort settles any tie.
            entropy = np.random.SeedSequence([self.seed, self.shard, epoch])
            keys = np.random.PCG64(entropy).random_raw(n)
            within = np.argsort(keys)
            ordered = keys[within]
            if n > 1 and bool((ordered[1:] == ordered[:-1]).any()):
                within = np.argsort(keys, kind="stable")
        else:
            within = np.arange(n, dtype=np.int64)
        order = self.shard + within.astype(np.int64) * self.num_shards
        self._perm_cache = (epoch, order)
        return order

    def indices(self, offset: int) -> np.ndarray:
        """Row positions of batch ``offset`` (``IndexError`` past the last batch)."""
        offset = _batch_offset(offset)
        total = self.num_batches
        if total is not None and offset >= total:
            raise IndexError(
                f"batch offset {offset} of {self!r} is past the last batch ({total - 1}) of its "
                f"{self.epochs} epoch(s)"
            )
        n = self.rows_per_epoch
        first = offset * self.rows_per_batch
        last = first + self.rows_per_batch
        if self.epochs is not None:
            last = min(last, n * self.epochs)
        parts: list[np.ndarray] = []
        pos = first
        while pos < last:
            epoch, within = divmod(pos, n)
            take = min(last - pos, n - within)
            parts.append(self._epoch_order(epoch)[within : within + take])
            pos += take
        return np.concatenate(parts)

    def take(self, offset: int) -> pa.Table:
        """Batch ``offset``: one batched random-access read (``take``) of its rows, in order."""
        rows = self.indices(offset)
        if self.dataset.version != self.version:
            raise RuntimeError(
                f"dataset {self._shown_uri!r} moved from version {self.version} to "
                f"{self.dataset.version} while {self!r} reads it (an insert, delete or checkout "
                f"on source.dataset): batch {offset} would read other rows than before; build "
                f"a new source with version={self.version}"
            )
        table = self.dataset.take(rows, columns=self.columns)
        for path in self._blob_columns:
            # take() returns a blob column's descriptors (position, size), not its bytes.
            blobs = self.dataset.read_blobs(".".join(path), indices=rows, preserve_order=True)
            data = pa.array([value for _, value in blobs], pa.large_binary())
            index = table.schema.get_field_index(path[0])
            column = data
            if len(path) > 1:  # a blob inside a struct column: rebuild the struct around it
                column = _replace_child(table.column(index).combine_chunks(), path[1:], data)
            table = table.set_column(index, pa.field(path[0], column.type), column)
        return table

    def iter_from(self, offset: int, stop: int | None = None) -> Iterator[tuple[int, pa.Table]]:
        """``(offset, table)`` for batches ``offset, offset + 1, ...`` up to ``stop`` (exclusive)
        or the end of the last epoch; nothing when ``offset`` is already there (a resumed
        producer that had finished)."""
        offset = _batch_offset(offset)
        end = self.num_batches
        if stop is not None:
            stop = as_int("stop", stop)
            end = stop if end is None else min(stop, end)
        return self._iterate(offset, end)

    def _iterate(self, offset: int, end: int | None) -> Iterator[tuple[int, pa.Table]]:
        current = offset
        while end is None or current < end:
            yield current, self.take(current)
            current += 1


def _uri_identity(uri: str) -> str:
    """``uri`` as :attr:`LanceSource.source_id` names it: a local path made absolute, a URL
    without user info and query (no credentials in manifests, messages or reprs)."""
    if "://" not in uri:
        return os.path.abspath(uri)
    parts = urlsplit(uri)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, "", ""))


def _scrubbed(text: str, uri: str) -> str:
    """``text`` (a Lance error message) with ``uri`` named as :func:`_uri_identity` does, should
    Lance quote the URI it was given, credentials included."""
    if "://" not in uri:
        return text
    return text.replace(uri, _uri_identity(uri))


def _batch_offset(offset: object) -> int:
    """``offset`` as a plain int, ``IndexError`` if it is negative."""
    offset = as_int("offset", offset)
    if offset < 0:
        raise IndexError(f"batch offset must be >= 0, got {offset}")
    return offset


def _blob_paths(schema: pa.Schema, name: str) -> list[tuple[str, ...]]:
    """The paths of the blob columns column ``name`` reads: itself, or blobs nested in it.

    ``name`` is a top-level column or a dotted path into struct columns (``"st.x"``), as
    Lance's ``columns=`` takes them (already checked to resolve).
    """
    if name in schema.names:
        path: tuple[str, ...] = (name,)
        field = schema.field(name)
    else:
        path = tuple(name.split("."))
        field = schema.field(path[0]) if path[0] in schema.names else None
        for part in path[1:]:
            if field is None or not pa.types.is_struct(field.type):
                return []
            index = field.type.get_field_index(part)
            field = field.type.field(index) if index >= 0 else None
        if field is None:
            return []
    return _blobs_under(field, path)


def _blobs_under(field: pa.Field, path: tuple[str, ...]) -> list[tuple[str, ...]]:
    if _is_blob(field):
        return [path]
    if pa.types.is_struct(field.type):
        return [found for child in field.type for found in _blobs_under(child, (*path, child.name))]
    return []


def _replace_child(column: pa.Array, path: tuple[str, ...], data: pa.Array) -> pa.Array:
    """``column`` with the child at ``path`` (struct field names; ``()``: itself) ``data``."""
    if not path:
        return data
    struct_type = column.type
    children = [column.field(i) for i in range(struct_type.num_fields)]
    fields = list(struct_type)
    index = struct_type.get_field_index(path[0])
    children[index] = _replace_child(children[index], path[1:], data)
    fields[index] = pa.field(path[0], children[index].type)
    mask = column.is_null() if column.null_count else None
    return pa.StructArray.from_arrays(children, fields=fields, mask=mask)


def _is_blob(field: pa.Field) -> bool:
    """Whether Lance stores the column as blobs (its ``take`` returns descriptors for them)."""
    if isinstance(field.type, pa.ExtensionType) and field.type.extension_name.startswith(
        "lance.blob"
    ):
        return True
    return (field.metadata or {}).get(b"lance-encoding:blob") == b"true"


def _open(
    dataset: str | os.PathLike[str] | lance.LanceDataset,
    version: int | None,
    storage_options: dict[str, str] | None,
) -> lance.LanceDataset:
    """The dataset at ``version`` (the newest if ``None``), as a handle of the source's own."""
    if isinstance(dataset, lance.LanceDataset):
        if version is not None and version != dataset.version:
            # Silently reading another version would map offsets to other rows on resume.
            raise ValueError(
                f"dataset {_uri_identity(dataset.uri)!r} is open at version {dataset.version}, "
                f"not the version={version} asked for; pass its path with version={version}, "
                f"or dataset.checkout_version({version})"
            )
        # A copy with a handle of its own: the caller's insert/delete/checkout on the object
        # passed in do not reach it.
        return dataset.checkout_version(dataset.version)
    uri = os.fspath(dataset)
    try:
        return lance.dataset(uri, version=version, storage_options=storage_options)
    except (ValueError, OSError) as exc:
        if version is None:
            raise
        try:
            newest = lance.dataset(uri, storage_options=storage_options)
            if version in {v["version"] for v in newest.versions()}:
                raise exc from None  # it exists: the failure is something else
        except (ValueError, OSError):
            raise exc from None
        raise ValueError(
            f"dataset {_uri_identity(uri)!r} has no version {version} (the newest is "
            f"{newest.version}; cleanup_old_versions removes old ones); resume with the version "
            f"the run started on, or start a new run: {_scrubbed(str(exc), uri)}"
        ) from exc


def export_history(
    store: ObjectStore,
    namespace: str,
    uri: str | os.PathLike[str],
    *,
    start: int | None = None,
    stop: int | None = None,
    mode: str = "create",
    storage_options: dict[str, str] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Write the namespace's batch membership history to the Lance dataset ``uri``.

    One row per ``(step, dp, cp)`` with the producer, epoch, offset, object key, slice bytes,
    sample count and sample ids (see :mod:`batchweave._history`); ``mode`` is Lance's
    (``create``, ``overwrite``, ``append``). Returns the number of rows written.
    ``progress(done, total)`` is called as steps are read (on Lance's writer thread).
    ``uri`` is a path (any ``os.PathLike``; a ``Path`` is made absolute) or a Lance URI.

    Ctrl-C or SIGTERM while the export runs (in the main thread) stops the write from inside:
    Lance reads the rows on a thread of its own, which a ``KeyboardInterrupt`` raised in the
    main thread would leave running into interpreter shutdown (a "Fatal Python error" abort).
    Once the write has stopped, the signal goes to the handler that was in place: by default
    Ctrl-C raises ``KeyboardInterrupt`` and SIGTERM ends the process. An export that fails or
    is interrupted removes the local dataset directory it created (what it wrote, if the
    directory was there and empty); an existing dataset or any other directory is left alone.
    """
    counted = 0
    failure: list[BaseException] = []
    target = uri if isinstance(uri, str) else str(Path(os.fspath(uri)).resolve())
    created = _new_local_dataset(target)

    with deferred_interrupt() as interrupted:

        def step_read(done: int, total: int) -> None:
            interrupted()  # on Lance's thread: a Ctrl-C stops the write from inside
            if progress is not None:
                progress(done, total)

        def batches() -> Iterator[pa.RecordBatch]:
            nonlocal counted
            try:
                batches = membership_batches(
                    store, namespace, start=start, stop=stop, progress=step_read
                )
                for batch in batches:
                    interrupted()
                    counted += batch.num_rows
                    yield batch
            except BaseException as exc:
                failure.append(exc)
                raise

        reader = pa.RecordBatchReader.from_batches(MEMBERSHIP_SCHEMA, batches())
        options: dict[str, Any] = {"mode": mode}
        if storage_options is not None:
            options["storage_options"] = storage_options
        try:
            try:
                lance.write_dataset(reader, target, schema=MEMBERSHIP_SCHEMA, **options)
            except Exception:
                if failure:
                    # Lance reports an error raised while reading the rows as its own error,
                    # with the Python traceback flattened into the message: raise the original.
                    raise failure[0] from None
                raise
            interrupted()  # a signal after the last row still interrupts the call
        except BaseException:
            # Lance creates the dataset directory before its first commit: a failed or
            # interrupted export would leave one that a re-run refuses as "exists".
            if created is not None:
                created.remove()
            if not interrupted.received:
                raise
    # Outside the block, with the caller's handlers back: a default SIGTERM now ends the
    # process, a default Ctrl-C raises KeyboardInterrupt.
    interrupted.redeliver()
    return counted


class _CreatedDataset:
    """A local dataset directory an export is about to create, to remove if the export fails.

    ``existed``: the directory was there, empty (Lance writes into it): only what the export
    put in it is removed. A directory holding anything is never touched.
    """

    def __init__(self, path: Path, existed: bool) -> None:
        self.path = path
        self.existed = existed

    def remove(self) -> None:
        if not self.existed:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        with contextlib.suppress(OSError):
            for child in self.path.iterdir():
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child, ignore_errors=True)
                else:
                    child.unlink(missing_ok=True)


def _new_local_dataset(target: str) -> _CreatedDataset | None:
    """What an export to ``target`` creates locally (``None``: a remote URI or an existing,
    non-empty directory, which a failure must leave alone)."""
    if "://" in target:
        parts = urlsplit(target)
        if parts.scheme.lower() != "file" or parts.netloc not in ("", "localhost"):
            return None
        path = Path(unquote(parts.path))
    else:
        path = Path(target)
    try:
        if not path.exists() and not path.is_symlink():
            return _CreatedDataset(path, existed=False)
        if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
            return _CreatedDataset(path, existed=True)
    except OSError:
        pass
    return None

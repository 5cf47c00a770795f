"""Carrying out a reclaim pass's deletions: its list and delete requests, what they add up to,
and the progress reported from those counts.

Separate from the reclaimer, which decides what to delete: a :class:`Sweep` lists prefixes and
deletes the objects it is given in batches, skips the keys the store refuses (the pass raises
at its end) and counts every key listed and object deleted for :class:`ReclaimProgress` and the
pass's report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from batchweave._errors import StoreError, StoreUnavailable, TransientStoreError
from batchweave._store._base import ObjectMeta, ObjectStore

__all__ = ["ReclaimProgress", "Sweep"]

_log = logging.getLogger("batchweave.lifecycle")

_PROGRESS_EVERY = 1000
"""Listed keys between two progress reports (one LIST page of S3)."""


@dataclass(frozen=True)
class ReclaimProgress:
    """A snapshot of a running :meth:`Reclaimer.run_once` pass, for progress displays.

    A pass on a large namespace is mostly LIST requests and 1,000-key batch deletes and can
    take minutes; the reclaimer's ``progress`` callback receives one of these when a phase
    begins, every 1,000 keys listed, after every delete request and when the pass ends.
    """

    phase: str
    """What the pass is doing: ``"reading watermarks"``, ``"committing base_step"``,
    ``"listing _manifests/"``, ``"reading manifests"``, ``"listing data/"``,
    ``"deleting TGBs"``, ``"deleting orphans"``, ``"listing _segments/"``,
    ``"deleting segments"``, ``"deleting manifests"``, then ``"done"``."""
    keys_listed: int
    """Keys listed so far in this pass (every prefix)."""
    objects_deleted: int
    """Objects deleted so far in this pass (every kind)."""
    bytes_deleted: int
    """Bytes of the objects deleted so far."""
    phase_done: int = 0
    """Objects of a deleting phase handled so far (deleted, or refused by the store)."""
    phase_total: int | None = None
    """Objects a deleting phase will handle (``None`` while listing or reading: unknown)."""
    seconds: float = 0.0
    """Time since the pass began, by a monotonic clock (never negative, whatever the wall
    clock does)."""


class Sweep:
    """The list and delete requests of one pass, their counts, and the progress reports made
    from them.

    The pass is timed with ``timer``, monotonic seconds: not with the reclaimer's wall clock
    (kept for its grace decisions), whose NTP steps made negative durations.
    """

    def __init__(
        self,
        store: ObjectStore,
        namespace: str,
        delete_batch: int,
        callback: Callable[[ReclaimProgress], None] | None,
        *,
        timer: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._namespace = namespace
        self._delete_batch = delete_batch
        self.refused: list[StoreError] = []
        """Deletions the store refused during this pass (the pass raises at its end)."""
        self.counts: dict[str, int] = {}
        self.listed = 0
        self.objects = 0
        self.bytes = 0
        self.phase = ""
        """What the pass is doing, named as in :attr:`ReclaimProgress.phase`, set by begin()."""
        self.phase_done = 0
        self.phase_total: int | None = None
        self._timer = timer
        self._callback = callback
        self.started = timer()

    def seconds(self) -> float:
        """Seconds since the pass began, by ``timer`` (never negative)."""
        return max(0.0, self._timer() - self.started)

    def begin(self, phase: str, total: int | None = None) -> None:
        self.phase, self.phase_done, self.phase_total = phase, 0, total
        self.report()

    def report(self) -> None:
        if self._callback is not None:
            self._callback(
                ReclaimProgress(
                    phase=self.phase,
                    keys_listed=self.listed,
                    objects_deleted=self.objects,
                    bytes_deleted=self.bytes,
                    phase_done=self.phase_done,
                    phase_total=self.phase_total,
                    seconds=self.seconds(),
                )
            )

    def list_prefix(self, relative_prefix: str) -> list[ObjectMeta]:
        """Every object under ``relative_prefix`` of the namespace, counted as listed."""
        self.begin(f"listing {relative_prefix}")
        metas: list[ObjectMeta] = []
        for meta in self._store.list(f"{self._namespace}/{relative_prefix}"):
            metas.append(meta)
            self._listed_one()
        self.report()
        return metas

    def delete(self, metas: list[ObjectMeta], kind: str) -> list[ObjectMeta]:
        """Delete ``metas`` in batches, count them as ``kind`` and return those deleted.

        A batch the store refuses (permission denied on some keys, an object lock) is retried
        key by key, and the keys still refused are skipped and recorded in ``refused``, so one
        undeletable object does not stop the whole pass; the pass raises at its end. An
        unreachable or failing store (``StoreUnavailable``, ``TransientStoreError``) stops the
        pass at once.
        """
        deleted: list[ObjectMeta] = []
        for i in range(0, len(metas), self._delete_batch):
            chunk = metas[i : i + self._delete_batch]
            try:
                self._store.delete_many([m.key for m in chunk])
            except (StoreUnavailable, TransientStoreError):
                raise
            except StoreError:
                for meta in chunk:
                    try:
                        self._store.delete_many([meta.key])
                    except (StoreUnavailable, TransientStoreError):
                        raise
                    except StoreError as exc:
                        level = logging.WARNING if not self.refused else logging.DEBUG
                        _log.log(level, "cannot delete %r, skipping it: %s", meta.key, exc)
                        self.refused.append(exc)
                        self._handled(kind, (), 1)
                    else:
                        deleted.append(meta)
                        self._handled(kind, (meta,), 1)
            else:
                deleted.extend(chunk)
                self._handled(kind, chunk, len(chunk))
        return deleted

    def _listed_one(self) -> None:
        self.listed += 1
        if self.listed % _PROGRESS_EVERY == 0:
            self.report()

    def _handled(self, kind: str, deleted: Iterable[ObjectMeta], count: int) -> None:
        """``count`` objects of the current phase were handled; ``deleted`` of them went."""
        for meta in deleted:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self.counts[f"{kind}_bytes"] = self.counts.get(f"{kind}_bytes", 0) + meta.size
            self.objects += 1
            self.bytes += meta.size
        self.phase_done += count
        self.report()

"""Which data objects a manifest's steps reference, each segment read once.

Separate from the reclaimer's decisions: :class:`StepKeys` only reads manifests and segments,
never deletes, and keeps the data keys of the segments it has read, so a pass reads only the
segments added since the previous one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from batchweave._errors import ObjectNotFound
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import Manifest, SegmentRef
from batchweave._manifest._segments import find_segment

__all__ = ["StepKeys"]

_log = logging.getLogger("batchweave.lifecycle")


class StepKeys:
    """The data keys of a manifest's steps, read through ``log``, for one reclaimer."""

    def __init__(self, log: ManifestLog, where: str) -> None:
        self._log = log
        self._where = where
        """The namespace and store, as errors name them (``namespace 'ns' in file:///...``)."""
        self._segment_keys: dict[str, tuple[SegmentRef, int, tuple[tuple[str, ...], ...]]] = {}
        """The data keys of each step of the segments the latest manifest lists, by segment key:
        (the reference they were read through, the first step kept, each step's keys from it).
        A segment is immutable, so a pass reads only the segments added since the previous one
        (the log's cache of decoded segments is bounded, and a long retained window exceeds
        it). Keys are a few short strings per step, a small part of a decoded descriptor
        (about 4 KB at ``dp=2``); segments the latest no longer lists are forgotten."""

    def live(self, latest: Manifest) -> set[str]:
        """Data keys of ``latest``'s steps; a segment it lists that is missing stops the pass
        (nothing is deleted without knowing what is live) with an error naming it."""
        live: set[str] = set()
        unread = latest.base_step
        try:
            for step, keys in self._step_keys(latest, latest.base_step, latest.next_step):
                live.update(keys)
                unread = step + 1
        except ObjectNotFound as exc:
            ref = find_segment(latest.segments, unread)
            raise ObjectNotFound(
                f"{self._where}: "
                f"{self._log.missing_segment(latest, ref)}. This pass deletes nothing"
            ) from exc
        return live

    def below(self, source: Manifest, base_step: int) -> set[str]:
        """Data keys of ``source``'s steps below ``base_step`` (best effort: a segment reclaimed
        by an earlier pass leaves its objects to the orphan rule)."""
        keys: set[str] = set()
        stop = min(base_step, source.next_step)
        try:
            for _, step_keys in self._step_keys(source, source.base_step, stop):
                keys.update(step_keys)
        except ObjectNotFound as exc:
            _log.info(
                "cannot list steps below %d in version %d: %s", base_step, source.version, exc
            )
        return keys

    def forget_unlisted(self, latest: Manifest) -> None:
        """Forget the keys of the segments ``latest`` no longer lists above its ``base_step``.

        Call it after :meth:`below` in a pass: the segments below ``base_step`` would otherwise
        be forgotten first and read again."""
        listed = {ref.key for ref in latest.segments if ref.end_step > latest.base_step}
        self._segment_keys = {k: v for k, v in self._segment_keys.items() if k in listed}

    def _step_keys(
        self, manifest: Manifest, start: int, stop: int
    ) -> Iterator[tuple[int, tuple[str, ...]]]:
        """``(step, data keys of its TGB)`` for steps ``start .. stop-1`` of ``manifest``; a
        segment whose keys ``_segment_keys`` holds (read through an equal reference) is not
        read again."""
        step = start
        while step < stop:
            if step >= manifest.tail_start:
                for s, desc in self._log.descriptors(manifest, step, stop):
                    yield s, tuple(ref.key for ref in desc.objects)
                return
            ref = find_segment(manifest.segments, step)
            cached = self._segment_keys.get(ref.key)
            if cached is None or cached[0] != ref or cached[1] > step:
                # The whole segment is downloaded either way: keep the keys of all its steps.
                keys = tuple(
                    tuple(obj.key for obj in desc.objects)
                    for _, desc in self._log.descriptors(manifest, step, ref.end_step)
                )
                cached = self._segment_keys[ref.key] = (ref, step, keys)
            _, first, keys = cached
            end = min(stop, ref.end_step)
            for s in range(step, end):
                yield s, keys[s - first]
            step = end

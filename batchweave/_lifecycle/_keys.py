"""Which data objects a manifest's steps reference, each segment read once.

Separate from the reclaimer's decisions: :class:`StepKeys` only reads manifests and segments,
never deletes, and keeps the data keys of the segments it has read, so a pass reads only the
segments added since the previous one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

from batchweave._errors import FormatError, ObjectNotFound, UnsupportedFormatVersion
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
        """Data keys of ``latest``'s steps; a segment it lists that is missing or cannot be
        decoded stops the pass (nothing is deleted without knowing what is live) with an error
        naming it and saying what to do (a ``FormatError`` stays one of the same class)."""
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
        except UnsupportedFormatVersion:
            raise  # no damage: its message says to upgrade batchweave
        except FormatError as exc:
            # Damage no pass can work around: without the segment's keys the objects of its
            # steps would look unreferenced (orphans). The raw error said only "corrupt".
            ref = find_segment(latest.segments, unread)
            raise type(exc)(
                f"{self._where}: segment {self._log.key(ref.key)!r}, which manifest version "
                f"{latest.version} (the latest) lists for TGB steps {ref.first_step}.."
                f"{ref.end_step - 1}, cannot be read ({exc}). This pass deletes nothing (nor "
                "will later ones while the latest version lists it): run `batchweave verify "
                f"{self._log.store.url} {self._log.namespace}` and restore the segment object "
                "from a backup, or continue in a new namespace"
            ) from exc
        return live

    def below(self, source: Manifest, base_step: int, damaged: list[str]) -> set[str]:
        """Data keys of ``source``'s steps below ``base_step``, best effort: the objects of the
        steps of a segment that cannot be read are left to the orphan rule.

        A segment reclaimed by an earlier pass is skipped quietly; one that cannot be decoded
        (bit rot, a partial restore) is skipped with a WARNING naming it and added to
        ``damaged`` (once per pass). Safe: the cut is committed, so no watermark needs these
        steps, and their objects are deleted once unreferenced by the latest version and older
        than ``grace``, like any orphan. A segment written by a newer BatchWeave is no damage
        and not ours to skip: its ``UnsupportedFormatVersion`` is raised.
        """
        keys: set[str] = set()
        step, stop = source.base_step, min(base_step, source.next_step)
        while step < stop:
            if step >= source.tail_start:  # inline in the manifest: nothing to read
                for _, step_keys in self._step_keys(source, step, stop):
                    keys.update(step_keys)
                break
            ref = find_segment(source.segments, step)
            end = min(stop, ref.end_step)
            try:
                for _, step_keys in self._step_keys(source, step, end):
                    keys.update(step_keys)
            except ObjectNotFound as exc:
                _log.info(
                    "cannot list steps %d..%d below %d in version %d: %s",
                    step,
                    end - 1,
                    base_step,
                    source.version,
                    exc,
                )
            except UnsupportedFormatVersion:
                raise
            except FormatError as exc:
                self._damaged(source, ref, exc, damaged)
            step = end
        return keys

    def _damaged(
        self, source: Manifest, ref: SegmentRef, exc: FormatError, damaged: list[str]
    ) -> None:
        """Add segment ``ref`` of ``source`` (below the cut), which cannot be decoded, to the
        pass's ``damaged`` keys, logging a WARNING the first time the pass meets it."""
        key = self._log.key(ref.key)
        if key in damaged:
            return
        damaged.append(key)
        _log.warning(
            "%s: segment %r, which old manifest version %d lists for TGB steps %d..%d (below "
            "the committed base_step, needed by no watermark), cannot be read (%s); the pass "
            "skips it, and the data objects of those steps are deleted as orphans once older "
            "than the grace. Run `batchweave verify %s %s` to check the rest of the namespace; "
            "the damaged segment is deleted like any segment no version readers may hold lists",
            self._where,
            key,
            source.version,
            ref.first_step,
            ref.end_step - 1,
            exc,
            self._log.store.url,
            self._log.namespace,
        )

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

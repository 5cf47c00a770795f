"""Retiring producer ids: the producer map of every manifest holds only ids that may come back.

Fencing and exactly-once resume need each producer id's state (epoch, committed offset) in every
manifest for as long as the id may start again, so the map never forgets an id by itself. A job
that names producers after pods, hosts or attempts starts new ids all the time, and each one
adds about 100-250 bytes to every manifest from then on: to every commit's fragile window.
Retiring ids whose streams are over keeps the manifest, and the commit, as small as the live
job. The ids' TGBs stay where they are; consumers see no change.

Retirement is one commit that removes the ids. A process still running under a retired id is
fenced (:class:`~batchweave.ProducerRetired`) at its next rebase, because a started producer
finds its own state in every manifest unless it was retired; the conditional PUT orders the
retirement against that producer's commits, so a producer that commits in between is seen as
active and kept; a producer whose start (read, then epoch commit) loses to the retirement of its
id stops with :class:`~batchweave.ProducerRetired` as well, rather than start over at offset 0.
A producer started later under a retired id begins a new stream, with no resume offset and an
epoch above every epoch the id had (an unlisted id's epoch is the version of its epoch commit),
so an old process that missed the retirement is fenced by that epoch.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

from batchweave._checks import as_count, as_seconds, check_namespace, check_store
from batchweave._manifest._log import CommitResult, ManifestLog, commit_until
from batchweave._manifest._models import Manifest
from batchweave._store._base import ObjectStore

__all__ = ["RetireReport", "retire_producers"]

_log = logging.getLogger("batchweave.retire")


@dataclass(frozen=True)
class RetireReport:
    """What :func:`retire_producers` did (or, with ``dry_run``, would do)."""

    retired: tuple[str, ...]
    """Ids removed from the producer map (with ``dry_run``: the ids that would be)."""
    active: tuple[str, ...]
    """Ids kept because they committed within ``idle_for`` (among those named, if any)."""
    unknown: tuple[str, ...]
    """Named ids that the newest manifest does not list (never started, or already retired)."""
    version: int | None
    """The manifest version that removed them; ``None`` if nothing was committed."""
    remaining: int
    """Producer ids the newest manifest still lists."""
    dry_run: bool = False


def retire_producers(
    store: ObjectStore,
    namespace: str,
    *,
    idle_for: float,
    producer_ids: Iterable[str] | None = None,
    dry_run: bool = False,
    wall_clock: Callable[[], float] = time.time,
    attempts: int = 50,
    sleep: Callable[[float], None] = time.sleep,
) -> RetireReport:
    """Remove producer ids whose last commit is ``idle_for`` seconds old or older.

    Use it for ids whose streams are over (a finished worker, a replaced pod): a producer later
    started under a retired id begins a new stream with no resume offset, and a process still
    running under it stops with :class:`~batchweave.ProducerRetired` (or
    :class:`~batchweave.ProducerFenced`, if the id started again first), naming the offset to
    resume after. ``producer_ids`` limits retirement to those ids (still only the idle ones);
    ``None`` considers every id. ``idle_for`` is measured with ``wall_clock`` against each id's
    ``last_commit_at``, so keep it well above the producers' clock skew and their longest
    pause between commits (a day or more). ``dry_run`` reports without committing. Lost races
    are retried on the winner, re-checking idleness there, up to ``attempts`` times. Every
    argument is checked before the first request (``idle_for`` a positive number of seconds,
    ``attempts`` an integer >= 1, ``namespace`` a ``str``): ``TypeError`` or ``ValueError``.
    """
    # Every argument is checked before the first request.
    check_store(store)
    check_namespace(namespace)
    idle_for = as_seconds("idle_for", idle_for, positive=True)  # a TypeError for "7d" or True
    if idle_for == math.inf:
        raise ValueError(
            f"idle_for must be a finite number of seconds, got {idle_for!r}; ids idle that "
            "long are retired, so use a day or more (idle_for=86400)"
        )
    attempts = as_count("attempts", attempts, 1)
    named = None if producer_ids is None else _as_ids(producer_ids)
    log = ManifestLog(store, namespace)
    decisions: list[_Decision] = []  # one per attempt; the last one is what happened

    def retire(manifest: Manifest) -> CommitResult | None:
        decision = _decide(manifest, named, wall_clock() - idle_for)
        decisions.append(decision)
        if dry_run or not decision.idle:
            return None
        return log.commit(manifest, retire=decision.idle)

    settled = commit_until(
        log,
        log.latest(),
        retire,
        what=f"the retirement of idle producer ids in {namespace!r}",
        attempts=attempts,
        sleep=sleep,
    )
    idle, active, unknown = decisions[-1]
    committed = settled.parent is not None
    if committed:
        _log.info(
            "retired %d producer id(s) of namespace %r in manifest version %d: %s",
            len(idle),
            namespace,
            settled.manifest.version,
            ", ".join(idle),
        )
    return RetireReport(
        retired=idle,
        active=active,
        unknown=unknown,
        version=settled.manifest.version if committed else None,
        remaining=len(settled.manifest.producers) - (len(idle) if dry_run else 0),
        dry_run=dry_run,
    )


class _Decision(NamedTuple):
    idle: tuple[str, ...]
    active: tuple[str, ...]
    unknown: tuple[str, ...]


def _decide(manifest: Manifest, named: tuple[str, ...] | None, idle_before: float) -> _Decision:
    """Split the candidate ids (``named``, or every listed id) by ``manifest``'s states."""
    listed = manifest.producers
    candidates = listed if named is None else named
    idle = tuple(
        pid for pid in candidates if pid in listed and listed[pid].last_commit_at <= idle_before
    )
    idle_ids = set(idle)  # a set: tens of thousands of ids must not cost a scan each
    return _Decision(
        idle=idle,
        active=tuple(pid for pid in candidates if pid in listed and pid not in idle_ids),
        unknown=tuple(pid for pid in candidates if pid not in listed),
    )


def _as_ids(producer_ids: Iterable[str]) -> tuple[str, ...]:
    if isinstance(producer_ids, str):
        raise TypeError(
            f"producer_ids takes a collection of ids, not the string {producer_ids!r}; "
            f"write [{producer_ids!r}]"
        )
    ids = tuple(dict.fromkeys(producer_ids))
    for pid in ids:
        if not isinstance(pid, str):
            raise TypeError(f"producer ids are strings, got {pid!r} ({type(pid).__name__})")
    return ids

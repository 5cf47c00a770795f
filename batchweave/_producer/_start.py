"""Starting a producer: join the namespace and commit a bumped epoch for its id.

The epoch commit fences every older incarnation of the id, and the manifest it lands on gives
the offset a restarted process resumes from. It runs once, before any thread of the producer,
and refuses (before committing anything) a sealed namespace, another source than the committed
one, an id retired while it started, and names over the length limits where they would be
created.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import NoReturn

from batchweave._checks import check_new_name, new_name_problem
from batchweave._errors import (
    InvalidKey,
    NamespaceNotFound,
    NamespaceSealed,
    ProducerRetired,
    SourceMismatch,
)
from batchweave._manifest._log import Committed, Conflict, ManifestLog
from batchweave._manifest._models import Manifest, ProducerState
from batchweave._mesh import Mesh
from batchweave._outage import is_outage
from batchweave._policy import measured_duration
from batchweave._producer._retry import RETRYABLE, Retries

__all__ = ["start_epoch"]

_LOG = logging.getLogger("batchweave.producer")


def start_epoch(
    log: ManifestLog,
    *,
    namespace: str,
    producer_id: str,
    mesh: Mesh,
    source: str | None,
    retries: Retries,
    max_retries: int,
    rng: random.Random,
    clock: Callable[[], float],
    wall_clock: Callable[[], float],
) -> tuple[Manifest, int, float]:
    """Join the namespace and commit ``epoch = old + 1`` for this id, retried until it lands.

    Returns the committed manifest, the epoch, and the seconds the last epoch commit took.
    """
    manifest: Manifest | None = None
    # The newest manifest read here that lists this id: one that lacks it after that was
    # retired in between (only retirement removes an id).
    listed: Manifest | None = None
    conflicts = 0
    failures = attempts = 0
    while True:
        try:
            if manifest is None:
                # Raises NamespaceMismatch for another mesh or a foreign prefix.
                manifest = _open_namespace(log, namespace, producer_id, mesh)
            else:
                # The winner of the race just lost is one version past the base, and others
                # may have committed since (during the sleep too): retried on it, a starting
                # producer fell one version further behind busy ones each time, for minutes.
                manifest = log.latest(manifest)
            old = manifest.producers.get(producer_id)
            if old is None and listed is None:
                # The id's first commit creates it: an id over the limits is refused.
                check_new_name("producer_id", producer_id)
            _check_not_sealed(namespace, producer_id, manifest)
            if old is not None:
                listed = manifest
            elif listed is not None:
                _raise_retired_while_starting(namespace, producer_id, listed, manifest)
            _check_source(namespace, producer_id, source, manifest, old)
            # An id the manifest does not list (new, or retired) takes the version of this
            # epoch commit: higher than any epoch the id had before a retirement (each was
            # committed in an earlier version), so a process left running from then is fenced.
            epoch = manifest.version + 1 if old is None else old.epoch + 1
            state = ProducerState(
                epoch=epoch,
                offset=None if old is None else old.offset,
                last_version=manifest.version + 1,
                last_commit_at=wall_clock(),
                source=old.source if source is None and old is not None else source,
            )
            began = clock()
            result = log.commit(manifest, producers={producer_id: state})
            window = measured_duration(began, clock())
            if isinstance(result, Conflict) and result.failure is not None:
                raise result.failure  # the store failed it (a 503): retried as a failure
            if isinstance(result, Conflict) and result.winner is None:
                result = Conflict(log.latest(manifest))
        except RETRYABLE as exc:
            attempts += 1
            failures += not is_outage(exc)  # an outage (also a hung store) is waited out
            if failures > max_retries:
                raise
            retries.note("starting (epoch commit)", exc, attempts)
            manifest = None
            continue
        if isinstance(result, Committed):
            _LOG.info(
                "producer %r started in namespace %r at epoch %d (manifest version %d, "
                "resume offset %s)",
                producer_id,
                namespace,
                epoch,
                result.manifest.version,
                0 if state.offset is None else state.offset + 1,
            )
            return result.manifest, epoch, window
        conflicts += 1
        manifest = result.winner
        # Producers starting together collide; spread their retries.
        retries.sleep(rng.uniform(0.0, retries.backoff(min(conflicts, 4))))


def _open_namespace(log: ManifestLog, namespace: str, producer_id: str, mesh: Mesh) -> Manifest:
    """``create_or_open(mesh)``, refusing names over the length limits only where created.

    A namespace or ``producer_id`` longer than the limits (``new_name_problem``) may join a
    namespace that exists (created before the limits, or by an older version), but creates
    nothing: a missing namespace is then :class:`InvalidKey`, before version 0 is written.
    Names within the limits pay no extra request.
    """
    problem = new_name_problem("namespace", namespace) or new_name_problem(
        "producer_id", producer_id
    )
    if problem is not None:
        try:
            log.create_or_open()  # opens only: NamespaceNotFound if nothing is there
        except NamespaceNotFound:
            raise InvalidKey(problem) from None
    return log.create_or_open(mesh)


def _raise_retired_while_starting(
    namespace: str, producer_id: str, listed: Manifest, manifest: Manifest
) -> NoReturn:
    """The id was retired between our read of ``listed`` and our epoch commit.

    Starting again from ``manifest`` would begin a new stream at offset 0 and publish the
    committed offsets a second time, so the start stops instead, naming them.
    """
    offset = listed.producers[producer_id].offset
    committed = (
        f"offsets up to {offset} were committed under it, and a producer started under it "
        f"now begins a new stream with no resume offset (resume_offset 0): resume the "
        f"source after {offset} yourself (append offsets above {offset}) to publish each "
        "offset once, or use a new producer_id"
        if offset is not None
        else "it had committed nothing, so starting it again begins its stream afresh"
    )
    raise ProducerRetired(
        f"producer {producer_id!r} in namespace {namespace!r} was retired while "
        f"it started: manifest version {listed.version} listed it, version "
        f"{manifest.version} no longer does (retire_producers / `batchweave retire` removes "
        f"ids idle for long), and this start committed nothing. {committed[0].upper()}"
        f"{committed[1:]}."
    )


def _check_source(
    namespace: str,
    producer_id: str,
    source: str | None,
    manifest: Manifest,
    old: ProducerState | None,
) -> None:
    """Refuse to start under another source than the one committed for this id."""
    if source is None or old is None or old.source in (None, source):
        return
    raise SourceMismatch(
        f"producer {producer_id!r} of namespace {namespace!r} committed "
        f"source {old.source!r} (manifest version {manifest.version}), but this producer "
        f"was given source {source!r}: the offsets it resumes at would read other "
        "data than the committed ones. Restart with the committed source (for a "
        "LanceSource, the same arguments and the dataset version the committed source "
        "names: LanceSource(..., version=N)), or use a new producer_id for the new data. "
        "Nothing was committed."
    )


def _check_not_sealed(namespace: str, producer_id: str, manifest: Manifest) -> None:
    if manifest.sealed:
        raise NamespaceSealed(
            f"namespace {namespace!r} was sealed at manifest version "
            f"{manifest.version}; producer {producer_id!r} cannot publish into it. "
            "Use a new namespace for more data."
        )

"""Sealing a namespace without a producer: one commit of the sealed flag, retried on races."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from batchweave._manifest._log import Committed, ManifestLog
from batchweave._manifest._models import Manifest
from batchweave._store._base import ObjectStore
from batchweave.cli._common import CliFailure

__all__ = ["seal_namespace"]


def seal_namespace(
    store: ObjectStore,
    namespace: str,
    *,
    attempts: int = 50,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[Manifest, bool]:
    """Commit the sealed flag on the newest version; return it and whether this call sealed it.

    Producers still running then fail with ``NamespaceSealed`` at their next commit; consumers
    stop cleanly after the last step. Lost races are retried on the winner.
    """
    log = ManifestLog(store, namespace)
    latest = log.latest()
    rng = random.Random()
    for attempt in range(attempts):
        if latest.sealed:
            return latest, False
        result = log.commit(latest, seal=True)
        if isinstance(result, Committed):
            return result.manifest, True
        sleep(rng.uniform(0.0, min(1.0, 0.01 * 2**attempt)))
        latest = log.latest(result.winner or latest)
    raise CliFailure(f"could not seal {namespace!r} after {attempts} lost races; retry")

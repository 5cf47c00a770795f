"""Sealing a namespace without a producer: one commit of the sealed flag, retried on races."""

from __future__ import annotations

import time
from collections.abc import Callable

from batchweave._manifest._log import CommitResult, ManifestLog, commit_until
from batchweave._manifest._models import Manifest
from batchweave._store._base import ObjectStore

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

    def seal(manifest: Manifest) -> CommitResult | None:
        return None if manifest.sealed else log.commit(manifest, seal=True)

    settled = commit_until(
        log, log.latest(), seal, what=f"the seal of {namespace!r}", attempts=attempts, sleep=sleep
    )
    return settled.manifest, settled.parent is not None

"""Checkpoint-aligned lifecycle: the checkpoint hook and the reclaimer.

Data must stay until no live checkpoint can need it, and go once none can. The training loop
records a watermark after each durable checkpoint (:func:`checkpoint_hook`, ``_hook.py``); the
:class:`Reclaimer` (``_reclaim.py``) raises the manifest's ``base_step`` to the minimum watermark
step through the normal commit protocol and deletes what nothing can read any more. What a pass
reads about the data keys manifests reference is ``_keys.py``; its list and delete requests,
their counts and its progress reports are ``_sweep.py``.
"""

from batchweave._lifecycle._hook import Resumable, checkpoint_hook
from batchweave._lifecycle._reclaim import DATA_DIR, METADATA_MIN_GRACE, Reclaimer, ReclaimReport
from batchweave._lifecycle._sweep import ReclaimProgress

__all__ = [
    "DATA_DIR",
    "METADATA_MIN_GRACE",
    "ReclaimProgress",
    "ReclaimReport",
    "Reclaimer",
    "Resumable",
    "checkpoint_hook",
]

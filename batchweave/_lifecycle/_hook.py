"""The checkpoint hook: record a checkpoint's watermark, the step resuming from it reads first.

Separate from the reclaimer: the training loop calls the hook on every rank after each durable
checkpoint, while the reclaimer runs on rank 0 or as ``batchweave reclaim``; they meet only
through the watermarks in the store.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Protocol

from batchweave._checks import as_int
from batchweave._watermarks import (
    Watermark,
    Watermarks,
    validate_checkpoint_id,
)

__all__ = ["Resumable", "checkpoint_hook"]


class Resumable(Protocol):
    """What :func:`checkpoint_hook` needs: a :class:`~batchweave.Consumer` or a
    ``batchweave.torch.WeaveLoader``."""

    def resume_tgb_step(self, state: Mapping[str, Any] | None = None) -> int:
        """The first TGB step resuming from ``state`` (default: the current state) reads."""
        ...

    @property
    def manifest_version(self) -> int | None:
        """The newest manifest version read, or ``None`` (the latest is recorded then)."""
        ...


def checkpoint_hook(
    consumer: Resumable,
    watermarks: Watermarks,
    checkpoint_id: str,
    *,
    state: Mapping[str, Any] | None = None,
    rank: int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Watermark | None:
    """Record the watermark of a checkpoint that was just written successfully.

    Call it once per checkpoint on every rank, after the checkpoint is durable; only rank 0
    (``rank``, an int, else the ``RANK`` environment variable, else 0) writes, the others return
    ``None``; a ``rank`` that is no integer (``"0"`` read from the environment) is a
    ``TypeError`` rather than a rank that never writes. The watermark's step is the manifest
    step that resuming from the consumer's state reads first: pass the ``state`` that went into
    the checkpoint if the loop may have advanced the consumer since (asynchronous
    checkpointing); by default the consumer's current state is used. ``consumer`` may also be a
    ``batchweave.torch.WeaveLoader`` (anything with ``resume_tgb_step`` and
    ``manifest_version``). Returns the recorded :class:`Watermark` on rank 0.

    Call it again right after restoring a checkpoint (``consumer.load_state_dict(state)``, then
    this hook with that ``state``): a process killed between writing the checkpoint and this
    call left that checkpoint without a watermark, and producers with a ``max_lag`` below two
    checkpoint intervals would block until the next checkpoint, which needs the steps they
    hold back. For a checkpoint whose watermark was recorded, the call writes the same one again.

    A consumer of another namespace than ``watermarks`` is a ``ValueError`` on every rank: its
    step and version mean nothing there, and such a watermark would hold (or free) the wrong data.
    So is a ``checkpoint_id`` that is no safe key segment (a ``TypeError`` if it is no ``str``).
    """
    # On every rank, like the checks below: rank 0 alone raising would leave the others waiting
    # for it at the next collective.
    validate_checkpoint_id(checkpoint_id)
    namespace = getattr(consumer, "namespace", None)
    if namespace is not None and namespace != watermarks.namespace:
        raise ValueError(
            f"checkpoint_hook: the consumer reads namespace {namespace!r} but the watermarks are "
            f"for {watermarks.namespace!r}; pass Watermarks(store, {namespace!r})"
        )
    if rank is None:
        env = os.environ if environ is None else environ
        raw = env.get("RANK", "0")
        try:
            rank = int(raw)
        except ValueError:
            raise ValueError(f"RANK={raw!r} is not an integer; pass rank= explicitly") from None
    else:
        # A string (os.environ["RANK"] passed on) is refused: "0" != 0, so rank 0 would
        # silently record nothing and reclamation would never see this checkpoint.
        rank = as_int("rank", rank)
    if rank != 0:
        return None
    step = consumer.resume_tgb_step(state)
    return watermarks.record(checkpoint_id, step, version=consumer.manifest_version)

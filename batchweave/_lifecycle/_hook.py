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
from batchweave._consumer._state import check_state_namespace, parse_state
from batchweave._errors import NamespaceMismatch
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
    ``batchweave.torch.WeaveLoader`` (anything with a ``resume_tgb_step`` method and a
    ``manifest_version`` attribute); anything else (``None``), or ``watermarks`` that are no
    :class:`Watermarks`, is a ``TypeError`` on every rank. Returns the recorded
    :class:`Watermark` on rank 0.

    Call it again right after restoring a checkpoint (``consumer.load_state_dict(state)``, then
    this hook with that ``state``): a process killed between writing the checkpoint and this
    call left that checkpoint without a watermark, and producers with a ``max_lag`` below two
    checkpoint intervals would block until the next checkpoint, which needs the steps they
    hold back. For a checkpoint whose watermark was recorded, the call writes the same one again.

    A consumer of another namespace than ``watermarks`` is a ``ValueError`` on every rank: its
    step and version mean nothing there, and such a watermark would hold (or free) the wrong data.
    So is a ``checkpoint_id`` that is no safe key segment (a ``TypeError`` if it is no ``str``) or
    lies outside ``watermarks.scope``; a ``state`` that is no consumer state is a
    ``ConsumerError``, and one taken from another namespace (its name differs from the
    consumer's, as for a copy of the namespace under another prefix, or its namespace id does,
    once the consumer has opened the namespace) is :class:`NamespaceMismatch`, as in
    ``load_state_dict``, both on every rank, without a store request: no rank returns ``None``
    for a call that fails on rank 0.
    A consumer of a namespace of the same name in another store or prefix (staging's, while the
    watermarks are prod's) is :class:`NamespaceMismatch` on rank 0: the namespace ids (one
    manifest lookup per ``Watermarks``, cached) differ, and its steps would release prod's data.
    """
    # On every rank, like the checks below: rank 0 alone raising would leave the others waiting
    # for it at the next collective.
    _check_arguments(consumer, watermarks)
    validate_checkpoint_id(checkpoint_id)
    namespace = getattr(consumer, "namespace", None)
    if namespace is not None and namespace != watermarks.namespace:
        raise ValueError(
            f"checkpoint_hook: the consumer reads namespace {namespace!r} but the watermarks are "
            f"for {watermarks.namespace!r}; pass Watermarks(store, {namespace!r})"
        )
    if watermarks.scope is not None and not checkpoint_id.startswith(watermarks.scope):
        raise ValueError(
            f"checkpoint_id {checkpoint_id!r} is outside this reader's scope "
            f"{watermarks.scope!r}; name it {watermarks.scope}..., or use another "
            "Watermarks(scope=...) for it"
        )
    # parse_state and the state's namespace, which rank 0's resume_tgb_step checks too.
    parsed = _check_state(consumer, namespace, state)
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
    if namespace is not None:
        reader_id = _reader_namespace_id(consumer, parsed)
        _check_same_namespace(consumer, namespace, watermarks, reader_id)
    return watermarks.record(checkpoint_id, step, version=consumer.manifest_version)


def _check_arguments(consumer: object, watermarks: object) -> None:
    """``TypeError`` unless ``consumer`` is a reader the hook can ask for a step (what
    :class:`Resumable` describes) and ``watermarks`` a :class:`Watermarks`: else ``None`` (a
    consumer not made yet) would fail on rank 0 alone, with ``'NoneType' object has no attribute
    'resume_tgb_step'``."""
    if not callable(getattr(consumer, "resume_tgb_step", None)) or not hasattr(
        consumer, "manifest_version"
    ):
        raise TypeError(
            "checkpoint_hook: consumer must be a batchweave.Consumer, a "
            "batchweave.torch.WeaveLoader, or a reader with a resume_tgb_step(state) method and "
            f"a manifest_version attribute, got the {type(consumer).__name__} {consumer!r:.100}"
        )
    if not isinstance(watermarks, Watermarks):
        raise TypeError(
            "checkpoint_hook: watermarks must be a batchweave.Watermarks (Watermarks(store, "
            f"namespace)), got the {type(watermarks).__name__} {watermarks!r:.100}"
        )


def _check_state(
    consumer: Resumable, namespace: str | None, state: Mapping[str, Any] | None
) -> dict[str, Any] | None:
    """``state`` parsed, refused as :meth:`Consumer.resume_tgb_step` would refuse it on rank 0,
    from what the consumer already knows (no store request); ``None`` without a ``state`` or for
    any reader whose states are not BatchWeave consumer states (a stand-in or a wrapper with a
    state of its own: only ``Consumer`` and ``WeaveLoader`` set ``_takes_consumer_states``)."""
    if state is None or namespace is None:
        return None
    if not getattr(consumer, "_takes_consumer_states", False):
        return None
    parsed = parse_state(state)  # ConsumerError for anything state_dict() could not return
    known = getattr(consumer, "namespace_id", None)  # a Consumer's, once it opened the namespace
    check_state_namespace(
        parsed,
        reader=f"checkpoint_hook: {consumer!r}",
        namespace=namespace,
        namespace_id=known if isinstance(known, str) else None,
    )
    return parsed


def _reader_namespace_id(consumer: Resumable, parsed: Mapping[str, Any] | None) -> str | None:
    """The id of the namespace ``consumer`` reads (after ``resume_tgb_step``, which opened it),
    from what it already holds (a ``Consumer``'s or ``WeaveLoader``'s ``namespace_id``, else the
    checked state's); ``None`` if it does not exist (yet) or cannot be told."""
    known = getattr(consumer, "namespace_id", None)
    if isinstance(known, str) and known:
        return known
    if parsed is not None and parsed["namespace_id"]:
        return str(parsed["namespace_id"])  # resume_tgb_step checked it against the consumer's
    return None


def _check_same_namespace(
    consumer: Resumable, namespace: str, watermarks: Watermarks, reader_id: str | None
) -> None:
    """Refuse a consumer of another namespace (same name, another store or prefix) than the
    watermarks': their namespace ids differ. The watermarks' id is looked up once and cached;
    a mismatch is looked up again before it is refused (the namespace may have been re-created)."""
    if reader_id is None:
        return  # the consumer's namespace does not exist yet: nothing of it can be held or freed
    marks_id = watermarks.namespace_id()
    if marks_id == reader_id:
        return
    marks_id = watermarks.namespace_id(refresh=True)
    if marks_id == reader_id:
        return
    there = (
        "which does not exist there" if marks_id is None else f"whose namespace id is {marks_id}"
    )
    raise NamespaceMismatch(
        f"checkpoint_hook: {consumer!r} reads namespace {namespace!r} (id {reader_id}), but the "
        f"watermarks are for {watermarks.namespace!r} in {watermarks.store.url}, {there}: "
        "another store or "
        "prefix holds a namespace of the same name, and this consumer's steps would hold (or "
        "release) that one's data. Record in Watermarks(<the store the consumer reads>, "
        f"{watermarks.namespace!r})"
    )

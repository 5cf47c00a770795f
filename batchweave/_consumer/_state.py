"""The consumer's resume point as a plain dict: its format, and the checks a loaded one passes.

Separate from :class:`~batchweave._consumer._core.Consumer` because a state arrives from outside
(a checkpoint, possibly edited, truncated or of another version): it is parsed and refused here,
whole, before the consumer changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from batchweave._checks import as_int
from batchweave._errors import ConsumerError, NamespaceMismatch
from batchweave._mesh import Mesh

__all__ = ["STATE_FORMAT", "check_state_namespace", "parse_state"]

STATE_FORMAT: Final = 1
"""Version of the dict :meth:`Consumer.state_dict` returns."""


_STATE_INTS: Final = (
    "format",
    "step",
    "dp",
    "cp",
    "dp_rank",
    "cp_rank",
    "anchor_step",
    "anchor_replica",
)


def _state_int(name: str, value: Any) -> int:
    """A state value as an int: what :func:`as_int` takes, or a float or string holding one
    exactly. ``int()`` alone would resume a state whose step is ``2.5`` at step 2."""
    if isinstance(value, float):
        if not value.is_integer():
            raise ValueError(f"{name} is {value!r}, not an integer")
        return int(value)
    if isinstance(value, str):
        return int(value)
    return as_int(name, value)


def parse_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """``state`` checked whole, its values made plain ints and strings; :class:`ConsumerError`
    for anything :meth:`Consumer.state_dict` could not have returned."""
    try:
        parsed: dict[str, Any] = {name: _state_int(name, state[name]) for name in _STATE_INTS}
        parsed["namespace"] = str(state.get("namespace", ""))
        parsed["namespace_id"] = str(state["namespace_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConsumerError(
            f"not a BatchWeave consumer state ({exc!r}); pass what Consumer.state_dict() returned"
        ) from exc
    if parsed["format"] != STATE_FORMAT:
        raise ConsumerError(
            f"consumer state format {parsed['format']} is not {STATE_FORMAT}; it was written by "
            "another BatchWeave version"
        )
    problems = [
        f"{name} {parsed[name]} is negative"
        for name in ("step", "anchor_step", "anchor_replica")
        if parsed[name] < 0
    ]
    if parsed["step"] < parsed["anchor_step"]:
        problems.append(f"step {parsed['step']} precedes anchor_step {parsed['anchor_step']}")
    try:
        Mesh(dp=parsed["dp"], cp=parsed["cp"])
    except ValueError:
        problems.append(f"dp={parsed['dp']}, cp={parsed['cp']} is not a mesh")
    if problems:
        raise ConsumerError(
            f"consumer state is inconsistent ({'; '.join(problems)}): {dict(state)!r}; pass "
            "what Consumer.state_dict() returned, unmodified"
        )
    return parsed


def check_state_namespace(
    parsed: Mapping[str, Any], *, reader: str, namespace: str, namespace_id: str | None
) -> None:
    """Refuse a parsed consumer state taken in another namespace than ``namespace``, whose id is
    ``namespace_id`` (``None`` while not known): :class:`NamespaceMismatch`.

    The one check of :meth:`Consumer.load_state_dict`, :meth:`Consumer.resume_tgb_step` and
    ``batchweave.checkpoint_hook`` (on every rank, from what the reader holds). Name and id must
    both match: a backup copied to another prefix keeps its namespace id, so the id alone lets
    the state of ``job`` into ``job-copy``, whose steps hold other data once the two diverge; a
    namespace of the same name in another store, or re-created, has another id. What a state
    lacks is not checked: one taken before its namespace existed has no id (``""``), one from
    before states recorded the name has no name (``""``). ``reader`` (``repr`` of the reader)
    starts the message.
    """
    name, state_id = parsed["namespace"], parsed["namespace_id"]
    other_name = bool(name) and name != namespace
    other_id = bool(state_id) and bool(namespace_id) and state_id != namespace_id
    if not (other_name or other_id):
        return
    theirs = f"namespace {name!r}" if name else "a namespace whose name it does not record"
    theirs += f" (id {state_id})" if state_id else ""
    ours = f"namespace {namespace!r}" + (f" (id {namespace_id})" if namespace_id else "")
    if other_name:
        fix = f"use it with a consumer of {name!r}"
        if not other_id:  # a copy, or the namespace moved: only the name tells them apart
            fix += (
                f". To use it here on purpose (the namespace was moved or renamed to "
                f'{namespace!r}), set state["namespace"] = {namespace!r} first'
            )
    else:
        fix = (
            "use it with a consumer of the namespace it was taken from: this one is another "
            "namespace (in another store or prefix, or re-created since)"
        )
    raise NamespaceMismatch(
        f"{reader} reads {ours}, but the consumer state belongs to {theirs}; {fix}"
    )

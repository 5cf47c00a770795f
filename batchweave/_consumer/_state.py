"""The consumer's resume point as a plain dict: its format, and the checks a loaded one passes.

Separate from :class:`~batchweave._consumer._core.Consumer` because a state arrives from outside
(a checkpoint, possibly edited, truncated or of another version): it is parsed and refused here,
whole, before the consumer changes anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from batchweave._checks import as_int
from batchweave._errors import ConsumerError
from batchweave._mesh import Mesh

__all__ = ["STATE_FORMAT", "parse_state"]

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

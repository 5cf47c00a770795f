"""Pydantic models built from values this library has just validated, without validating again.

Validation stays the rule for anything a caller gives or a store returns. On the few hot paths
that build a model from values computed and checked a moment ago (footer entries of slices the
builder just stored, a producer's descriptor of the TGB it just encoded), validating again is
pure cost, and ``BaseModel.model_construct`` costs more than validating. :func:`unchecked` sets
exactly what ``model_construct`` sets; each caller's tests compare its result with the
validated constructor's (``==`` and ``model_dump_json``).
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel

__all__ = ["unchecked"]

_Model = TypeVar("_Model", bound=BaseModel)
_set_attr = object.__setattr__


def unchecked(
    cls: type[_Model], fields: dict[str, Any], fields_set: set[str] | None = None
) -> _Model:
    """An instance of ``cls`` holding ``fields`` as they are, without running any validator.

    ``fields`` must name every field of ``cls`` with a value its validation would accept
    unchanged; the caller guarantees that. ``fields_set`` may be one set shared by many instances
    of a frozen model (nothing adds to it); by default it is ``set(fields)``, as for
    ``cls(**fields)``. ``cls`` must have no private attributes and forbid or ignore extras.
    """
    model: _Model = object.__new__(cls)
    _set_attr(model, "__dict__", fields)
    _set_attr(model, "__pydantic_fields_set__", set(fields) if fields_set is None else fields_set)
    _set_attr(model, "__pydantic_extra__", None)
    _set_attr(model, "__pydantic_private__", None)
    return model

"""Argument checks shared by the public constructors, so every refusal reads the same."""

from __future__ import annotations

import operator
import os

from batchweave._errors import InvalidKey
from batchweave._store._base import validate_key

__all__ = ["as_int", "check_at_least", "check_key_name", "check_store"]


def check_at_least(minimum: int, **values: int) -> None:
    """Raise ``ValueError`` naming the first of ``values`` (in order) that is below ``minimum``."""
    for name, value in values.items():
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_store(store: object) -> None:
    """Refuse a store URL or path where an opened store is needed, saying how to open it.

    Without this a URL string fails deep inside with ``'str' object has no attribute ...``.
    """
    if isinstance(store, str | bytes | os.PathLike):
        raise TypeError(
            f"expected an opened store, got the {type(store).__name__} {store!r}; open it "
            "first (store = batchweave.open_store(url)) and pass the store"
        )


def check_key_name(name: str, value: str) -> None:
    """Refuse a ``namespace`` or ``producer_id`` that cannot be part of an object key.

    :class:`InvalidKey` naming the parameter: the store's own message names only the key, which
    a caller never wrote (``object key 'a\\tb' contains ...`` for ``namespace="a\\tb"``).
    """
    try:
        validate_key(value)
    except InvalidKey as exc:
        raise InvalidKey(f"{name} {value!r} cannot be used in object keys: {exc}") from exc


def as_int(name: str, value: object) -> int:
    """``value`` as a plain ``int`` (NumPy and torch integers too), else ``TypeError``.

    Offsets and coordinates end up in manifests and ``state_dict()``s, which must survive JSON,
    strict models and ``torch.load(weights_only=True)``; a NumPy integer survives none of them.
    """
    if not isinstance(value, bool):  # an int, but True/False as a number is a mistake
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(
        f"{name} must be an integer, got the {type(value).__name__} {value!r}; convert it first "
        f"(e.g. {name}=int(...))"
    )

"""Argument checks shared by the public constructors, so every refusal reads the same."""

from __future__ import annotations

import os

__all__ = ["check_at_least", "check_store"]


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

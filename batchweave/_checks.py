"""Argument checks shared by the public constructors, so every refusal reads the same."""

from __future__ import annotations

__all__ = ["check_at_least"]


def check_at_least(minimum: int, **values: int) -> None:
    """Raise ``ValueError`` naming the first of ``values`` (in order) that is below ``minimum``."""
    for name, value in values.items():
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")

"""The public API is exactly what ``batchweave.__all__`` names, and all of it is importable."""

from __future__ import annotations

import importlib
import pkgutil

import batchweave


def test_all_names_exist_and_are_documented() -> None:
    for name in batchweave.__all__:
        obj = getattr(batchweave, name)
        if name.startswith("__"):
            continue
        if callable(obj):
            assert obj.__doc__, f"public name batchweave.{name} has no docstring"


def test_public_objects_are_listed_in_all() -> None:
    public = {
        name
        for name, obj in vars(batchweave).items()
        if not name.startswith("_") and not isinstance(obj, type(batchweave))
    }
    assert public == set(batchweave.__all__) - {"__version__"}


def test_implementation_modules_are_private() -> None:
    allowed_public = {"testing", "torch", "lance", "cli"}
    for info in pkgutil.iter_modules(batchweave.__path__):
        assert info.name.startswith("_") or info.name in allowed_public, info.name
        importlib.import_module(f"batchweave.{info.name}")

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


def test_the_argument_checks_for_store_implementers_are_exported() -> None:
    # docs/store.md's custom store and the conformance suite's expected messages use them.
    from batchweave._store import _base

    for name in ("validate_key", "check_keys", "checked_keys", "check_mode", "check_range"):
        assert name in batchweave.__all__, name
        assert getattr(batchweave, name) is getattr(_base, name), name

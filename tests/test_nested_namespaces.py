"""Namespaces nested under another namespace's prefix (``a`` and ``a/b``, ``a/_manifests``).

Before the fixes: reclaiming ``a`` crashed on every pass with ``TypeError: '<' not supported
between instances of 'ObjectMeta' and 'ObjectMeta'`` when a namespace ``a/_manifests`` existed
(its versions matched ``a``'s by suffix); ``a/_manifests`` could be created next to ``a``;
creating ``a`` over ``a/b`` was refused as objects "BatchWeave did not write"; and ``inspect a``
counted ``a/b``'s objects as ``a``'s storage.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from click.testing import CliRunner

import batchweave as bw
from batchweave._checks import new_name_problem
from batchweave._manifest._log import NAMESPACE_DIRS, ManifestLog
from batchweave.cli._app import cli
from batchweave.cli._inspect import gather_inspection, storage_by_prefix

ONE = bw.Mesh(dp=1, cp=1)
OTHER_PREFIX = "other (not this namespace's)"  # cli._inspect.OTHER_PREFIX


def _fill(store: bw.ObjectStore, namespace: str, steps: int, producer_id: str = "p") -> None:
    with bw.Producer(store, namespace, mesh=ONE, producer_id=producer_id, tail_limit=2) as p:
        for i in range(steps):
            p.append([b"x%d" % i * 100], offset=i)
            p.flush()


def _keys(store: bw.ObjectStore, prefix: str) -> dict[str, int]:
    return {meta.key: meta.size for meta in store.list(prefix)}


def _plant(store: bw.ObjectStore, source: str, target: str) -> dict[str, int]:
    """Copy namespace ``source`` to ``target``: a nested namespace made before its name was
    refused (or by a creator racing the parent's), which the name checks no longer allow."""
    copied = {}
    for key, size in _keys(store, f"{source}/").items():
        store.put(target + key[len(source) :], store.get(key))
        copied[target + key[len(source) :]] = size
    return copied


@pytest.fixture
def store(tmp_path: Path) -> bw.ObjectStore:
    return bw.open_store(f"file://{tmp_path}/store")


# -- 1. the reclaimer never takes a nested namespace's objects for its own -------------------


def test_reclaim_leaves_namespaces_nested_in_its_layout_alone(store: bw.ObjectStore) -> None:
    _fill(store, "a", 6)
    _fill(store, "inner", 5)
    planted = {}
    for top in sorted(NAMESPACE_DIRS):
        planted.update(_plant(store, "inner", f"a/{top}"))
    bw.Watermarks(store, "a").record("ck", 6)
    later = time.time() + 100_000
    reclaimer = bw.Reclaimer(store, "a", grace=600, clock=lambda: later)
    reports = [reclaimer.run_once() for _ in range(3)]  # crashed: TypeError on ObjectMeta
    report = reports[-1]
    assert report.base_step_after == 6
    assert sum(r.manifests_deleted for r in reports) > 0  # a's own objects do go
    assert sum(r.tgbs_deleted for r in reports) > 0
    left = _keys(store, "a/")
    assert {key: left.get(key) for key in planted} == planted
    # a's own versions only: a nested namespace's versions are not counted as a's
    assert report.latest_version == ManifestLog(store, "a").latest().version
    for top in sorted(NAMESPACE_DIRS):
        with bw.Consumer(store, f"a/{top}", mesh=ONE, dp_rank=0, cp_rank=0, timeout=2) as c:
            assert next(c)[0] == 0


def test_reclaim_of_parent_leaves_child_namespace_alone(store: bw.ObjectStore) -> None:
    _fill(store, "a", 4)
    _fill(store, "a/b", 4)
    child = _keys(store, "a/b/")
    bw.Watermarks(store, "a").record("ck", 4)
    later = time.time() + 100_000
    report = bw.Reclaimer(store, "a", grace=600, clock=lambda: later).run_once()
    assert report.objects_deleted > 0
    assert _keys(store, "a/b/") == child


# -- 2. which namespaces may be created -----------------------------------------------------


@pytest.mark.parametrize(
    "name", ["a/_manifests", "a/_segments", "a/_watermarks", "a/data", "a/data/x"]
)
def test_names_with_a_reserved_part_are_refused(store: bw.ObjectStore, name: str) -> None:
    reserved = name.split("/")[1]
    with pytest.raises(ValueError, match=f"part '{reserved}' after its first") as caught:
        _fill(store, name, 1)
    assert isinstance(caught.value, bw.InvalidKey)
    assert "namespace 'a'" in str(caught.value)
    assert _keys(store, "") == {}  # refused before any write


def test_reserved_first_part_and_plain_nesting_are_allowed(store: bw.ObjectStore) -> None:
    for name in ("data", "data/run-1", "_manifests-x/a", "runs/datasets"):
        assert new_name_problem("namespace", name) is None
    _fill(store, "data/run-1", 1)
    _fill(store, "a", 1)
    _fill(store, "a/b", 1)  # inside another namespace's prefix, outside its layout


def test_existing_namespace_with_reserved_part_can_still_be_joined(store: bw.ObjectStore) -> None:
    _fill(store, "inner", 2)
    _plant(store, "inner", "old/_segments")
    _fill(store, "old/_segments", 3, producer_id="q")  # joins and appends, creates nothing
    assert ManifestLog(store, "old/_segments").latest().next_step == 5


@pytest.mark.parametrize("child", ["b", "b/c", "_manifests", "data"])
def test_parent_over_existing_child_names_the_child(store: bw.ObjectStore, child: str) -> None:
    _fill(store, "inner", 1)
    _plant(store, "inner", f"a/{child}")
    with pytest.raises(bw.NamespaceMismatch) as caught:
        _fill(store, "a", 1)
    message = str(caught.value)
    assert f"namespace 'a/{child}' exists under it" in message
    assert "cannot be created around an existing one" in message
    assert "did not write" not in message
    assert list(store.list("a/_manifests/0")) == []  # no version 0 of 'a'


def test_parent_over_foreign_objects_still_says_so(store: bw.ObjectStore) -> None:
    store.put("a/notes.txt", b"mine")
    with pytest.raises(bw.NamespaceMismatch, match="BatchWeave did not write"):
        _fill(store, "a", 1)


# -- 3. inspect counts only the namespace's own layout ----------------------------------------


def test_inspect_does_not_count_a_nested_namespace(store: bw.ObjectStore) -> None:
    _fill(store, "a", 2)
    own = _keys(store, "a/")
    _fill(store, "a/b", 5)
    store.put("a/data/README", b"another tool's")
    nested = {k: v for k, v in _keys(store, "a/").items() if k not in own}
    rows = storage_by_prefix(store, "a")
    assert [row["prefix"] for row in rows if not row.get("own", True)] == [OTHER_PREFIX]
    assert rows[-1] == {
        "prefix": OTHER_PREFIX,
        "objects": len(nested),
        "bytes": sum(nested.values()),
        "own": False,
    }
    assert not any(row["prefix"].startswith("b") for row in rows)
    data = gather_inspection(store, "a")
    assert (data["stored_objects"], data["stored_bytes"]) == (len(own), sum(own.values()))
    assert storage_by_prefix(store, "a/b")[-1]["own"]  # the child itself has nothing foreign

    result = CliRunner().invoke(cli, ["inspect", store.url, "a"])
    assert result.exit_code == 0, result.output
    assert f"in {len(own)} objects" in result.output
    assert "other (not this" in result.output
    assert "not counted in 'stored'" in result.output


def test_inspect_counts_foreign_files_in_the_layouts_directories_as_other(
    store: bw.ObjectStore,
) -> None:
    """Before: any name directly under ``_manifests/``, ``_segments/`` or ``_watermarks/`` (and
    any under ``data/{producer}/{epoch}/``) counted as the namespace's storage, though reclaim
    never deletes such files."""
    _fill(store, "a", 3)
    bw.Watermarks(store, "a").record("c1", 1)
    own = _keys(store, "a/")
    foreign = {
        "a/_manifests/README.txt": 11,
        "a/_manifests/1.manifest": 12,
        "a/_segments/notes.txt": 13,
        "a/_watermarks/c1.json.bak": 14,
        "a/_watermarks/.hidden.json": 15,
        "a/data/p/1/README": 16,
    }
    for key, size in foreign.items():
        store.put(key, b"x" * size)
    rows = storage_by_prefix(store, "a")
    assert rows[-1] == {
        "prefix": OTHER_PREFIX,
        "objects": len(foreign),
        "bytes": sum(foreign.values()),
        "own": False,
    }
    counted = {row["prefix"]: row["objects"] for row in rows if row["own"]}
    assert counted["_manifests/"] == sum(k.startswith("a/_manifests/") for k in own)
    assert counted["_segments/"] == sum(k.startswith("a/_segments/") for k in own) > 0
    assert counted["_watermarks/"] == 1
    data = gather_inspection(store, "a")
    assert (data["stored_objects"], data["stored_bytes"]) == (len(own), sum(own.values()))


def test_inspect_without_foreign_objects_has_no_other_row(store: bw.ObjectStore) -> None:
    _fill(store, "a", 2)
    rows = storage_by_prefix(store, "a")
    assert rows
    assert all(row["own"] for row in rows)
    assert sum(row["objects"] for row in rows) == len(_keys(store, "a/"))

"""FileStore specifics: root confinement, temp files, directory pruning, path conflicts.

Also housekeeping against operators and races: writes survive removal of the temp directory,
and a directory swapped for a symlink after the delete check cannot redirect the unlink. And
roots that cannot be written (read in a subprocess without CAP_DAC_OVERRIDE when run as root)
or cannot be a directory at all fail with errors naming the root and the fix.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_consumer import in_threads, produce

import batchweave as bw
from batchweave import (
    AccessDenied,
    Bounded,
    FileStore,
    InvalidKey,
    InvalidStoreURL,
    Mesh,
    ObjectExists,
    ObjectNotFound,
    PutMode,
    Suffix,
)
from batchweave._store import _file
from batchweave._store._file import TEMP_DIR_NAME, _non_directory
from batchweave._store._open import open_store


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the store root: nothing may ever be written or read there."""
    path = tmp_path / "outside"
    path.mkdir()
    return path


@pytest.fixture
def store(root: Path, request: pytest.FixtureRequest) -> FileStore:
    """A store at ``root``; under :data:`KERNEL_CHECK`, confined either way it can be."""
    store = FileStore(root)
    store._proc_fd = getattr(request, "param", True) and store._proc_fd
    return store


def test_missing_root_is_created_and_url_is_a_file_uri(tmp_path: Path) -> None:
    root = tmp_path / "deep" / "er" / "root"
    store = FileStore(root)
    assert root.is_dir()
    assert store.url == root.as_uri()
    assert store.root == os.path.realpath(root)


def test_relative_root_is_refused() -> None:
    with pytest.raises(InvalidStoreURL, match="absolute"):
        FileStore("relative/dir")


KERNEL_CHECK = pytest.mark.parametrize(
    "store", [True, False], ids=["proc-fd", "realpath"], indirect=True
)
"""Confinement is checked on opened descriptors (Linux /proc/self/fd) or, elsewhere, on paths:
the ``store`` of a test marked so is run both ways (``realpath``: as if there were no
/proc/self/fd)."""
PROC_FD_ONLY = pytest.mark.skipif(
    not os.path.isdir("/proc/self/fd"), reason="descriptor confinement needs /proc/self/fd"
)


@KERNEL_CHECK
def test_symlinked_directory_cannot_escape_root(
    outside: Path, store: FileStore, root: Path
) -> None:
    (outside / "secret").write_bytes(b"do not read")
    (root / "link").symlink_to(outside, target_is_directory=True)
    for call in (
        lambda: store.put("link/new", b"x"),
        lambda: store.put_if_absent("link/new", b"x"),
        lambda: store.put("link/sub/new", b"x"),  # nothing may be created outside either
        lambda: store.get("link/secret"),
        lambda: store.get_range("link/secret", Suffix(2)),
        lambda: store.head("link/secret"),
        lambda: store.delete_many(["link/secret"]),
    ):
        with pytest.raises(InvalidKey, match="outside the root"):
            call()
    assert sorted(p.name for p in outside.iterdir()) == ["secret"]
    assert (outside / "secret").read_bytes() == b"do not read"
    assert list(store.list()) == []  # symlinks are not followed when listing
    with pytest.raises(InvalidKey, match="outside the root"):
        list(store.list("link/"))  # ...unless on the prefix's own path: refused there, as reads


@pytest.mark.parametrize("first_write", [True, False])
def test_a_temp_directory_replaced_by_a_symlink_is_refused_not_written_through(
    outside: Path, root: Path, first_write: bool
) -> None:
    # Writes stage their bytes in .bw-tmp before publishing them: a symlink planted there
    # put every object's bytes outside the root first.
    store = FileStore(root, fsync=False)
    if not first_write:
        store.put("before", b"x")
        shutil.rmtree(root / TEMP_DIR_NAME)
    (root / TEMP_DIR_NAME).symlink_to(outside, target_is_directory=True)
    for call in (
        lambda: store.put("k", b"payload"),
        lambda: store.put_if_absent("k", b"payload"),
    ):
        with pytest.raises(InvalidKey, match="symbolic link") as info:
            call()
        assert "outside the root" in str(info.value)
    assert list(outside.iterdir()) == []
    assert not (root / "k").exists()


@KERNEL_CHECK
@pytest.mark.parametrize("temp_dir", ["none", "in-root", "in-target"])
def test_a_root_swapped_for_a_symlink_writes_no_byte_outside(
    outside: Path,
    store: FileStore,
    root: Path,
    monkeypatch: pytest.MonkeyPatch,
    temp_dir: str,
) -> None:
    # Before: a put after the root was replaced by a symlink was refused by the publish, but
    # only once it had created .bw-tmp in the symlink's target (makedirs by path) and written
    # and fsynced the whole object into a temp file there (.bw-tmp opened by path).
    if temp_dir != "none":
        store.put("before", b"x")
    if temp_dir == "in-target":
        (outside / TEMP_DIR_NAME).mkdir()
    root.rename(root.with_name("root.old"))
    root.symlink_to(outside, target_is_directory=True)
    written: list[object] = []
    monkeypatch.setattr(_file, "_write_all", lambda fd, parts: written.append(parts))
    for put in (store.put, store.put_if_absent):
        with pytest.raises(InvalidKey, match="outside the root") as info:
            put("ns/k", b"payload")
        assert "'ns/k'" in str(info.value)
    assert written == []
    expected = [TEMP_DIR_NAME] if temp_dir == "in-target" else []
    assert sorted(p.name for p in outside.iterdir()) == expected
    if expected:
        assert list((outside / TEMP_DIR_NAME).iterdir()) == []


@KERNEL_CHECK
def test_a_symlink_to_the_root_is_inside_the_root(store: FileStore, root: Path) -> None:
    # Before: put, list and delete through "self -> ." raised InvalidKey "resolves to
    # '<root>', outside the root" (only a path strictly below the root counted as inside),
    # while get of the same key worked.
    store.put("x", b"X")
    (root / "self").symlink_to(".", target_is_directory=True)
    store.put("self/y", b"Y")
    assert store.get("y") == b"Y"
    assert [m.key for m in store.list("self/")] == ["self/x", "self/y"]
    store.delete_many(["self/x"])
    with pytest.raises(ObjectNotFound):
        store.get("x")
    # The root itself is a directory: no object there, whichever way it is read.
    for read in (store.get, store.head, lambda key: store.get_range(key, Suffix(1))):
        with pytest.raises(ObjectNotFound, match="is a directory"):
            read("self")


@KERNEL_CHECK
def test_symlinked_file_cannot_escape_root(tmp_path: Path, store: FileStore, root: Path) -> None:
    target = tmp_path / "target"
    target.write_bytes(b"outside")
    (root / "alias").symlink_to(target)
    (root / "dangling").symlink_to(tmp_path / "not-yet")
    with pytest.raises(InvalidKey):
        store.get("alias")
    for key in ("alias", "dangling"):
        with pytest.raises(InvalidKey, match="outside the root"):
            store.put(key, b"overwrite through the link")
        with pytest.raises(InvalidKey, match="outside the root"):
            store.put_if_absent(key, b"create through the link")
    assert target.read_bytes() == b"outside"
    assert not (tmp_path / "not-yet").exists()
    assert (root / "alias").is_symlink()
    assert (root / "dangling").is_symlink()


@KERNEL_CHECK
def test_a_put_replaces_a_symlink_inside_the_root_not_its_target(
    store: FileStore, root: Path
) -> None:
    store.put("real/object", b"target")
    (root / "alias").symlink_to(root / "real" / "object")
    with pytest.raises(ObjectExists):
        store.put_if_absent("alias", b"new")
    store.put("alias", b"new")
    assert not (root / "alias").is_symlink()
    assert store.get("alias") == b"new"
    assert store.get("real/object") == b"target"


@PROC_FD_ONLY
def test_a_directory_swapped_for_a_symlink_after_it_is_made_is_refused(
    outside: Path, store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The window a path check leaves open: the directory is checked and created, then replaced
    # by a symlink before the object is linked. Opening it without following the symlink (or,
    # before, the descriptor check) sees where it really goes.
    real_mkdir = os.mkdir

    def mkdir_then_swap(name: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(name, mode, dir_fd=dir_fd)
        if os.path.basename(name) == "d":
            os.rmdir(root / "ns" / "d")
            os.symlink(outside, root / "ns" / "d")

    monkeypatch.setattr(os, "mkdir", mkdir_then_swap)
    for put in (store.put, store.put_if_absent):
        with pytest.raises(InvalidKey, match="outside the root"):
            put("ns/d/object", b"x")
        (root / "ns" / "d").unlink()
    assert list(outside.iterdir()) == []
    assert list((root / TEMP_DIR_NAME).iterdir()) == []


@PROC_FD_ONLY
def test_a_directory_swapped_after_the_check_cannot_redirect_the_write(
    outside: Path, store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once the directory's descriptor is confined the object is linked relative to it, so
    # renaming the directory away and planting a symlink at its name changes nothing.
    store.put("ns/d/first", b"1")
    directory = os.path.join(store.root, "ns", "d")
    real_readlink = os.readlink

    def readlink_then_swap(path: str) -> str:
        target = real_readlink(path)
        if target == directory and not os.path.islink(directory):
            os.rename(directory, os.path.join(store.root, "ns", "moved"))
            os.symlink(outside, directory)
        return target

    monkeypatch.setattr(os, "readlink", readlink_then_swap)
    store.put("ns/d/second", b"2")
    monkeypatch.undo()
    assert list(outside.iterdir()) == []
    assert store.get("ns/moved/second") == b"2"


@PROC_FD_ONLY
@pytest.mark.parametrize("mode", [PutMode.OVERWRITE, PutMode.CREATE])
def test_a_put_retries_when_its_opened_directory_is_pruned(
    store: FileStore, monkeypatch: pytest.MonkeyPatch, mode: PutMode
) -> None:
    # delete_many may remove the empty directory between the put's open and its link: the link
    # fails with ENOENT, and the put recreates the directory and tries again.
    directory = os.path.join(store.root, "ns", "d")
    os.makedirs(directory)
    real_readlink = os.readlink
    pruned: list[str] = []

    def readlink_then_prune(path: str) -> str:
        target = real_readlink(path)
        if target == directory and not pruned:
            os.rmdir(directory)
            pruned.append(target)
        return target

    monkeypatch.setattr(os, "readlink", readlink_then_prune)
    store.put("ns/d/object", b"1", mode=mode)
    assert pruned == [directory]
    assert store.get("ns/d/object") == b"1"
    assert list(os.scandir(os.path.join(store.root, TEMP_DIR_NAME))) == []


@KERNEL_CHECK
@pytest.mark.parametrize("mode", [PutMode.OVERWRITE, PutMode.CREATE])
def test_an_empty_directory_at_the_name_is_no_object_in_the_way(
    store: FileStore, root: Path, mode: PutMode
) -> None:
    # An empty directory holds no objects (one a delete is about to prune, or one a put made
    # and has not published into yet): a put removes it and publishes. One of other objects,
    # or a symlink to a directory, is still a conflict.
    (root / "a").mkdir(parents=True)
    store.put("a", b"1", mode=mode)
    assert store.get("a") == b"1"
    store.put("d/e", b"x")
    with pytest.raises(InvalidKey, match="cannot hold both"):
        store.put("d", b"2", mode=mode)
    (root / "empty").mkdir()
    (root / "alias").symlink_to(root / "empty")
    with pytest.raises(InvalidKey, match="cannot hold both"):
        store.put_if_absent("alias", b"3")
    assert (root / "empty").is_dir()
    assert store.get("d/e") == b"x"
    assert list((root / TEMP_DIR_NAME).iterdir()) == []


@KERNEL_CHECK
@pytest.mark.parametrize("mode", [PutMode.OVERWRITE, PutMode.CREATE])
def test_a_directory_pruned_after_the_publish_failed_is_retried_not_taken_for_an_object(
    store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch, mode: PutMode
) -> None:
    # The link (create) or replace (overwrite) meets the empty directory a concurrent delete
    # is about to prune, and the prune runs before the put looks at what holds the name. Two
    # separate checks once saw the name taken but no directory there: ObjectExists for an
    # object no one wrote (create), or a conflict with nothing (overwrite).
    directory = root / "a"
    directory.mkdir(parents=True)
    pruned: list[str] = []

    def pruned_after_failing(real: Any) -> Any:
        def publish(*args: Any, **kwargs: Any) -> None:
            try:
                real(*args, **kwargs)
            except OSError:
                if not pruned:
                    directory.rmdir()
                    pruned.append(str(directory))
                raise

        return publish

    monkeypatch.setattr(os, "link", pruned_after_failing(os.link))
    monkeypatch.setattr(os, "replace", pruned_after_failing(os.replace))
    store.put("a", b"1", mode=mode)
    monkeypatch.undo()
    assert pruned == [str(directory)]
    assert store.get("a") == b"1"
    assert list((root / TEMP_DIR_NAME).iterdir()) == []


@KERNEL_CHECK
def test_a_directory_replaced_by_a_file_after_makedirs_names_the_file(
    store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A delete prunes the directories a put just made and another put stores a file at their
    # name: the put retries and names the file in its way (opening the directory once raised
    # ENOTDIR straight through, a put failing with "no object").
    real_mkdir = os.mkdir
    replaced: list[str] = []

    def mkdir_then_replace(name: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        real_mkdir(name, mode, dir_fd=dir_fd)
        if os.path.basename(name) == "d" and not replaced:
            shutil.rmtree(root / "ns")
            (root / "ns").write_bytes(b"file")
            replaced.append(name)

    monkeypatch.setattr(os, "mkdir", mkdir_then_replace)
    with pytest.raises(InvalidKey, match="object 'ns' is in the way"):
        store.put("ns/d/object", b"x")
    monkeypatch.undo()
    assert replaced
    assert store.get("ns") == b"file"
    assert list((root / TEMP_DIR_NAME).iterdir()) == []


@KERNEL_CHECK
def test_a_directory_replaced_by_a_file_before_its_fsync_ends_the_put_quietly(
    store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Once published, a concurrent delete may remove the object and prune its new directories,
    # and another put store a file at their name, before the directories are fsynced: nothing
    # of this write is left to sync (the fsync once raised ENOTDIR, a put of "no object").
    assert store._fsync
    real_fsync = os.fsync
    replaced: list[bool] = []

    def fsync_then_replace(fd: int) -> None:
        real_fsync(fd)
        if (root / "a" / "b" / "c").exists() and not replaced:
            replaced.append(True)
            store.delete_many(["a/b/c"])
            (root / "a").write_bytes(b"file")

    monkeypatch.setattr(os, "fsync", fsync_then_replace)
    store.put("a/b/c", b"x")
    monkeypatch.undo()
    assert replaced
    assert store.get("a") == b"file"
    assert [m.key for m in store.list()] == ["a"]


@KERNEL_CHECK
def test_every_read_path_refuses_an_escaping_symlink(
    tmp_path: Path, store: FileStore, root: Path
) -> None:
    # Reads check the descriptor they opened (Linux /proc/self/fd) or, elsewhere, the path.
    (tmp_path / "outside").write_bytes(b"0123456789")
    (root / "alias").symlink_to(tmp_path / "outside")
    buffer = memoryview(bytearray(4))
    for call in (
        lambda: store.get("alias"),
        lambda: store.get_range("alias", Suffix(2)),
        lambda: store.get_range_into("alias", 0, buffer),
        lambda: store.map_range("alias", 0, 4),
        lambda: store.head("alias"),
    ):
        with pytest.raises(InvalidKey, match="outside the root"):
            call()
    assert bytes(buffer) == bytes(4)


def test_a_symlink_inside_the_root_is_followed(store: FileStore, root: Path) -> None:
    store.put("real/object", b"0123456789")
    (root / "alias").symlink_to(root / "real" / "object")
    assert store.get("alias") == b"0123456789"
    assert store.get_range("alias", Suffix(3)) == b"789"


@KERNEL_CHECK
def test_a_prefix_through_a_symlink_inside_the_root_lists_what_reads_read(
    store: FileStore, root: Path
) -> None:
    # A namespace under a symlinked directory was written and read through the link but
    # listed as empty (the walk from the root never follows a symlink), so it was reported
    # missing right after its creation.
    store.put("inner/ns/_manifests/0", b"v0")
    store.put("inner/ns/deep/object", b"x")
    (root / "link").symlink_to(root / "inner", target_is_directory=True)
    (root / "inner" / "ns" / "alias").symlink_to(root / "inner" / "ns" / "deep")
    assert store.get("link/ns/_manifests/0") == b"v0"
    assert [m.key for m in store.list("link/ns/_manifests/")] == ["link/ns/_manifests/0"]
    assert [m.key for m in store.list("link/ns/_manifests/", start_after="link/ns/_m")] == [
        "link/ns/_manifests/0"
    ]
    # Below the prefix's directory a symlink is still never followed.
    assert [m.key for m in store.list("link/ns/")] == [
        "link/ns/_manifests/0",
        "link/ns/deep/object",
    ]
    # No key can begin with these: nothing listed, as on S3.
    for prefix in ("missing/", "inner/ns/_manifests/0/", "a//b", "../x/", ".bw-tmp/x"):
        assert list(store.list(prefix)) == []


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_planted_fifo_cannot_hang_a_read(tmp_path: Path, store: FileStore, root: Path) -> None:
    os.mkfifo(tmp_path / "pipe")
    (root / "alias").symlink_to(tmp_path / "pipe")
    with pytest.raises(InvalidKey, match="outside the root"):
        store.get_range("alias", Suffix(2))  # a blocking open would wait for a writer forever
    os.mkfifo(root / "pipe")
    with pytest.raises(ObjectNotFound):
        store.head("pipe")  # not an object, and head must not open it for reading either


def test_dotdot_keys_never_touch_the_parent(tmp_path: Path, store: FileStore) -> None:
    before = sorted(p.name for p in tmp_path.iterdir())
    for key in ("../escape", "a/../../escape", ".."):
        with pytest.raises(InvalidKey):
            store.put(key, b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_temp_directory_is_reserved_and_hidden(store: FileStore, root: Path) -> None:
    with pytest.raises(InvalidKey, match="reserved"):
        store.put(f"{TEMP_DIR_NAME}/x", b"x")
    assert not (root / TEMP_DIR_NAME).exists()  # made by the first write, not by opening
    # A writer that crashed mid-write leaves only a temp file: never visible as an object.
    (root / TEMP_DIR_NAME).mkdir()
    (root / TEMP_DIR_NAME / "crashed.tmp").write_bytes(b"partial")
    assert list(store.list()) == []


def test_writes_leave_no_temp_files(store: FileStore, root: Path) -> None:
    store.put("a", b"1")
    store.put("a", b"2")
    store.put_if_absent("b", b"3")
    with pytest.raises(ObjectExists):
        store.put_if_absent("b", b"4")
    assert list((root / TEMP_DIR_NAME).iterdir()) == []
    assert (root / "b").read_bytes() == b"3"


def test_object_and_directory_name_conflicts(store: FileStore) -> None:
    store.put("a", b"file")
    with pytest.raises(InvalidKey, match="'a' is in the way"):
        store.put("a/b", b"x")
    with pytest.raises(ObjectNotFound):
        store.get("a/b")
    store.put("d/e", b"x")
    with pytest.raises(InvalidKey, match="cannot hold both"):
        store.put("d", b"x")
    with pytest.raises(InvalidKey, match="cannot hold both"):
        store.put_if_absent("d", b"x")
    with pytest.raises(ObjectNotFound):
        store.get("d")
    with pytest.raises(ObjectNotFound):
        store.head("d")
    store.delete_many(["d"])  # a directory is not an object: nothing to delete
    assert store.get("d/e") == b"x"


def test_delete_prunes_emptied_directories_only(store: FileStore, root: Path) -> None:
    store.put("x/y/z/1", b"1")
    store.put("x/keep", b"2")
    store.delete_many(["x/y/z/1"])
    assert not (root / "x" / "y").exists()
    assert (root / "x" / "keep").exists()
    store.delete_many(["x/keep"])
    assert sorted(p.name for p in root.iterdir()) == [TEMP_DIR_NAME]


def test_a_batch_delete_prunes_each_emptied_directory_and_closes_its_descriptors(
    store: FileStore, root: Path
) -> None:
    # Pruning walks directory descriptors from the root and keeps them from one key to the
    # next: one removed must not be reused for the next key, and none may be left open.
    keys = ["x/y/z/1", "x/y/w/2", "a/b/3", "x/y/z/4", "x/y/z/5/6", "top"]
    for key in [*keys, "x/keep"]:
        store.put(key, b"v")
    fds_before = sorted(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else []
    store.delete_many(["x/y/z/5/6", "x/y/z/1", "a/b/3", "x/y/w/2", "x/y/z/4", "top", "gone/7"])
    assert sorted(p.name for p in root.iterdir()) == [TEMP_DIR_NAME, "x"]
    assert sorted(p.name for p in (root / "x").iterdir()) == ["keep"]
    assert [m.key for m in store.list()] == ["x/keep"]
    if fds_before:
        assert sorted(os.listdir("/proc/self/fd")) == fds_before


def test_puts_survive_concurrent_pruning(store: FileStore) -> None:
    # Deletes prune the directory a concurrent put is about to publish into; puts must retry.
    def churn(worker: int) -> None:
        for i in range(150):
            key = f"hot/dir/w{worker}-{i}"
            store.put(key, b"x")
            assert store.get(key) == b"x"
            store.delete_many([key])

    errors = in_threads(4, churn)
    assert not errors, errors[0]
    assert list(store.list()) == []


def test_a_directory_pruned_while_checked_is_never_taken_for_a_file_in_the_way(
    tmp_path: Path,
) -> None:
    # A put whose makedirs collides with a concurrent prune asks what is in the way. Checking
    # "exists" and "is a directory" with two calls once saw the directory, then saw it gone,
    # and called it a file in the way (an InvalidKey under concurrent deletes, seen in CI).
    directory = tmp_path / "hot" / "dir"
    directory.mkdir(parents=True)
    flipper = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import os
                print(flush=True)
                while True:
                    for step in (os.rmdir, os.mkdir):
                        try:
                            step({str(directory)!r})
                        except OSError:
                            pass
            """),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert flipper.stdout is not None
        flipper.stdout.readline()  # flipping
        seen = [_non_directory(str(directory), stop=str(tmp_path)) for _ in range(20_000)]
    finally:
        flipper.kill()
        flipper.wait()
    assert seen == [None] * len(seen)
    assert _non_directory(str(directory / "x"), stop=str(tmp_path)) is None
    (tmp_path / "hot" / "file").write_bytes(b"")
    assert _non_directory(str(tmp_path / "hot" / "file" / "x"), stop=str(tmp_path)) == str(
        tmp_path / "hot" / "file"
    )


def test_fsync_can_be_disabled(root: Path) -> None:
    store = FileStore(root, fsync=False)
    store.put_if_absent("k", b"v")
    assert store.get("k") == b"v"


_segment = st.text(alphabet="ab-.0/", min_size=1, max_size=3).filter(
    lambda s: all(p not in ("", ".", "..") for p in s.split("/"))
)


def _without_file_dir_clashes(keys: set[str]) -> list[str]:
    """Drop keys that are a directory of another key: a file tree cannot hold both."""
    return sorted(k for k in keys if not any(other.startswith(k + "/") for other in keys))


@settings(max_examples=60, deadline=None, database=None)
@given(
    keys=st.sets(_segment, max_size=12),
    prefix=st.text(alphabet="ab-.0/", max_size=3),
    start_after=st.none() | st.text(alphabet="ab-.0/", max_size=4),
)
def test_list_matches_a_sorted_reference(
    keys: set[str], prefix: str, start_after: str | None
) -> None:
    # The directory walk must reproduce plain bytewise order, including '-' and '.' < '/'.
    stored = _without_file_dir_clashes(keys)
    with tempfile.TemporaryDirectory() as tmp:
        store = FileStore(Path(tmp) / "root", fsync=False)
        for key in stored:
            store.put(key, key.encode())
        expected = [
            k for k in stored if k.startswith(prefix) and (start_after is None or k > start_after)
        ]
        assert [m.key for m in store.list(prefix, start_after=start_after)] == expected


class _TypedEntries:
    """``os.scandir`` whose entries count how often the walk asks their type or stat."""

    def __init__(self) -> None:
        self.typed: list[str] = []
        self._scandir = os.scandir

    def __call__(self, path: int | str) -> contextlib.AbstractContextManager[Iterator[Any]]:
        @contextlib.contextmanager
        def entries() -> Iterator[Iterator[Any]]:
            with self._scandir(path) as it:
                yield (self._entry(entry) for entry in it)

        return entries()

    def _entry(self, entry: os.DirEntry[str]) -> Any:
        typed = self.typed

        class Entry:
            name, path = entry.name, entry.path

            def is_dir(self, *, follow_symlinks: bool = True) -> bool:
                typed.append(entry.name)
                return entry.is_dir(follow_symlinks=follow_symlinks)

            def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
                return entry.stat(follow_symlinks=follow_symlinks)

        return Entry()


def test_a_listing_after_a_key_types_and_sorts_only_the_names_after_it(
    store: FileStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ManifestLog.latest(known) lists a directory of thousands of versions after the known one:
    # the walk must not stat and sort every name to return the few after it.
    keys = [f"ns/_manifests/{v:020d}.manifest" for v in range(300)]
    for key in keys:
        store.put(key, b"m")
    store.put("ns/data/p/0/x.tgb", b"d")
    scandir = _TypedEntries()
    monkeypatch.setattr(os, "scandir", scandir)
    listed = [m.key for m in store.list("ns/_manifests/", start_after=keys[-3])]
    assert listed == keys[-2:]
    # the walk starts in the prefix's directory: only the names from the key on are typed
    # (the key's own name could be a directory of keys after it)
    assert sorted(scandir.typed) == sorted(k[-29:] for k in keys[-3:])
    scandir.typed.clear()
    assert [m.key for m in store.list("ns/", start_after="ns/_n")] == ["ns/data/p/0/x.tgb"]
    assert "_manifests" not in scandir.typed  # a directory entirely before start_after


@pytest.mark.parametrize("replaced", ["file", "directory"])
def test_list_decides_what_is_an_object_from_one_lstat(
    store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch, replaced: str
) -> None:
    # Between the directory scan and the lstat of an entry, a file may be replaced by a
    # directory (deleted, then a put of "k/x"), or its directory by a file. scandir's cached
    # type said "a file" and the lstat gave a directory's size: "k" was listed as an object of
    # 4096 bytes; and an entry under a directory now a file raised ENOTDIR ("no object").
    for key in ("d/x", "k", "z"):
        store.put(key, b"v")
    real_scandir = os.scandir
    root_stat, d_stat = os.stat(root), os.stat(root / "d")

    def replace_after_scanning(directory: int | str) -> Any:  # walked by descriptor (or path)
        with real_scandir(directory) as it:
            entries = list(it)
        scanned = os.stat(directory)
        if replaced == "file" and os.path.samestat(scanned, root_stat):
            (root / "k").unlink()
            (root / "k").mkdir()
        elif replaced == "directory" and os.path.samestat(scanned, d_stat):
            store.delete_many(["d/x"])
            (root / "d").write_bytes(b"file")
        return contextlib.nullcontext(iter(entries))

    monkeypatch.setattr(os, "scandir", replace_after_scanning)
    listed = [(m.key, m.size) for m in store.list()]
    monkeypatch.undo()
    assert listed == ([("d/x", 1), ("z", 1)] if replaced == "file" else [("k", 1), ("z", 1)])


def test_range_reads_resume_after_short_preads(
    store: FileStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pread`` may return fewer bytes than asked; the read continues where it stopped."""
    data = bytes(range(256)) * 40
    store.put("k", data)
    real_pread = os.pread
    calls: list[int] = []

    def short_pread(fd: int, n: int, offset: int) -> bytes:
        calls.append(offset)
        return real_pread(fd, min(n, 1000), offset)

    monkeypatch.setattr(os, "pread", short_pread)
    assert store.get_range("k", Bounded(100, 5_000)) == data[100:5_000]
    assert calls == [100, 1100, 2100, 3100, 4100]
    assert store.get_range("k", Bounded(9_900, 20_000)) == data[9_900:]  # stops at the end
    assert store.get_range("k", Suffix(50)) == data[-50:]


def test_put_parts_writes_more_buffers_than_one_writev_takes(store: FileStore) -> None:
    parts = [bytes([i % 256]) * (i % 7) for i in range(3000)]  # some empty, > IOV_MAX of 1024
    store.put_parts("many/parts", parts)
    assert store.get("many/parts") == b"".join(parts)


def test_put_parts_finishes_short_writes(store: FileStore, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.writev
    calls = 0

    def at_most_five_bytes(fd: int, buffers: list[memoryview]) -> int:
        nonlocal calls
        calls += 1
        return real(fd, [bytes(buffers[0][:5])])

    monkeypatch.setattr(os, "writev", at_most_five_bytes)
    parts = [b"first part", memoryview(b"-second-"), b"", b"third"]
    store.put_parts("short/writes", parts)
    monkeypatch.undo()
    assert store.get("short/writes") == b"first part-second-third"
    assert calls == 5  # 10 + 8 + 5 bytes, at most five per call: 2 + 2 + 1 calls


@KERNEL_CHECK
@pytest.mark.parametrize("mode", [PutMode.OVERWRITE, PutMode.CREATE])
def test_a_put_removes_its_temp_file_and_unlinks_only_what_is_left(
    store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch, mode: PutMode
) -> None:
    # A published replace consumed the temp name (no unlink spent on it); a link (CREATE)
    # leaves it, and so does a failed publish: those are unlinked. Either way none stays.
    temp_dir = root / TEMP_DIR_NAME
    real_unlink = os.unlink
    unlinked: list[str] = []

    def recording_unlink(path: str, *args: object, **kwargs: object) -> None:
        unlinked.append(os.fspath(path))
        real_unlink(path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "unlink", recording_unlink)
    store.put("ns/a", b"1", mode=mode)
    store.put_parts("ns/d/b", [b"2", memoryview(b"3")], mode=mode)
    assert len(unlinked) == (0 if mode is PutMode.OVERWRITE else 2)
    assert all(os.path.dirname(path) == str(temp_dir) for path in unlinked)
    assert list(temp_dir.iterdir()) == []

    unlinked.clear()
    with pytest.raises(InvalidKey, match="'a' and 'a/b'"):
        store.put("ns/a/c", b"x", mode=mode)  # ns/a is an object: nothing can go under it
    if mode is PutMode.CREATE:
        with pytest.raises(ObjectExists):
            store.put("ns/a", b"x", mode=mode)
    assert len(unlinked) == (1 if mode is PutMode.OVERWRITE else 2)
    assert list(temp_dir.iterdir()) == []
    monkeypatch.undo()
    assert (store.get("ns/a"), store.get("ns/d/b")) == (b"1", b"23")


# -- housekeeping against operators and races --------------------------------------------------


def test_file_store_writes_survive_removal_of_its_temp_directory(tmp_path: Path) -> None:
    # Before: after an operator removed `.bw-tmp` (where stray temp files of crashed writers
    # collect), every put raised ObjectNotFound "no object 'b'" until the process restarted.
    store = bw.FileStore(tmp_path / "root", fsync=False)
    store.put("a", b"1")
    shutil.rmtree(tmp_path / "root" / ".bw-tmp")
    store.put("b", b"2")
    store.put_if_absent("c", b"3")
    assert [m.key for m in store.list()] == ["a", "b", "c"]
    assert store.get("b") == b"2"


@PROC_FD_ONLY
def test_a_temp_directory_removed_while_it_is_confined_is_made_again(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel names a removed directory "<path> (deleted)": not taken for one outside.
    store = FileStore(root, fsync=False)
    store.put("a", b"1")
    real_readlink = os.readlink
    removed: list[bool] = []

    def remove_then_readlink(path: Any, *args: Any, **kwargs: Any) -> Any:
        if not removed and (root / TEMP_DIR_NAME).is_dir():
            (root / TEMP_DIR_NAME).rmdir()
            removed.append(True)
        return real_readlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "readlink", remove_then_readlink)
    store.put("b", b"2")
    monkeypatch.undo()
    assert removed
    assert store.get("b") == b"2"
    assert list((root / TEMP_DIR_NAME).iterdir()) == []


@pytest.mark.parametrize("mode", [bw.PutMode.OVERWRITE, bw.PutMode.CREATE])
def test_a_temp_directory_removed_during_a_write_is_a_transient_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: bw.PutMode
) -> None:
    # Before: the publish found its temp file gone, took that for a pruned parent directory,
    # retried 100 times and raised a plain StoreError "its directory kept disappearing under
    # concurrent deletes": fatal to a producer, and wrong. Nothing was written; a retry works.
    store = bw.FileStore(tmp_path / "root", fsync=False)
    write_temp = store._write_temp

    def write_then_clean(key: str, parts: Any) -> str:
        tmp = write_temp(key, parts)
        shutil.rmtree(tmp_path / "root" / TEMP_DIR_NAME)  # an operator cleaning stray temps
        return tmp

    monkeypatch.setattr(store, "_write_temp", write_then_clean)
    with pytest.raises(bw.TransientStoreError, match="temp file") as info:
        store.put("ns/k", b"v", mode=mode)
    assert "'ns/k'" in str(info.value)
    with pytest.raises(bw.ObjectNotFound):
        store.get("ns/k")
    monkeypatch.undo()
    store.put("ns/k", b"v", mode=mode)
    assert store.get("ns/k") == b"v"


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc/self/fd")
def test_a_directory_swapped_after_the_delete_check_cannot_redirect_the_unlink(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: delete_many checked the path with realpath and then unlinked it by path, so a
    # directory swapped for a symlink in between made it delete a file outside the root.
    store = bw.FileStore(tmp_path / "root", fsync=False)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(b"keep me")
    store.put("ns/d/victim", b"object")
    directory = os.path.join(store.root, "ns", "d")
    swapped = False

    def swap() -> None:
        nonlocal swapped
        if not swapped:
            swapped = True
            os.rename(directory, os.path.join(store.root, "ns", "moved"))
            os.symlink(outside, directory)

    real_readlink, real_realpath = os.readlink, os.path.realpath

    def readlink_then_swap(path: Any, *args: Any, **kwargs: Any) -> Any:
        target = real_readlink(path, *args, **kwargs)
        if target == directory:
            swap()
        return target

    def realpath_then_swap(path: Any, *args: Any, **kwargs: Any) -> Any:
        resolved = real_realpath(path, *args, **kwargs)
        if resolved == os.path.join(directory, "victim"):
            swap()
        return resolved

    monkeypatch.setattr(os, "readlink", readlink_then_swap)
    monkeypatch.setattr(os.path, "realpath", realpath_then_swap)
    store.delete_many(["ns/d/victim"])
    monkeypatch.undo()
    assert swapped
    assert (outside / "victim").read_bytes() == b"keep me"
    assert not os.path.exists(os.path.join(store.root, "ns", "moved", "victim"))


def _swap_for_symlink(directory: Path, target: Path) -> None:
    """What an adversary with write access to the root does: park ``directory`` beside itself
    and plant a symlink to ``target`` at its name."""
    directory.rename(directory.with_name(directory.name + ".parked"))
    directory.symlink_to(target, target_is_directory=True)


def test_a_directory_swapped_for_a_symlink_after_the_scan_is_not_listed_through(
    outside: Path, store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The scan typed ns/d as a directory; it became a symlink to outside before the walk went
    # into it. Walking by path (scandir of ns/d) listed the files outside the root as objects.
    (outside / "secret").write_bytes(b"outside the root")
    store.put("ns/aaa", b"1")
    store.put("ns/d/object", b"2")
    real_scandir = os.scandir
    ns_stat = os.stat(root / "ns")
    swapped: list[bool] = []

    def scan_then_swap(directory: int | str) -> Any:  # walked by descriptor (or path)
        with real_scandir(directory) as it:
            entries = list(it)
        if os.path.samestat(os.stat(directory), ns_stat) and not swapped:
            _swap_for_symlink(root / "ns" / "d", outside)
            swapped.append(True)
        return contextlib.nullcontext(iter(entries))

    monkeypatch.setattr(os, "scandir", scan_then_swap)
    listed = [m.key for m in store.list("ns/")]
    monkeypatch.undo()
    assert swapped
    assert listed == ["ns/aaa"]


@KERNEL_CHECK
def test_a_directory_swapped_for_a_symlink_after_the_unlink_is_not_pruned_through(
    outside: Path, store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # After the (confined) unlink, delete_many removes the parents that became empty. Removing
    # them by path (rmdir ns/a/b) went through ns/a swapped for a symlink in between and
    # removed an empty directory outside the root.
    (outside / "b").mkdir()
    store.put("ns/a/b/object", b"x")
    real_unlink = os.unlink

    def unlink_then_swap(name: str, *, dir_fd: int | None = None) -> None:
        real_unlink(name, dir_fd=dir_fd)
        if os.path.basename(name) == "object":
            _swap_for_symlink(root / "ns" / "a", outside)

    monkeypatch.setattr(os, "unlink", unlink_then_swap)
    store.delete_many(["ns/a/b/object"])
    monkeypatch.undo()
    assert (root / "ns" / "a").is_symlink()
    assert (outside / "b").is_dir()
    assert not (root / "ns" / "a.parked" / "b" / "object").exists()


@PROC_FD_ONLY
def test_a_directory_swapped_for_a_symlink_before_a_put_creates_under_it_creates_nothing_outside(
    outside: Path, store: FileStore, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A put checked the parent of its new directory and then created it by path (makedirs of
    # ns/a/new): ns/a swapped for a symlink in between made it create ns/a/new outside the root.
    # Created relative to the descriptor of ns/a opened (and confined) before, it lands in the
    # directory that was checked, wherever that has been moved.
    (root / "ns" / "a").mkdir(parents=True)
    real_mkdir = os.mkdir
    swapped: list[bool] = []

    def swap_then_mkdir(name: str, mode: int = 0o777, *, dir_fd: int | None = None) -> None:
        if os.path.basename(name) == "new" and not swapped:
            _swap_for_symlink(root / "ns" / "a", outside)
            swapped.append(True)
        real_mkdir(name, mode, dir_fd=dir_fd)

    monkeypatch.setattr(os, "mkdir", swap_then_mkdir)
    with contextlib.suppress(InvalidKey):  # how the check made after makedirs refused it
        store.put("ns/a/new/object", b"x")
    monkeypatch.undo()
    assert swapped
    assert list(outside.iterdir()) == []
    assert store.get("ns/a.parked/new/object") == b"x"


# -- roots that cannot be written, or cannot be a root at all ----------------------------------

_READ_ONLY_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from click.testing import CliRunner
    import batchweave as bw
    from batchweave.cli._app import cli

    out = {}
    for root in sys.argv[1:]:
        try:  # the setup must really deny writes, else the test would prove nothing
            open(os.path.join(root, "canary"), "xb")
        except PermissionError:
            pass
        else:
            sys.exit(f"{root} is writable for this process: permissions were not dropped")
        url = "file://" + root
        store = bw.FileStore(root)
        seen = {
            "get": store.get("k").decode(),
            "range": store.get_range("k", bw.Bounded(1, 3)).decode(),
            "head": store.head("k").size,
            "list": [m.key for m in store.list() if not m.key.startswith("run/")],
            "open_store": bw.open_store(url, verify_conditional_writes=False).get("k").decode(),
        }
        with bw.Consumer(store, "run", mesh=bw.Mesh(dp=1, cp=1), dp_rank=0, cp_rank=0) as c:
            seen["steps"] = [step for step, _ in c]
        for command in ("inspect", "verify"):
            result = CliRunner().invoke(cli, [command, root, "run"])
            seen[command] = [result.exit_code, result.output[-300:]]
        for name, write in (
            ("put", lambda: store.put("new", b"x")),
            ("put_if_absent", lambda: store.put_if_absent("new", b"x")),
            ("delete", lambda: store.delete_many(["k"])),
            ("probe", lambda: bw.open_store(url)),
        ):
            try:
                write()
            except bw.AccessDenied as exc:
                seen[name] = str(exc)
            except Exception as exc:
                seen[name] = f"wrong error {type(exc).__name__}: {exc}"
            else:
                seen[name] = "no error"
        out[root] = seen
    print(json.dumps(out))
    """
)


def _run_without_write_permission(*args: str) -> Any:
    """Run ``_READ_ONLY_SCRIPT`` with ``args`` where file permission bits apply, and parse it.

    Root ignores permission bits (CAP_DAC_OVERRIDE), so as root the script runs under
    ``setpriv`` with that capability and CAP_DAC_READ_SEARCH dropped; as any other user, plainly.
    Never skipped: without ``setpriv`` (or the privilege to drop capabilities) as root the test
    fails, and the script itself first checks that a write into each root is really refused.
    """
    command = [sys.executable, "-c", _READ_ONLY_SCRIPT, *args]
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.fail("running as root needs setpriv (util-linux) to drop CAP_DAC_OVERRIDE")
        command = [
            setpriv,
            "--inh-caps=-all",
            "--bounding-set=-dac_override,-dac_read_search",
            *command,
        ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def _make_read_only(root: Path) -> None:
    for path in [root, *root.rglob("*")]:
        if not path.is_symlink():
            path.chmod(stat.S_IMODE(path.stat().st_mode) & ~0o222)


def test_a_read_only_root_can_be_read_and_writes_say_why_they_fail(tmp_path: Path) -> None:
    # Before: FileStore() created `.bw-tmp` when opened, so a read-only root could not even be
    # read ("[Errno 13] Permission denied: '<root>/.bw-tmp'", a raw PermissionError), from the
    # API, consumers, `batchweave inspect` and `verify` alike.
    roots = [tmp_path / "no-temp-dir", tmp_path / "with-temp-dir"]
    for root in roots:
        store = FileStore(root, fsync=False)
        store.put("k", b"value")
        produce(store, "run", Mesh(dp=1, cp=1), tgbs=2)
    shutil.rmtree(roots[0] / TEMP_DIR_NAME)  # the reported case: nothing made it yet
    assert (roots[1] / TEMP_DIR_NAME).is_dir()  # there, but read-only like everything else
    for root in roots:
        _make_read_only(root)
    try:
        results = _run_without_write_permission(*map(str, roots))
    finally:
        for root in roots:
            for path in [root, *root.rglob("*")]:
                path.chmod(stat.S_IMODE(path.stat().st_mode) | 0o200)
    for root in roots:
        seen = results[str(root)]
        assert (seen["get"], seen["range"], seen["head"]) == ("value", "al", 5)
        assert seen["list"] == ["k"]
        assert seen["open_store"] == "value"
        assert seen["steps"] == [0, 1]
        assert seen["inspect"][0] == 0, seen["inspect"]
        assert seen["verify"][0] == 0, seen["verify"]
        for write in ("put", "put_if_absent", "delete", "probe"):
            message = seen[write]
            assert message.startswith(("cannot write", "permission denied")), (write, message)
            assert str(root) in message, message
            assert "read-only for this user; reads work, writes need write permission" in message
        assert not (root / "new").exists()
    assert not (roots[0] / TEMP_DIR_NAME).exists()  # reading created nothing


def test_the_temp_directory_is_made_once_by_concurrent_first_writes(root: Path) -> None:
    store = FileStore(root, fsync=False)
    assert not (root / TEMP_DIR_NAME).exists()
    start = threading.Barrier(8)

    def write(i: int) -> None:
        start.wait()
        store.put(f"k{i}", b"x")

    assert in_threads(8, write) == []
    assert [m.key for m in store.list()] == [f"k{i}" for i in range(8)]
    assert list((root / TEMP_DIR_NAME).iterdir()) == []


def test_a_temp_directory_that_cannot_be_made_names_what_is_in_the_way(root: Path) -> None:
    store = FileStore(root, fsync=False)
    (root / TEMP_DIR_NAME).write_bytes(b"someone's file")
    with pytest.raises(InvalidStoreURL, match=rf"{TEMP_DIR_NAME}.* is not a directory.*move it"):
        store.put("k", b"x")


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        ("file", InvalidStoreURL, r"root '{path}' is a file, not a directory.*move the file"),
        ("under-file", InvalidStoreURL, r"its ancestor '{blocker}' is not a directory"),
        ("dangling-symlink", InvalidStoreURL, r"root '{path}' cannot be used: it is not a dir"),
        ("proc", InvalidStoreURL, r"temp directory .* failed .*not .* /proc"),
    ],
)
def test_a_root_that_cannot_be_a_directory_is_refused_with_the_fix(
    tmp_path: Path, make: str, error: type[Exception], message: str
) -> None:
    # Before: "cannot create file store root ...: [Errno 17] File exists" for a file, and a raw
    # FileNotFoundError from open_store("file:///proc/self").
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"not a directory")
    path = {
        "file": blocker,
        "under-file": blocker / "root",
        "dangling-symlink": tmp_path / "link",
        "proc": Path("/proc/self"),
    }[make]
    if make == "dangling-symlink":
        path.symlink_to(tmp_path / "missing" / "target")
    pattern = message.format(path=path, blocker=blocker)
    with pytest.raises(error, match=pattern):
        open_store(path.as_uri())
    assert blocker.read_bytes() == b"not a directory"


def test_a_root_that_cannot_be_created_is_access_denied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parent = tmp_path / "locked"
    parent.mkdir()
    # Permission bits do not stop root, so the refusal is played by the file system call.
    real_mkdir = os.mkdir

    def refuse(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.fspath(path).startswith(os.fspath(parent)):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", refuse)
    with pytest.raises(AccessDenied, match=r"cannot create file store root '.*locked/r'.*choose"):
        FileStore(parent / "r")

"""``file:///abs/path``: the embedded default backend, one file per object under a root directory.

Writes go to a uniquely named temp file in the root's hidden ``.bw-tmp/`` directory, are fsynced,
and are then published atomically: ``os.replace`` for overwrites, ``os.link`` for create-if-absent
(``link`` fails with ``EEXIST`` if the name is taken, which is the atomic primitive
``If-None-Match: *`` maps to). Readers therefore never see a partially written object.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import stat
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path

from batchweave._errors import (
    AccessDenied,
    InvalidKey,
    InvalidStoreURL,
    ObjectExists,
    ObjectNotFound,
    StoreError,
    TransientStoreError,
)
from batchweave._store._base import (
    ByteRange,
    ObjectMeta,
    ObjectStore,
    PutMode,
    check_mode,
    check_range,
    checked_keys,
    resolve_range,
    validate_key,
)

__all__ = ["FileStore", "check_root"]

TEMP_DIR_NAME = ".bw-tmp"
"""Reserved top-level directory for in-flight writes; never listed, never a valid key prefix."""

_MISSING_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ENXIO)
"""Errors meaning "no object here" (``ENXIO``: a socket where the object's file would be)."""
_NO_SUCH_NAME_ERRNOS = (*_MISSING_ERRNOS, errno.ENAMETOOLONG)
"""What a delete takes for "nothing to delete": also a name too long for the file system,
which no object can have (a batch must not stop part-way at it)."""
_WRITE_ACTIONS = frozenset({"write", "delete"})
"""Actions whose ``PermissionError`` means the root is read-only for this user."""
_NOT_A_ROOT_FIX = (
    "the root must be a directory (or a path that can be created) on a writable local file "
    "system, not a file, a special file system such as /proc, or a path under a file"
)
_PUBLISH_RETRIES = 100
_IOV_MAX = 1024
"""Buffers per ``writev`` call (Linux's ``IOV_MAX``; a call may also write fewer bytes)."""
_PROC_FD = "/proc/self/fd"
"""Where Linux shows the path of each open descriptor (resolved by the kernel)."""
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
"""Reads open with O_NONBLOCK so a FIFO planted under the root cannot hang ``open``."""
_DIR_FLAGS = _READ_FLAGS | getattr(os, "O_DIRECTORY", 0)
"""A parent directory opened to publish into (Python's ``os.open`` already sets close-on-exec)."""
_TEMP_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL
_NOFOLLOW_DIR_FLAGS = _DIR_FLAGS | getattr(os, "O_NOFOLLOW", 0)
"""A directory opened by :func:`_open_dir`: never through a symlink at its name."""
_NOT_A_DIRECTORY_ERRNOS = (errno.ENOENT, errno.ENOTDIR, errno.ELOOP)
"""What :func:`_open_dir` raises for a name that is gone, a file, or a symlink (Linux says
``ENOTDIR`` for a symlink opened with ``O_DIRECTORY | O_NOFOLLOW``, macOS ``ELOOP``)."""
_STAT_FLAGS = getattr(os, "O_PATH", 0)
"""``head`` opens with ``O_PATH``: no read permission needed, nothing of a FIFO opened."""
_PUBLISH_AT = (
    hasattr(os, "O_DIRECTORY")
    and {os.link, os.rename, os.rmdir, os.stat, os.unlink} <= os.supports_dir_fd
    and os.stat in os.supports_follow_symlinks
)
"""``link``/``replace``/``rmdir``/``lstat``/``unlink`` relative to a directory descriptor
(``os.replace`` shares ``os.rename``'s implementation, which is the one ``supports_dir_fd``
lists)."""


class FileStore(ObjectStore):
    """Objects as files under ``root``; keys map to ``/``-separated relative paths.

    Guarantees: atomic whole-object visibility, atomic create-if-absent, keys confined to the root
    (``..`` is refused by :func:`validate_key`, and a key whose resolved path leaves the root
    through a symlink is refused with ``InvalidKey``). The root directory is created if missing.
    Opening and reading need no write permission (the temp directory is made by the first
    write), so a read-only root can be read; a write to it raises ``AccessDenied``. A root that
    cannot be a directory (a file, a path under a file) raises ``InvalidStoreURL``.

    Limitation: a directory tree cannot hold both ``a`` and ``a/b`` as objects (S3 can). Such a
    write raises ``InvalidKey`` naming the conflicting object.

    ``fsync=False`` skips the file and directory fsyncs: faster, still atomic for readers, but
    not durable across a machine crash. Use it only for scratch data and tests.
    """

    def __init__(self, root: str | os.PathLike[str], *, fsync: bool = True) -> None:
        root_path = check_root(root)
        _use_root(root_path)
        self._root = os.path.realpath(root_path)
        self._prefix = os.path.join(self._root, "")  # the root and one separator
        # Created by the first write, not here: a read-only root can still be read.
        self._tmp = os.path.join(self._root, TEMP_DIR_NAME)
        self._fsync = fsync
        self._proc_fd = os.path.isdir(_PROC_FD)
        self.url = root_path.as_uri()

    @property
    def root(self) -> str:
        """The resolved absolute root directory."""
        return self._root

    # -- paths -------------------------------------------------------------------------------

    def _lexical_path(self, key: str) -> str:
        """``key``'s path under the root, checked as a string (no symlinks resolved yet)."""
        validate_key(key)
        parts = key.split("/")
        if parts[0] == TEMP_DIR_NAME:
            raise InvalidKey(
                f"object key {key!r} uses the reserved directory {TEMP_DIR_NAME!r} of {self.url}"
            )
        # The key was validated: plain segments only, so the path is the key under the root.
        return self._prefix + (key if os.sep == "/" else os.path.join(*parts))

    def _check_inside(self, key: str, path: str, real: str) -> None:
        """``InvalidKey`` unless ``real`` (where ``key``'s ``path`` resolves) is in the root.

        The root itself is inside (a symlink ``self -> .``): a directory, so a key expected to
        be a file there is not found (:meth:`_require_file`), as for any directory.
        """
        if real == path or real == self._root:
            return
        if not real.startswith(self._root + os.sep):
            raise InvalidKey(
                f"object key {key!r} resolves to {real!r}, outside the root of {self.url} "
                "(through a symlink); keys must stay inside the store root"
            )
        if real == self._tmp or real.startswith(self._tmp + os.sep):
            raise InvalidKey(
                f"object key {key!r} resolves into the reserved directory {TEMP_DIR_NAME!r} of "
                f"{self.url} (through a symlink); remove the symlink, in-flight writes live there"
            )

    def _path(self, key: str) -> str:
        path = self._lexical_path(key)
        self._check_inside(key, path, os.path.realpath(path))
        return path

    def _open_for_read(self, key: str) -> int:
        """Open ``key``'s file read-only and return the descriptor, confined to the root.

        On Linux the check asks the kernel where the opened descriptor points, so it costs one
        ``readlink`` instead of an ``lstat`` per path component (``realpath``: about a third
        of a 100 KB read) and leaves no window between check and use. Elsewhere the path is
        resolved first, as for writes.
        """
        if not self._proc_fd:
            path = self._path(key)
            return os.open(path, _READ_FLAGS)
        path = self._lexical_path(key)
        return self._open_confined(key, path, _READ_FLAGS)

    def _open_confined(self, key: str, path: str, flags: int) -> int:
        """Open ``path`` (``key``'s file or its directory) and confine where the kernel says it is.

        Needs ``self._proc_fd``. Closes the descriptor and raises ``InvalidKey`` if it leads
        outside the root.
        """
        fd = os.open(path, flags)
        try:
            self._check_inside(key, path, os.readlink(f"{_PROC_FD}/{fd}"))
        except BaseException:
            os.close(fd)
            raise
        return fd

    @contextmanager
    def _errors(self, key: str, action: str) -> Iterator[None]:
        """Translate ``OSError`` into the store error tree, naming the key."""
        try:
            yield
        except StoreError:
            raise
        except OSError as exc:
            raise self._error(exc, key, action) from exc

    def _error(self, exc: OSError, key: str, action: str) -> StoreError:
        """The store error ``exc`` (raised while doing ``action`` on ``key``) translates to."""
        if exc.errno in _MISSING_ERRNOS:
            return ObjectNotFound(f"no object {key!r} in {self.url}")
        if _refused(exc):
            hint = f": {self._read_only(exc)}" if action in _WRITE_ACTIONS else ""
            return AccessDenied(f"permission denied to {action} {key!r} in {self.url}{hint}")
        return StoreError(f"cannot {action} {key!r} in {self.url}: {exc}")

    def _read_only(self, exc: OSError) -> str:
        """Why a write was refused (``EACCES``/``EPERM``/``EROFS``), and what to do about it."""
        if exc.errno == errno.EROFS:
            return (
                f"the directory {self._root} is on a read-only file system; reads work, writes "
                "need a writable mount"
            )
        return (
            f"the directory {self._root} is read-only for this user; reads work, writes need "
            "write permission on it and its subdirectories"
        )

    # -- writes ------------------------------------------------------------------------------

    def _write_temp(self, key: str, parts: Sequence[bytes | memoryview]) -> str:
        name = f"{secrets.token_hex(16)}.tmp"
        tmp = os.path.join(self._tmp, name)
        try:
            fd = self._create_temp(key, name)
        except (FileNotFoundError, NotADirectoryError):
            # The first write, or an operator removed the temp directory (cleaning up stray
            # temp files): create it rather than failing every write with "no object".
            self._make_temp_dir(key)
            fd = self._create_temp(key, name)
        try:
            _write_all(fd, parts)
            if self._fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(tmp)
            raise
        os.close(fd)
        return tmp

    def _create_temp(self, key: str, name: str) -> int:
        """Create temp file ``name`` in the temp directory, confined to the root.

        A ``.bw-tmp`` replaced by a symlink, or the root (or a directory above it) replaced by
        one after the store was opened, would put every object's bytes outside the root before
        the publish refuses them: the temp directory is opened without following a symlink at
        its name and confined like every directory a write uses, before a byte is written.
        """
        if os.open not in os.supports_dir_fd:
            self._confine_temp_dir(key, None)
            return os.open(os.path.join(self._tmp, name), _TEMP_FILE_FLAGS, 0o644)
        try:
            dfd = _open_dir(self._tmp)
        except OSError as exc:
            # With O_DIRECTORY, Linux reports a symlink as ENOTDIR rather than ELOOP.
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR) or not os.path.islink(self._tmp):
                raise
            raise InvalidKey(
                f"cannot write {key!r} to {self.url}: its temp directory {self._tmp} is a "
                f"symbolic link, which would put the data outside the root; remove the link "
                f"(the name {TEMP_DIR_NAME!r} is reserved for in-flight writes)"
            ) from exc
        try:
            self._confine_temp_dir(key, dfd)
            return os.open(name, _TEMP_FILE_FLAGS, 0o644, dir_fd=dfd)
        finally:
            os.close(dfd)

    def _where(self, fd: int | None, path: str) -> str:
        """Where directory ``path`` (open as ``fd``, if not None) really is: the kernel's word
        for the descriptor where ``/proc/self/fd`` tells it (one ``readlink``), else the path
        resolved."""
        if fd is not None and self._proc_fd:
            return os.readlink(f"{_PROC_FD}/{fd}")
        return os.path.realpath(path)

    def _confine_temp_dir(self, key: str, fd: int | None) -> None:
        """``InvalidKey`` unless the temp directory (open as ``fd``) is ``<root>/.bw-tmp``."""
        where = self._where(fd, self._tmp)
        if where == self._tmp:
            return
        if fd is not None and os.fstat(fd).st_nlink == 0:
            # Removed since it was opened (an operator cleaning stray temp files): made again.
            raise FileNotFoundError(errno.ENOENT, "temp directory removed", self._tmp)
        raise self._root_moved(key, self._tmp, where)

    def _root_moved(self, key: str, path: str, where: str) -> InvalidKey:
        """The error for writing ``key`` when ``path`` (the temp directory or the root) leads
        to ``where`` instead: the root or a directory above it became a symlink."""
        return InvalidKey(
            f"cannot write {key!r} to {self.url}: {path} resolves to {where!r}, outside the "
            "root (the root or a directory above it was replaced by a symbolic link after the "
            "store was opened); nothing was written; restore the root, or open the store at "
            "its new location"
        )

    def _make_temp_dir(self, key: str) -> None:
        """Create the temp directory (and the root, if it was removed) for writing ``key``.

        Made relative to a confined descriptor of the root, never by a path a swapped-in
        symlink could redirect. Safe to race: a temp directory another thread or process made
        first is used. A root that cannot hold it raises a store error naming the root and the
        fix.
        """
        try:
            self._mkdir_temp(key)
        except OSError as exc:
            what = f"cannot write {key!r} to {self.url}"
            if _refused(exc):
                raise AccessDenied(f"{what}: {self._read_only(exc)}") from exc
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO):
                raise StoreError(f"{what}: creating {self._tmp} failed: {exc.strerror}") from exc
            blocker = _non_directory(self._tmp)
            if blocker is not None:
                raise InvalidStoreURL(
                    f"{what}: {blocker} is not a directory, so the temp directory {self._tmp} "
                    f"cannot be created; move it away (the name {TEMP_DIR_NAME!r} is reserved "
                    "for in-flight writes)"
                ) from exc
            raise InvalidStoreURL(
                f"{what}: creating its temp directory {self._tmp} failed ({exc.strerror}); "
                f"{_NOT_A_ROOT_FIX}"
            ) from exc

    def _mkdir_temp(self, key: str) -> None:
        """``mkdir`` the temp directory in the root's confined descriptor (see above)."""
        try:
            rfd = os.open(self._root, _DIR_FLAGS)
        except FileNotFoundError:
            os.makedirs(self._root, exist_ok=True)  # the root was removed: made again
            rfd = os.open(self._root, _DIR_FLAGS)
        try:
            where = self._where(rfd, self._root)
            if where != self._root:
                raise self._root_moved(key, self._root, where)
            if os.mkdir not in os.supports_dir_fd:
                os.makedirs(self._tmp, exist_ok=True)
                return
            try:
                os.mkdir(TEMP_DIR_NAME, dir_fd=rfd)
            except FileExistsError:
                if not _is_dir_at(rfd, TEMP_DIR_NAME):  # a file in the way: named above
                    raise
        finally:
            os.close(rfd)

    def _fsync_dir(self, path: str) -> None:
        if not self._fsync or not hasattr(os, "O_DIRECTORY"):
            return
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError):
            # A concurrent delete removed the object and pruned its directory (and a put may
            # have stored a file at its name since): nothing of this write is left to sync.
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _fsync_ancestors(self, directory: str) -> None:
        """Make new directory entries durable: fsync ``directory``'s ancestors up to the root."""
        while directory != self._root:
            directory = os.path.dirname(directory)
            self._fsync_dir(directory)

    def _blocking_file(self, directory: str) -> str | None:
        """The nearest ancestor (or ``directory`` itself) below the root that is not a directory."""
        return _non_directory(directory, stop=self._root)

    def _conflict(self, key: str, blocker: str | None) -> InvalidKey:
        """``key`` cannot be stored: ``blocker`` (a file) is in the way, or, if None, a
        directory of other objects already holds its name."""
        what = (
            f"object {os.path.relpath(blocker, self._root)!r} is in the way"
            if blocker is not None
            else "a directory of other objects already uses that name"
        )
        return InvalidKey(
            f"cannot store {key!r} in {self.url}: {what}; a file store cannot hold both "
            "'a' and 'a/b'"
        )

    def _makedirs(self, key: str, path: str) -> bool:
        """Create ``path``'s parent directories; False if a concurrent prune raced us (retry)."""
        parent = os.path.dirname(path)
        try:
            os.makedirs(parent, exist_ok=True)
        except FileNotFoundError:
            return False  # an ancestor was pruned while we were creating it
        except (FileExistsError, NotADirectoryError) as exc:
            blocker = self._blocking_file(parent)
            if blocker is not None:
                raise self._conflict(key, blocker) from exc
            return False  # a concurrent prune raced makedirs; nothing is in the way
        return True

    def _taken_by_directory(self, key: str, path: str) -> InvalidKey:
        """The conflict for ``key`` whose name ``path`` a directory of other objects holds."""
        return self._conflict(key, self._blocking_file(os.path.dirname(path)))

    def _settle_taken_name(self, exc: OSError, key: str, path: str, dfd: int | None) -> None:
        """Settle a publish whose ``link``/``replace`` failed with ``exc``: the name was taken.

        Returns to retry the publish; raises the error otherwise. ``dfd`` is the directory
        descriptor the name was published through (``path``'s last component is then relative
        to it), or None to act on ``path`` itself. What holds the name is decided from one
        ``lstat``: a directory pruned by a concurrent delete between two separate checks would
        otherwise be taken for an object (``ObjectExists``) or a conflict (``InvalidKey``).
        """
        name = path if dfd is None else os.path.basename(path)
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            # Gone since (pruned), or an ancestor is no longer a directory: the next attempt
            # recreates the directory, or names the file in its way.
            return
        if stat.S_ISDIR(st.st_mode):
            # Only an empty directory can be removed, and it holds no objects: one a delete
            # is about to prune, or one a put made and has not published into yet (that put
            # retries, as when a delete prunes it).
            try:
                os.rmdir(name, dir_fd=dfd)
            except (FileNotFoundError, NotADirectoryError):
                return
            except OSError as rmdir_exc:  # ENOTEMPTY: a directory of other objects
                raise self._taken_by_directory(key, path) from rmdir_exc
            return
        if stat.S_ISLNK(st.st_mode) and _is_dir_at(dfd, name):
            # A symlink to a directory (never removed through): not an object either.
            raise self._taken_by_directory(key, path) from exc
        if isinstance(exc, FileExistsError):
            raise ObjectExists(f"object {key!r} already exists in {self.url}") from exc
        # A replace that met a directory, now a file: replacing it may succeed.

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        self.put_parts(key, (data,), mode=mode)

    def put_parts(
        self,
        key: str,
        parts: Sequence[bytes | memoryview],
        *,
        mode: PutMode = PutMode.OVERWRITE,
    ) -> None:
        check_mode(mode)
        # Through a confined directory descriptor where the kernel can tell where it points;
        # elsewhere the path is resolved (realpath) first.
        at_fd = self._proc_fd and _PUBLISH_AT
        path = self._lexical_path(key) if at_fd else self._path(key)
        publish = self._publish_at if at_fd else self._publish_by_path
        with self._errors(key, "write"):
            tmp = self._write_temp(key, parts)
            new_directory: bool | None = None
            try:
                # A concurrent delete_many may prune the (empty) parent between makedirs and
                # the publish; recreate it and try again.
                for _ in range(_PUBLISH_RETRIES):
                    new_directory = publish(key, path, tmp, mode)
                    if new_directory is not None:
                        break
                    if not os.path.lexists(tmp):
                        raise TransientStoreError(
                            f"cannot write {key!r} in {self.url}: its temp file {tmp} was "
                            f"removed before it was published ({TEMP_DIR_NAME} cleaned during "
                            "a write?); nothing was written, retry the write"
                        )
                else:
                    raise StoreError(
                        f"cannot write {key!r} in {self.url}: its directory kept disappearing "
                        "under concurrent deletes"
                    )
            finally:
                # A published replace consumed the temp name; a link (CREATE) or a failure
                # left it behind.
                if new_directory is None or mode is PutMode.CREATE:
                    _unlink_quietly(tmp)
            if new_directory:
                self._fsync_ancestors(os.path.dirname(path))

    def _publish_at(self, key: str, path: str, tmp: str, mode: PutMode) -> bool | None:
        """One attempt to publish ``tmp`` as ``path`` through a descriptor of its directory.

        The directory is opened, confined by asking the kernel where the descriptor points, and
        the object is linked relative to that descriptor: a directory swapped for a symlink
        after the check cannot redirect the write, and no ``lstat`` per path component is spent.
        The final component is never followed (``link`` and ``replace`` act on the name itself).
        Returns whether the directory was created, or None when a concurrent prune removed it
        (retry).
        """
        parent, name = os.path.split(path)
        new_directory = False
        try:
            dfd = self._open_confined(key, parent, _DIR_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            # A new directory, or a file in the way.
            made = self._make_parents_at(key, parent)
            if made is None:
                return None
            dfd, new_directory = made, True
        try:
            if mode is not PutMode.CREATE:
                self._refuse_escaping_link(key, path, dfd, name)
            try:
                if mode is PutMode.CREATE:
                    os.link(tmp, name, dst_dir_fd=dfd)
                else:
                    os.replace(tmp, name, dst_dir_fd=dfd)
            except FileNotFoundError:
                return None  # the directory was pruned after we opened it
            except (FileExistsError, IsADirectoryError, NotADirectoryError) as exc:
                self._refuse_escaping_link(key, path, dfd, name)
                self._settle_taken_name(exc, key, path, dfd)
                return None
            if self._fsync:
                os.fsync(dfd)
        finally:
            os.close(dfd)
        return new_directory

    def _make_parents_at(self, key: str, parent: str) -> int | None:
        """Create ``parent`` (the directory of ``key``'s file) and its missing ancestors, and
        return a descriptor of it; None when a concurrent prune removed one of them (retry).

        No step acts on a path: the deepest existing ancestor is opened and confined like any
        directory a write publishes into (a symlink inside the root may lead to it, one leading
        outside is refused before anything is created), and each missing directory is made
        relative to its parent's descriptor (``mkdirat``) and opened from it without following
        a symlink. A directory swapped for a symlink between two steps therefore cannot make a
        put create directories outside the root, as ``makedirs`` by path once did.
        """
        missing: list[str] = []
        ancestor = parent
        while ancestor != self._root:
            ancestor, name = os.path.split(ancestor)
            missing.append(name)
            try:
                fd = self._open_confined(key, ancestor, _DIR_FLAGS)
                break
            except (FileNotFoundError, NotADirectoryError):
                continue
        else:
            return None  # the root itself was removed: the retry finds the temp file gone
        try:
            for name in reversed(missing):
                with suppress(FileExistsError):  # a concurrent put's, or not a directory
                    os.mkdir(name, dir_fd=fd)
                fd, above = _open_dir(name, dir_fd=fd), fd
                os.close(above)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in _NOT_A_DIRECTORY_ERRNOS:
                raise
            if exc.errno == errno.ENOENT:
                return None  # pruned by a concurrent delete since it was made or opened
            # A file or a symlink holds the name. A symlink leading outside is refused, a file
            # in the way named; a symlink to a directory inside the root (made since the
            # ancestor was opened) is gone through, confined, by the next attempt.
            self._check_inside(key, parent, os.path.realpath(parent))
            blocker = self._blocking_file(parent)
            if blocker is not None:
                raise self._conflict(key, blocker) from exc
            return None
        return fd

    def _refuse_escaping_link(self, key: str, path: str, dfd: int, name: str) -> None:
        """``InvalidKey`` if ``name`` in ``dfd`` is a symlink resolving outside the root.

        Publishing replaces such a link rather than writing through it, so this only keeps
        the error the same as for a read of that key.
        """
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            self._check_inside(key, path, os.path.realpath(path))

    def _publish_by_path(self, key: str, path: str, tmp: str, mode: PutMode) -> bool | None:
        """``_publish_at`` where descriptors cannot be confined: ``path`` was checked by
        ``realpath`` beforehand."""
        parent = os.path.dirname(path)
        new_directory = not os.path.isdir(parent)
        if not self._makedirs(key, path):
            return None
        try:
            if mode is PutMode.CREATE:
                os.link(tmp, path)
            else:
                os.replace(tmp, path)
        except FileNotFoundError:
            return None
        except (FileExistsError, IsADirectoryError, NotADirectoryError) as exc:
            self._settle_taken_name(exc, key, path, None)
            return None
        self._fsync_dir(parent)
        return new_directory

    # -- reads -------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        with self._errors(key, "read"):
            fd = self._open_for_read(key)
            try:
                # Checked before ``open``: it raises IsADirectoryError for a directory's
                # descriptor without closing it, so the descriptor is ours to close, always.
                self._require_file(key, os.fstat(fd))
                with open(fd, "rb", closefd=False) as f:
                    return f.read()
            finally:
                os.close(fd)

    def _require_file(self, key: str, st: os.stat_result) -> None:
        """``ObjectNotFound`` unless ``st`` is a regular file: a FIFO, device, socket or
        directory planted under the root is not an object (reading ``/dev/zero`` never ends)."""
        if stat.S_ISDIR(st.st_mode):
            # The usual case: other objects' keys begin with ``key/`` (S3 has no object there
            # either), or a directory a delete left behind.
            raise ObjectNotFound(
                f"no object {key!r} in {self.url} (its path is a directory, which holds the "
                f"objects under {key + '/'!r} if there are any)"
            )
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFound(
                f"no object {key!r} in {self.url}: its path is not a regular file "
                f"({_file_kind(st.st_mode)}); remove whatever was planted there"
            )

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        # try/except rather than ``with self._errors(...)``: a consumer's steps are often single
        # ranges of this call, and the context manager costs a microsecond each.
        check_range(rng)
        try:
            fd = self._open_for_read(key)
            try:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode):  # inline: the consumer's per-step path
                    self._require_file(key, st)
                start, end = resolve_range(rng, st.st_size)
                data = os.pread(fd, end - start, start)
                if len(data) == end - start:  # the common case: one pread returns the range
                    return data
                chunks = [data]
                start += len(data)
                while data and start < end:
                    data = os.pread(fd, end - start, start)
                    chunks.append(data)
                    start += len(data)
                return b"".join(chunks)
            finally:
                os.close(fd)
        except StoreError:
            raise
        except OSError as exc:
            raise self._error(exc, key, "read") from exc

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        target = buffer.cast("B")
        filled = 0
        with self._errors(key, "read"):
            fd = self._open_for_read(key)
            try:
                self._require_file(key, os.fstat(fd))
                while filled < len(target):
                    n = os.preadv(fd, [target[filled:]], start + filled)
                    if n == 0:
                        break
                    filled += n
            finally:
                os.close(fd)
        return filled

    def map_range(self, key: str, start: int, end: int) -> memoryview | None:
        # Objects are never modified in place (a put links a new file), so a mapping cannot
        # shrink under a reader unless someone truncates files in the root by hand.
        if not 0 <= start <= end:
            raise ValueError(f"invalid range [{start}, {end})")
        with self._errors(key, "map"):
            fd = self._open_for_read(key)
            try:
                st = os.fstat(fd)
                self._require_file(key, st)
                size = st.st_size
                if min(end, size) <= start:
                    return memoryview(b"")
                mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
        return memoryview(mapped)[start : min(end, size)]

    def head(self, key: str) -> ObjectMeta:
        if self._proc_fd and _STAT_FLAGS:
            # As for reads: open (O_PATH: no permission or FIFO side effects), confine, fstat.
            path = self._lexical_path(key)
            with self._errors(key, "stat"):
                fd = self._open_confined(key, path, _STAT_FLAGS)
                try:
                    st = os.fstat(fd)
                finally:
                    os.close(fd)
        else:
            path = self._path(key)
            with self._errors(key, "stat"):
                st = os.stat(path)
        self._require_file(key, st)
        return ObjectMeta(key=key, size=st.st_size, last_modified=st.st_mtime)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        with self._errors(prefix, "list"):
            directory = prefix.rpartition("/")[0]
            try:
                fd = self._open_listed_dir(prefix, directory)
            except OSError as exc:
                if exc.errno in (*_NOT_A_DIRECTORY_ERRNOS, errno.ENAMETOOLONG):
                    return  # missing, a file, a symlink where none is followed, or no name
                raise
            if fd is None:
                return
            yield from self._walk(fd, directory + "/" if directory else "", prefix, start_after)

    def _open_listed_dir(self, prefix: str, directory: str) -> int | None:
        """Open the directory holding every key ``prefix`` can begin: its path up to a ``/``.

        Opened and confined like a read's file, so a namespace reached through a symlink inside
        the root lists as it reads and writes; the walk below it never follows one. None when
        no key can begin with ``prefix`` (an empty or ``..`` segment, the reserved directory).
        """
        if not directory:
            return _open_dir(self._root)
        try:
            path = self._lexical_path(directory)
        except InvalidKey:
            return None
        if not self._proc_fd:
            self._check_inside(prefix, path, os.path.realpath(path))
            return os.open(path, _DIR_FLAGS)
        return self._open_confined(prefix, path, _DIR_FLAGS)

    def _walk(
        self, fd: int, rel: str, prefix: str, start_after: str | None
    ) -> Iterator[ObjectMeta]:
        """List the objects in the directory open as ``fd`` (closed when done), ``rel`` its path.

        Each subdirectory is opened relative to ``fd`` without following a symlink, and entries
        are typed and stat'ed relative to it: a directory swapped for a symlink after the scan
        is skipped, never walked into (``scandir`` by path once listed the files it led to).
        """
        try:
            # Only names that can be or hold a wanted key are kept, then typed and sorted: a
            # listing after a key (``ManifestLog.latest`` in a directory of thousands of
            # versions) sorts the few names after it, not the whole directory.
            entries: list[tuple[str, os.DirEntry[str]]] = []
            with os.scandir(fd) as it:
                for entry in it:
                    path = rel + entry.name
                    if _may_hold(path, prefix, start_after) and not (
                        rel == "" and entry.name == TEMP_DIR_NAME
                    ):
                        entries.append((path, entry))
            # A directory sorts as "name/" among its siblings, which puts its keys in key order.
            sortable = []
            for path, entry in entries:
                is_dir = entry.is_dir(follow_symlinks=False)
                sortable.append((path + ("/" if is_dir else ""), is_dir, entry))
            sortable.sort(key=lambda t: t[0])
            for name, is_dir, entry in sortable:
                if is_dir:
                    if not (name.startswith(prefix) or prefix.startswith(name)):
                        continue
                    if (
                        start_after is not None
                        and start_after > name
                        and not start_after.startswith(name)
                    ):
                        continue  # every key under this directory is <= start_after
                    try:
                        sub = _open_dir(entry.name, dir_fd=fd)
                    except OSError as exc:
                        if exc.errno in _NOT_A_DIRECTORY_ERRNOS:
                            continue  # pruned, or replaced by a file or a symlink since the scan
                        raise
                    yield from self._walk(sub, name, prefix, start_after)
                    continue
                if not name.startswith(prefix) or (start_after is not None and name <= start_after):
                    continue
                # Decided from one lstat, not scandir's type and a later lstat: a file replaced
                # by a directory between the two would be listed as an object the size of a
                # directory.
                try:
                    st = entry.stat(follow_symlinks=False)
                except (FileNotFoundError, NotADirectoryError):
                    continue  # deleted since scandir (and maybe its directory pruned)
                if not stat.S_ISREG(st.st_mode):
                    continue
                yield ObjectMeta(key=name, size=st.st_size, last_modified=st.st_mtime)
        finally:
            os.close(fd)

    # -- deletes -----------------------------------------------------------------------------

    def delete_many(self, keys: Iterable[str]) -> None:
        # Every key is checked before any is deleted: an invalid one deletes nothing.
        keys = checked_keys(keys)
        # Descriptors of the root and of directories below it (``opened``: their names), kept
        # from one key's pruning to the next: a batch usually deletes keys of one directory.
        chain: list[int] = []
        opened: list[str] = []
        try:
            for key in keys:
                if self._proc_fd and _PUBLISH_AT:
                    path = self._lexical_path(key)
                    with self._errors(key, "delete"):
                        if not self._unlink_at(key, path):
                            continue
                else:
                    path = self._path(key)
                    with self._errors(key, "delete"):
                        try:
                            os.unlink(path)
                        except OSError as exc:
                            if exc.errno in _NO_SUCH_NAME_ERRNOS or (
                                isinstance(exc, PermissionError) and os.path.isdir(path)
                            ):
                                continue
                            raise
                if "/" not in key:
                    continue
                if not chain:
                    try:
                        chain.append(_open_dir(self._root))
                    except OSError:
                        continue  # gone, or a symlink: nothing of ours to prune
                _prune_empty_dirs(key, chain, opened)
        finally:
            for fd in chain:
                os.close(fd)

    def _unlink_at(self, key: str, path: str) -> bool:
        """Unlink ``path`` through a confined descriptor of its directory; False if absent.

        As for writes: a directory swapped for a symlink after the check cannot redirect the
        unlink to a file outside the root.
        """
        parent, name = os.path.split(path)
        try:
            dfd = self._open_confined(key, parent, _DIR_FLAGS)
        except OSError as exc:
            if exc.errno in _NO_SUCH_NAME_ERRNOS:
                return False
            raise
        try:
            self._refuse_escaping_link(key, path, dfd, name)
            os.unlink(name, dir_fd=dfd)
        except OSError as exc:
            if exc.errno in _NO_SUCH_NAME_ERRNOS or (
                isinstance(exc, PermissionError) and _is_dir_at(dfd, name)
            ):
                return False
            raise
        finally:
            os.close(dfd)
        return True


def _may_hold(name: str, prefix: str, start_after: str | None) -> bool:
    """Whether ``name`` (a file's key, or a directory's path without its ``/``) can be or hold
    a key listed for ``prefix`` and ``start_after``, decided without knowing which it is.

    A file's key is ``name``; a directory's keys all begin with ``name + "/"``. Either can match
    ``prefix`` only if one of ``name`` and ``prefix`` begins with the other, and can lie after
    ``start_after`` only if ``name`` sorts after it or begins it: otherwise they differ at a
    position inside ``name`` where ``name`` is lower, so the file and every key under the
    directory sort before ``start_after`` too. This keeps a superset of the names the walk lists
    or descends into; it checks each kept name exactly.
    """
    if not (name.startswith(prefix) or prefix.startswith(name)):
        return False
    return start_after is None or name > start_after or start_after.startswith(name)


def check_root(root: str | os.PathLike[str]) -> Path:
    """``root`` as a ``Path`` if it can name a file store root, else ``InvalidStoreURL``.

    Only the path itself is checked (absolute, no NUL byte, encodable as a file name): no file
    system access, so a process that only passes the root on (to DataLoader workers) can refuse
    a bad one up front.
    """
    root_path = Path(root)
    if not root_path.is_absolute():
        raise InvalidStoreURL(f"file store root {_show_root(root)} must be an absolute path")
    if "\x00" in str(root_path):
        raise InvalidStoreURL(f"file store root {_show_root(root)} contains a NUL byte")
    try:
        os.fsencode(root_path)
    except UnicodeEncodeError as exc:
        raise InvalidStoreURL(
            f"file store root {_show_root(root)} contains {exc.object[exc.start : exc.end]!r}, "
            "which no file name can hold (a lone surrogate); give the path as text or as bytes "
            "decoded with os.fsdecode"
        ) from None
    return root_path


def _use_root(path: Path) -> None:
    """Create the root ``path`` if missing; a store error naming it and the fix if it is unusable.

    An existing directory is used as it is (no write needed: a read-only root can be read).
    Every ``OSError`` becomes ``AccessDenied`` or ``InvalidStoreURL``.
    """
    shown = _show_root(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        pass  # missing (or a dangling symlink): created below
    except PermissionError as exc:
        raise AccessDenied(
            f"cannot reach file store root {shown}: {exc.strerror}; this user needs search (x) "
            "permission on every directory above it"
        ) from exc
    except OSError as exc:
        raise _unusable_root(path, exc) from exc
    else:
        if stat.S_ISDIR(st.st_mode):
            return
        raise InvalidStoreURL(
            f"file store root {shown} is {_file_kind(st.st_mode)}, not a directory; give the "
            "path of a directory (a missing one is created), or move the file away"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        if _refused(exc):
            raise AccessDenied(
                f"cannot create file store root {shown}: {exc.strerror}; create it with write "
                "permission for this user, or choose a path this user can create"
            ) from exc
        raise _unusable_root(path, exc) from exc


def _unusable_root(path: Path, exc: OSError) -> InvalidStoreURL:
    """Why the root ``path`` cannot be used (``exc``: the error stat or mkdir raised)."""
    shown = _show_root(path)
    if exc.errno == errno.ENAMETOOLONG:
        return InvalidStoreURL(
            f"file store root {shown} cannot be used: its path is too long for the file system "
            f"({len(os.fsencode(path))} bytes; a name between slashes may have at most "
            f"{_name_max(path)} bytes and the whole path at most {_PATH_MAX} on most Linux "
            "file systems); choose a shorter root"
        )
    try:
        blocker = _non_directory(str(path))
    except OSError:  # what stat said stays the reason (a symlink loop, an I/O error, ...)
        blocker = None
    if blocker is not None:
        where = "it" if blocker == str(path) else f"its ancestor {_show_root(blocker)}"
        return InvalidStoreURL(
            f"file store root {shown} cannot be used: {where} is not a directory "
            "(a file, or a symlink to nothing); give the path of a directory, or move the "
            "file away"
        )
    return InvalidStoreURL(
        f"file store root {shown} cannot be used ({exc.strerror}); {_NOT_A_ROOT_FIX}"
    )


_SHOWN_ROOT_CHARS = 200
"""Longer roots are shortened in messages: the start and end name the directory well enough."""
_PATH_MAX = 4096
"""Linux's limit on a path's bytes, for the message (the file system says what it enforces)."""


def _show_root(path: str | os.PathLike[str]) -> str:
    """``path`` quoted for a message, shortened in the middle if very long."""
    text = str(path)
    if len(text) <= _SHOWN_ROOT_CHARS:
        return repr(text)
    half = _SHOWN_ROOT_CHARS // 2
    return f"{text[:half]!r}...{text[-half:]!r} ({len(text)} characters)"


def _name_max(path: Path) -> int:
    """The longest name (bytes between slashes) the file system of ``path``'s existing
    ancestor allows, 255 if it cannot say."""
    for ancestor in path.parents:
        try:
            return os.pathconf(ancestor, "PC_NAME_MAX")
        except (OSError, ValueError):
            continue
    return 255


def _refused(exc: OSError) -> bool:
    """Whether ``exc`` means this user may not write there (permissions, a read-only mount)."""
    return isinstance(exc, PermissionError) or exc.errno == errno.EROFS


def _non_directory(path: str, *, stop: str | None = None) -> str | None:
    """The nearest of ``path`` and its ancestors (up to, not including, ``stop``) that exists
    but is not a directory, if any.

    One ``lstat`` per path (and a ``stat`` for a symlink): a directory pruned between two
    separate checks would otherwise look like a file in the way.
    """
    while path != stop:
        if _occupied_by_non_directory(path):
            return path
        parent = os.path.dirname(path)
        if parent == path:
            return None
        path = parent
    return None


def _occupied_by_non_directory(path: str) -> bool:
    """Whether ``path`` exists as a file, or a symlink not leading to a directory."""
    try:
        st = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(path)
        except OSError:
            return True  # a dangling link still holds the name
    return not stat.S_ISDIR(st.st_mode)


def _write_all(fd: int, parts: Sequence[bytes | memoryview]) -> None:
    """Write every byte of ``parts`` in order, in as few ``writev`` calls as the kernel allows."""
    views = [v for v in map(_byte_view, parts) if v.nbytes]
    first = 0  # views before this one are written
    while first < len(views):
        written = os.writev(fd, views[first : first + _IOV_MAX])
        while first < len(views) and written >= views[first].nbytes:
            written -= views[first].nbytes
            first += 1
        if written:
            views[first] = views[first][written:]


def _byte_view(part: bytes | memoryview) -> memoryview:
    """``part`` as a flat view of bytes; a copy only if it is not contiguous (``view[::2]``),
    which ``writev`` cannot take (S3 request bodies are copied with ``bytes`` the same way)."""
    view = memoryview(part)
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def _open_dir(name: str, *, dir_fd: int | None = None) -> int:
    """Open directory ``name`` (relative to ``dir_fd``), never through a symlink at ``name``.

    How the store steps into a directory without trusting a path: the temp directory, each
    directory a listing walks, each one a put creates, each parent a delete prunes. Raises
    an ``OSError`` with an errno of :data:`_NOT_A_DIRECTORY_ERRNOS` for a name that is gone,
    a file or a symlink.
    """
    return os.open(name, _NOFOLLOW_DIR_FLAGS, dir_fd=dir_fd)


def _prune_empty_dirs(key: str, chain: list[int], opened: list[str]) -> None:
    """Remove the directories of ``key`` that are empty, deepest first (best effort).

    Each is removed relative to its parent's descriptor (``unlinkat(AT_REMOVEDIR)``), the
    parents opened name by name from the root without following a symlink: a directory
    swapped for a symlink cannot lead the pruning outside the root, as ``rmdir`` of a path
    once did. ``chain`` holds the descriptors of the root and of the directories named by
    ``opened`` (each inside the one before), from the previous key; both are updated.
    """
    names = key.split("/")[:-1]  # a validated key: plain names
    keep = 0
    while keep < min(len(opened), len(names) - 1) and opened[keep] == names[keep]:
        keep += 1
    _close_below(chain, opened, keep)
    try:
        for name in names[keep:-1]:
            chain.append(_open_dir(name, dir_fd=chain[-1]))
            opened.append(name)
        for depth in range(len(names) - 1, -1, -1):
            os.rmdir(names[depth], dir_fd=chain[depth])
            _close_below(chain, opened, depth)  # the directory removed, and any in it
    except OSError:
        pass  # not empty, already gone, or a symlink (never walked or removed through)


def _close_below(chain: list[int], opened: list[str], depth: int) -> None:
    """Keep the root's descriptor and those of the first ``depth`` directories ``opened``;
    close the rest (see :func:`_prune_empty_dirs`)."""
    while len(opened) > depth:
        opened.pop()
        os.close(chain.pop())


def _unlink_quietly(path: str) -> None:
    with suppress(FileNotFoundError):
        os.unlink(path)


def _file_kind(mode: int) -> str:
    """What kind of file ``st_mode`` describes, for error messages."""
    for test, name in (
        (stat.S_ISREG, "a file"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"file type {stat.S_IFMT(mode):o}"


def _is_dir_at(dfd: int | None, name: str) -> bool:
    """Whether ``name`` in directory ``dfd`` (None: the path ``name``) is (or links to) a
    directory."""
    try:
        return stat.S_ISDIR(os.stat(name, dir_fd=dfd).st_mode)
    except OSError:
        return False

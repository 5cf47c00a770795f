"""``memory://name``: a process-local store for tests and examples."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import ClassVar

from batchweave._errors import ObjectExists, ObjectNotFound
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

__all__ = ["MemoryStore"]

_LIST_PAGE = 1000


class MemoryStore(ObjectStore):
    """Objects in a dict guarded by one lock.

    ``MemoryStore(name)`` is a private store whatever its name (the name only shows in its
    ``url``); the stores that :meth:`named` and ``open_store("memory://name")`` return share
    their contents with every other one of the same name in the process.
    """

    _registry: ClassVar[dict[str, MemoryStore]] = {}
    _registry_lock = threading.Lock()

    def __init__(self, name: str = "", *, clock: Callable[[], float] = time.time) -> None:
        """``clock`` (wall-clock seconds) stamps ``last_modified``; tests inject a fake one."""
        self.url = f"memory://{name}"
        self._clock = clock
        self._lock = threading.Lock()
        self._objects: dict[str, tuple[bytes, float]] = {}
        self._sorted_keys: list[str] = []

    @classmethod
    def named(cls, name: str) -> MemoryStore:
        """Return the shared store called ``name``, creating it on first use."""
        with cls._registry_lock:
            store = cls._registry.get(name)
            if store is None:
                store = cls._registry[name] = cls(name)
            return store

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        validate_key(key)
        check_mode(mode)
        payload = bytes(data)
        with self._lock:
            exists = key in self._objects
            if mode is PutMode.CREATE and exists:
                raise ObjectExists(f"object {key!r} already exists in {self.url}")
            if not exists:
                bisect.insort(self._sorted_keys, key)
            self._objects[key] = (payload, self._clock())

    def _entry(self, key: str) -> tuple[bytes, float]:
        validate_key(key)
        with self._lock:
            entry = self._objects.get(key)
        if entry is None:
            raise ObjectNotFound(f"no object {key!r} in {self.url}")
        return entry

    def get(self, key: str) -> bytes:
        return self._entry(key)[0]

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        check_range(rng)
        data = self._entry(key)[0]
        start, end = resolve_range(rng, len(data))
        return data[start:end]

    def head(self, key: str) -> ObjectMeta:
        data, mtime = self._entry(key)
        return ObjectMeta(key=key, size=len(data), last_modified=mtime)

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        cursor = max(prefix, start_after) if start_after is not None else prefix
        inclusive = start_after is None or start_after < prefix
        while True:
            with self._lock:
                if inclusive:
                    i = bisect.bisect_left(self._sorted_keys, cursor)
                else:
                    i = bisect.bisect_right(self._sorted_keys, cursor)
                page = [
                    ObjectMeta(
                        key=k, size=len(self._objects[k][0]), last_modified=self._objects[k][1]
                    )
                    for k in self._sorted_keys[i : i + _LIST_PAGE]
                    if k.startswith(prefix)
                ]
            if not page:
                return
            yield from page
            cursor, inclusive = page[-1].key, False

    def delete_many(self, keys: Iterable[str]) -> None:
        # Every key is checked before any is deleted: an invalid one deletes nothing.
        for key in checked_keys(keys):
            with self._lock:
                if self._objects.pop(key, None) is not None:
                    i = bisect.bisect_left(self._sorted_keys, key)
                    del self._sorted_keys[i]

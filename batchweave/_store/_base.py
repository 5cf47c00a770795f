"""The object-store seam: one small interface every backend implements.

The rest of BatchWeave talks to storage only through :class:`ObjectStore`. It knows nothing of
manifests or TGBs; the commit protocol knows nothing of boto3. Conditional creation is a typed
:class:`PutMode`, never a boolean, and backends must implement it natively (an atomic primitive
of the store), never as check-then-set.
"""

from __future__ import annotations

import abc
import enum
import operator
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from batchweave._errors import InvalidKey

__all__ = [
    "Bounded",
    "ByteRange",
    "ObjectMeta",
    "ObjectStore",
    "Offset",
    "PutMode",
    "Suffix",
    "check_keys",
    "check_mode",
    "check_range",
    "check_store",
    "checked_keys",
    "validate_key",
]


class PutMode(enum.Enum):
    """How :meth:`ObjectStore.put` treats an existing object under the key."""

    OVERWRITE = "overwrite"
    """Replace whatever is there (plain PUT)."""

    CREATE = "create"
    """Create only if absent (``If-None-Match: *``); raise ``ObjectExists`` otherwise."""


@dataclass(frozen=True)
class ObjectMeta:
    """What a store knows about one object without reading it."""

    key: str
    size: int
    last_modified: float
    """Seconds since the epoch (UTC)."""
    etag: str | None = None


@dataclass(frozen=True)
class Bounded:
    """Bytes ``[start, end)`` of an object. ``end`` past the object's size is clamped."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if type(self.start) is not int or type(self.end) is not int:  # bool (an int subclass) too
            _set_offsets(self, "start", "end")
        if self.start < 0 or self.end < self.start:
            raise ValueError(f"invalid byte range [{self.start}, {self.end})")


@dataclass(frozen=True)
class Offset:
    """Bytes from ``start`` to the end of the object."""

    start: int

    def __post_init__(self) -> None:
        if type(self.start) is not int:  # bool (an int subclass) too
            _set_offsets(self, "start")
        if self.start < 0:
            raise ValueError(f"invalid range offset {self.start}")


@dataclass(frozen=True)
class Suffix:
    """The last ``length`` bytes of the object (all of it if shorter)."""

    length: int

    def __post_init__(self) -> None:
        if type(self.length) is not int:  # bool (an int subclass) too
            _set_offsets(self, "length")
        if self.length <= 0:
            raise ValueError(f"suffix length must be positive, got {self.length}")


def _set_offsets(rng: object, *fields: str) -> None:
    """Make the byte offsets ``fields`` of the range ``rng`` plain ints, or raise ``TypeError``.

    Integers of any type ``operator.index`` takes (NumPy's included) become ``int``, so every
    backend sees the same value; ``bool`` and non-integers (``1.0``, ``"3"``) are refused here,
    where the range is built, instead of failing differently in each backend's request.
    """
    for name in fields:
        value = getattr(rng, name)
        if isinstance(value, bool) or not hasattr(type(value), "__index__"):
            raise TypeError(
                f"{type(rng).__name__}.{name} must be an int, got {type(value).__name__} {value!r}"
            )
        object.__setattr__(rng, name, operator.index(value))  # frozen dataclass


ByteRange = Bounded | Offset | Suffix
_RANGE_TYPES = (Bounded, Offset, Suffix)


def check_range(rng: object) -> None:
    """Refuse anything but a :data:`ByteRange` with a ``TypeError`` naming the range types.

    Every backend's ``get_range`` calls it before any request: a tuple such as ``(0, 3)`` would
    otherwise fail deep inside with ``'tuple' object has no attribute 'length'``.
    """
    if not isinstance(rng, _RANGE_TYPES):
        raise TypeError(
            f"a byte range must be a Bounded, Offset or Suffix, got the {type(rng).__name__} "
            f"{rng!r}; e.g. get_range(key, Bounded(0, 3)) for bytes [0, 3)"
        )


def resolve_range(rng: ByteRange, size: int) -> tuple[int, int]:
    """Return the absolute ``[start, end)`` that ``rng`` selects in an object of ``size`` bytes."""
    if isinstance(rng, Bounded):
        return min(rng.start, size), min(rng.end, size)
    if isinstance(rng, Offset):
        return min(rng.start, size), size
    check_range(rng)  # a custom store may resolve without checking first
    return max(0, size - rng.length), size


def check_keys(keys: object) -> None:
    """Refuse a ``delete_many`` argument that is not an iterable of keys, with a ``TypeError``.

    A single key (``delete_many("ab")``) is refused, not iterated: its characters would be
    deleted as the one-character keys ``"a"`` and ``"b"``. Every backend's ``delete_many`` calls
    it first; the keys themselves are checked by :func:`validate_key`.
    """
    if isinstance(keys, str | bytes | bytearray | memoryview):
        raise TypeError(
            f"delete_many takes an iterable of keys, got the single {type(keys).__name__} "
            f"{keys!r}; pass a list of keys, e.g. delete_many([key])"
        )
    try:
        iter(keys)  # type: ignore[call-overload]  # the same iterator for a generator: no item read
    except TypeError:
        raise TypeError(
            f"delete_many takes an iterable of keys, got the {type(keys).__name__} {keys!r}; "
            "pass a list of keys, e.g. delete_many([key])"
        ) from None


def check_mode(mode: object) -> None:
    """Refuse a ``put`` ``mode`` that is not a :class:`PutMode` with a ``TypeError`` naming it.

    Every backend's ``put`` and ``put_parts`` call it before anything is written: ``"create"``,
    ``True`` or ``None`` would otherwise read as "not ``PutMode.CREATE``" and silently overwrite
    the object a caller meant to create only if absent.
    """
    if not isinstance(mode, PutMode):
        raise TypeError(
            f"put's mode must be a PutMode, got the {type(mode).__name__} {mode!r}; pass "
            "mode=PutMode.CREATE (create if absent) or mode=PutMode.OVERWRITE"
        )


def checked_keys(keys: object) -> list[str]:
    """The keys of a ``delete_many`` argument as a list, every one validated, or an error.

    :func:`check_keys` first, then :func:`validate_key` on each key: the iterable is read once
    (a generator too) and nothing is deleted unless every key is valid, so one invalid key
    never leaves a batch half deleted.
    """
    check_keys(keys)
    return [validate_key(key) for key in keys]  # type: ignore[attr-defined]


_FORBIDDEN_CHAR = re.compile(r"[\x00-\x1f\x7f\\\ud800-\udfff\ufffe\uffff]")
"""Characters no key may contain: control characters (NUL, tab, newline, DEL, ...), the
backslash, lone surrogates (not encodable as UTF-8, so no S3 key) and U+FFFE/U+FFFF. S3's XML
listings and bulk deletes cannot carry the control and non-characters, and obstore refuses
control characters outright, so such a key would work on one backend and fail on another."""


def validate_key(key: str) -> str:
    """Return ``key`` if it is a safe relative object key, else raise :class:`InvalidKey`.

    Keys are ``/``-separated relative paths. Refused: a non-string or empty key, an absolute key
    (leading ``/``), empty, ``.`` or ``..`` segments (``a//b``, ``a/``, ``../x``), control
    characters (NUL, tab, newline, DEL, ...), backslashes, lone surrogates (not encodable as
    UTF-8) and U+FFFE/U+FFFF. Everything else is legal (spaces, unicode, punctuation).

    Why: every backend refuses the same keys, so a key that works on one backend works on all,
    and no key can escape a ``file://`` root or a store's S3 prefix. S3's XML listings and bulk
    deletes cannot carry control characters or non-characters, obstore refuses control
    characters, and ``..`` or a backslash would name a path outside the root on a file system.

    A custom :class:`ObjectStore` should call it on every key it is given, before any request
    (it returns the key, so ``self.prefix + validate_key(key)`` works): the conformance suite
    (:class:`batchweave.testing.StoreTests`) checks that every method refuses these keys with
    :class:`InvalidKey`, a ``ValueError``.
    """
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"object key must be a non-empty string, got {key!r}")
    bad = _FORBIDDEN_CHAR.search(key)
    if bad is not None:
        raise InvalidKey(
            f"object key {key!r} contains the forbidden character {bad.group()!r}; keys may not "
            "hold control characters, backslashes or invalid unicode"
        )
    if key.startswith("/"):
        raise InvalidKey(f"object key {key!r} is absolute; keys are relative to the store root")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise InvalidKey(
                f"object key {key!r} has an empty, '.' or '..' segment; use plain relative paths"
            )
    return key


class ObjectStore(abc.ABC):
    """A flat key -> bytes store with atomic create-if-absent.

    Implementations must be safe to call from many threads at once. Errors are always leaves of
    :class:`batchweave.StoreError`; backend exceptions never leak.
    """

    url: str
    """The store's URL, without credentials (safe to log)."""

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        """Write ``data`` under ``key``. With ``PutMode.CREATE``, raise ``ObjectExists`` if taken.

        Readers see either the whole new object or none of it.
        """

    def put_parts(
        self,
        key: str,
        parts: Sequence[bytes | memoryview],
        *,
        mode: PutMode = PutMode.OVERWRITE,
    ) -> None:
        """Write the concatenation of ``parts`` under ``key``, exactly like :meth:`put`.

        Producers hold a TGB as its slices, footer and trailer; joining them into one buffer
        first costs a copy of the whole object. This default joins and calls :meth:`put` (what
        an S3 request body needs anyway); stores that can write several buffers at once
        (``file://`` through ``writev``) override it. Wrappers inherit this default, so a
        wrapper that intercepts ``put`` sees these writes too.
        """
        self.put(key, parts[0] if len(parts) == 1 else b"".join(map(_joinable, parts)), mode=mode)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        """Create ``key`` only if no object exists there; raise ``ObjectExists`` otherwise."""
        self.put(key, data, mode=PutMode.CREATE)

    @abc.abstractmethod
    def get(self, key: str) -> bytes:
        """Return the whole object; raise ``ObjectNotFound`` if absent."""

    @abc.abstractmethod
    def get_range(self, key: str, rng: ByteRange) -> bytes:
        """Return the bytes ``rng`` selects, clamped to the object; ``ObjectNotFound`` if absent."""

    def get_range_into(self, key: str, start: int, buffer: memoryview) -> int:
        """Read the object's bytes from ``start`` into ``buffer``; return how many were read.

        ``buffer`` is filled byte by byte whatever its item type (a view of an ``array`` of
        ``uint32`` takes ``nbytes`` bytes). Fewer than ``buffer.nbytes`` only when the object
        ends first. Large reads use it to land
        in one preallocated buffer without an intermediate copy; this default reads with
        :meth:`get_range` and copies, stores that can read into memory directly override it.
        """
        view = memoryview(buffer)
        # Bytes, whatever the item type (nbytes, not len); a strided view of bytes as it is.
        target = view.cast("B") if view.c_contiguous else view
        data = self.get_range(key, Bounded(start, start + target.nbytes))
        target[: len(data)] = data
        return len(data)

    def map_range(self, key: str, start: int, end: int) -> memoryview | None:
        """A read-only view of bytes ``[start, end)`` mapped from the store without a copy.

        ``None`` means this store cannot map objects (the default; S3 cannot): read with
        :meth:`get_range` or :meth:`get_range_into` instead. A store that maps (``file://``
        through ``mmap``) clamps the range to the object like ``get_range``. The view stays
        valid after the object is deleted; it keeps the mapping alive until released.
        """
        return None

    @abc.abstractmethod
    def head(self, key: str) -> ObjectMeta:
        """Return the object's metadata; raise ``ObjectNotFound`` if absent."""

    @abc.abstractmethod
    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        """Yield objects whose key starts with ``prefix``, in lexicographic key order.

        Only keys strictly greater than ``start_after`` are yielded. Pages are fetched lazily, so
        stopping early costs only the pages read.
        """

    @abc.abstractmethod
    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete every key; keys that do not exist are ignored (deletion is idempotent)."""

    def close(self) -> None:  # noqa: B027 - optional hook, most backends hold nothing
        """Release connections or handles. The store must not be used afterwards."""

    def __enter__(self) -> ObjectStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"


def _joinable(part: bytes | memoryview) -> bytes | memoryview:
    """``part`` as ``bytes.join`` takes it: a view that is not contiguous (``view[::2]``),
    which it refuses, as its bytes (a copy, as ``put`` stores it)."""
    if isinstance(part, bytes) or memoryview(part).c_contiguous:
        return part
    return bytes(part)


def check_store(store: object) -> None:
    """Refuse anything but an opened :class:`ObjectStore` with a ``TypeError``.

    A store URL or path (the common mistake) gets a message saying how to open it: without this
    a URL string fails deep inside with ``'str' object has no attribute ...``.
    """
    if isinstance(store, ObjectStore):
        return
    if isinstance(store, str | bytes | os.PathLike):
        raise TypeError(
            f"expected an opened store, got the {type(store).__name__} {store!r}; open it "
            "first (store = batchweave.open_store(url)) and pass the store"
        )
    raise TypeError(
        f"expected an opened store (a batchweave.ObjectStore), got the {type(store).__name__} "
        f"{store!r}; open one with batchweave.open_store(url)"
    )

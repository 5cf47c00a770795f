"""``open_store(url)``: pick a backend by URL scheme and check that it is safe to commit on."""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from batchweave._errors import (
    AccessDenied,
    AmbiguousWriteError,
    ConditionalWritesUnsupported,
    InvalidStoreURL,
    ObjectExists,
    ObjectNotFound,
    StoreError,
    StoreUnavailable,
    TransientStoreError,
)
from batchweave._store._base import ObjectStore, check_store
from batchweave._store._file import FileStore, check_root
from batchweave._store._memory import MemoryStore
from batchweave._store._obstore import ObstoreS3Store
from batchweave._store._s3 import S3Store
from batchweave._store._s3_location import (
    S3Location,
    check_s3_arguments,
    has_url_credentials,
    redact_url,
    refuse_url_credentials,
)

__all__ = [
    "PROBE_FIRST",
    "PROBE_PREFIX",
    "PROBE_SECOND",
    "SCHEMES",
    "check_store_url",
    "ensure_conditional_writes",
    "open_store",
    "probe_conditional_writes",
    "store_url_scheme",
]

_log = logging.getLogger("batchweave.store")

PROBE_PREFIX = "_batchweave/probe-"
"""Keys of the conditional-write probe objects (deleted right after the probe)."""

SCHEMES = ("file", "s3", "memory")
"""URL schemes ``open_store`` serves."""

S3_CLIENTS = ("boto3", "obstore")
"""Backends ``open_store`` can use for ``s3://``: boto3 (the default) or obstore (optional)."""


def _keyword_options(factory: Callable[..., Any], *, exclude: tuple[str, ...] = ()) -> list[str]:
    params = inspect.signature(factory).parameters.values()
    return sorted(
        p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in exclude
    )


_OPTIONS: dict[str, list[str]] = {
    "file": _keyword_options(FileStore),
    "s3": _keyword_options(S3Store, exclude=("client",)),
    "s3+obstore": _keyword_options(ObstoreS3Store),
    "memory": [],
}


def open_store(
    url: str, *, verify_conditional_writes: bool = True, s3_client: str = "boto3", **options: Any
) -> ObjectStore:
    """Open the store at ``url``: ``file:///abs/path``, ``s3://bucket/prefix`` or ``memory://name``.

    ``options`` go to the backend (for S3: ``endpoint_url``, ``region``, credentials,
    ``profile``, pool size, timeouts, ``max_attempts``; for files: ``fsync``); an unknown option
    raises ``InvalidStoreURL`` naming the accepted ones. ``memory://name`` returns the process-wide
    store of that name. A missing ``file://`` root directory is created. ``s3_client="obstore"``
    serves ``s3://`` with :class:`ObstoreS3Store` (``pip install 'batchweave[obstore]'``):
    several times boto3's small-GET rate at less CPU per request (``docs/benchmarks.md``).

    With ``verify_conditional_writes`` (the default) the store is probed once: a second
    create-if-absent of a fresh probe key must fail, else ``ConditionalWritesUnsupported`` is
    raised. The probe also surfaces missing credentials (``AccessDenied``), an unreachable
    endpoint (``StoreUnavailable``) and a missing bucket (``InvalidStoreURL``) here rather than
    at the first commit.
    """
    store = _construct(url, options, s3_client)
    if verify_conditional_writes:
        try:
            ensure_conditional_writes(store)
        except BaseException:
            store.close()
            raise
    return store


@dataclass(frozen=True)
class _Target:
    """Where a checked store URL points: the backend ``kind`` and its location."""

    kind: str
    """A key of ``_OPTIONS``: ``file``, ``s3``, ``s3+obstore`` or ``memory``."""
    location: str
    """The file root, the memory store's name, or the bucket."""
    prefix: str = ""
    """The S3 prefix, unquoted (``%20`` is a space)."""


def _parse(url: str, options: dict[str, Any], s3_client: str) -> _Target:
    """Check ``url`` and the option names (no I/O) and say which backend serves it where."""
    if s3_client not in S3_CLIENTS:
        raise ValueError(f"unknown s3_client {s3_client!r}; expected one of {S3_CLIENTS}")
    if not isinstance(url, str) or "://" not in url:
        raise InvalidStoreURL(_missing_slashes(url))
    shown = redact_url(url)  # messages never echo credentials or a query
    _refuse_control_characters(url, shown)
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket: s3://[::1/prefix
        # Some of these errors quote the netloc, which may hold credentials.
        detail = "" if has_url_credentials(url) else f" ({exc})"
        raise InvalidStoreURL(
            f"store URL {shown!r} is malformed{detail}; use file:///absolute/path, "
            "s3://bucket/prefix or memory://name"
        ) from None
    scheme = parts.scheme.lower()
    if scheme not in SCHEMES:
        raise InvalidStoreURL(
            f"store URL {shown!r} has the unsupported scheme {parts.scheme!r}; "
            f"supported: {', '.join(s + '://' for s in SCHEMES)}"
        )
    if scheme == "s3":
        # Before anything reads the netloc: a secret holding '/', '?' or '#' ends it early,
        # leaving the rest of the credentials in the bucket, the prefix or the query.
        refuse_url_credentials(url, "store URL")
    if parts.query or parts.fragment:
        raise InvalidStoreURL(
            f"store URL {shown!r} has a query or fragment; pass options as keyword arguments"
        )
    kind = "s3+obstore" if scheme == "s3" and s3_client == "obstore" else scheme
    unknown = sorted(set(options) - set(_OPTIONS[kind]))
    if unknown:
        accepted = ", ".join(_OPTIONS[kind]) or "none"
        raise InvalidStoreURL(
            f"unknown option(s) {', '.join(unknown)} for {scheme}:// stores"
            f"{' on obstore' if kind == 's3+obstore' else ''}; accepted: {accepted}"
        )
    if scheme == "memory":
        return _Target(kind, parts.netloc + parts.path)
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise InvalidStoreURL(
                f"file URL {shown!r} names host {urlsplit(shown).netloc!r}; relative paths are not "
                "supported, use file:///absolute/path (three slashes)"
            )
        # Undecodable %XX bytes (a non-UTF-8 directory name, as Path.as_uri writes it) stay
        # those bytes, not U+FFFD: that would name another directory.
        path = unquote(parts.path, errors="surrogateescape")
        if not path.startswith("/"):
            raise InvalidStoreURL(f"file URL {shown!r} needs an absolute path: file:///abs/path")
        return _Target(kind, path)
    if not parts.netloc:
        raise InvalidStoreURL(f"S3 URL {shown!r} has no bucket; use s3://bucket/prefix")
    return _Target(kind, parts.netloc, _unquote_prefix(parts.path, shown))


_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")


def _refuse_control_characters(url: str, shown: str) -> None:
    """``InvalidStoreURL`` if ``url`` holds a control character (``shown``: ``url`` redacted).

    ``urlsplit`` silently deletes tabs and newlines anywhere in a URL (``s3://b/run\t1`` would
    be the prefix ``run1/``) and strips other control characters from its ends, so the store
    would live somewhere else than the URL says. The message gives the character's position,
    not the text around it, which may be credentials.
    """
    bad = _CONTROL_CHARACTER.search(url)
    if bad is None:
        return
    char = bad.group()
    escape = (
        f"; a directory name that really holds it is written %{ord(char):02X}"
        if url.lstrip().lower().startswith("file:")
        else ""
    )
    raise InvalidStoreURL(
        f"store URL {shown!r} contains the control character {char!r} (U+{ord(char):04X}) at "
        f"position {bad.start()} of {len(url)} characters (URL parsing would drop or misread "
        "it, and the store would be somewhere else); remove it (often a pasted tab, or the "
        f"newline ending a line read from a file){escape}"
    )


def _unquote_prefix(path: str, shown: str) -> str:
    """The S3 prefix ``path`` of a URL unquoted; ``InvalidStoreURL`` for a %-escape not UTF-8.

    S3 keys are UTF-8 text; ``unquote``'s default would silently turn ``%FF`` into U+FFFD, and
    the store would live under another prefix than the URL says.
    """
    try:
        return unquote(path, errors="strict")
    except UnicodeDecodeError as exc:  # exc.object: the bytes of the run of escapes
        bad = "".join(f"%{byte:02X}" for byte in exc.object[exc.start : exc.end])
        raise InvalidStoreURL(
            f"S3 URL {shown!r} has a %-escape that is not UTF-8 ({bad}); S3 keys are UTF-8 "
            "text: escape each character's UTF-8 bytes (%C3%A9 for \u00e9)"
        ) from None


def _construct(url: str, options: dict[str, Any], s3_client: str) -> ObjectStore:
    target = _parse(url, options, s3_client)
    if target.kind == "memory":
        return MemoryStore.named(target.location)
    if target.kind == "file":
        return FileStore(target.location, **options)
    # The backends check what they get too, but skip credentials and region for an injected
    # client (which ignores them); an unusable value is refused here all the same.
    _check_s3(target, options)
    if target.kind == "s3+obstore":
        return ObstoreS3Store(target.location, target.prefix, **options)
    return S3Store(target.location, target.prefix, **options)


def check_store_url(url: str, *, s3_client: str = "boto3", **options: Any) -> None:
    """Raise what ``open_store(url, s3_client=..., **options)`` would for the URL or an option.

    Nothing is opened: no file is touched, no request is sent, no credentials are resolved.
    For code that passes a URL on to where the store is opened (``WeaveDataset`` to its
    DataLoader workers), so a bad scheme, an unknown option or an invalid option value
    (``InvalidStoreURL``) fails where the URL was given. What only the store can tell (a missing
    bucket, wrong credentials, an unusable root directory) still surfaces when it is opened.
    """
    target = _parse(url, options, s3_client)
    if target.kind == "file":
        check_root(target.location)
    elif target.kind != "memory":
        _check_s3(target, options)


def _check_s3(target: _Target, options: dict[str, Any]) -> None:
    """What ``S3Location.__init__`` checks for both backends (and the region), without a client."""
    factory = S3Store if target.kind == "s3" else ObstoreS3Store
    given = inspect.signature(factory).bind(target.location, target.prefix, **options)
    given.apply_defaults()
    value = given.arguments
    check_s3_arguments(
        value["bucket"],
        value["prefix"],
        **{name: value[name] for name in _S3_CHECKED if name in value},
    )


_S3_CHECKED = tuple(
    name
    for name in inspect.signature(check_s3_arguments).parameters
    if name not in ("bucket", "prefix")
)
"""The S3 backends' arguments :func:`check_s3_arguments` takes (all but the location)."""


def store_url_scheme(url: str) -> str:
    """The scheme ``open_store`` reads in ``url`` (``file``, ``s3`` or ``memory``).

    As its parser reads it (``MEMORY://x`` and `` memory://x`` are ``memory``); raises
    ``InvalidStoreURL`` for a URL ``open_store`` would refuse. Nothing is opened.
    """
    return _parse(url, {}, S3_CLIENTS[0]).kind


def _missing_slashes(url: object) -> str:
    """Why ``url`` (without ``://``) is not a store URL, with the URL the user probably meant."""
    usage = "use file:///absolute/path, s3://bucket/prefix or memory://name"
    if not isinstance(url, str):
        return f"store URL must be a str, got {type(url).__name__}; {usage}"
    scheme, colon, rest = url.partition(":")
    if colon and scheme.lower() in SCHEMES:
        # Credentials (s3:key:secret@bucket) are masked as in a URL with its slashes.
        shown = redact_url(url, authority_at=len(url) - len(rest.lstrip("/")))
        if scheme.lower() == "file":
            if not rest.startswith("/"):
                return f"file URL {shown!r} needs an absolute path: file:///absolute/path"
            meant = f"file://{rest}"  # rest is '/abs/path': no '://' got us here
        else:
            meant = f"{scheme}://{rest.lstrip('/')}"
        return (
            f"store URL {shown!r} is missing slashes after '{scheme}:'; did you mean "
            f"{redact_url(meant)!r}?"
        )
    if url.startswith("/"):
        return f"store URL {url!r} has no scheme; for a local directory use 'file://{url}'"
    return f"store URL {redact_url(url)!r} has no scheme; {usage}"


def _read_back_probe(store: ObjectStore, key: str, ambiguous: AmbiguousWriteError) -> None:
    """Resolve an ambiguous probe create by reading it back, as the error says to do.

    If it landed, the probe goes on. If the read fails too, its error names the real problem (an
    endpoint that refuses connections, missing credentials) rather than an ambiguity the user
    can do nothing about; if the probe is simply absent, the ambiguity stands.
    """
    try:
        store.head(key)
    except ObjectNotFound:
        raise ambiguous from None
    except StoreError as exc:
        raise exc from ambiguous


PROBE_FIRST, PROBE_SECOND = b"probe-1", b"probe-2"
"""The bodies of the probe's first and second create of its key."""


def _refuse_a_non_store(store: ObjectStore, key: str) -> None:
    """``StoreError`` if ``store`` does not give back what the probe wrote to ``key``.

    Called when a second create-if-absent succeeded. An endpoint that is no object store at
    all (a web server or dashboard on that port answering 200 to everything) also "accepts" it;
    telling its owner to upgrade the store would send them the wrong way.
    """
    try:
        data = store.get(key)
    except StoreError as exc:
        detail = f"reading it back failed: {exc}"
    else:
        if data == PROBE_SECOND:
            return
        detail = f"reading it back gave {len(data)} other bytes ({bytes(data[:40])!r})"
    raise StoreError(
        f"{store!r} does not behave like an object store: it accepted two creates of the "
        f"probe object {key!r}, and {detail}. Check that the endpoint is the object store's "
        "API address (scheme, host and port), not a web page or proxy in front of it"
    )


_verified: dict[int, weakref.ref[ObjectStore]] = {}
"""The stores ``ensure_conditional_writes`` has verified: ``id(store)`` -> a weak reference.

Keyed by identity, not by hash: a store may be unhashable (a ``@dataclass`` with ``eq``) or
define ``__eq__`` so that two stores compare equal, and each instance is probed once either way.
A lookup checks that the reference still leads to the store (an ``id`` is reused after its
object dies); the reference's callback drops the entry, so nothing keeps a store alive."""
_verified_lock = threading.Lock()

SLOW_PROBE_NOTICE = 10.0
"""Seconds without an answer to the probe after which ``ensure_conditional_writes`` says so.

An S3 store's probe waits at most ``probe_timeout`` (10 s) for each answer and fails at the
first request that got none, but a slow server may take almost that long for each of the
probe's requests, and other stores (a ``file://`` root on a hung network mount, an injected
boto3 client) wait as long as they do; the warning tells the user that ``open_store`` is
waiting and for what, instead of leaving them at a silent prompt.
"""


@contextlib.contextmanager
def _notice_if_slow(store: ObjectStore, key: str) -> Iterator[None]:
    """Log one warning if the block is still running after :data:`SLOW_PROBE_NOTICE` seconds."""
    timer = threading.Timer(
        SLOW_PROBE_NOTICE,
        _log.warning,
        args=(
            "%s has not answered the conditional-write probe (%r) for %g s; still waiting. An "
            "S3 endpoint gets probe_timeout seconds per answer (plus connect_timeout and "
            "retries for a connection); other stores their own timeouts: check the store URL "
            "and endpoint",
            store.url,
            key,
            SLOW_PROBE_NOTICE,
        ),
    )
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def ensure_conditional_writes(store: ObjectStore) -> None:
    """Check once per store instance that create-if-absent is really enforced.

    Creates ``_batchweave/probe-{uuid}`` twice; the second create must raise ``ObjectExists``.
    Raises ``ConditionalWritesUnsupported`` otherwise, since committing manifests on a store that
    silently ignores ``If-None-Match`` would lose data. The probe object is deleted afterwards.

    An S3 store (either backend) is probed through a copy of its client that waits at most its
    ``probe_timeout`` for each answer and retries no request that got none: an endpoint that
    accepts connections but never answers raises ``StoreUnavailable`` saying so within about
    ``probe_timeout`` (plus the connect time), not after ``read_timeout`` x ``max_attempts``.
    """
    check_store(store)  # a URL string: open_store(url) probes it already
    with _verified_lock:
        ref = _verified.get(id(store))
        if ref is not None and ref() is store:
            return
    key = f"{PROBE_PREFIX}{uuid.uuid4().hex}"
    probe_conditional_writes(store, key, delete=True)
    _remember_verified(store)


def _remember_verified(store: ObjectStore) -> None:
    """Note that ``store`` passed the probe, without keeping it alive.

    Every ``ObjectStore`` can be weakly referenced: the base class has no ``__slots__``.
    """
    ident = id(store)

    def forget(ref: weakref.ref[ObjectStore]) -> None:
        # Runs when the store dies, possibly from the garbage collector in a thread holding
        # the lock: no lock here. Only this store's entry is dropped, never a later store's
        # that reuses the id (a stale entry would only cost that store a second probe).
        if _verified.get(ident) is ref:
            _verified.pop(ident, None)

    ref = weakref.ref(store, forget)
    with _verified_lock:
        _verified[ident] = ref


def probe_conditional_writes(store: ObjectStore, key: str, *, delete: bool) -> None:
    """Create ``key`` twice; raise ``ConditionalWritesUnsupported`` if the second create succeeds.

    What :func:`ensure_conditional_writes` does, without its once-per-store cache, for callers
    that report on a store (``batchweave check``). An S3 store is probed through its probe client
    (``probe_timeout``); a WARNING says so if no answer comes for :data:`SLOW_PROBE_NOTICE`
    seconds. With ``delete``, ``key`` is deleted afterwards, but not after ``StoreUnavailable``:
    an endpoint that is unreachable, or did not answer within the probe's timeout, would only
    keep the caller waiting as long again. Nor if the store refused the first create (a missing
    bucket, no permission, an endpoint that is not an S3 server), or refused to read back a first
    create whose outcome was unknown: then there is no probe object, or no store, to delete from.
    """
    view = store._probe_view() if isinstance(store, S3Location) else None
    target = store if view is None else view
    unavailable = False
    refused = False
    try:
        with _notice_if_slow(store, key):
            try:
                target.put_if_absent(key, PROBE_FIRST)
            except ObjectExists:
                pass  # our own retried first attempt landed: all the probe needs
            except AmbiguousWriteError as exc:
                try:
                    _read_back_probe(target, key, exc)
                except StoreError as failed:
                    # A plain StoreError: the read-back was refused outright (an endpoint that
                    # is not an S3 server); a delete would be too, its warning only repeating it.
                    refused = type(failed) is StoreError
                    raise
            except (TransientStoreError, StoreUnavailable):
                raise  # the create may have landed (or the store is out of reach: see below)
            except AccessDenied as exc:
                refused = True
                raise AccessDenied(
                    f"{exc} (open_store checks that conditional writes are enforced by creating "
                    f"{key!r}; a process that only reads, such as a consumer rank, may skip "
                    "that check: open_store(url, verify_conditional_writes=False))"
                ) from exc
            except StoreError:
                # A definite refusal: a missing bucket, or an endpoint that did not answer like an
                # S3 server (a web server's 405 to a PUT, a 501): no probe object to delete.
                refused = True
                raise
            _create_second(target, key)
    except StoreUnavailable:
        unavailable = True
        raise
    finally:
        if delete and not unavailable and not refused:
            try:
                target.delete_many([key])
            except StoreError as exc:
                _log.warning("could not delete the probe object %r in %s: %s", key, store.url, exc)
        if view is not None:
            view.close()


def _create_second(store: ObjectStore, key: str) -> None:
    try:
        store.put_if_absent(key, PROBE_SECOND)
    except ObjectExists:
        pass
    else:
        _refuse_a_non_store(store, key)
        raise ConditionalWritesUnsupported(
            f"{store.url} accepted a second create-if-absent of {key!r}: it ignores "
            "conditional writes (If-None-Match: *), so concurrent commits would overwrite "
            "each other. Use a store that enforces them (AWS S3, MinIO, SeaweedFS, a "
            "file:// directory) or upgrade this one; open_store(..., "
            "verify_conditional_writes=False) skips this check at your own risk."
        )

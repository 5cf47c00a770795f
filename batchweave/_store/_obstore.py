"""``s3://`` on obstore (Rust ``object_store`` bindings): an optional, faster S3 client.

Same semantics, keys and errors as the boto3 :class:`~batchweave.S3Store`; only the client
differs. obstore measured 2-3x boto3's small-GET throughput and a third of its latency here,
which is what a consumer's one-range-read-per-slice pattern is bound by. Install with
``pip install 'batchweave[obstore]'``; boto3 stays the default backend.

``object_store`` lists by whole path segments and refuses some ranges the S3 API answers, so
this adapter lists the enclosing "directory" and filters, and clamps ranges itself, to give
exactly the :class:`ObjectStore` contract (checked by the shipped conformance suite).
"""

from __future__ import annotations

import html
import os
import random
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any, NamedTuple
from urllib.parse import quote

from batchweave._errors import (
    AccessDenied,
    AmbiguousWriteError,
    ConcurrentWriteConflict,
    InvalidKey,
    InvalidStoreURL,
    ObjectExists,
    ObjectNotFound,
    StoreError,
    StoreTimeout,
    StoreUnavailable,
    TransientStoreError,
)
from batchweave._fork import current_pid
from batchweave._store._base import (
    Bounded,
    ByteRange,
    ObjectMeta,
    Offset,
    PutMode,
    check_mode,
    check_range,
    checked_keys,
    resolve_range,
    validate_key,
)
from batchweave._store._s3_location import (
    BUCKET_OPS,
    DENIED_CODES,
    THROTTLED_CODES,
    TRANSIENT_CODES,
    ClientOptions,
    S3Location,
    check_endpoint,
    check_region,
    not_s3_status,
    refuse_unusable_credential,
)

__all__ = ["ObstoreS3Store"]

_LIST_CHUNK = 1000
_STREAM_CHUNK = 1 << 20
"""Bytes per chunk when a body is streamed (a range read on a server that ignores Range)."""
_TRANSIENT = re.compile(
    r"\b(5\d\d|429)\b|SlowDown|ServiceUnavailable|InternalError|RequestTimeout|timed out|"
    r"timeout|connection|reset|broken pipe|error sending request|dns|"
    r"response body error|kind: Interrupted\b",
    re.IGNORECASE,
)
"""Transient failures without a status; a body cut short (reqwest's "request or response body
error", object_store's ``Interrupted``) is one, as boto3's ``IncompleteRead`` is."""
_STATUS = re.compile(r"status code: (\d{3})\b")
"""The HTTP status object_store quotes when the server answered with an error."""
_REPLY = re.compile(
    r"(Server returned (?:non-2xx status code: \d{3}[^:\n]*|error response): )(.*?)"
    r"(?=\n\nDebug source:|\Z)",
    re.DOTALL,
)
"""object_store's quote of the server's reply: S3's XML error document, or a DeleteObjects
result with a key's ``InternalError``/``SlowDown`` (which object_store retries, then reports)."""
_DUMPED_REPLY = re.compile(r'body: (?:Some\(\s*)?"(?:[^"\\]|\\.)*"')
"""The reply again, quoted in object_store's debug dump."""
_DELETE_FAILED = re.compile(r"DeleteObjects request failed for key .*\(code: ([^()\s]*)\)$")
"""object_store's words for a key's error in a DeleteObjects result (other than the above)."""
_PAST_THE_END = re.compile(r"status code: 416\b|out of bounds", re.IGNORECASE)
"""A range starting at or past the object's end (or S3's code ``InvalidRange``). Matched
exactly: a bare "416" also occurs in request ids and timings ("in 1.416ms") of unrelated
errors, which must not read as b""."""
_UNREACHABLE = re.compile(
    r"connection refused|dns error|tcp connect|kind: Connect\b|error sending request$", re.I
)
"""Nothing was reached: refused, unresolvable, or a connect that timed out. reqwest's bare
"error sending request" is only the first line: the debug dump after it names the kind, and a
request that did connect (then timed out or got garbage) is not an outage of the endpoint."""
_TIMED_OUT = re.compile(r"kind: Timeout\b|TimedOut|timed out", re.I)
_RETRIES = re.compile(r"\bretries: (\d+)")
"""How many times object_store retried the request (its debug dump; absent: none). It does not
say why: after a 5xx or a timeout (which it retries for an overwrite) a write may have landed."""
_HTTP_KIND = re.compile(r"HttpError \{\s*kind: (\w+)")
"""object_store's kind of a transport failure: ``Connect`` (nothing sent), ``Request``,
``Timeout``, ``Interrupted``, ``Decode``, ``Unknown``."""
_NOT_S3 = re.compile(
    r"Unable to extract metadata from headers|Got invalid \w+ response|non-2xx status code: 404\b"
)
"""The endpoint answered, but not as S3 does (a web page without ETag, a 404 page, a listing
that is not XML)."""
_LISTING_CHECK_KEY = "_batchweave/listing-check"
"""A key :meth:`ObstoreS3Store._check_empty_listing` asks about (a HEAD; it is never written)."""
_INSTANCE_METADATA = re.compile(r"169\.254\.169\.254|/latest/api/token|/latest/meta-data/")
"""A request to the EC2 instance metadata service (at its default or a configured address)."""
_BARE_REDIRECT = "Received redirect without LOCATION"
"""object_store's words for a 3xx without ``Location``: AWS S3's answer to a request signed for
another region than the bucket's (object_store does not follow S3's region redirects)."""
_CREDENTIAL_ENV = (
    "AWS_ACCESS_KEY_ID",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_SKIP_SIGNATURE",
)
"""Environment variables from which object_store finds credentials (or is told to need none)
before it falls back to the EC2 instance metadata service."""
_ENV_KEY_PAIR = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
"""The key pair object_store takes from the environment when none is given."""
_ENV_TOKEN = ("AWS_SESSION_TOKEN", "AWS_TOKEN")
"""The variables object_store takes a session token from (used with the key pair only)."""
_REGION_ENV = ("AWS_DEFAULT_REGION", "AWS_REGION")
"""Environment variables the region is taken from when none is given, in this order (boto3
reads the first)."""
_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
"""Environment variables object_store takes the S3 endpoint from when none is given."""


class _Reply(NamedTuple):
    """An obstore error, read: what object_store said and what the server answered."""

    text: str
    """object_store's words (debug dump included) without the reply and without the request's
    keys: searched for its own phrases, which a key such as ``runs/NoSuchBucket`` must not
    fake."""
    status: int | None
    """The HTTP status of the server's error answer, if it gave one."""
    code: str | None
    """S3's error ``<Code>`` (of the first failed key for DeleteObjects), if it gave one."""
    said: str | None
    """S3's ``<Code>`` and ``<Message>`` from its XML reply, for messages."""
    key: str | None
    """The failed key a DeleteObjects result names (full path), if it names one."""
    quoted: bool
    """Whether object_store quoted the server's reply (its body, maybe empty): then no ``code``
    means the reply was not S3's XML error (a web server's page)."""


def _xml_field(body: str, name: str) -> str | None:
    found = re.search(f"<{name}>([^<]*)</{name}>", body)
    return html.unescape(found.group(1)).strip() if found is not None else None


def _without_paths(text: str, paths: Iterable[str]) -> str:
    """``text`` without ``paths`` where object_store quotes them: as an object's location, in
    a request's URL (percent-encoded) and in its debug dump (escaped). Only whole occurrences
    are removed: a short key such as ``a`` or ``Code`` leaves the words around it alone."""
    forms: set[str] = set()
    for path in paths:
        if path:
            escaped = path.replace("\\", "\\\\").replace('"', '\\"')
            forms |= {path, quote(path, safe="/~"), quote(path, safe="~"), escaped}
    if not forms:
        return text
    names = "|".join(re.escape(f) for f in sorted(forms, key=len, reverse=True))
    return re.sub(rf'(?:(?<=[\s/"=,(])|^)(?:{names})(?=[\s"?&,:)]|$)', "", text)


def _is_path(path: str) -> bool:
    """Whether object_store takes ``path`` as a path: what a key may be (its segments are not
    empty, ``.`` or ``..``, and hold no control characters)."""
    try:
        validate_key(path)
    except InvalidKey:
        return False
    return True


def _valid_parent(path: str) -> str:
    """The longest run of ``path``'s leading segments that is a valid path (``""``: none),
    without a trailing ``/``: ``"p/a/../b"`` gives ``"p/a"``."""
    segments = path.split("/")
    for end in range(len(segments), 0, -1):
        parent = "/".join(segments[:end])
        if _is_path(parent):
            return parent
    return ""


class _StaticCredentials:
    """An obstore credential provider of explicitly given credentials, which never expire.

    Asked once; object_store then signs with exactly these (no token from the environment).
    """

    def __init__(self, key: str, secret: str, token: str | None) -> None:
        self._credential = {
            "access_key_id": key,
            "secret_access_key": secret,
            "token": token,
            "expires_at": None,
        }

    def __call__(self) -> dict[str, Any]:
        return dict(self._credential)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(***)"


class _NoCredentials(Exception):
    """Raised by the credential provider installed when no credentials can be found."""


def _metadata_disabled() -> bool:
    """``AWS_EC2_METADATA_DISABLED=true``, as boto3 reads it (object_store ignores it)."""
    return os.environ.get("AWS_EC2_METADATA_DISABLED", "").strip().lower() == "true"


def _refuse_credentials() -> Any:
    raise _NoCredentials(
        "no credentials configured and AWS_EC2_METADATA_DISABLED=true forbids asking the EC2 "
        "instance metadata service"
    )


_used_in: int | None = None
"""The process that sent a request with obstore, if any: a process forked from it cannot."""


def _check_not_forked(url: str) -> None:
    """Refuse obstore in a process forked from one that used it, where a request would hang.

    obstore is not fork-safe (its maintainers say so): the threads of its runtime stay in the
    parent, so in a forked child a request never completes; and one sent on a connection
    inherited from the parent leaves that connection unusable for the parent too.
    """
    used = _used_in
    if used is not None and used != current_pid():
        raise StoreError(
            f"{url}: obstore cannot be used in process {current_pid()}, which was fork()ed from "
            f"process {used} after that process used obstore: obstore is not fork-safe (the "
            "threads of its runtime stay in the parent, so a request here would hang). Start "
            "worker processes with the 'spawn' or 'forkserver' start method (DataLoader: "
            "multiprocessing_context='forkserver'; batchweave.torch.WeaveLoader does so for an "
            "obstore store), or read with the boto3 client (S3Store, or "
            "open_store(..., s3_client='boto3'))"
        )


def _mark_used() -> None:
    """Record that this process sends requests with obstore (see :func:`_check_not_forked`)."""
    global _used_in
    _used_in = current_pid()


class ObstoreNotInstalled(StoreError, ImportError):
    """The obstore backend was asked for without obstore installed.

    An ``ImportError`` (what a missing package is), and still a ``StoreError`` as before, so
    callers handling store errors around ``open_store`` keep seeing it there.
    """


def _import_obstore() -> Any:
    try:
        import obstore
        import obstore.exceptions
        import obstore.store
    except ImportError as exc:
        raise ObstoreNotInstalled(
            f"the obstore S3 backend (s3_client='obstore', ObstoreS3Store) needs the obstore "
            f"package ({exc}): pip install 'batchweave[obstore]', or use the default boto3 "
            "backend",
            name=exc.name,
        ) from exc
    return obstore


class ObstoreS3Store(S3Location):
    """Objects under ``s3://bucket/prefix`` through obstore. Thread-safe.

    Options mirror :class:`~batchweave.S3Store`: ``endpoint_url`` (MinIO, SeaweedFS, RGW, ...),
    ``region``, explicit credentials (used alone, as on boto3: no token from the environment
    joins them; else the ``AWS_*`` environment, checked when the store is opened), timeouts in
    seconds,
    ``max_attempts`` (1 + retries of transient failures: inside obstore for reads, by
    :meth:`put` itself for writes, which so knows whether an earlier attempt may have landed),
    ``addressing_style`` (``"path"`` or ``"virtual"``; ``"auto"`` or ``None``, the default, is
    path style, as :class:`~batchweave.S3Store` uses with an endpoint, so one option value works
    for both),
    ``probe_timeout`` (how long :func:`~batchweave.open_store`'s probe waits for each answer).
    ``sleep`` waits between a PUT's attempts (tests pass a recorder, so no test waits).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_attempts: int = 5,
        addressing_style: str | None = None,
        probe_timeout: float = 10.0,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        super().__init__(
            bucket,
            prefix,
            endpoint_url=endpoint_url,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            region=region,
            options={
                "connect_timeout": connect_timeout,
                "read_timeout": read_timeout,
                "max_attempts": max_attempts,
                "addressing_style": addressing_style,
                "probe_timeout": probe_timeout,
            },
        )
        assert self._options is not None
        options = self._options
        endpoints = [endpoint_url] if endpoint_url is not None else []
        if endpoint_url is None:
            for name in _ENDPOINT_ENV:
                if os.environ.get(name):
                    # object_store takes the endpoint from there: refuse what an explicit
                    # endpoint_url would be refused for (boto3 does so for its variables).
                    check_endpoint(
                        os.environ[name],
                        f"{name} (used as the endpoint of {self.url})",
                        bucket=self.bucket,
                    )
                    if not endpoints:  # the first one set is named in messages
                        self._endpoint_shown = f"{os.environ[name]} (from {name})"
                    endpoints.append(os.environ[name])
        _check_not_forked(self.url)
        obs = _import_obstore()
        self._obs = obs
        self._errors = obs.exceptions
        self._region = region or self._environment_region() or "us-east-1"
        config: dict[str, Any] = {"region": self._region, "conditional_put": "etag"}
        if endpoint_url is not None:
            config["endpoint"] = endpoint_url
        config["virtual_hosted_style_request"] = options.addressing_style == "virtual"
        extra: dict[str, Any] = {}
        if access_key_id is not None and secret_access_key is not None:
            # Exactly the given credentials: in the config, object_store would add the
            # environment's AWS_SESSION_TOKEN to an explicit key pair that has none (which AWS
            # refuses, or signs as another identity); boto3 uses explicit keys alone.
            extra["credential_provider"] = _StaticCredentials(
                access_key_id, secret_access_key, session_token
            )
        else:
            self._check_environment_credentials()
        no_credentials = access_key_id is None and not any(map(os.environ.get, _CREDENTIAL_ENV))
        if no_credentials and _metadata_disabled():
            # object_store would ask the instance metadata service anyway (a request leaving
            # the machine, and a long wait off EC2); refuse as boto3 does.
            extra["credential_provider"] = _refuse_credentials
        # An http:// endpoint from the environment too (else: "builder error" on each request)
        self._allow_http = any(e.startswith("http://") for e in endpoints)
        self._config, self._extra = config, extra
        self._read_timeout = options.read_timeout
        self._listing_checked = False
        """Whether a listing was seen to be S3's (see :meth:`_check_empty_listing`)."""
        self._store = self._make_store(
            options.connect_timeout, options.read_timeout, options.max_attempts
        )
        self._writer = self._make_store(options.connect_timeout, options.read_timeout, 1)
        """Sends each PUT attempt once: :meth:`put` retries, knowing what every attempt got."""
        self._write_attempts = options.max_attempts
        self._sleep = sleep
        self._write_retry_timeout = max(options.read_timeout, 1.0) * options.max_attempts
        """Seconds after a PUT's start past which it is retried no more (as object_store)."""

    def _environment_region(self) -> str | None:
        """The region of ``AWS_DEFAULT_REGION`` (else ``AWS_REGION``), if set and not empty.

        boto3 signs for ``AWS_DEFAULT_REGION`` when no region is given; object_store, given a
        config, reads neither variable, and would sign every request for ``us-east-1`` (which
        AWS and servers configured with another region refuse). ``AWS_REGION``, the name the
        other AWS SDKs read, counts when ``AWS_DEFAULT_REGION`` is unset. A value that is not a
        region name is refused naming the variable, as an invalid ``region`` is.
        """
        for name in _REGION_ENV:
            value = os.environ.get(name)
            if value:
                check_region(self.url, f"{name} (from the environment)", value)
                return value
        return None

    def _check_environment_credentials(self) -> None:
        """Refuse the ``AWS_*`` credentials object_store would take from the environment if it
        cannot use them, as boto3 does, and mask them in every message from now on.

        A key without its secret (or the reverse) is ``AccessDenied`` in boto3's words
        (object_store: a configuration error with a debug dump); a value with whitespace or a
        control character (a trailing newline of a secret file) makes object_store panic on
        the first request (a ``BaseException``), or is echoed.
        """
        given = [name in os.environ for name in _ENV_KEY_PAIR]
        if given[0] != given[1]:
            missing = _ENV_KEY_PAIR[given.index(False)]
            raise self._no_credentials(
                f"open {self.url}", f"Partial credentials found in env, missing: {missing}"
            )
        if not given[0]:
            return  # object_store takes no token without a key pair
        for name in _ENV_KEY_PAIR + _ENV_TOKEN:
            value = os.environ.get(name)
            if value is not None:
                refuse_unusable_credential(self.url, f"{name} (from the environment)", value)
                self._add_secrets(value)

    def _make_store(
        self,
        connect_timeout: float,
        read_timeout: float,
        max_attempts: int,
        retry_timeout: float | None = None,
    ) -> Any:
        """An obstore ``S3Store`` for this location with these timeouts and attempts.

        ``retry_timeout``: seconds after a request's start past which object_store retries it
        no more (default: enough for every attempt to wait ``read_timeout``).
        """
        client: dict[str, Any] = {
            "connect_timeout": timedelta(seconds=connect_timeout),
            "timeout": timedelta(seconds=read_timeout),
            "allow_http": self._allow_http,
        }
        retry: dict[str, Any] = {
            "max_retries": max_attempts - 1,
            "retry_timeout": timedelta(
                seconds=max(read_timeout, 1.0) * max_attempts
                if retry_timeout is None
                else retry_timeout
            ),
            "backoff": {
                "init_backoff": timedelta(milliseconds=50),
                "max_backoff": timedelta(seconds=5),
                "base": 2,
            },
        }
        try:
            return self._obs.store.S3Store(
                self.bucket,
                config=self._config,
                client_options=client,
                retry_config=retry,
                **self._extra,
            )
        except Exception as exc:
            raise InvalidStoreURL(
                f"cannot configure obstore for {self.url}: {self._scrub(str(exc))}"
            ) from self._scrubbed(exc)

    def _check_process(self) -> None:
        """Before a request: refuse one in a process forked from one that used obstore (where
        it would hang), else note that this process uses obstore. Outside the ``try`` of a
        request, whose errors are obstore's, translated."""
        if _used_in != current_pid():
            _check_not_forked(self.url)
            _mark_used()

    def _use_probe_client(self, options: ClientOptions) -> None:
        # object_store does not retry a PUT that timed out (it is not idempotent), and the probe
        # stops at its first timeout: no request of the probe waits twice. object_store would
        # retry a HEAD or GET that timed out; it retries nothing once retry_timeout has passed
        # since the request began, which a first attempt that waited probe_read_timeout has
        # (failures that come at once, a refused connection, are still retried).
        self._store = self._make_store(
            options.probe_connect_timeout,
            options.probe_read_timeout,
            options.probe_attempts,
            retry_timeout=0.9 * options.probe_read_timeout,
        )
        self._writer = self._make_store(
            options.probe_connect_timeout, options.probe_read_timeout, 1
        )
        self._write_attempts = options.probe_attempts
        self._write_retry_timeout = 0.9 * options.probe_read_timeout

    # -- error translation -------------------------------------------------------------------

    def _read_error(self, exc: Exception, paths: Sequence[str]) -> _Reply:
        """``exc`` read apart; ``paths`` are the request's full keys (not searched for words)."""
        text = _without_paths(str(exc), paths)
        reply = _REPLY.search(text)
        body = self._scrub(reply.group(2)) if reply is not None else ""
        text = self._scrub(_DUMPED_REPLY.sub("body: ...", _REPLY.sub(r"\1", text))).strip()
        status = _STATUS.search(text)
        deleting = "<DeleteResult" in body
        if deleting:  # the first key's error of a DeleteObjects result
            body = body[body.find("<Error>") :]
        code, said = _xml_field(body, "Code"), None
        key = _xml_field(body, "Key") if deleting else None
        if code:
            said = f"{code} {_xml_field(body, 'Message') or ''}".rstrip()
        elif (failed := _DELETE_FAILED.search(text.split("\n", 1)[0])) is not None:
            code = failed.group(1)
            line = self._scrub(str(exc)).split("\n", 1)[0]
            for path in paths:  # "... failed for key {path}: {message} (code: {code})"
                named = f" for key {path}: "
                if (start := line.find(named)) >= 0:
                    words = line[start + len(named) : line.rfind(" (code: ")]
                    key, said = path, f"{code} {words}".rstrip()
                    break
        return _Reply(
            text=text,
            status=int(status.group(1)) if status is not None else None,
            code=code or None,
            said=said,
            key=key,
            quoted=reply is not None,
        )

    def _translate(
        self,
        exc: Exception,
        *,
        op: str,
        key: str | None,
        paths: Sequence[str] | None = None,
        landed: bool | None = None,
    ) -> StoreError:
        """Map an obstore exception to the store error tree. The single place that does so.

        ``paths``: the full keys the request named (default: ``key``'s), which are no part of
        what the error says (a missing key ``runs/NoSuchBucket`` is a missing key). ``landed``
        (a write): whether an earlier attempt may have landed (``None``: unknown, then any
        retry object_store made counts as such an attempt).

        Raise it ``from self._scrubbed(exc)``, never ``from exc``: object_store's error quotes
        the server's reply, which may quote the request's credentials (see :meth:`_scrubbed`).
        """
        what = self._describe(op, key)
        message = self._scrub(str(exc)).strip()
        if paths is None:
            paths = [self.prefix + key] if key is not None else []
        reply = self._read_error(exc, paths)
        text, status, code = reply.text, reply.status, reply.code
        if reply.said is not None and reply.key is not None:
            rel = reply.key.removeprefix(self.prefix)
            detail = f"delete {rel!r} in {self.url}: {reply.said}"
        elif reply.said is not None:
            detail = f"{what}: {reply.said}"
        else:
            # obstore appends a multi-line debug dump; the first line is the useful part
            detail = f"{what}: {message.splitlines()[0] if message else type(exc).__name__}"
        errors = self._errors
        # A delete is idempotent: a failed one is retried, never "ambiguous" (as on boto3).
        write = op in ("put", "put_if_absent")
        if code == "NoSuchBucket":
            return self._missing_bucket(detail)
        if _INSTANCE_METADATA.search(text) or _NoCredentials.__name__ in text:
            # No credentials were configured: obstore asked EC2 instance metadata and failed,
            # or was not allowed to ask it.
            return AccessDenied(
                f"cannot {what}: no usable AWS credentials (none were given, and the EC2 "
                "instance metadata service failed or is disabled); pass access_key_id and "
                "secret_access_key or set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY"
            )
        if _BARE_REDIRECT in text:
            # A refusal, so nothing was stored; and retrying with the same region cannot help.
            return StoreError(
                f"cannot {what}: {self._endpoint_shown} answered with a redirect: on AWS S3 the "
                f"bucket is in another region than region={self._region!r}; set region to the "
                "bucket's region (elsewhere: endpoint_url is not the S3 API's address)"
            )
        not_s3 = _NOT_S3.search(text)
        if not_s3 is not None and (op in BUCKET_OPS or "404" not in not_s3.group()):
            # (NoSuchBucket was matched above.) Checked before a failed write is called
            # ambiguous: a reply that is not S3's is no reason to read the object back.
            answer = _REPLY.sub(r"\1", message.splitlines()[0]).rstrip(": ")
            return self._not_s3(op, key, f"{answer}: {reply.said}" if reply.said else answer)
        if op == "put_if_absent" and (status == 409 or code == "ConditionalRequestConflict"):
            # Before the "exists" check: object_store reports a 409 as AlreadyExistsError, but
            # it means another conditional write is in flight (boto3: the same leaf).
            return ConcurrentWriteConflict(detail)
        exists = (errors.AlreadyExistsError, errors.PreconditionError, FileExistsError)
        if op == "put_if_absent" and isinstance(exc, exists):
            return ObjectExists(detail)
        if isinstance(exc, (errors.NotFoundError, FileNotFoundError)):
            return ObjectNotFound(detail)
        # A write's last attempt tells about that attempt only: an earlier one may have landed.
        # put() knows (it makes the attempts); if object_store retried, it does not say why (a
        # 5xx or a timeout as well as a 429 or a refused connection): assume one may have.
        retried = (found := _RETRIES.search(text)) is not None and int(found.group(1)) > 0
        retried = retried if landed is None else landed or retried
        if status is not None and reply.quoted and code is None and not (write and retried):
            # An error reply that is not S3's XML (as on boto3: see not_s3_status).
            why = not_s3_status(op, status)
            if why is not None:
                return self._not_s3(op, key, why)
        denied = (errors.PermissionDeniedError, errors.UnauthenticatedError, PermissionError)
        # (object_store reports a 401/403 to a listing, and a key's refusal in a DeleteObjects
        # result, as a generic error.)
        if isinstance(exc, denied) or status in (401, 403) or code in DENIED_CODES:
            return self._denied(detail)
        if op == "put_if_absent" and (status == 501 or code == "NotImplemented"):
            return self._no_conditional_writes(detail)
        unreachable = _UNREACHABLE.search(text) is not None
        # Connected, then no answer (no status, and not a connect that failed or timed out).
        silent = status is None and not unreachable and _TIMED_OUT.search(text) is not None
        if silent and self._answer_within is not None:
            return self._silent(op, key)  # the probe: it fails at once, writes included
        within = f"did not answer within read_timeout={self._read_timeout:g} s"
        if silent and not write:
            # Connected, then no answer: transient, and typed so a waiting client sees an outage.
            return StoreTimeout(
                f"{what}: {self._endpoint_shown} accepted the connection but {within} (an "
                "overloaded or hung server, or not an S3 server on that port)"
            )
        if status is not None and status < 500 and not (write and retried):
            # A definite answer, also to a write: refused, nothing was stored (as on boto3).
            # Classified by status and code only: the words of the reply and of object_store's
            # dump (request ids, timings "in 503.1ms") say nothing.
            throttled = status == 429 or code in THROTTLED_CODES
            return TransientStoreError(detail) if throttled else StoreError(detail)
        if unreachable and not (write and retried):
            # Nothing could have been sent, on the only attempt (of a write) or on the last.
            return StoreUnavailable(
                f"cannot {what}: {self._endpoint_shown} is unreachable (refused, DNS, TLS "
                "or proxy failure: check the endpoint's scheme, host and port, and HTTPS_PROXY)"
            )
        if write:
            if silent:
                ambiguous = AmbiguousWriteError(
                    f"{what}: {self._endpoint_shown} {within}; the object may or may not exist "
                    "now, read it back to decide"
                )
                ambiguous.timed_out = True
                return ambiguous
            if (status is not None and status < 500) or unreachable:
                return AmbiguousWriteError(
                    f"{detail}; an earlier attempt may have landed (it got no answer, or a 5xx), "
                    "read the object back to decide"
                )
            return AmbiguousWriteError(f"{detail}; the write may have landed, read it back")
        if status is not None:  # 5xx
            return TransientStoreError(detail)
        if code is not None:
            # S3's answer without an error status: a key's error in a DeleteObjects result.
            return TransientStoreError(detail) if code in TRANSIENT_CODES else StoreError(detail)
        # Every RetryError dump names its "retry_timeout" setting, which is no sign of a timeout.
        if _TRANSIENT.search(text.replace("retry_timeout", "")):
            return TransientStoreError(detail)
        return StoreError(detail)

    # -- operations --------------------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        """Send the PUT, retrying as object_store would, but attempt by attempt.

        object_store's own retries would hide what the earlier attempts got, and with it
        whether one may have landed; knowing it, a write refused (4xx) or unreachable on its
        last attempt is ambiguous exactly when an earlier attempt may have landed, as on boto3.
        """
        self._check_process()
        full = self._key(key)
        check_mode(mode)
        body = data if isinstance(data, bytes) else bytes(data)
        create = mode is PutMode.CREATE
        op = "put_if_absent" if create else "put"
        started = time.monotonic()
        landed = False  # whether an earlier attempt may have landed
        for attempt in range(1, self._write_attempts + 1):
            try:
                self._obs.put(
                    self._writer,
                    full,
                    body,
                    mode="create" if create else "overwrite",
                    use_multipart=False,
                )
                return
            except Exception as exc:
                retry, maybe_landed = self._put_attempt_failed(exc, full, create=create)
                last = (
                    not retry
                    or attempt >= self._write_attempts
                    or time.monotonic() - started >= self._write_retry_timeout
                )
                if last:
                    error = self._translate(exc, op=op, key=key, landed=landed)
                    raise error from self._scrubbed(exc)
                landed = landed or maybe_landed
            # object_store's backoff: from 50 ms, doubling, at most 5 s, jittered.
            self._sleep(random.uniform(0.05, min(0.05 * 2**attempt, 5.0)))

    def _put_attempt_failed(self, exc: Exception, full: str, *, create: bool) -> tuple[bool, bool]:
        """``(retry, may_have_landed)`` for a failed PUT attempt, retried as object_store does:
        a 5xx, a 429, a transport failure before the request was sent, and a timeout or an
        interrupted exchange only for an overwrite (a create is not idempotent). Not a 501, as
        on boto3: the server does not implement the request, so it stored nothing and will not."""
        reply = self._read_error(exc, [full])
        if reply.status is not None:
            server_error = reply.status >= 500 and reply.status != 501
            return server_error or reply.status == 429, server_error
        found = _HTTP_KIND.search(reply.text)
        kind = found.group(1) if found is not None else None
        if kind == "Connect":
            return True, False  # nothing was sent
        if kind == "Request":
            return True, True  # sending failed: how much arrived is unknown
        if kind in ("Timeout", "Interrupted"):
            return not create, True
        return False, True

    def get(self, key: str) -> bytes:
        self._check_process()
        full = self._key(key)
        try:
            result = self._obs.get(self._store, full)
        except Exception as exc:
            raise self._translate(exc, op="get", key=key) from self._scrubbed(exc)
        self._check_meta(result.meta, op="get", key=key)
        try:
            return bytes(result.bytes())
        except Exception as exc:
            raise self._translate(exc, op="get", key=key) from self._scrubbed(exc)

    def _check_meta(self, meta: Any, *, op: str, key: str) -> None:
        """``StoreError`` if an object's metadata has neither ETag nor Last-Modified.

        A web server on the endpoint's port answers 200 with a page: without this check its
        HTML would be returned as the object's bytes. Either header alone is S3's: some
        compatible servers send no ETag on GET/HEAD (object_store does not require one), and
        object_store reports a missing Last-Modified as the epoch.
        """
        if meta.get("e_tag") is None and meta["last_modified"].timestamp() == 0:
            raise self._not_s3(op, key, "no ETag and no Last-Modified in a 200 response")

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        check_range(rng)
        self._check_process()
        full = self._key(key)
        if isinstance(rng, Bounded):
            if rng.start == rng.end:
                self.head(key)  # an empty range still requires the object to exist
                return b""
            option: Any = (rng.start, rng.end)
        elif isinstance(rng, Offset):
            option = {"offset": rng.start}
        else:
            option = {"suffix": rng.length}
        try:
            result = self._obs.get(self._store, full, options={"range": option})
            self._check_meta(result.meta, op="get_range", key=key)
            return bytes(result.bytes())
        except StoreError:
            raise
        except Exception as exc:
            whole = "non-partial response" in str(exc)
            if not whole and not self._past_the_end(exc, full):
                raise self._translate(exc, op="get_range", key=key) from self._scrubbed(exc)
        # Past the except block: an error raised by these requests does not get the raw
        # obstore error (which quotes the server's reply) as its __context__.
        if whole:
            return self._range_of_whole_object(key, full, rng)
        self.head(key)  # out of range, or missing? only the latter is an error
        return b""

    def _range_of_whole_object(self, key: str, full: str, rng: ByteRange) -> bytes:
        """``rng`` of ``key`` from a plain GET, read only as far as the range reaches.

        For a server that ignored the Range header (S3 does so for empty objects, some servers
        always): a bounded read (a manifest's 64 MiB + 1) must stay bounded there too, so the
        body is streamed and dropped once ``rng``'s end has arrived.
        """
        try:
            result = self._obs.get(self._store, full)
            self._check_meta(result.meta, op="get_range", key=key)
            start, end = resolve_range(rng, int(result.meta["size"]))
            data = bytearray()
            if end > start:
                for chunk in result.stream(min_chunk_size=_STREAM_CHUNK):
                    data += chunk
                    if len(data) >= end:
                        break
        except StoreError:
            raise
        except Exception as exc:
            raise self._translate(exc, op="get_range", key=key) from self._scrubbed(exc)
        return bytes(data[start:end])

    def _past_the_end(self, exc: Exception, full: str) -> bool:
        if isinstance(exc, (self._errors.NotFoundError, FileNotFoundError)):
            return False
        reply = self._read_error(exc, [full])
        return reply.code == "InvalidRange" or _PAST_THE_END.search(reply.text) is not None

    def head(self, key: str) -> ObjectMeta:
        self._check_process()
        full = self._key(key)
        try:
            meta = self._obs.head(self._store, full)
        except Exception as exc:
            raise self._translate(exc, op="head", key=key) from self._scrubbed(exc)
        self._check_meta(meta, op="head", key=key)
        if meta["last_modified"].timestamp() == 0:
            # object_store reports a missing Last-Modified as the epoch; every S3 HEAD has one
            # (and boto3's S3Store refuses a HEAD without it the same way).
            raise self._not_s3("head", key, "no Last-Modified in a 200 reply")
        return self._meta(meta)

    def _meta(self, meta: Any) -> ObjectMeta:
        return ObjectMeta(
            key=str(meta["path"])[len(self.prefix) :],
            size=int(meta["size"]),
            last_modified=meta["last_modified"].timestamp(),
            etag=meta.get("e_tag"),
        )

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        self._check_process()
        wanted = self.prefix + prefix
        # object_store lists whole path segments: list the enclosing directory, filter here.
        # It refuses a prefix or offset that is no valid path ("../", "a//b"): ask for the
        # longest one of its parents that is (a prefix of it, which bounds the same listing
        # from below) and filter the rest here, as every other backend answers.
        directory = _valid_parent(wanted[: wanted.rfind("/") + 1] if "/" in wanted else "")
        after = None  # the keys listed are greater than this
        if start_after is not None and self.prefix + start_after >= wanted:
            after = self.prefix + start_after
        offset = after if after is None or _is_path(after) else _valid_parent(after) or None
        try:
            stream = self._obs.list(
                self._store,
                prefix=directory or None,
                offset=offset,
                chunk_size=_LIST_CHUNK,
            )
            for chunk in stream:
                if chunk:
                    self._listing_checked = True  # a web page never parses as an object
                for meta in chunk:
                    path = str(meta["path"])
                    if after is not None and path <= after:
                        continue
                    if path.startswith(wanted):
                        yield self._meta(meta)
                    elif path > wanted:
                        return
        except StoreError:
            raise
        except Exception as exc:
            # The request names the directory (with a trailing "/") and the offset, not prefix
            named = [directory + "/", directory, wanted, offset or ""]
            raise self._translate(
                exc, op="list", key=prefix or None, paths=named
            ) from self._scrubbed(exc)
        if not self._listing_checked:
            self._check_empty_listing(prefix)

    def _check_empty_listing(self, prefix: str) -> None:
        """``StoreError`` if the endpoint that gave an empty listing does not answer like S3.

        object_store parses any ``200`` body as a ListObjectsV2 result: a web page on the
        endpoint's port lists as "no objects" (a namespace that does not exist, a reclaimer pass
        over nothing). The first empty listing of this store is therefore confirmed with a HEAD
        of a key that need not exist, which S3 answers with 404 (403 without ``s3:ListBucket``)
        and a web page with a 200 lacking ETag and Last-Modified, or another refusal (plain
        ``StoreError``). Later empty listings (a consumer polling for news) cost nothing more.
        """
        try:
            self.head(_LISTING_CHECK_KEY)
        except (ObjectNotFound, AccessDenied):
            pass  # S3's answer for a key that is not there
        except StoreError as exc:
            if type(exc) is not StoreError:
                raise  # transient, unreachable, ...: no verdict on the listing
            raise self._not_s3(
                "list",
                prefix or None,
                "not a ListObjectsV2 result: an empty listing, and a HEAD that S3 would answer "
                "with 404 was answered otherwise",
            ) from exc
        self._listing_checked = True

    def delete_many(self, keys: Iterable[str]) -> None:
        # Every key is checked before any is deleted: an invalid one deletes nothing.
        paths = [self.prefix + k for k in checked_keys(keys)]
        if not paths:
            return
        self._check_process()
        try:
            self._obs.delete(self._store, paths)
        except Exception as exc:
            missing = isinstance(exc, (self._errors.NotFoundError, FileNotFoundError))
            if missing and self._read_error(exc, paths).code != "NoSuchBucket":
                return
            rel = paths[0][len(self.prefix) :]
            raise self._translate(exc, op="delete", key=rel, paths=paths) from self._scrubbed(exc)

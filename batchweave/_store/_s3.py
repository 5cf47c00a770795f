"""``s3://bucket/prefix``: any S3-compatible store through boto3.

Conditional create is ``PutObject`` with ``If-None-Match: *``. Every botocore exception is
translated in one place, :meth:`S3Store._translate`, into the store error tree, so callers never
see boto3 types. Transient failures are retried by botocore's ``standard`` retry mode; what is
left after the retries surfaces as a typed error.

A retried PUT is subtle: if the first attempt landed but its response was lost, the retry of a
create-if-absent gets ``412`` from the first attempt's own object. ``ObjectExists`` therefore does
not prove that somebody else won; callers that care read the object back.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import re
import threading
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import boto3
import botocore.exceptions as bex
from botocore.config import Config
from botocore.credentials import RefreshableCredentials
from botocore.utils import is_valid_endpoint_url

from batchweave._errors import (
    AccessDenied,
    AmbiguousWriteError,
    ConcurrentWriteConflict,
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
    Suffix,
    check_mode,
    check_range,
    checked_keys,
    resolve_range,
)
from batchweave._store._s3_location import (
    BUCKET_OPS,
    DENIED_CODES,
    THROTTLED_CODES,
    TRANSIENT_CODES,
    ClientOptions,
    S3Location,
    check_endpoint,
    not_s3_status,
    redact_signing_details,
    redact_url,
    refuse_unusable_credential,
)

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["S3Store"]

DELETE_BATCH = 1000
"""S3's limit on keys per ``DeleteObjects`` request (SeaweedFS enforces it too)."""

_NOT_FOUND = frozenset({"NoSuchKey", "NotFound", "404"})
_DENIED = DENIED_CODES | {"403"}
_WRITE_OPS = frozenset({"put", "put_if_absent"})
_LISTING_FIELDS = frozenset({"IsTruncated", "Contents", "Name", "Prefix", "KeyCount", "MaxKeys"})
"""Elements of a ListObjectsV2 result. S3 sends all of them (``Contents`` when not empty), some
compatible servers omit ``IsTruncated`` when false; a web page botocore parses has none."""
_RECURSION = "maximum recursion depth exceeded"
"""How botocore's ``HTTPClientError`` quotes a ``RecursionError`` (see ``_translate``)."""
_CREDENTIAL_ERRORS = (
    bex.NoCredentialsError,
    bex.PartialCredentialsError,
    bex.CredentialRetrievalError,  # a failing credential_process, assume-role, ...
    bex.TokenRetrievalError,
    bex.SSOError,  # no or expired SSO token: `aws sso login`
    bex.NoAuthTokenError,
    bex.RefreshWithMFAUnsupportedError,
    bex.UnknownCredentialError,
)
"""botocore's "could not get credentials" errors, raised before any request is sent."""


_ENV_CREDENTIALS = {
    "access_key": ("AWS_ACCESS_KEY_ID",),
    "secret_key": ("AWS_SECRET_ACCESS_KEY",),
    "token": ("AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"),
}
"""The environment variables botocore's ``EnvProvider`` reads each of them from."""
_ARGUMENTS = {
    "access_key": "access_key_id",
    "secret_key": "secret_access_key",
    "token": "session_token",
}
"""The arguments that give each of them explicitly."""


def _credential_source(field: str, value: str, method: str) -> str:
    """Where botocore found the credential ``field`` (never its value), for messages."""
    if method == "explicit":
        return _ARGUMENTS[field]
    if method == "env":
        names = _ENV_CREDENTIALS[field]
        name = next((n for n in names if os.environ.get(n) == value), names[0])
        return f"{name} (from the environment)"
    return f"the {_ARGUMENTS[field]} botocore found ({method})"


_INVALID_ENDPOINT = "Invalid endpoint: "
"""How botocore's ``ValueError`` for an endpoint it refuses begins; the endpoint follows."""


def _botocore_endpoint_error(text: str) -> str:
    """botocore's refusal of an endpoint with the endpoint shown by :func:`redact_url`:
    credentials masked (where its ``://`` is mistyped or missing too: ``_scrub`` finds only
    those after ``://``), query and fragment cut."""
    head, sep, endpoint = text.partition(_INVALID_ENDPOINT)
    return f"{head}{sep}{redact_url(endpoint)}" if sep else redact_url(text)


_REDACTED_TREE = "botocore"
"""The loggers whose records :class:`_RedactCredentials` masks: botocore's, all of them. Its
DEBUG records print request headers (``botocore.auth``, ``botocore.endpoint``,
``botocore.awsrequest``) and response bodies (``botocore.parsers``, ``botocore.handlers``:
"Error found for response with 200 status code: b'<body>'"), and a later botocore may log
from a module of its own."""
_live_stores: weakref.WeakSet[S3Store] = weakref.WeakSet()
"""Stores with explicit credentials, whose secrets the filter masks; guarded by the lock."""
_live_lock = threading.Lock()
_fork_lock = threading.Lock()
"""Held while a store builds its client for a process forked from the one that made it."""


def _new_fork_lock() -> None:
    # Another thread of the parent may have held it at the fork: in the child it is never let go.
    global _fork_lock
    _fork_lock = threading.Lock()


os.register_at_fork(after_in_child=_new_fork_lock)


class _RedactCredentials(logging.Filter):
    """Masks session tokens, a server's quote of the request's signing and the credentials of
    live stores in botocore's records (:func:`_redact_botocore_logs` installs it).

    botocore logs every request's headers (``X-Amz-Security-Token`` included) and error bodies
    (which may quote them) at DEBUG; an application that sets its root logger to DEBUG would
    write them to its logs. A filter runs only for records that pass the logger's level, so
    this costs nothing otherwise. It changes the record itself, so every handler that sees the
    record after it sees it masked.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record: let logging report it as it does
            return True
        with _live_lock:
            stores = list(_live_stores)
        scrubbed = _redact(message, stores)
        if scrubbed != message:
            record.msg, record.args = scrubbed, None
        if record.exc_info and not record.exc_text:
            # Formatters print exc_text, once set, instead of formatting exc_info again.
            record.exc_text = _redact(_FORMATTER.formatException(record.exc_info), stores)
        return True


def _redact(text: str, stores: Iterable[S3Store]) -> str:
    for store in stores:
        text = store._scrub(text)  # also masks what redact_signing_details does
    return redact_signing_details(text)


_FORMATTER = logging.Formatter()


class _RedactingHandler(logging.Handler):
    """On the ``botocore`` logger, first of its handlers: masks (its filter) every record of
    every logger in botocore's tree before the handlers of ``botocore`` and its ancestors (the
    application's, on the root logger) see it; emits nothing itself.

    A filter on a logger sees only the records logged on that logger itself, not those its
    children propagate: this handler covers botocore loggers that do not exist yet (a module
    imported later, a later botocore's new logger) too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.addFilter(_REDACT)

    def emit(self, record: logging.LogRecord) -> None:
        pass


_NOT_S3_REPLY = "BatchWeaveNotS3"
"""Key :meth:`S3Store._on_response` sets in a response's ``ResponseMetadata`` when the server
answered ``200`` with a body that is not XML (a web page), which botocore turned into a ``500``."""


def _no_retry_after_read_timeout(caught_exception: Exception | None = None, **_: Any) -> Any:
    """A probe client's ``needs-retry`` handler: a read timeout is final (``False``), not retried.

    Registered before botocore's retry handler, whose answer the first non-``None`` one
    overrides; every other outcome (``None``) is left to it.
    """
    return False if isinstance(caught_exception, bex.ReadTimeoutError) else None


def _throttle_delay(attempts: int) -> float:
    """Seconds to wait before retrying after the ``attempts``-th attempt was throttled:
    botocore's backoff for throttling (``rand(0, 1) * min(2 ** (attempts - 1), 20)``)."""
    return random.random() * min(2.0 ** (attempts - 1), 20.0)


class _ThrottlingRetry:
    """A ``needs-retry`` handler retrying what botocore's ``standard`` mode does not: an HTTP
    ``429`` (a rate limiter or proxy in front of S3, often without S3's XML error) and the
    throttling codes of :data:`THROTTLED_CODES` it does not know (``TooManyRequests``).

    Within the client's attempts (``total_max_attempts``, as botocore counts them), with
    botocore's throttling backoff; the last attempt's answer is left to botocore (which then
    raises it: ``TransientStoreError``). A throttled attempt stored nothing, so
    :meth:`S3Store._on_put_attempt` notes it as not landed and a retried PUT keeps the
    ambiguity rules: a create retried after a 429 is resolved by the answers of its attempts
    as any other.
    """

    def __init__(self, client: S3Client) -> None:
        self._client = client

    def _max_attempts(self) -> int:
        retries = getattr(self._client.meta.config, "retries", None) or {}
        if "total_max_attempts" in retries:
            return int(retries["total_max_attempts"])
        if "max_attempts" in retries:  # botocore's legacy form: retries, not attempts
            return int(retries["max_attempts"]) + 1
        return 3  # botocore's standard default (an injected client without retry settings)

    def __call__(self, response: Any = None, attempts: int = 1, **_: Any) -> Any:
        if response is None:
            return None
        http, parsed = response
        status = getattr(http, "status_code", None)
        error = parsed.get("Error", {}) if isinstance(parsed, dict) else {}
        code = error.get("Code") if isinstance(error, dict) else None
        if status != 429 and code not in THROTTLED_CODES:
            return None
        if attempts >= self._max_attempts():
            return None
        return _throttle_delay(attempts)


_XML_ELEMENT = re.compile(rb"<[A-Za-z_]")
"""The start of an XML element (``<Error>``, ``<ListBucketResult ...>``)."""
_HTML_ELEMENT = re.compile(rb"<(?:html|head|body)\b", re.IGNORECASE)
"""An element that starts a web page, not an S3 document."""


def _is_xml(body: bytes) -> bool:
    """Whether ``body`` may be an S3 answer, possibly cut short: it begins as XML does.

    With the XML declaration, or a part of it (``<?x``: cut short), or with an element that is
    not HTML's: S3 and some compatible servers send ``<Error>`` in a ``200`` without a
    declaration, which botocore rightly makes a ``500``. A web page begins with ``<!DOCTYPE``,
    ``<html>`` or text that is no element.
    """
    start = body.lstrip().removeprefix(b"\xef\xbb\xbf").lstrip()  # a UTF-8 byte order mark
    if b"<?xml".startswith(start[:5]):
        return True
    return _XML_ELEMENT.match(start) is not None and _HTML_ELEMENT.match(start) is None


_REDACT = _RedactCredentials()
_REDACTING_HANDLER = _RedactingHandler()


def _redact_botocore_logs() -> None:
    """Install the masking of botocore's records (again, if a logging configuration removed it).

    :class:`_RedactingHandler` on the ``botocore`` logger, first, for the handlers of it and of
    its ancestors; and :class:`_RedactCredentials` on every botocore logger there is now, for
    handlers attached to such a logger itself (which run before the ``botocore`` logger's).
    Run at import and whenever an :class:`S3Store` is made (botocore has imported more of its
    modules, with their loggers, by then).
    """
    tree = logging.getLogger(_REDACTED_TREE)
    if _REDACTING_HANDLER not in tree.handlers:
        tree.handlers.insert(0, _REDACTING_HANDLER)  # before handlers attached earlier
    loggers = [tree] + [
        logger
        for name, logger in list(logging.Logger.manager.loggerDict.items())
        if name.startswith(f"{_REDACTED_TREE}.") and isinstance(logger, logging.Logger)
    ]
    for logger in loggers:
        if _REDACT not in logger.filters:
            logger.addFilter(_REDACT)


_redact_botocore_logs()


class S3Store(S3Location):
    """Objects under ``s3://bucket/prefix`` on AWS S3 or an S3-compatible server.

    Credentials come from the arguments if given, else from boto3's normal chain (environment,
    ``profile``, config files, instance metadata). ``max_pool_connections`` is sized for many
    concurrent range reads (consumer prefetch); ``max_attempts`` counts the first attempt, so
    ``1`` disables botocore's retries. ``addressing_style`` defaults to ``"path"`` when an
    ``endpoint_url`` is given (what MinIO, SeaweedFS and RGW expect) and to botocore's choice
    otherwise. ``probe_timeout`` bounds :func:`~batchweave.open_store`'s conditional-write probe
    (each answer, through a client of its own); the data path keeps ``read_timeout``. ``client``
    injects a ready boto3 S3 client (tests, custom sessions); the other connection options are
    then ignored.

    Neither ``url`` nor ``repr`` nor any error message contains credentials.
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
        profile: str | None = None,
        max_pool_connections: int = 64,
        connect_timeout: float = 5.0,
        read_timeout: float = 60.0,
        max_attempts: int = 5,
        addressing_style: str | None = None,
        probe_timeout: float = 10.0,
        client: S3Client | None = None,
    ) -> None:
        super().__init__(
            bucket,
            prefix,
            endpoint_url=endpoint_url,
            access_key_id=access_key_id,
            secret_access_key=secret_access_key,
            session_token=session_token,
            region=region,
            options=None
            if client is not None
            else {
                "max_pool_connections": max_pool_connections,
                "connect_timeout": connect_timeout,
                "read_timeout": read_timeout,
                "max_attempts": max_attempts,
                "addressing_style": addressing_style,
                "probe_timeout": probe_timeout,
            },
        )
        self._local = threading.local()
        self._session: boto3.session.Session | None = None
        """The session the client was made from (``None``: injected); probe clients reuse it."""
        self._config: Config | None = None
        self._client_config: Config | None = None
        """The configuration the client was made with (``None``: injected), for a forked child."""
        self._probe = False
        """Whether the client is a probe client (see :meth:`_use_probe_client`)."""
        self._pid = current_pid()
        """The process the client belongs to: another one (forked) makes its own."""
        self._inherited: S3Client | None = None
        """A forked child's reference to the client it inherited, which it never closes."""
        self._session_lock = threading.Lock()
        """A boto3 session is not thread-safe: probe clients may be made from several threads."""
        if client is None:
            assert self._options is not None
            client = self._make_client(
                region=region,
                access_key_id=access_key_id,
                secret_access_key=secret_access_key,
                session_token=session_token,
                profile=profile,
                options=self._options,
            )
            if endpoint_url is None:
                # botocore may take it from AWS_ENDPOINT_URL(_S3) or the AWS config file.
                self._endpoint_shown = client.meta.endpoint_url
                check_endpoint(
                    client.meta.endpoint_url,
                    f"the endpoint botocore found for {self.url} (AWS_ENDPOINT_URL, "
                    "AWS_ENDPOINT_URL_S3 or the AWS config file)",
                    bucket=self.bucket,
                )
        self._own_client = client
        self._client_config = self._config
        if self._secrets:
            with _live_lock:
                _live_stores.add(self)
        _redact_botocore_logs()  # the loggers of botocore's modules imported since
        self._register(client)

    def _register(self, client: S3Client) -> None:
        """Install this store's botocore event handlers on ``client``."""
        # Note PutObject attempts that may have landed, so a final connect error or 4xx after
        # an earlier timed-out (or 5xx) attempt is reported as ambiguous, not as "never sent".
        client.meta.events.register("needs-retry.s3.PutObject", self._on_put_attempt)
        # On "needs-retry.s3.*": runs before botocore's retry handler (on "needs-retry.s3"),
        # whose answer a False from here overrides.
        client.meta.events.register("needs-retry.s3.*", self._on_response)
        # After it (a web page is never retried), also before botocore's: throttling it skips.
        client.meta.events.register("needs-retry.s3.*", _ThrottlingRetry(client))

    def _make_client(
        self,
        *,
        region: str | None,
        access_key_id: str | None,
        secret_access_key: str | None,
        session_token: str | None,
        profile: str | None,
        options: ClientOptions,
    ) -> S3Client:
        try:
            session = boto3.session.Session(
                aws_access_key_id=access_key_id,
                aws_secret_access_key=secret_access_key,
                aws_session_token=session_token,
                region_name=region,
                profile_name=profile,
            )
        except bex.ProfileNotFound as exc:
            named = (
                repr(profile)
                if profile is not None
                else f"{os.environ.get('AWS_PROFILE', '')!r} (from AWS_PROFILE)"
            )
            raise InvalidStoreURL(
                f"{self.url}: AWS profile {named} is not in the AWS config files"
            ) from self._scrubbed(exc)
        style = options.addressing_style or ("path" if self.endpoint_url else None)
        config = Config(
            connect_timeout=options.connect_timeout,
            read_timeout=options.read_timeout,
            retries={"mode": "standard", "total_max_attempts": options.max_attempts},
            max_pool_connections=options.max_pool_connections,
            s3=cast(Any, {"addressing_style": style} if style else None),
            user_agent_extra="batchweave",
        )
        client = self._client_from(session, config)
        self._check_resolved_credentials(session)
        self._session, self._config = session, config
        return client

    def _check_resolved_credentials(self, session: boto3.session.Session) -> None:
        """Refuse credentials botocore found (environment, profile, ...) that can never be sent,
        naming where they came from, and mask them in every message from now on.

        Explicit arguments were checked before (``check_s3_arguments``); a value found
        elsewhere, such as an ``AWS_SESSION_TOKEN`` read from a secret file with its trailing
        newline, would fail every request with "Invalid header value b'<the token>\\n'": a
        transient-looking error (retried without end) that quotes the token escaped, past
        :meth:`_scrub`.
        """
        try:
            # Found (and kept) by the session when the client was made: nothing new is asked.
            with self._session_lock:
                credentials = session.get_credentials()
                if credentials is None:
                    return  # none found: the first request says so (AccessDenied)
                if isinstance(credentials, RefreshableCredentials) and credentials.refresh_needed():
                    # Fetched at the first request (an SSO login, an assumed role), as a client
                    # does; not here, where no request is sent. Checked no further.
                    return
                frozen = credentials.get_frozen_credentials()
        except _CREDENTIAL_ERRORS as exc:
            raise self._credential_failure(f"open {self.url}", exc) from self._scrubbed(exc)
        method = str(getattr(credentials, "method", "") or "the AWS credential chain")
        found = {"access_key": frozen.access_key, "secret_key": frozen.secret_key}
        found["token"] = frozen.token
        for field, value in found.items():
            if value is not None:
                where = _credential_source(field, value, method)
                refuse_unusable_credential(self.url, where, value)
        self._add_secrets(*found.values())

    def _client_from(self, session: boto3.session.Session, config: Config) -> S3Client:
        try:
            # Resolves the credentials: a failing credential_process or SSO profile fails here.
            # (The session keeps them: a probe client made from it resolves nothing again.)
            with self._session_lock:
                return session.client("s3", endpoint_url=self.endpoint_url, config=config)
        except _CREDENTIAL_ERRORS as exc:
            raise self._credential_failure(f"open {self.url}", exc) from self._scrubbed(exc)
        except bex.BotoCoreError as exc:
            raise InvalidStoreURL(
                f"cannot configure boto3 for {self.url}: {self._scrub(str(exc))}"
            ) from self._scrubbed(exc)
        except ValueError as exc:
            # botocore's own check of the endpoint ("Invalid endpoint: ..."): a bare ValueError
            # that names no setting. It quotes the endpoint, which is shown as any endpoint is.
            detail = _botocore_endpoint_error(self._scrub(str(exc)))
            raise InvalidStoreURL(
                f"{self.url}: {self._unusable_endpoint(session)} (botocore: {detail})"
            ) from self._scrubbed(ValueError(detail))

    def _unusable_endpoint(self, session: boto3.session.Session) -> str:
        """What made the endpoint botocore refused, and what to do: the ``endpoint_url``
        argument (a host name botocore refuses), an empty region (botocore then builds the
        host ``s3..amazonaws.com``), or an endpoint botocore found in the environment or the
        AWS config file."""
        if self.endpoint_url is not None:
            if not is_valid_endpoint_url(self.endpoint_url):
                return (
                    f"boto3 cannot use the endpoint_url {redact_url(self.endpoint_url)!r}: "
                    "botocore accepts only host names of ASCII letters, digits, '-' and '.' "
                    "(no '_', no accented letters): use the server's IP address, a host name "
                    "without '_', the punycode form (xn--...) of an international name, or "
                    "s3_client='obstore'"
                )
            return f"boto3 cannot use the endpoint_url {redact_url(self.endpoint_url)!r}"
        with contextlib.suppress(Exception):
            if session.region_name == "":
                where = (
                    "AWS_DEFAULT_REGION is set but empty"
                    if os.environ.get("AWS_DEFAULT_REGION") == ""
                    else "the region in the AWS config file is empty"
                )
                return (
                    f"{where}, so boto3 cannot build the AWS endpoint; set it to the bucket's "
                    "region (e.g. us-east-1) or unset it, or pass region"
                )
        return (
            "the endpoint botocore found (AWS_ENDPOINT_URL, AWS_ENDPOINT_URL_S3 or the AWS "
            "config file) is unusable; give scheme, host and port, e.g. http://127.0.0.1:9000"
        )

    def _use_probe_client(self, options: ClientOptions) -> None:
        # Options are only known for a client this store made, from a session it kept.
        assert self._session is not None
        assert self._config is not None
        config = self._config.merge(
            Config(
                connect_timeout=options.probe_connect_timeout,
                read_timeout=options.probe_read_timeout,
                retries={"mode": "standard", "total_max_attempts": options.probe_attempts},
            )
        )
        self._local = threading.local()
        self._own_client = self._new_client(config, probe=True)
        self._client_config, self._probe = config, True

    def _new_client(self, config: Config, *, probe: bool) -> S3Client:
        """A client of this store's session with ``config`` and this store's event handlers."""
        assert self._session is not None
        client = self._client_from(self._session, config)
        self._register(client)
        if probe:
            client.meta.events.register("needs-retry.s3.*", _no_retry_after_read_timeout)
        return client

    @property
    def _client(self) -> S3Client:
        """The client of this process: in a process forked from the one that made this store,
        a new one, made the first time it is needed (:meth:`_client_after_fork`)."""
        if self._pid != current_pid():
            self._client_after_fork()
        return self._own_client

    def _client_after_fork(self) -> None:
        """Give this store a client of its own in a process forked from the one it was used in.

        The inherited client's connection pool holds the parent's keep-alive sockets: a request
        sent on one of them by both processes reads the other's response (garbled data, or
        errors quoting another request's bytes). The new client comes from the same session
        (the credentials it resolved) with the same configuration; the inherited one is kept,
        never used or closed (closing would shut connections the parent still uses).
        """
        with _fork_lock:
            pid = current_pid()
            if self._pid == pid:  # another thread of this process made it meanwhile
                return
            if self._session is None or self._client_config is None:
                raise StoreError(
                    f"{self.url}: this S3Store was made with an injected client= in process "
                    f"{self._pid} and is used in process {pid}, forked from it: that client's "
                    "connections are the parent's, and both using them garbles responses. Make "
                    "the store in the child process (or pass a store URL to WeaveDataset, which "
                    "each DataLoader worker opens itself)"
                )
            # The session's lock may have been held by another thread of the parent at the fork.
            self._session_lock = threading.Lock()
            self._local = threading.local()
            client = self._new_client(self._client_config, probe=self._probe)
            self._inherited, self._own_client = self._own_client, client
            self._pid = pid

    @property
    def client(self) -> S3Client:
        """The underlying boto3 client (for tests and advanced use): this process's."""
        return self._client

    def close(self) -> None:
        if self._pid != current_pid():
            return  # the client is the parent's, which still uses its connections
        self._own_client.close()

    # -- error translation -------------------------------------------------------------------

    def _on_put_attempt(
        self, response: Any = None, caught_exception: Exception | None = None, **_: Any
    ) -> None:
        """Note a PutObject attempt that may have landed (``put_maybe_landed``).

        Every attempt may have, except one that could not connect (``ConnectionError``: nothing
        was sent) and one answered below 500 or with 501: a 4xx is a definite refusal of that
        attempt (429 included), a redirect stores nothing, a 501 says the server does not
        implement the request. A read timeout, a reset after sending, another 5xx may all come
        after the object was stored.
        """
        if caught_exception is not None:
            landed = not isinstance(caught_exception, bex.ConnectionError)
        else:
            status = getattr(response[0], "status_code", None) if response else None
            landed = not (isinstance(status, int) and (status < 500 or status == 501))
        if landed:
            self._local.put_maybe_landed = True

    def _on_response(self, response: Any = None, **_: Any) -> Any:
        """Mark a web page botocore took for a cut S3 error, and do not retry it (``False``).

        botocore parses a ``200`` body that is not XML as a ``500`` error (meant for an S3
        answer cut short), which would be retried and reported as transient: a web server or
        console on the endpoint's port would read as an S3 outage. The wire status is still
        ``200`` on the raw response. A body that begins as XML (:func:`_is_xml`: ``<?xml``, or
        an element such as ``<Error>``) stays botocore's case.
        """
        if response is None:
            return None
        http, parsed = response
        metadata = parsed.get("ResponseMetadata", {}) if isinstance(parsed, dict) else {}
        wire = getattr(getattr(http, "raw", None), "status", None)
        if wire != 200 or metadata.get("HTTPStatusCode") != 500:
            return None
        body = bytes(getattr(http, "content", b"") or b"")
        if _is_xml(body):
            return None
        kind = self._scrub(str(http.headers.get("content-type", "no content type")))[:60]
        metadata[_NOT_S3_REPLY] = f"200 with a {len(body)}-byte {kind} body that is not S3's XML"
        return False

    def _translate(self, exc: Exception, *, op: str, key: str | None) -> StoreError:
        """Map a botocore exception to the store error tree. The single place that does so.

        Raise it ``from self._scrubbed(exc)``, never ``from exc``: ``exc`` may quote the
        server's reply (see :meth:`_scrubbed`).
        """
        what = self._describe(op, key)
        write = op in _WRITE_OPS
        # Whether an attempt of this write may have landed (see _on_put_attempt).
        landed = write and getattr(self._local, "put_maybe_landed", False)
        if isinstance(exc, bex.ClientError):
            not_s3 = exc.response.get("ResponseMetadata", {}).get(_NOT_S3_REPLY)
            if not_s3:
                return self._not_s3(op, key, str(not_s3))
            error = exc.response.get("Error", {})
            code = str(error.get("Code", ""))
            message = self._scrub(str(error.get("Message", "")))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            detail = f"{what}: {code or status} {message}".rstrip()
            headers = exc.response.get("ResponseMetadata", {}).get("HTTPHeaders", {})
            region = headers.get("x-amz-bucket-region") or error.get("Region")
            if code == "PermanentRedirect" or (status == 301 and region):
                # Left after botocore's own region redirect (an endpoint_url of another region).
                where = f"in region {region!r}" if region else "in another region"
                return StoreError(
                    f"{detail}: the bucket is {where}; set region to it and, for AWS S3, leave "
                    "endpoint_url unset (or use that region's endpoint)"
                )
            return self._from_code(code, status, detail, op=op, key=key, landed=landed)
        if isinstance(exc, _CREDENTIAL_ERRORS):
            return self._credential_failure(what, exc)
        if isinstance(exc, RecursionError) or _RECURSION in str(exc):
            # botocore answers a bare 301 by asking the bucket's region with another request,
            # which is redirected too, until the stack overflows. Nothing was stored.
            return self._not_s3(
                op,
                key,
                "it answered with redirects (an http-to-https redirect, a load balancer or web "
                "server on that port, or a bucket in another region: set region)",
            )
        if isinstance(exc, bex.ParamValidationError):
            # Refused by botocore before anything was sent: neither ambiguous nor transient.
            return StoreError(f"cannot {what}: boto3 refused the request: {self._scrub(str(exc))}")
        if self._answer_within is not None and isinstance(exc, bex.ReadTimeoutError):
            return self._silent(op, key)  # the probe: connected, then no answer in time
        endpoint = self._endpoint_shown
        if isinstance(exc, bex.ReadTimeoutError):
            config: Any = self._client.meta.config
            within = f"read_timeout={config.read_timeout:g} s"
            if write:
                ambiguous = AmbiguousWriteError(
                    f"{what}: {endpoint} did not answer within {within}; the object may or may "
                    "not exist now, read it back to decide"
                )
                ambiguous.timed_out = True
                return ambiguous
            return StoreTimeout(
                f"{what}: {endpoint} accepted the connection but did not answer within {within} "
                "(an overloaded or hung server, or not an S3 server on that port)"
            )
        if isinstance(exc, bex.ConnectionError):
            if landed:
                return AmbiguousWriteError(
                    f"{what}: an earlier attempt may have landed before {endpoint} became "
                    "unreachable; read the object back to decide"
                )
            return StoreUnavailable(
                f"cannot {what}: {endpoint} is unreachable ({self._scrub(str(exc))})"
            )
        if isinstance(exc, bex.BotoCoreError):
            if write:
                return AmbiguousWriteError(
                    f"{what}: the outcome is unknown ({type(exc).__name__}); the object may or "
                    "may not exist now, read it back to decide"
                )
            return TransientStoreError(f"{what} failed transiently: {self._scrub(str(exc))}")
        return StoreError(f"{what} failed: {type(exc).__name__}: {self._scrub(str(exc))}")

    def _credential_failure(self, what: str, exc: Exception) -> AccessDenied:
        """The error for one of botocore's :data:`_CREDENTIAL_ERRORS`."""
        reason = "" if isinstance(exc, bex.NoCredentialsError) else self._scrub(str(exc))
        return self._no_credentials(what, reason)

    def _from_code(
        self, code: str, status: int, detail: str, *, op: str, key: str | None, landed: bool = False
    ) -> StoreError:
        """The error for S3's answer ``code``/``status``; ``landed``: an earlier attempt of this
        write may have landed (a 4xx or 501 refuses only the last attempt)."""
        # Only the conditional PUT asks a condition: a 412 or 409 to another request is no
        # answer about the key (and a plain StoreError below).
        if op == "put_if_absent" and (code == "PreconditionFailed" or status == 412):
            return ObjectExists(detail)
        if op == "put_if_absent" and (code == "ConditionalRequestConflict" or status == 409):
            return ConcurrentWriteConflict(detail)
        if code == "NoSuchBucket":
            return self._missing_bucket(detail)
        if status == 404 and op in BUCKET_OPS and code != "NoSuchKey":
            return self._not_s3(
                op, key, f"{code or status} to a {op}, which S3 only answers with NoSuchBucket"
            )
        if code in _NOT_FOUND or status == 404:
            return ObjectNotFound(detail)
        # botocore makes the code the bare status (or leaves it empty) when the body is not
        # S3's XML error. Such a 4xx or 501 refuses only the last attempt of a write: after an
        # earlier one that may have landed, it stays ambiguous below.
        why = not_s3_status(op, status) if code in ("", str(status)) else None
        if why is not None and not landed:
            return self._not_s3(op, key, why)
        if code in _DENIED or status == 403:
            return self._denied(detail)
        if code == "NotImplemented" and op == "put_if_absent":
            return self._no_conditional_writes(detail)
        if op in _WRITE_OPS and status >= 500:
            return AmbiguousWriteError(f"{detail}; the write may have landed, read it back")
        if op in _WRITE_OPS and landed:
            return AmbiguousWriteError(
                f"{detail}; an earlier attempt may have landed (it got no answer, or a 5xx), "
                "read the object back to decide"
            )
        if code in THROTTLED_CODES or status >= 500 or status == 429:
            return TransientStoreError(detail)
        if status == 0 and code in TRANSIENT_CODES:
            # A key's error in a DeleteObjects result, which has no status of its own.
            return TransientStoreError(detail)
        return StoreError(detail)

    # -- operations --------------------------------------------------------------------------

    def put(self, key: str, data: bytes | memoryview, *, mode: PutMode = PutMode.OVERWRITE) -> None:
        full = self._key(key)
        check_mode(mode)
        body = data if isinstance(data, bytes) else bytes(data)
        self._local.put_maybe_landed = False
        try:
            if mode is PutMode.CREATE:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=body, IfNoneMatch="*")
            else:
                self._client.put_object(Bucket=self.bucket, Key=full, Body=body)
        except Exception as exc:
            op = "put_if_absent" if mode is PutMode.CREATE else "put"
            raise self._translate(exc, op=op, key=key) from self._scrubbed(exc)

    def get(self, key: str) -> bytes:
        full = self._key(key)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
            self._check_reply(resp, op="get", key=key)
            return resp["Body"].read()
        except StoreError:
            raise
        except Exception as exc:
            raise self._translate(exc, op="get", key=key) from self._scrubbed(exc)

    def _check_reply(self, resp: Any, *, op: str, key: str) -> None:
        """``StoreError`` (the body unread, closed) if a GET's ``200`` has neither ETag nor
        Last-Modified.

        A web server on the endpoint's port answers every GET with a page: without this check
        its HTML would be returned as the object's bytes. Either header alone is S3's (some
        compatible servers send no ETag), as the obstore backend's ``_check_meta`` has it. A
        reply without HTTP headers (botocore's ``Stubber`` in tests) is no server's: not judged.
        """
        replied = resp.get("ResponseMetadata", {}).get("HTTPHeaders") is not None
        if replied and resp.get("ETag") is None and resp.get("LastModified") is None:
            resp["Body"].close()
            raise self._not_s3(op, key, "no ETag and no Last-Modified in a 200 response")

    def get_range(self, key: str, rng: ByteRange) -> bytes:
        check_range(rng)
        full = self._key(key)
        if isinstance(rng, Bounded) and rng.start == rng.end:
            self.head(key)  # an empty range still requires the object to exist
            return b""
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=full, Range=_range_header(rng))
            self._check_reply(resp, op="get_range", key=key)
            if "ContentRange" in resp:
                return resp["Body"].read()
            # The server ignored the Range header and sends the whole object: read only as far
            # as a bounded range needs (a caller bounding its read stays bounded), slice here.
            stream = resp["Body"]
            body = _read_prefix(stream, rng.end) if isinstance(rng, Bounded) else stream.read()
            stream.close()
        except bex.ClientError as exc:
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if exc.response.get("Error", {}).get("Code") == "InvalidRange" or status == 416:
                return b""  # the range starts at or past the end: clamp like every backend
            raise self._translate(exc, op="get_range", key=key) from self._scrubbed(exc)
        except StoreError:
            raise
        except Exception as exc:
            raise self._translate(exc, op="get_range", key=key) from self._scrubbed(exc)
        # ``body`` is the object's first bytes (all of it, or up to the bounded range's end).
        start, end = resolve_range(rng, len(body))
        return body[start:end]

    def head(self, key: str) -> ObjectMeta:
        full = self._key(key)
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=full)
        except Exception as exc:
            raise self._translate(exc, op="head", key=key) from self._scrubbed(exc)
        if "ContentLength" not in resp or "LastModified" not in resp:
            # A web page on the endpoint's port (every S3 HEAD has both).
            raise self._not_s3("head", key, "no Content-Length or Last-Modified in a 200 reply")
        return ObjectMeta(
            key=key,
            size=int(resp["ContentLength"]),
            last_modified=resp["LastModified"].timestamp(),
            etag=resp.get("ETag"),
        )

    def list(self, prefix: str = "", *, start_after: str | None = None) -> Iterator[ObjectMeta]:
        strip = len(self.prefix)
        extra: dict[str, Any] = {}
        if start_after is not None:
            extra["StartAfter"] = self.prefix + start_after
        while True:
            try:
                resp = self._client.list_objects_v2(
                    Bucket=self.bucket, Prefix=self.prefix + prefix, **extra
                )
            except Exception as exc:
                raise self._translate(exc, op="list", key=prefix or None) from self._scrubbed(exc)
            if not _LISTING_FIELDS & resp.keys():
                # An empty listing, as botocore parses a web page, would read as "nothing here".
                raise self._not_s3("list", prefix or None, "not a ListObjectsV2 result")
            for obj in resp.get("Contents", []):
                if not {"Key", "Size", "LastModified"} <= obj.keys():
                    # S3 sends all three for every object: a listing that lacks one is not S3's.
                    missing = sorted({"Key", "Size", "LastModified"} - obj.keys())
                    raise self._not_s3(
                        "list", prefix or None, f"a listed object without {', '.join(missing)}"
                    )
                yield ObjectMeta(
                    key=obj["Key"][strip:],
                    size=int(obj["Size"]),
                    last_modified=obj["LastModified"].timestamp(),
                    etag=obj.get("ETag"),
                )
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                return
            extra = {"ContinuationToken": token}

    def delete_many(self, keys: Iterable[str]) -> None:
        # Every key is checked before any batch is sent: an invalid one deletes nothing.
        it = iter([self.prefix + k for k in checked_keys(keys)])
        while batch := list(itertools.islice(it, DELETE_BATCH)):
            try:
                resp = self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": k} for k in batch], "Quiet": True},
                )
            except Exception as exc:
                raise self._translate(
                    exc, op="delete", key=batch[0][len(self.prefix) :]
                ) from self._scrubbed(exc)
            errors = [e for e in resp.get("Errors", []) if e.get("Code") != "NoSuchKey"]
            if errors:
                first = errors[0]
                rel = str(first.get("Key", ""))[len(self.prefix) :]
                code = str(first.get("Code", ""))
                detail = (
                    f"delete {rel!r} in {self.url}: {code} "
                    f"{self._scrub(str(first.get('Message', '')))}"
                    + (f" (and {len(errors) - 1} more keys failed)" if len(errors) > 1 else "")
                )
                raise self._from_code(code, 0, detail, op="delete", key=rel)


def _read_prefix(stream: Any, size: int) -> bytes:
    """The first ``size`` bytes of ``stream`` (fewer at its end); a read may return less."""
    chunks: list[bytes] = []
    while size > 0:
        chunk = stream.read(size)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def _range_header(rng: ByteRange) -> str:
    if isinstance(rng, Bounded):
        return f"bytes={rng.start}-{rng.end - 1}"
    if isinstance(rng, Offset):
        return f"bytes={rng.start}-"
    assert isinstance(rng, Suffix)
    return f"bytes=-{rng.length}"

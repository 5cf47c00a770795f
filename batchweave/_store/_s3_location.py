"""What both ``s3://`` backends share: where the objects live and how to name them safely.

:class:`~batchweave.S3Store` (boto3) and :class:`~batchweave.ObstoreS3Store` differ only in the
client; the bucket/prefix location, the key mapping, the credential-free ``url``/``repr`` and the
error wording live here once, so the two cannot drift apart.
"""

from __future__ import annotations

import copy
import math
import numbers
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final
from urllib.parse import urlsplit

from batchweave._errors import (
    AccessDenied,
    ConditionalWritesUnsupported,
    InvalidStoreURL,
    StoreError,
    StoreUnavailable,
)
from batchweave._store._base import ObjectStore, validate_key

__all__ = [
    "BUCKET_OPS",
    "DENIED_CODES",
    "PROBE_ATTEMPTS",
    "THROTTLED_CODES",
    "TOKEN_HEADER",
    "TRANSIENT_CODES",
    "ClientOptions",
    "S3Location",
    "ScrubbedClientError",
    "check_endpoint",
    "check_region",
    "not_s3_status",
    "check_s3_arguments",
    "redact_signing_details",
    "redact_url",
    "refuse_unusable_credential",
    "refuse_url_credentials",
]

PROBE_ATTEMPTS = 3
"""At most this many attempts per request of ``open_store``'s probe (``max_attempts`` if lower).

A probe request that times out waiting for an answer is not retried at all: a server that did
not answer a few-byte PUT within ``probe_timeout`` will not answer the next one either, and each
retry would add as long again. Throttling, 5xx and connect errors still get these attempts."""

_USERINFO = re.compile(r"(?<=://)[^/?#\s\"']*@")
"""The ``user:password@`` of any URL in a text (botocore and obstore quote request URLs), up to
the authority's last ``@``, as ``urlsplit`` reads it: a password may contain ``@`` itself. A
URL given to BatchWeave is masked by :func:`redact_url`, which also finds a password holding
``/``, ``?`` or ``#`` (a URL with credentials is refused, so none reaches the clients' text)."""

TOKEN_HEADER = re.compile(r"(x-amz-security-token['\"]?\s*[:=]\s*b?['\"]?)[^'\"\s,}]+", re.I)
"""A session token in a header dump: botocore's canonical request and request repr, the
``<CanonicalRequest>`` an AWS ``SignatureDoesNotMatch`` quotes."""
_SIGNING_DETAILS = re.compile(
    r"(<(AWSAccessKeyId|CanonicalRequest(?:Bytes)?|StringToSign(?:Bytes)?|SignatureProvided)>)"
    r".*?(?=</\2>|\Z)"
    r"|(\bCredential=)[^/\s,'\"]+",
    re.DOTALL,
)
"""What an S3 server quotes of the request's signing when it refuses it: AWS's
``SignatureDoesNotMatch`` names the access key id and dumps the canonical request (with the
session token's header) and the string to sign; an ``Authorization`` header names the key id
(``Credential=<id>/<date>/...``). Masked even where the credentials are not known to the store
(found by a client itself, refreshed), up to the element's end or the text's end if cut short."""


def redact_signing_details(text: str) -> str:
    """``text`` with the session token header and a server's quote of the request's signing
    (:data:`_SIGNING_DETAILS`) masked: for text from a server or client whose credentials are
    not all known (the store's :meth:`S3Location._scrub` also masks the known ones)."""
    text = TOKEN_HEADER.sub(r"\1***", text)
    return _SIGNING_DETAILS.sub(lambda m: f"{m.group(1) or m.group(3)}***", text)


class ScrubbedClientError(Exception):
    """Stands in for an S3 client's exception as the ``__cause__`` of the BatchWeave error
    translated from it (see :meth:`S3Location._scrubbed`).

    The client's own exception keeps the server's reply (obstore quotes the whole body: an AWS
    ``SignatureDoesNotMatch`` names the access key id and dumps the session token) or echoed
    credentials (botocore's ``ClientError``), and every printed traceback shows the causes. This
    one holds only the name of the client's exception type and its scrubbed message.
    """

    def __init__(self, client_error: str, message: str) -> None:
        super().__init__(client_error, message)  # both in ``args``: it pickles
        self.client_error = client_error
        """The qualified name of the client's exception type, e.g.
        ``botocore.exceptions.ClientError``."""
        self.message = message
        """Its message, scrubbed."""

    def __str__(self) -> str:
        return f"{self.client_error}: {self.message}" if self.message else self.client_error


DENIED_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "ExpiredToken",
        "InvalidAccessKeyId",
        "InvalidToken",
        "SignatureDoesNotMatch",
        "TokenRefreshRequired",
    }
)
"""S3 error codes for credentials that are missing, wrong or not allowed (``AccessDenied``)."""
THROTTLED_CODES = frozenset(
    {
        "RequestLimitExceeded",
        "RequestThrottled",
        "RequestTimeout",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "TooManyRequests",
    }
)
"""S3 error codes that mean "retry later" whatever the status (S3's RequestTimeout is a 400)."""
TRANSIENT_CODES = THROTTLED_CODES | {"InternalError", "ServiceUnavailable"}
"""Codes that are transient without a status: a key's error in a DeleteObjects result."""


_BUCKET = re.compile(r"[a-zA-Z0-9.\-_]{1,255}")
"""Bucket names both S3 clients accept: botocore's own rule, which already admits the legacy
names (upper case, ``_``) some self-hosted servers allow. Anything else is refused up front:
botocore would fail every request with a ``ParamValidationError`` and obstore panics on a
bucket that is not valid in a URL."""
_ACCESS_POINT_ARN = re.compile(
    r"arn:aws[a-z-]*:(s3|s3-object-lambda):[a-z\-0-9]*:[0-9]{12}:accesspoint[/:][a-zA-Z0-9\-.]{1,63}"
    r"|arn:aws[a-z-]*:s3-outposts:[a-z\-0-9]+:[0-9]{12}:outpost[/:][a-zA-Z0-9\-]{1,63}[/:]"
    r"accesspoint[/:][a-zA-Z0-9\-]{1,63}"
)
"""An S3 access point ARN, which boto3 accepts in place of a bucket name (botocore's rule)."""


BUCKET_OPS = frozenset({"put", "put_if_absent", "list", "delete"})
"""Requests whose only S3 404 is ``NoSuchBucket``: a bare 404 means the endpoint is not S3."""

_ADDRESSING_STYLES = ("auto", "path", "virtual")
"""Values of the ``addressing_style`` option both S3 backends accept (``None`` = the default)."""

_MIN_SECRET = 8
"""Credentials shorter than this are not masked in messages (see ``S3Location``): AWS secrets
have 40 characters and MinIO refuses fewer than 8, while test setups use "a", "test" or
"testing", which masking would cut out of every bucket, prefix and key that contains them."""

_UNPRINTABLE = re.compile(r"[\x00-\x20\x7f]")
"""Spaces and control characters: never part of a URL; a pasted one would corrupt every request."""

_NOT_IN_CREDENTIALS = re.compile(r"[\s\x00-\x1f\x7f-\x9f]")
"""Whitespace and control characters (a trailing newline of a credential read from a file):
never part of a credential or region. botocore sends them and echoes the value escaped, which
the scrubbing of messages does not recognize; obstore panics (a ``BaseException``)."""

_REGION = re.compile(r"(?![0-9]+$)(?!-)[a-zA-Z0-9-]{1,63}(?<!-)")
"""A region name both S3 clients may use: a DNS label, not all digits. botocore's own rule
(``botocore.utils.validate_region_name``), except that the empty name is refused too: botocore
then builds the host ``s3..amazonaws.com``, obstore silently uses ``us-east-1``. obstore checks
nothing and puts the region into the AWS host name (``evil.example/x``: ``s3.evil.example``)."""


def check_region(url: str, what: str, region: str) -> None:
    """``InvalidStoreURL`` naming ``what`` (the argument or variable) if ``region`` is not a
    region name both S3 clients may use (:data:`_REGION`)."""
    refuse_unusable_credential(url, what, region)
    if not _REGION.fullmatch(region):
        raise InvalidStoreURL(
            f"{url}: {what} {region!r} is not a valid AWS region name (letters, digits and '-', "
            "e.g. 'us-east-1'; leave it unset for the default)"
        )


def _redact_userinfo(text: str) -> str:
    return _USERINFO.sub("***@", text)


def _userinfo_end(url: str, start: int) -> int:
    """Where the ``user:password@`` that would begin at ``url[start]`` ends (past its ``@``), or -1.

    A password may hold ``/``, ``?`` or ``#`` (AWS secret keys often hold ``/``), which end the
    authority where ``urlsplit`` reads it, and ``@``. So an ``@`` anywhere after ``start`` ends
    credentials if the authority as ``urlsplit`` reads it holds an ``@``, or a ``:`` that starts
    no port (``host:9000``) and is not in an IPv6 literal or an access point ARN; they then run
    to the last ``@``. That may hide more than the credentials (an ``@`` in a key), never less.
    """
    last = url.rfind("@", start)
    if last < 0:
        return -1
    authority = re.split(r"[/?#]", url[start:], maxsplit=1)[0]
    if "@" not in authority:
        if authority.startswith(("[", "arn:")):
            return -1
        colon, port = authority.partition(":")[1:]
        if not colon or (port.isascii() and port.isdigit()):
            return -1
    return last + 1


_SCHEME: Final = re.compile(r"\s*[A-Za-z][A-Za-z0-9+.-]*[:;]?/+")
"""What precedes the authority of a URL: a scheme and its slashes, spelled right (``http://``)
or not (``http:/``, ``http//``, ``s3;//``, ``http:///``)."""


def _authority_start(url: str) -> int:
    """Where the authority of ``url`` begins, for finding its ``user:password@``.

    After the scheme and all its slashes (:data:`_SCHEME`), however mistyped; without one, at
    the start: ``key:secret@host`` (no scheme at all) is all authority. Anchored at the start,
    never a later ``://`` (``http:/u:p@h/a://b``): credentials in a URL whose ``://`` is
    mistyped are masked as in one spelled right.
    """
    scheme = _SCHEME.match(url)
    return scheme.end() if scheme else 0


def _redact_credentials(url: str, start: int | None = None) -> str:
    """``url`` with its ``user:password@`` masked (see :func:`_userinfo_end`).

    ``start``: where the authority begins (the default: see :func:`_authority_start`).
    """
    if start is None:
        start = _authority_start(url)
    end = _userinfo_end(url, start)
    return url if end < 0 else f"{url[:start]}***@{url[end:]}"


def redact_url(url: str, *, authority_at: int | None = None) -> str:
    """``url`` for an error message: ``user:password@`` masked, query and fragment cut off.

    ``authority_at``: where the authority begins, for a URL without ``://`` (``s3:key:secret@b``);
    by default it follows ``://`` (or a mistyped one: see :func:`_authority_start`).
    """
    shown = _redact_credentials(url, authority_at)
    cut = min((i for i in (shown.find("?"), shown.find("#")) if i >= 0), default=-1)
    return shown if cut < 0 else shown[:cut] + "?..."


def has_url_credentials(url: str) -> bool:
    """Whether ``url`` holds ``user:password@``, as :func:`redact_url` masks it (with ``://``
    mistyped or missing too)."""
    return _userinfo_end(url, _authority_start(url)) >= 0


def refuse_url_credentials(endpoint_url: str, what: str) -> None:
    """``InvalidStoreURL`` (not echoing them) if ``endpoint_url`` has ``user:password@``.

    They would be echoed in every error, repr and botocore log line; S3 signs requests with
    access keys and never uses URL credentials. A password holding ``/``, ``?``, ``#`` or ``@``
    counts too (see :func:`_userinfo_end`).
    """
    if has_url_credentials(endpoint_url):
        raise InvalidStoreURL(
            f"{what} {redact_url(endpoint_url)!r} carries credentials (user:password@); "
            "S3 does not use them: remove them from the URL and pass access_key_id/"
            "secret_access_key (or set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) instead"
        )


def check_endpoint(endpoint_url: object, what: str, *, bucket: str) -> None:
    """``InvalidStoreURL`` saying what is wrong with ``endpoint_url`` and what to write instead.

    ``what`` names where the endpoint came from (``"endpoint_url for s3://bucket"``, an
    environment variable). An endpoint is ``scheme://host[:port]``, or with a path where a
    gateway serves its S3 API under one (``https://host/storage/v1/s3``): botocore and obstore
    put the bucket and key after that path. A path that starts with ``bucket`` is the common
    mistake of naming the bucket twice (``http://host:9000/bucket``), which would silently
    store every object under ``bucket/bucket/prefix/...``: refused. Both clients accept every
    form refused here and fail later, if at all: with a misleading "ambiguous write", or
    (obstore, for a bad port) a Rust panic.
    """
    example = "give scheme, host and port, e.g. http://127.0.0.1:9000"
    if not isinstance(endpoint_url, str):
        raise InvalidStoreURL(f"{what} must be a str, got {type(endpoint_url).__name__}; {example}")
    # Credentials masked, query and fragment cut (they may carry a signed URL's token), as for
    # a store URL.
    where = f"{what} {redact_url(endpoint_url)!r}"
    if _UNPRINTABLE.search(endpoint_url):
        raise InvalidStoreURL(f"{where} contains spaces or control characters; {example}")
    refuse_url_credentials(endpoint_url, what)
    try:
        parts = urlsplit(endpoint_url)
        port = parts.port  # raises for a port that is not a number in 0..65535
    except ValueError as exc:
        raise InvalidStoreURL(f"{where} is malformed ({exc}); {example}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InvalidStoreURL(f"{where} is not an http(s) URL; {example}")
    if port == 0:
        raise InvalidStoreURL(f"{where} has port 0; {example}")
    if parts.query or parts.fragment or endpoint_url.endswith(("?", "#")):
        raise InvalidStoreURL(f"{where} has a query or fragment; {example}")
    if parts.path.strip("/").split("/")[0] == bucket:
        raise InvalidStoreURL(
            f"{where} has a path ({parts.path!r}) that names the bucket {bucket!r} again: an S3 "
            "endpoint is scheme://host:port (plus the path of a gateway's S3 API, if it has "
            "one); the bucket and prefix belong in the store URL (s3://bucket/prefix), or every "
            f"object would be stored under {bucket}/{bucket}/..."
        )


def refuse_unusable_credential(url: str, name: str, value: str) -> None:
    """``InvalidStoreURL`` naming ``name`` (never ``value``: it may be a secret) if ``value``
    holds whitespace or control characters.

    ``name`` is an argument (``session_token``) or where the client found the value
    (``AWS_SESSION_TOKEN (from the environment)``). Such a value can never be sent: botocore
    fails each request with a transient-looking error that quotes it escaped (which
    :meth:`S3Location._scrub` does not recognize), obstore panics.
    """
    if _NOT_IN_CREDENTIALS.search(value):
        raise InvalidStoreURL(
            f"{url}: {name} contains whitespace or control characters (a trailing newline, if "
            "it was read from a file?); strip them"
        )


def _positive_number(url: str, name: str, value: object) -> float:
    """``value`` as a ``float`` if it is a finite real number > 0 (NumPy's too), else refused."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        number = float(value)
        if number > 0 and math.isfinite(number):
            return number
    raise InvalidStoreURL(f"{url}: {name} must be a positive number of seconds, got {value!r}")


def _at_least_one(url: str, name: str, value: object, note: str = "") -> int:
    """``value`` as an ``int`` if ``operator.index`` takes it (not a bool) and it is >= 1."""
    if not isinstance(value, bool):
        try:
            number = operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            if number >= 1:
                return number
    raise InvalidStoreURL(f"{url}: {name} must be an integer >= 1{note}, got {value!r}")


_NO_POOL: object = object()
"""``max_pool_connections`` of a backend without that option (obstore)."""


@dataclass(frozen=True)
class ClientOptions:
    """The client options of an S3 backend, checked and as plain ``float``/``int`` values."""

    connect_timeout: float
    read_timeout: float
    probe_timeout: float
    max_attempts: int
    addressing_style: str | None
    max_pool_connections: int | None
    """``None`` for a backend without this option (obstore)."""

    @property
    def probe_read_timeout(self) -> float:
        """Seconds the probe waits for an answer: ``probe_timeout``, or ``read_timeout`` if less."""
        return min(self.read_timeout, self.probe_timeout)

    @property
    def probe_connect_timeout(self) -> float:
        """Seconds the probe waits for a connection: never longer than for an answer."""
        return min(self.connect_timeout, self.probe_timeout)

    @property
    def probe_attempts(self) -> int:
        """Attempts per probe request (see :data:`PROBE_ATTEMPTS`)."""
        return min(self.max_attempts, PROBE_ATTEMPTS)


@dataclass(frozen=True)
class CheckedS3:
    """What :func:`check_s3_arguments` found usable: the location and the client options."""

    prefix: str
    """The prefix without its slashes."""
    url: str
    """``s3://bucket/prefix``, without credentials."""
    options: ClientOptions | None
    """``None`` where only the location was checked (an injected client)."""


def check_s3_arguments(
    bucket: str,
    prefix: str,
    *,
    endpoint_url: str | None,
    access_key_id: str | None,
    secret_access_key: str | None,
    connect_timeout: object,
    read_timeout: object,
    probe_timeout: object,
    max_attempts: object,
    addressing_style: object,
    max_pool_connections: object = _NO_POOL,
    session_token: str | None = None,
    region: str | None = None,
) -> CheckedS3:
    """Check an S3 backend's location and client options; ``InvalidStoreURL`` naming what is wrong.

    The one check of both backends (:class:`S3Location` runs it for each) and of
    :func:`~batchweave._store._open.check_store_url`, which runs it where no store is opened:
    pure, no request, no credentials resolved. So both backends refuse the same values with the
    same words (the clients' own errors are not ``BatchWeaveError`` and name no option), before
    a client is built. Credentials are never echoed: only which one is missing or unusable.
    ``max_pool_connections`` is left out for a backend without that option.
    """
    prefix = check_location(bucket, prefix, endpoint_url)
    url = location_url(bucket, prefix)
    strings = {
        "access_key_id": access_key_id,
        "secret_access_key": secret_access_key,
        "session_token": session_token,
        "region": region,
    }
    for name, value in strings.items():
        if value is None:
            continue
        if not isinstance(value, str):
            raise InvalidStoreURL(f"{url}: {name} must be a str, got {type(value).__name__}")
        refuse_unusable_credential(url, name, value)
    if region is not None:
        check_region(url, "region", region)
    if (access_key_id is None) != (secret_access_key is None):
        given, missing = (
            ("access_key_id", "secret_access_key")
            if secret_access_key is None
            else ("secret_access_key", "access_key_id")
        )
        raise InvalidStoreURL(
            f"{url}: {given} was given without {missing}: give both, or neither (to use the AWS "
            "credential chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile, ...)"
        )
    if session_token is not None and access_key_id is None:
        # A session token only signs together with the temporary key pair it was issued with;
        # alone, boto3 fails to sign ("sequence item 0: expected str instance, NoneType found").
        raise InvalidStoreURL(
            f"{url}: session_token was given without access_key_id and secret_access_key: a "
            "session token is used with the temporary key pair issued with it, so give all "
            "three, or none (to use the AWS credential chain: AWS_ACCESS_KEY_ID/"
            "AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN, a profile, ...)"
        )
    options = ClientOptions(
        connect_timeout=_positive_number(url, "connect_timeout", connect_timeout),
        read_timeout=_positive_number(url, "read_timeout", read_timeout),
        probe_timeout=_positive_number(url, "probe_timeout", probe_timeout),
        max_attempts=_at_least_one(url, "max_attempts", max_attempts, " (1 disables retries)"),
        addressing_style=_addressing_style(url, addressing_style),
        max_pool_connections=(
            None
            if max_pool_connections is _NO_POOL
            else _at_least_one(url, "max_pool_connections", max_pool_connections)
        ),
    )
    return CheckedS3(prefix, url, options)


def _addressing_style(url: str, addressing_style: object) -> str | None:
    if addressing_style is None or (
        isinstance(addressing_style, str) and addressing_style in _ADDRESSING_STYLES
    ):
        return addressing_style
    raise InvalidStoreURL(
        f"{url}: addressing_style must be 'path', 'virtual' or 'auto' (the default), "
        f"got {addressing_style!r}"
    )


def check_location(bucket: str, prefix: str, endpoint_url: str | None) -> str:
    """``prefix`` without its slashes if ``bucket``, ``prefix`` and ``endpoint_url`` are usable.

    Else ``InvalidStoreURL`` (``InvalidKey`` for the prefix). Pure: no request, no credentials.
    """
    if not bucket:
        raise InvalidStoreURL("an S3 store needs a bucket: use s3://bucket/prefix")
    if isinstance(bucket, str):
        # ``s3://key:secret@bucket`` parses with the credentials in the bucket name, which
        # would then be in ``url``, meant to be safe to log.
        refuse_url_credentials(f"s3://{bucket}", "S3 store URL")
        if not (_BUCKET.fullmatch(bucket) or _ACCESS_POINT_ARN.fullmatch(bucket)):
            shown = repr(bucket) if "@" not in bucket else "the bucket"
            raise InvalidStoreURL(
                f"{shown} is not a valid S3 bucket name: use letters, digits, '.', '-' "
                "and '_' (at most 255 characters; AWS S3 itself requires 3-63 lower-case "
                "characters), e.g. s3://my-bucket/prefix"
            )
    prefix = prefix.strip("/")
    if prefix:
        validate_key(prefix)
    if endpoint_url is not None:
        check_endpoint(endpoint_url, f"endpoint_url for s3://{bucket}", bucket=bucket)
    return prefix


def location_url(bucket: str, prefix: str) -> str:
    """The store URL of ``bucket`` and a prefix :func:`check_location` returned (no credentials)."""
    return f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"


class S3Location(ObjectStore):
    """An object store whose objects live under ``s3://bucket/prefix``.

    The credentials given (``None`` entries are skipped) are masked by :meth:`_scrub` in every
    message built from server or client text, so they never reach logs or errors.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        endpoint_url: str | None,
        access_key_id: str | None,
        secret_access_key: str | None,
        session_token: str | None,
        options: Mapping[str, object] | None,
        region: str | None = None,
    ) -> None:
        """Check the location, credentials, ``region`` and ``options`` (the client options;
        ``None``: an injected client, which uses none of them)."""
        if options is None:  # an injected client: only the location is ours
            prefix = check_location(bucket, prefix, endpoint_url)
            checked = CheckedS3(prefix, location_url(bucket, prefix), None)
        else:
            checked = check_s3_arguments(
                bucket,
                prefix,
                endpoint_url=endpoint_url,
                access_key_id=access_key_id,
                secret_access_key=secret_access_key,
                session_token=session_token,
                region=region,
                **options,
            )
        self.bucket = bucket
        self.prefix = f"{checked.prefix}/" if checked.prefix else ""
        self.endpoint_url = endpoint_url
        self._endpoint_shown = endpoint_url or "AWS S3"
        """The endpoint as messages name it; a backend sets the one its client really uses."""
        self.url = checked.url
        self._options = checked.options
        """The checked client options (``None`` with an injected client: then unknown)."""
        self._answer_within: float | None = None
        """Set on a probe view (:meth:`_probe_view`): seconds it waits for an answer."""
        # A secret of a few characters (test setups: "a", "test") would mask those letters in
        # every message; it protects nothing anyway.
        self._secrets: tuple[str, ...] = ()
        self._add_secrets(access_key_id, secret_access_key, session_token)

    def _add_secrets(self, *values: str | None) -> None:
        """Mask ``values`` (credentials; ``None`` is skipped) in every message from now on:
        the given ones, and those a client resolved itself (environment, profile)."""
        for value in values:
            if value and len(value) >= _MIN_SECRET and value not in self._secrets:
                self._secrets += (value,)

    def _probe_view(self) -> S3Location | None:
        """A copy of this store for ``open_store``'s probe, or ``None`` to probe this store itself.

        The copy waits at most ``probe_timeout`` for each answer and does not retry a request
        that timed out (the data path keeps ``read_timeout`` and ``max_attempts``); its
        ``_translate`` reports such a timeout with :meth:`_silent`. Closed after the probe.
        ``None`` with an injected client, whose timeouts are not ours to change.
        """
        options = self._options
        if options is None:
            return None
        view = copy.copy(self)
        view._answer_within = options.probe_read_timeout
        view._use_probe_client(options)
        return view

    def _use_probe_client(self, options: ClientOptions) -> None:
        """Give this copy (see :meth:`_probe_view`) a client of its own with the probe's
        timeouts and attempts (``options.probe_*``)."""
        raise NotImplementedError

    def _silent(self, op: str, key: str | None) -> StoreUnavailable:
        """The probe's error for an endpoint that connected but did not answer in time."""
        within = self._answer_within
        options = self._options
        # The probe waits the shorter of the two: name the one that set the limit.
        limit = (
            "read_timeout"
            if options is not None and options.read_timeout < options.probe_timeout
            else "probe_timeout"
        )
        return StoreUnavailable(
            f"cannot {self._describe(op, key)}: {self._endpoint_shown} accepted the connection "
            f"but did not answer within {within:g} s (a wrong port, a hung or overloaded "
            "server, or not an S3 server); check that endpoint_url is the address of the S3 "
            "API (scheme, host and port) and that the server is up. A server that is only "
            f"slow: pass a larger {limit} (now {within:g} s) to open_store"
            + (" (batchweave CLI: --probe-timeout)" if limit == "probe_timeout" else "")
        )

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"{type(self).__name__}({self.url!r}{endpoint})"

    def _key(self, key: str) -> str:
        """The full object key of the store-relative ``key`` (validated)."""
        return self.prefix + validate_key(key)

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return redact_signing_details(_redact_userinfo(text))

    def _scrubbed(self, exc: BaseException) -> ScrubbedClientError:
        """A stand-in for the client's ``exc`` to chain instead of it (``raise error from
        self._scrubbed(exc)``, never ``from exc``): ``exc`` may quote the server's reply.

        ``raise ... from`` also sets ``__suppress_context__``: raised inside the ``except``
        block, the error gets ``exc`` as ``__context__`` too, which no traceback then prints
        (tracebacks follow the cause instead).
        """
        kind = type(exc)
        name = (
            kind.__qualname__
            if kind.__module__ == "builtins"
            else f"{kind.__module__}.{kind.__qualname__}"
        )
        return ScrubbedClientError(name, self._scrub(str(exc)))

    def _describe(self, op: str, key: str | None) -> str:
        """``op`` on ``key`` (or on the store) in words, for error messages."""
        return f"{op} {key!r} in {self.url}" if key is not None else f"{op} in {self.url}"

    def _not_s3(self, op: str, key: str | None, detail: str) -> StoreError:
        """The endpoint answered, but not as S3 does (a web page, a dashboard, a proxy)."""
        return StoreError(
            f"cannot {self._describe(op, key)}: {self._endpoint_shown} did not "
            f"answer like an S3 server ({detail}); check that endpoint_url is the address of "
            "the S3 API (scheme, host and port), not of a web page or console"
        )

    def _no_credentials(self, what: str, reason: str = "") -> AccessDenied:
        """No usable credentials; ``reason``: why not, in the client's words (no secret in it)."""
        reason = f" ({reason})" if reason else ""
        return AccessDenied(
            f"cannot {what}: no usable AWS credentials found{reason}; pass access_key_id and "
            "secret_access_key, set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or use a profile "
            "(for an SSO profile, log in again: aws sso login)"
        )

    def _denied(self, detail: str) -> AccessDenied:
        return AccessDenied(f"{detail} (check the credentials and the bucket policy)")

    def _no_conditional_writes(self, detail: str) -> ConditionalWritesUnsupported:
        return ConditionalWritesUnsupported(
            f"{detail}: the store does not implement If-None-Match; BatchWeave needs "
            "conditional writes"
        )

    def _missing_bucket(self, detail: str) -> InvalidStoreURL:
        return InvalidStoreURL(
            f"{detail}: bucket {self.bucket!r} does not exist at "
            f"{self._endpoint_shown}; create it or fix the store URL"
        )


_S3_ANSWERS_WITHOUT_CODE = frozenset({404, 429})
"""Error statuses an S3 endpoint may send without S3's XML error code (see
:func:`not_s3_status`): a 404 is a missing object (to a bucket operation it is checked on its own),
a 429 a proxy or rate limiter in front of S3 throttling (transient)."""


def not_s3_status(op: str, status: int) -> str | None:
    """Why an error reply with HTTP ``status`` to ``op``, whose body is not S3's XML error (no
    error code in it), shows that the endpoint is not an S3 server; ``None`` if it does not.

    S3 answers every request but a HEAD with an XML ``<Error>`` naming its code; a 4xx or a 501
    without one is a web server's, console's or proxy's page (nginx answers a PUT with 405, a
    request without Content-Length with 411, a large body with 413). Not: a HEAD (no reply to a
    HEAD has a body, S3's neither), a 404 or 429 (:data:`_S3_ANSWERS_WITHOUT_CODE`), and a 5xx
    other than 501: a gateway's error page while S3 behind it is down, which stays transient.
    Both S3 backends apply it, each reading "no error code" from its client's reply.
    """
    if (
        op == "head"
        or status in _S3_ANSWERS_WITHOUT_CODE
        or not (400 <= status < 500 or status == 501)
    ):
        return None
    try:
        answer = f"{status} {HTTPStatus(status).phrase}"
    except ValueError:  # a status Python has no name for
        answer = str(status)
    if status == 501:
        return (
            f"{answer} to a {op}, without S3's XML error: not an S3 server, or a gateway that "
            "does not implement this request"
        )
    return f"{answer} to a {op}, without S3's XML error: a web server, console or proxy answered"

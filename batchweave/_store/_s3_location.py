"""What both ``s3://`` backends share: where the objects live and how to name them safely.

:class:`~batchweave.S3Store` (boto3) and :class:`~batchweave.ObstoreS3Store` differ only in the
client; the bucket/prefix location, the key mapping, the credential-free ``url``/``repr`` and the
error wording live here once, so the two cannot drift apart.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from batchweave._errors import InvalidStoreURL, StoreError
from batchweave._store._base import ObjectStore, validate_key

__all__ = [
    "S3Location",
    "check_client_options",
    "check_endpoint",
    "check_location",
    "check_pool_size",
    "location_url",
    "redact_url",
    "refuse_url_credentials",
]

_USERINFO = re.compile(r"(?<=://)[^/?#\s\"']*@")
"""The ``user:password@`` of any URL in a text (botocore and obstore quote request URLs), up to
the authority's last ``@``, as ``urlsplit`` reads it: a password may contain ``@`` itself."""


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


_ADDRESSING_STYLES = ("auto", "path", "virtual")
"""Values of the ``addressing_style`` option both S3 backends accept (``None`` = the default)."""

_MIN_SECRET = 8
"""Credentials shorter than this are not masked in messages (see ``S3Location``): AWS secrets
have 40 characters and MinIO refuses fewer than 8, while test setups use "a", "test" or
"testing", which masking would cut out of every bucket, prefix and key that contains them."""

_UNPRINTABLE = re.compile(r"[\x00-\x20\x7f]")
"""Spaces and control characters: never part of a URL; a pasted one would corrupt every request."""


def _redact_userinfo(text: str) -> str:
    return _USERINFO.sub("***@", text)


def redact_url(url: str) -> str:
    """``url`` for an error message: ``user:password@`` masked, query and fragment cut off."""
    shown = _redact_userinfo(url)
    cut = min((i for i in (shown.find("?"), shown.find("#")) if i >= 0), default=-1)
    return shown if cut < 0 else shown[:cut] + "?..."


def refuse_url_credentials(endpoint_url: str, what: str) -> None:
    """``InvalidStoreURL`` (not echoing them) if ``endpoint_url`` has ``user:password@``.

    They would be echoed in every error, repr and botocore log line; S3 signs requests with
    access keys and never uses URL credentials.
    """
    try:
        netloc = urlsplit(endpoint_url).netloc
    except ValueError:  # malformed (a bad IPv6 literal): look at the authority by hand
        netloc = endpoint_url.partition("://")[2].partition("/")[0]
    if "@" in netloc:
        raise InvalidStoreURL(
            f"{what} {_redact_userinfo(endpoint_url)!r} carries credentials (user:password@); "
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
    where = f"{what} {_redact_userinfo(endpoint_url)!r}"
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


def _positive_number(url: str, name: str, value: object) -> None:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (value > 0 and math.isfinite(value))
    ):
        raise InvalidStoreURL(f"{url}: {name} must be a positive number of seconds, got {value!r}")


def _at_least_one(url: str, name: str, value: object, note: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidStoreURL(f"{url}: {name} must be an integer >= 1{note}, got {value!r}")


def check_pool_size(url: str, max_pool_connections: object) -> None:
    """``InvalidStoreURL`` unless ``max_pool_connections`` (boto3 only) is an integer >= 1."""
    _at_least_one(url, "max_pool_connections", max_pool_connections)


def check_client_options(
    url: str,
    *,
    access_key_id: str | None,
    secret_access_key: str | None,
    connect_timeout: object,
    read_timeout: object,
    max_attempts: object,
    addressing_style: object,
) -> None:
    """``InvalidStoreURL`` naming the option for a value neither S3 client can use.

    Checked here, before a client is built, so both backends refuse the same values with the
    same words (the clients' own errors are not ``BatchWeaveError`` and name no option).
    Credentials are never echoed: only which one is missing.
    """
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
    _positive_number(url, "connect_timeout", connect_timeout)
    _positive_number(url, "read_timeout", read_timeout)
    _at_least_one(url, "max_attempts", max_attempts, " (1 disables retries)")
    if addressing_style is not None and addressing_style not in _ADDRESSING_STYLES:
        raise InvalidStoreURL(
            f"{url}: addressing_style must be 'path', 'virtual' or 'auto' (the default), "
            f"got {addressing_style!r}"
        )


def check_location(bucket: str, prefix: str, endpoint_url: str | None) -> str:
    """``prefix`` without its slashes if ``bucket``, ``prefix`` and ``endpoint_url`` are usable.

    Else ``InvalidStoreURL`` (``InvalidKey`` for the prefix). Pure: no request, no credentials,
    so :func:`~batchweave._store._open.check_store_url` can run it where no store is opened.
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

    ``secrets`` (credentials; ``None`` entries are skipped) are masked by :meth:`_scrub` in every
    message built from server or client text, so they never reach logs or errors.
    """

    def __init__(
        self,
        bucket: str,
        prefix: str,
        *,
        endpoint_url: str | None,
        secrets: Iterable[str | None],
    ) -> None:
        prefix = check_location(bucket, prefix, endpoint_url)
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint_url = endpoint_url
        self._endpoint_shown = endpoint_url or "AWS S3"
        """The endpoint as messages name it; a backend sets the one its client really uses."""
        self.url = location_url(bucket, prefix)
        # A secret of a few characters (test setups: "a", "test") would mask those letters in
        # every message; it protects nothing anyway.
        self._secrets = tuple(s for s in secrets if s and len(s) >= _MIN_SECRET)

    def __repr__(self) -> str:
        endpoint = f", endpoint_url={self.endpoint_url!r}" if self.endpoint_url else ""
        return f"{type(self).__name__}({self.url!r}{endpoint})"

    def _key(self, key: str) -> str:
        """The full object key of the store-relative ``key`` (validated)."""
        return self.prefix + validate_key(key)

    def _scrub(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return _redact_userinfo(text)

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

    def _missing_bucket(self, detail: str) -> InvalidStoreURL:
        return InvalidStoreURL(
            f"{detail}: bucket {self.bucket!r} does not exist at "
            f"{self._endpoint_shown}; create it or fix the store URL"
        )

"""What both ``s3://`` backends share: where the objects live and how to name them safely.

:class:`~batchweave.S3Store` (boto3) and :class:`~batchweave.ObstoreS3Store` differ only in the
client; the bucket/prefix location, the key mapping, the credential-free ``url``/``repr`` and the
error wording live here once, so the two cannot drift apart.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import urlsplit

from batchweave._errors import InvalidStoreURL
from batchweave._store._base import ObjectStore, validate_key

__all__ = ["S3Location", "redact_url", "refuse_url_credentials"]

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
    if "@" in urlsplit(endpoint_url).netloc:
        raise InvalidStoreURL(
            f"{what} {_redact_userinfo(endpoint_url)!r} carries credentials (user:password@); "
            "S3 does not use them: remove them from the URL and pass access_key_id/"
            "secret_access_key (or set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) instead"
        )


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
            parts = urlsplit(endpoint_url) if isinstance(endpoint_url, str) else None
            shown = (
                _redact_userinfo(endpoint_url) if isinstance(endpoint_url, str) else endpoint_url
            )
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise InvalidStoreURL(
                    f"endpoint_url {shown!r} for s3://{bucket} is not an http(s) URL; "
                    "give scheme, host and port, e.g. http://127.0.0.1:9000"
                )
            refuse_url_credentials(endpoint_url, f"endpoint_url for s3://{bucket}")
        self.bucket = bucket
        self.prefix = f"{prefix}/" if prefix else ""
        self.endpoint_url = endpoint_url
        self.url = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._secrets = tuple(s for s in secrets if s)

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

    def _missing_bucket(self, detail: str) -> InvalidStoreURL:
        return InvalidStoreURL(
            f"{detail}: bucket {self.bucket!r} does not exist at "
            f"{self.endpoint_url or 'AWS S3'}; create it or fix the store URL"
        )

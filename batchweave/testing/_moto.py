"""Make moto's conditional create atomic, as S3's is.

moto 5.2 answers ``If-None-Match: *`` by checking for the key and then storing the object, with
no lock between the two (``moto/s3/responses.py``, ``S3Response.put_object``), so two racing
creates can both succeed. It also closes an overwritten object's buffer while a concurrent GET
may still be reading it ("I/O operation on closed file"). Real S3, MinIO and SeaweedFS do
neither. The shared conformance suite races creates and overwrites on every backend, so the moto
fixtures call :func:`serialize_moto_puts` first: moto's PUT and GET handlers then run under one
process-wide lock, which gives moto the atomic create and whole-object reads the S3 API
promises. Only the fake server changes; BatchWeave's ``S3Store`` sends exactly the requests it
sends to S3.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["serialize_moto_puts"]

_lock = threading.Lock()
_PATCHED = "_batchweave_serialized"


def serialize_moto_puts() -> None:
    """Run moto's object PUT and GET handlers under one lock (idempotent)."""
    from moto.s3.responses import S3Response

    for name in ("put_object", "get_object"):
        original = getattr(S3Response, name)
        if getattr(original, _PATCHED, False):
            continue
        setattr(S3Response, name, _serialized(original))


def _serialized(handler: Callable[[Any], Any]) -> Callable[[Any], Any]:
    @functools.wraps(handler)
    def locked(self: Any) -> Any:
        with _lock:
            return handler(self)

    setattr(locked, _PATCHED, True)
    return locked

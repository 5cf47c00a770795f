"""Make moto's conditional create atomic, as S3's is.

moto 5.2 answers ``If-None-Match: *`` by checking for the key and then storing the object, with
no lock between the two (``moto/s3/responses.py``, ``S3Response.put_object``), so two racing
creates can both succeed. Real S3, MinIO and SeaweedFS decide the race atomically. The shared
conformance suite races creates on every backend, so the moto fixtures call
:func:`serialize_moto_puts` first: every PUT handled by moto then runs under one process-wide
lock, which turns moto's check-then-set into the atomic create the S3 API promises. Only the
fake server changes; BatchWeave's ``S3Store`` sends exactly the requests it sends to S3.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

__all__ = ["serialize_moto_puts"]

_lock = threading.Lock()
_PATCHED = "_batchweave_serialized"


def serialize_moto_puts() -> None:
    """Run moto's ``put_object`` handler under one lock (idempotent)."""
    from moto.s3.responses import S3Response

    original = S3Response.put_object
    if getattr(original, _PATCHED, False):
        return

    @functools.wraps(original)
    def put_object(self: Any) -> Any:
        with _lock:
            return original(self)

    setattr(put_object, _PATCHED, True)
    S3Response.put_object = put_object  # type: ignore[method-assign]

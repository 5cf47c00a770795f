"""The :class:`~batchweave._producer._client.Producer`'s arguments, checked up front.

Pure checks, apart from the producer: each raises ``TypeError`` or ``ValueError`` naming the
argument, so a wrong one is refused before the namespace is created or the epoch committed.
"""

from __future__ import annotations

from batchweave._checks import as_int, check_callable, check_int64, check_key_name, check_namespace
from batchweave._errors import OffsetOrderError
from batchweave._manifest._models import check_source
from batchweave._mesh import Mesh, check_mesh

__all__ = ["as_offset", "check_functions", "check_identity"]

_FUNCTION_EXAMPLES = {
    "clock": "time.monotonic",
    "wall_clock": "time.time",
    "sleep": "time.sleep",
    "backoff": "lambda attempt: min(5.0, 0.1 * 2**attempt)",
    "boundary": "lambda: 0; or None for the namespace's watermarks",
}
"""What each function argument of :class:`Producer` looks like, for the error naming it."""


def check_identity(namespace: str, producer_id: str, mesh: Mesh, source: str | None) -> None:
    """Refuse a namespace, ``producer_id``, mesh or ``source`` that is not valid.

    The length limits of a new namespace or id are checked later, by ``start_epoch``: only
    where it would create them.
    """
    check_namespace(namespace)
    check_key_name("producer_id", producer_id)
    check_mesh(mesh)
    if "/" in producer_id:
        raise ValueError(f"producer_id {producer_id!r} must not contain '/'")
    if source is not None:
        if not isinstance(source, str):
            raise TypeError(
                f"producer {producer_id!r}: source must be a str or None, got the "
                f"{type(source).__name__} {source!r}; e.g. source=lance_source.source_id"
            )
        try:
            check_source(source)
        except ValueError as exc:
            raise ValueError(f"producer {producer_id!r}: {exc}") from None


def check_functions(**functions: object) -> None:
    """Refuse a function argument (``clock=``, ...) that is not callable; ``boundary`` may be
    ``None``. The error shows what the argument looks like."""
    for name, function in functions.items():
        if not (name == "boundary" and function is None):
            check_callable(name, function, _FUNCTION_EXAMPLES[name])


def as_offset(value: object) -> int:
    """``value`` as a non-negative int offset (NumPy integers too), else ``OffsetOrderError``."""
    try:
        offset = as_int("offset", value)
    except TypeError as exc:
        raise OffsetOrderError(str(exc)) from None
    if offset < 0:
        raise OffsetOrderError(f"offset must be a non-negative int, got {offset}")
    try:
        return check_int64("offset", offset)
    except ValueError as exc:
        raise OffsetOrderError(str(exc)) from None

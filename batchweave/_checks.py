"""Argument checks shared by the public constructors, so every refusal reads the same."""

from __future__ import annotations

import math
import numbers
import operator

from batchweave._errors import InvalidKey
from batchweave._store._base import check_store, validate_key  # the store layer uses both too

__all__ = [
    "MAX_NAMESPACE_BYTES",
    "MAX_NAME_SEGMENT_BYTES",
    "MAX_PRODUCER_ID_BYTES",
    "as_count",
    "as_fraction",
    "as_int",
    "as_seconds",
    "as_size",
    "check_at_least",
    "check_callable",
    "check_key_name",
    "check_namespace",
    "check_new_name",
    "check_store",
    "new_name_problem",
]

MAX_PRODUCER_ID_BYTES = 200
"""Longest ``producer_id`` (UTF-8 bytes), as long as the longest ``checkpoint_id``."""
MAX_NAMESPACE_BYTES = 512
"""Longest ``namespace`` (UTF-8 bytes, slashes included).

The longest key a producer writes, ``{namespace}/data/{producer_id}/{epoch}/{offset:020d}-
{uuid}.tgb``, is then at most 512 + 285 = 797 bytes (epoch up to 20 digits), leaving 227 bytes
of S3's 1024-byte key limit for a store's prefix."""
MAX_NAME_SEGMENT_BYTES = 255
"""Longest ``/``-separated part of a namespace: one directory name in a ``file://`` store."""

_MAX_NAME_BYTES = {"namespace": MAX_NAMESPACE_BYTES, "producer_id": MAX_PRODUCER_ID_BYTES}
_SHOWN_CHARS = 40


def check_at_least(minimum: int, **values: int) -> None:
    """Raise ``ValueError`` naming the first of ``values`` (in order) that is below ``minimum``."""
    for name, value in values.items():
        if value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_callable(name: str, value: object, like: str) -> None:
    """Refuse an argument that must be a function (an injected ``clock=``, ``sleep=``, ...) and
    is not callable, naming it and what it looks like: before any request, not as a bare
    "'float' object is not callable" from a background thread later."""
    if not callable(value):
        raise TypeError(
            f"{name} must be callable (like {like}), got the {type(value).__name__} {value!r:.100}"
        )


def check_key_name(name: str, value: str) -> None:
    """Refuse a ``namespace`` or ``producer_id`` that cannot be part of an object key.

    :class:`InvalidKey` naming the parameter: the store's own message names only the key, which
    a caller never wrote (``object key 'a\\tb' contains ...`` for ``namespace="a\\tb"``).
    This is every path's check (reads, restarts, joining a namespace): it accepts any name the
    store accepts. The length limits apply only where a name is first created
    (:func:`check_new_name`), so a namespace or id created before them stays usable.
    """
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a str, got the {type(value).__name__} {value!r}; names are strings "
            f"such as {name}='job-1'"
        )
    try:
        validate_key(value)
    except InvalidKey as exc:
        raise InvalidKey(f"{name} {_shown(value)} cannot be used in object keys: {exc}") from exc


def check_namespace(namespace: str) -> None:
    """Refuse a ``namespace`` no client can use, before any request: ``TypeError`` for a
    non-``str`` (``namespace=123``), ``ValueError`` for a trailing ``/``,
    :class:`~batchweave.InvalidKey` for a name no object key can hold."""
    if isinstance(namespace, str) and namespace.endswith("/"):
        raise ValueError(f"namespace {namespace!r} must not end with '/'")
    check_key_name("namespace", namespace)


def new_name_problem(name: str, value: str) -> str | None:
    """Why ``value`` may not be created as a ``namespace`` or ``producer_id``, or ``None``.

    A name longer than its limit (:data:`MAX_NAMESPACE_BYTES`, :data:`MAX_PRODUCER_ID_BYTES`)
    or with a ``/``-separated part longer than :data:`MAX_NAME_SEGMENT_BYTES` makes keys that
    S3 (1024 bytes) or a file system (255 bytes per name) refuses only at the first upload,
    after the producer's epoch was committed. A namespace with a part after its first named
    like a directory BatchWeave creates in every namespace (``_manifests``, ``_segments``,
    ``_watermarks``, ``data``) would nest in another namespace's own layout
    (``a/_manifests`` in ``a``'s), where that namespace's reclaimer and tools look.
    """
    limit = _MAX_NAME_BYTES.get(name)
    size = len(value.encode())
    if limit is not None and size > limit:
        return (
            f"{name} {_shown(value)} is {size} bytes long; at most {limit} bytes (UTF-8) are "
            "allowed, so that the object keys built from it fit S3's 1024-byte key limit and a "
            "file system's 255-byte names"
        )
    if name == "namespace":
        from batchweave._manifest._log import NAMESPACE_DIRS  # here: _log imports this module

        parts = value.split("/")
        for i, part in enumerate(parts[1:], 1):
            if part in NAMESPACE_DIRS:
                return (
                    f"namespace {_shown(value)} has a part {part!r} after its first, a name "
                    "BatchWeave reserves inside every namespace "
                    f"({', '.join(sorted(NAMESPACE_DIRS))}): its objects would sit in the "
                    f"layout of a namespace {_shown('/'.join(parts[:i]))}; choose another name"
                )
    longest = max(value.split("/"), key=lambda part: len(part.encode()))
    if len(longest.encode()) > MAX_NAME_SEGMENT_BYTES:
        return (
            f"{name} {_shown(value)} has a {len(longest.encode())}-byte part {_shown(longest)}; "
            f"each '/'-separated part may be at most {MAX_NAME_SEGMENT_BYTES} bytes (UTF-8), the "
            "longest file name a file:// store can create"
        )
    return None


def check_new_name(name: str, value: str) -> None:
    """:class:`InvalidKey` if ``value`` may not be created (see :func:`new_name_problem`).

    Called only where the name is first created: a producer creating its namespace, or an id
    the namespace's producer table does not list yet.
    """
    problem = new_name_problem(name, value)
    if problem is not None:
        raise InvalidKey(problem)


def _shown(value: str) -> str:
    """``repr(value)``, cut to its first characters if it is long (a 1000-byte id is no help)."""
    if not isinstance(value, str) or len(value) <= _SHOWN_CHARS:
        return repr(value)
    return f"{value[:_SHOWN_CHARS]!r}..."


def as_int(name: str, value: object) -> int:
    """``value`` as a plain ``int`` (NumPy and torch integers too), else ``TypeError``.

    Offsets and coordinates end up in manifests and ``state_dict()``s, which must survive JSON,
    strict models and ``torch.load(weights_only=True)``; a NumPy integer survives none of them.
    """
    if not isinstance(value, bool):  # an int, but True/False as a number is a mistake
        try:
            return operator.index(value)  # type: ignore[arg-type]
        except TypeError:
            pass
    raise TypeError(
        f"{name} must be an integer, got the {type(value).__name__} {value!r}; convert it first "
        f"(e.g. {name}=int(...))"
    )


MAX_INT64 = 2**63 - 1
"""Largest offset or sample count a producer writes: a signed 64-bit integer, as exported
membership histories (Arrow ``int64``) and most tools store it."""


def check_int64(name: str, value: int) -> int:
    """``value`` if it fits a signed 64-bit integer, else ``ValueError`` naming ``name``."""
    if value > MAX_INT64:
        raise ValueError(
            f"{name} must be at most 2**63 - 1 (a signed 64-bit integer, as exports store it), "
            f"got {value}"
        )
    return value


def as_count(name: str, value: object, minimum: int) -> int:
    """``value`` as a plain ``int`` of at least ``minimum``: ``TypeError`` or ``ValueError``.

    For counts and limits: ``2.5`` or ``"4"`` would otherwise be accepted here and fail later,
    deep inside, with Python's own ``'float' object cannot be interpreted as an integer``.
    """
    number = as_int(name, value)
    check_at_least(minimum, **{name: number})
    return number


def as_size(name: str, value: object, minimum: int) -> int:
    """A size in bytes: :func:`as_count`, but a float holding a whole number is taken too.

    Sizes are often written ``16e6`` or ``1e9``; ``1.5e3 + 0.5`` is still refused.
    """
    whole = (
        isinstance(value, numbers.Real)
        and not isinstance(value, numbers.Integral)
        and float(value).is_integer()  # False for inf and NaN
    )
    return as_count(name, int(float(value)) if whole else value, minimum)  # type: ignore[arg-type]


def as_seconds(
    name: str, value: object, *, minimum: float = 0.0, finite: bool = False, positive: bool = False
) -> float:
    """``value`` as a number of seconds of at least ``minimum`` (above 0 if ``positive``), else
    a clear error.

    ``TypeError`` for a string or bool (``timeout="5"`` would otherwise fail at its first use
    with ``'<' not supported between instances of 'str' and 'int'``), ``ValueError`` for NaN or
    a value below the bound. Infinity is a timeout or a period that never ends, unless
    ``finite`` (for what is slept: ``time.sleep(inf)`` raises).
    """
    seconds = _as_real(name, value, "a number of seconds", f"{name}=5.0")
    too_small = seconds <= 0 if positive else seconds < minimum
    if math.isnan(seconds) or too_small or (finite and math.isinf(seconds)):
        least = "> 0" if positive else f">= {minimum:g}"
        bound = f"a finite number of seconds {least}" if finite else f"{least} seconds"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return seconds


def as_fraction(name: str, value: object) -> float:
    """``value`` as a number in ``(0, 1]`` (a share), else ``TypeError`` or ``ValueError``."""
    share = _as_real(name, value, "a number in (0, 1]", f"{name}=0.5")
    if not 0 < share <= 1:  # NaN too
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return share


def _as_real(name: str, value: object, expected: str, example: str) -> float:
    """``value`` as a ``float`` (NumPy numbers too), else ``TypeError`` saying ``expected``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    try:
        return float(as_int(name, value))  # an integer type numbers.Real does not know
    except TypeError:
        raise TypeError(
            f"{name} must be {expected}, got the {type(value).__name__} {value!r}; pass e.g. "
            f"{example}"
        ) from None

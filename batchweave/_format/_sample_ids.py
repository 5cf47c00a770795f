"""Per-slice sample ids in TGB metadata: the one metadata key BatchWeave reads back.

Sample ids are a producer convention, not part of the container: a producer that puts
``{SAMPLE_IDS_KEY: sample_ids_metadata(ids)}`` into a TGB's metadata (``ids`` holds one sequence
of ids per slice, in ``(d, c)`` order) gets them into the membership history
(``batchweave export``). A committed object is immutable, so the value is checked where it is
written, not only where it is read: :class:`~batchweave._format._tgb_write.TgbBuilder` (and so
``encode_tgb`` and ``Producer.append``) refuses a malformed one before anything is uploaded, and
the history reader refuses one already stored, both with :func:`parse_sample_ids`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Any, Final

import numpy as np
import pyarrow as pa  # already loaded with the codecs: costs nothing here

__all__ = ["SAMPLE_IDS_KEY", "parse_sample_ids", "sample_ids_metadata"]

SAMPLE_IDS_KEY: Final = "batchweave.sample_ids"
"""TGB metadata key holding a JSON list (one entry per slice) of lists of sample ids."""

_NOT_A_SEQUENCE = (str, bytes, bytearray, memoryview)
_SHOWN_CHARS = 100  # of a refused id's repr


def sample_ids_metadata(ids: Sequence[Sequence[object]]) -> str:
    """Encode per-slice sample ids (one sequence per slice, ``(d, c)`` order) for TGB metadata.

    Raises ``ValueError`` naming the slice when an entry is not a sequence of ids: a string
    (``"doc-17"``) would otherwise be split into characters. For one id per slice, pass
    ``[[i] for i in ids]``. An id is stored as its ``str()``: a string, a number (NumPy scalars
    included), a UUID, a path. What ``str()`` would not turn into the id is a ``ValueError``
    naming the slice and the id: bytes (``"b'doc-1'"``; decode them first: ``.decode()``),
    ``None``, a bool, a container (``"[1, 2]"``). Nor is a string
    that is not valid Unicode (a lone surrogate, as ``os.fsdecode`` gives for a file name that
    is not UTF-8): JSON would store it escaped, but no export could write it as UTF-8 text.
    """
    if isinstance(ids, _NOT_A_SEQUENCE) or not isinstance(ids, Iterable):
        raise ValueError(
            f"sample_ids_metadata takes one sequence of sample ids per slice, got {ids!r:.100}"
        )
    encoded: list[list[str]] = []
    for j, slice_ids in enumerate(ids):
        if isinstance(slice_ids, _NOT_A_SEQUENCE) or not isinstance(slice_ids, Iterable):
            raise ValueError(
                f"sample_ids_metadata: slice {j} must be a sequence of sample ids, got "
                f"{slice_ids!r:.100} (a string would be split into characters); give one list "
                "per slice in (d, c) order, e.g. [[i] for i in ids] for one id per slice"
            )
        encoded.append([_encoded_id(j, i) for i in slice_ids])
    return json.dumps(encoded, separators=(",", ":"))


def _is_id(value: Any) -> bool:
    """A sample id as stored (JSON): a string of valid Unicode or a number, not a bool."""
    if isinstance(value, str):
        return _is_text(value)
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_text(value: str) -> bool:
    """Whether ``value`` is valid Unicode: encodable as UTF-8, as every export writes it (a
    lone surrogate is not; JSON escapes one, so a footer can hold it)."""
    if value.isascii():  # O(1) in CPython: the common case costs no copy
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _shown(value: object) -> str:
    """``repr(value)``, cut to :data:`_SHOWN_CHARS` characters, for a message."""
    shown = repr(value)
    return f"{shown[:_SHOWN_CHARS]}..." if len(shown) > _SHOWN_CHARS else shown


_NOT_TEXT_HINT = (
    "sample ids must be valid Unicode text (an export writes them as UTF-8): decode file names "
    "with errors='replace' (os.fsencode(name).decode('utf-8', errors='replace')) or record "
    "os.fsencode(name).hex()"
)


_NOT_AN_ID = (
    bytes,
    bytearray,
    memoryview,
    bool,
    np.bool_,
    type(None),
    list,
    tuple,
    dict,
    set,
    frozenset,
    np.ndarray,
)
"""What ``str()`` would turn into text that is not the id: ``b'doc-1'``, ``None``, ``[1, 2]``."""


def _encoded_id(slice_: int, value: object) -> str:
    """``value`` as :func:`sample_ids_metadata` stores it: its ``str()`` (a string, a number, a
    UUID, a path, a pyarrow scalar...), except for what :data:`_NOT_AN_ID` lists, whose
    ``str()`` is not the id, and text that is not valid Unicode: both refused. A pyarrow or
    NumPy scalar is checked by the Python value it holds (``list(table["id"])`` gives pyarrow
    scalars wrapping bytes or ``None``)."""
    if isinstance(value, pa.Scalar):
        value = value.as_py()  # whose str() is the scalar's
    # A NumPy scalar keeps its own str(): np.float32(0.1) is "0.1", its .item() is not.
    plain = value.item() if isinstance(value, np.generic) else value
    if isinstance(plain, _NOT_AN_ID):
        hint = (
            "; decode bytes first, e.g. id.decode()" if isinstance(plain, bytes | bytearray) else ""
        )
        raise ValueError(
            f"sample_ids_metadata: slice {slice_} holds the {type(plain).__name__} "
            f"{_shown(plain)}, which is no sample id: a sample id is a str, a number, or an "
            f"object whose str() is the id (a UUID, a path){hint}"
        )
    text = value if isinstance(value, str) else str(value)
    if not _is_text(text):
        raise ValueError(
            f"sample_ids_metadata: slice {slice_} holds the id {_shown(value)}, which is not "
            f"valid Unicode (it holds a lone surrogate); {_NOT_TEXT_HINT}"
        )
    return text


def parse_sample_ids(raw: str, slices: int) -> list[tuple[str, ...]]:
    """The per-slice ids ``raw`` (a :data:`SAMPLE_IDS_KEY` value) holds for ``slices`` slices.

    Raises ``ValueError`` unless ``raw`` is a JSON list of exactly ``slices`` lists of ids
    (strings of valid Unicode or numbers, as :func:`sample_ids_metadata` writes them: a lone
    surrogate, which JSON escapes, could not be exported as UTF-8); the message starts with
    ``metadata 'batchweave.sample_ids'`` for the caller to prefix with the object or append.
    """
    what = f"metadata {SAMPLE_IDS_KEY!r}"
    try:
        parsed = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{what} is not JSON") from exc
    if not isinstance(parsed, list) or len(parsed) != slices:
        got = (
            f"{len(parsed)} entr{'y' if len(parsed) == 1 else 'ies'}"
            if isinstance(parsed, list)
            else f"a JSON {type(parsed).__name__}"
        )
        raise ValueError(f"{what} must list one entry per slice ({slices}), got {got}")
    # A string entry would be split into characters and a number fail with a TypeError: only a
    # list of ids (strings or numbers, as sample_ids_metadata writes them) is one slice's ids.
    for j, entry in enumerate(parsed):
        if not isinstance(entry, list) or not all(_is_id(i) for i in entry):
            if isinstance(entry, list):
                for i in entry:
                    if isinstance(i, str) and not _is_text(i):
                        raise ValueError(
                            f"{what} entry {j} holds the id {_shown(i)}, which is not valid "
                            f"Unicode (a lone surrogate, escaped in the JSON); {_NOT_TEXT_HINT}"
                        )
            raise ValueError(
                f"{what} entry {j} must be a list of sample ids (strings or numbers), got "
                f"{entry!r:.100}"
            )
    return [tuple(str(i) for i in entry) for entry in parsed]

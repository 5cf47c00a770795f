"""Checkpoint watermarks: which TGB steps live checkpoints still need.

After a training checkpoint is durable, the training loop records a *watermark*: the checkpoint's
id, the manifest (TGB) step that resuming from it will read first, and the manifest version the
consumer had seen. Each watermark is one small object ``{namespace}/_watermarks/{id}.json``.
When the framework deletes a checkpoint, its watermark is released (or a keep-last-K policy
releases old ones automatically).

The reclamation boundary ``b`` is the minimum step over live watermarks: no live checkpoint can
need a step below it, so :class:`~batchweave.Reclaimer` may delete those TGBs, and producers with
``max_lag`` use it to bound storage. With no watermark at all, ``b = 0``: nothing is reclaimable.

This module depends only on the store and the manifest layers, so the producer can use it.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable
from typing import Final

from pydantic import BaseModel, ConfigDict, Field

from batchweave._checks import as_count, as_int, check_callable, check_namespace, check_store
from batchweave._errors import (
    FormatError,
    NamespaceMismatch,
    NamespaceNotFound,
    ObjectNotFound,
    TransientStoreError,
    UnsupportedFormatVersion,
)
from batchweave._manifest._codec import decode_object, encode_object
from batchweave._manifest._log import ManifestLog
from batchweave._manifest._models import Manifest
from batchweave._store._base import ObjectMeta, ObjectStore

__all__ = [
    "CLOCK_SKEW_TOLERANCE",
    "WATERMARKS_DIR",
    "WATERMARK_FORMAT",
    "Watermark",
    "Watermarks",
    "recorded_ago",
    "validate_checkpoint_id",
]

_log = logging.getLogger("batchweave.watermarks")

WATERMARKS_DIR: Final = "_watermarks"
WATERMARK_FORMAT: Final = 1
"""Watermark format this library writes and the newest it reads."""

_MAGIC: Final = "batchweave-watermark"
_MAX_BYTES: Final = 64 << 10
_SUFFIX: Final = ".json"
_LIST_ATTEMPTS: Final = 10
"""Listings :meth:`Watermarks.live` makes while watermarks vanish under it, before giving up."""
_CONFIRMING_LISTS: Final = 3
"""LISTs after the first that one listing may take while each names watermarks the ones before
did not (see :meth:`Watermarks._list_once`), before it is stale."""
_LIST_BACKOFF: Final = 0.05
"""Pause before the first listing retaken; it doubles before each next one..."""
_LIST_BACKOFF_CAP: Final = 1.0
"""... up to this many seconds (the whole budget then waits about 5.5 s)."""
_ID_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.=+-]{0,199}")
CLOCK_SKEW_TOLERANCE: Final = 60.0
"""Seconds a ``recorded_at`` may lie in the future of a reader's clock before it is flagged as
clock skew (the recording host's clock runs ahead)."""


class Watermark(BaseModel):
    """One live checkpoint's claim on the stream: steps from ``step`` on must stay readable."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format: int = WATERMARK_FORMAT
    checkpoint_id: str
    step: int = Field(ge=0)
    """The manifest (TGB) step the checkpoint reads first when training resumes from it."""
    version: int = Field(ge=0)
    """A manifest version current when the checkpoint was taken; older versions may be deleted."""
    recorded_at: float = Field(default=0.0, allow_inf_nan=False)
    """Wall-clock seconds when the watermark was written, by the recording host's clock (finite;
    for operators, not for safety; ``keep_last`` orders by ``version`` and the store's clock and
    uses it only to break ties). A stored infinity or NaN is damage, as in a manifest."""


_SCOPE_ENDS = "-_.=+"
"""The characters a scope must end with (the separators a checkpoint id may hold): ``rank-1``
would also cover ``rank-10-...``, ``rank-1-`` cannot."""


def validate_checkpoint_id(checkpoint_id: str, name: str = "checkpoint_id") -> str:
    """Return ``checkpoint_id`` if it is usable as one key segment, else raise ``ValueError``
    (``TypeError`` if it is no ``str``); ``name`` is the parameter the errors name.

    Allowed: 1-200 characters of letters, digits and ``_ . = + -``, not starting with ``.`` or
    ``-`` (so no ``..``, no ``/``, nothing a shell or a store would treat specially).
    """
    if not isinstance(checkpoint_id, str):
        raise TypeError(
            f"{name} must be a str, got the {type(checkpoint_id).__name__} {checkpoint_id!r}; "
            "checkpoint ids are strings such as 'step-000100'"
        )
    if _ID_RE.fullmatch(checkpoint_id) is None:
        raise ValueError(
            f"{name} {checkpoint_id!r} is not a safe key segment: use 1-200 letters, "
            "digits and '_.=+-', starting with a letter, digit or '_' (e.g. 'step-000100')"
        )
    return checkpoint_id


def recorded_ago(mark: Watermark, now: float) -> str:
    """How long ago ``mark`` was recorded by wall clock ``now``, for log lines:
    ``"recorded 12 s ago"``.

    ``recorded_at`` is the recording host's clock, so the age is clamped at 0, and one more than
    :data:`CLOCK_SKEW_TOLERANCE` in the future is flagged ``"clock skew?"`` (as ``batchweave
    inspect`` flags it) rather than shown as a negative age.
    """
    age = now - mark.recorded_at
    if age >= -CLOCK_SKEW_TOLERANCE:
        return f"recorded {max(0.0, age):.0f} s ago"
    return f"recorded {-age:.0f} s in the future by this host's clock (clock skew?)"


class Watermarks:
    """The watermarks of one namespace: record, release, list, and the reclamation boundary.

    ``keep_last``: after each :meth:`record`, keep the new watermark and the ``keep_last - 1``
    others recorded most recently (by the manifest ``version`` each was taken at, then the
    store's ``last_modified``, clocks no host can skew: see :meth:`record`), releasing the rest
    (``None``: release only explicitly, when the framework deletes a checkpoint). ``scope``: a
    checkpoint-id prefix that confines this instance to one reader's watermarks: :meth:`record`
    refuses ids outside it and ``keep_last`` releases only ids inside it, so several readers of
    one namespace (a training job and an evaluation job) never release each other's
    (``None``: the whole namespace, for a namespace with one reader). ``clock`` (wall-clock
    seconds) is stored in each watermark for operators (``keep_last`` uses it only to break
    ties).
    ``sleep`` paces the listings :meth:`live` retakes when a watermark vanishes under it.

    Safe to use from several processes: every watermark is its own object, written whole.
    """

    def __init__(
        self,
        store: ObjectStore,
        namespace: str,
        *,
        keep_last: int | None = None,
        scope: str | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        # Every argument is checked before the first request: a keep_last=1.5 found only by
        # record() failed after its PUT, leaving the old watermarks unreleased.
        check_store(store)
        check_namespace(namespace)
        check_callable("clock", clock, "time.time")
        check_callable("sleep", sleep, "time.sleep")
        if keep_last is not None:
            keep_last = as_count("keep_last", keep_last, 1)  # None: release only explicitly
        if scope is not None:
            validate_checkpoint_id(scope, "scope")
            if scope[-1] not in _SCOPE_ENDS:
                raise ValueError(
                    f"scope {scope!r} must end with one of {' '.join(_SCOPE_ENDS)}: a scope is a "
                    f"prefix of checkpoint ids, and {scope!r} would also cover another reader's "
                    f"(e.g. {scope + '0-step-5'!r}), whose live watermarks keep_last would then "
                    f"release; use scope={scope + '-'!r}"
                )
        self.store = store
        self.namespace = namespace
        self.keep_last = keep_last
        self.scope = scope
        self._clock = clock
        self._sleep = sleep
        self._prefix = f"{namespace}/{WATERMARKS_DIR}/"
        self._manifests: ManifestLog | None = None
        """The manifest log :meth:`record` finds the latest version in (made on first use)."""
        self._known: Manifest | None = None
        """The newest manifest :meth:`record` found: the next lookup starts from it."""
        self._namespace_id: str | None = None
        """The namespace's id, once :meth:`namespace_id` found it."""

    def __getstate__(self) -> dict[str, object]:
        # Pickled as before (a spawned process gets the store, namespace and policy): the
        # cached log holds locks, and a copy looks the latest version up afresh.
        return {**self.__dict__, "_manifests": None, "_known": None, "_namespace_id": None}

    def __repr__(self) -> str:
        scope = "" if self.scope is None else f", scope={self.scope!r}"
        return (
            f"Watermarks({self.store.url!r}, {self.namespace!r}, keep_last={self.keep_last}{scope})"
        )

    def key(self, checkpoint_id: str) -> str:
        """Store key of ``checkpoint_id``'s watermark."""
        return f"{self._prefix}{validate_checkpoint_id(checkpoint_id)}{_SUFFIX}"

    def namespace_id(self, *, refresh: bool = False) -> str | None:
        """The id of the namespace these watermarks belong to, ``None`` while it does not exist.

        Found with the lookup :meth:`record` makes for the latest version (its result is
        reused), then cached: later calls make no request unless ``refresh`` (a namespace
        deleted and re-created since has another id). ``checkpoint_hook`` compares it with the
        consumer's, so a consumer of a same-named namespace in another store or prefix cannot
        record (or release) watermarks here.
        """
        if self._namespace_id is None or refresh:
            known = self._known
            if known is None or refresh:
                self._latest_version()
                known = self._known
            self._namespace_id = None if known is None else known.namespace_id
        return self._namespace_id

    def record(self, checkpoint_id: str, step: int, *, version: int | None = None) -> Watermark:
        """Record that checkpoint ``checkpoint_id`` resumes at manifest step ``step``.

        Call it only after the checkpoint is durable. ``version`` is a manifest version the
        consumer had read when the checkpoint was taken; ``None`` reads the namespace's latest
        version (0 if the namespace does not exist yet). Recording the same id again replaces
        its watermark. With ``keep_last``, the watermarks (of this ``scope``) recorded before the
        ``keep_last - 1`` most recent others are then released: most recent by the manifest
        ``version`` each was taken at, then by the store's ``last_modified`` of each watermark
        object (then ``recorded_at``, ``step``, id), so a trainer resuming on a host whose clock
        is behind, or watermarks restored from a copy, still keep the newest checkpoints. That
        listing is one LIST of the ids in ``scope`` (of the namespace without one) and one GET
        per watermark it names: other readers' watermarks are neither read nor judged here.
        """
        step = as_int("step", step)  # the step counter of a loop is often a NumPy integer
        if step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if version is not None:
            version = as_int("version", version)  # True is no version 1, as it is no step
            if version < 0:
                raise ValueError(f"version must be a non-negative int, got {version!r}")
        validate_checkpoint_id(checkpoint_id)
        if self.scope is not None and not checkpoint_id.startswith(self.scope):
            raise ValueError(
                f"checkpoint_id {checkpoint_id!r} is outside this reader's scope {self.scope!r}; "
                f"name it {self.scope}..., or use another Watermarks(scope=...) for it"
            )
        now = self._clock()
        if isinstance(now, bool) or not isinstance(now, int | float) or not math.isfinite(now):
            # JSON has no inf or nan: such a watermark would be written as null, and every
            # reclaim pass would then stop on an object it cannot decode.
            raise ValueError(
                f"the Watermarks clock returned {now!r}; it must return finite wall-clock "
                "seconds (as time.time does)"
            )
        if version is None:
            version = self._latest_version()
        mark = Watermark(
            checkpoint_id=validate_checkpoint_id(checkpoint_id),
            step=step,
            version=version,
            recorded_at=now,
        )
        self.store.put(self.key(checkpoint_id), encode_object(_MAGIC, mark))
        _log.info(
            "watermark %r recorded in %s/%s: step %d, manifest version %d",
            checkpoint_id,
            self.store.url,
            self.namespace,
            step,
            version,
        )
        if self.keep_last is not None:
            others = [
                (written, m)
                for written, m in self._listed(tolerant=False, scope_only=True)[0]
                if m.checkpoint_id != checkpoint_id
            ]
            # Most recently taken first, as a trainer keeps its last K checkpoints: after a
            # rollback, the checkpoints of the abandoned run (higher steps, taken earlier) must
            # not take the slots of the resumed run's. By the manifest version each was taken
            # at (the store's history, which no host clock and no copy of the objects changes),
            # then by the store's clock: by recorded_at, a trainer resumed on a host whose clock
            # is behind would release its newest checkpoints and keep the oldest, stalling the
            # boundary; by last_modified alone, a copy of the watermarks (a restore) would
            # order them by when each was copied.
            others.sort(
                key=lambda pair: (
                    pair[1].version,
                    pair[0],
                    pair[1].recorded_at,
                    pair[1].step,
                    pair[1].checkpoint_id,
                ),
                reverse=True,
            )
            for _, old in others[self.keep_last - 1 :]:
                self.release(old.checkpoint_id)
        return mark

    def release(self, checkpoint_id: str) -> None:
        """Drop ``checkpoint_id``'s watermark (its checkpoint was deleted). Idempotent."""
        self.store.delete_many([self.key(checkpoint_id)])
        _log.info("watermark %r released in %s/%s", checkpoint_id, self.store.url, self.namespace)

    def get(self, checkpoint_id: str) -> Watermark | None:
        """``checkpoint_id``'s watermark, or ``None`` if there is none."""
        key = self.key(checkpoint_id)
        try:
            data = self.store.get(key)
        except ObjectNotFound:
            return None
        return self._decode(data, key)

    def live(self) -> list[Watermark]:
        """Every live watermark, lowest step first.

        A watermark object that cannot be decoded raises :class:`FormatError` naming its key:
        ignoring it could reclaim data its checkpoint needs. Delete or re-record it to go on
        (one written by a newer BatchWeave, :class:`UnsupportedFormatVersion`, is intact: upgrade
        the reader instead).
        Costs two LISTs (the second, begun after the first ended, finds a successor recorded
        while the first ran, whose released predecessor the first may have skipped: see
        :meth:`_list_once`) and one GET per watermark listed; a LIST that names new watermarks
        costs one more (at most 4). A listing in which a watermark is released before it is
        read, or that keeps changing, is taken again after a pause that doubles from 0.05 s up
        to 1 s, so a store whose LIST lags its DELETEs gets time to catch up;
        :class:`TransientStoreError` if it still happens after 10 listings (about 5.5 s of
        pauses).
        """
        return [mark for _, mark in self._listed(tolerant=False)[0]]

    def _survey(self) -> tuple[list[Watermark], list[tuple[str, FormatError]]]:
        """Every watermark that can be read (lowest step first, as :meth:`live`), and the key
        and error of each one that cannot (in key order), from one consistent listing.

        For showing a damaged namespace (``batchweave inspect``): the readable watermarks of
        live checkpoints stay visible beside every unreadable one. The boundary is unknown while
        any is unreadable; decide nothing on the readable ones alone.
        """
        marks, unreadable = self._listed(tolerant=True)
        return [mark for _, mark in marks], unreadable

    def _listed(
        self, *, tolerant: bool, scope_only: bool = False
    ) -> tuple[list[tuple[float, Watermark]], list[tuple[str, FormatError]]]:
        """:meth:`live`'s listing loop, each watermark with its object's listed
        ``last_modified`` (the store's clock); ``tolerant``: collect decoding errors, do not
        raise. ``scope_only``: only this instance's ``scope``, from one LIST of its keys and no
        confirming one (for ``keep_last``, which a watermark missed only keeps one more
        round; never for a boundary)."""
        prefix = self._prefix + (self.scope or "") if scope_only else self._prefix
        waited = 0.0
        for attempt in range(_LIST_ATTEMPTS):
            if attempt:
                pause = min(_LIST_BACKOFF_CAP, _LIST_BACKOFF * 2.0 ** (attempt - 1))
                self._sleep(pause)
                waited += pause
            unreadable: list[tuple[str, FormatError]] | None = [] if tolerant else None
            marks, stale = self._list_once(prefix, unreadable, confirm=not scope_only)
            if stale is None:
                marks.sort(key=lambda pair: (pair[1].step, pair[1].checkpoint_id))
                return marks, sorted(unreadable or [], key=lambda bad: bad[0])
            _log.debug("watermarks changed while listed (%s); listing again", stale)
        raise TransientStoreError(
            f"{self.store.url}/{self.namespace}: the watermarks could not be listed consistently: "
            f"{_LIST_ATTEMPTS} listings over {waited:.1f} s each found them changing (last: "
            f"{stale}). Either checkpoints are recorded and released faster than they can be "
            "listed, or the store's LIST lags its DELETEs. Nothing was decided on the "
            "stale view; retry (a reclaimer retries on its next pass), and if it persists "
            f"check what releases watermarks under {self._prefix!r} and the store's listing "
            "consistency"
        )

    def _list_once(
        self,
        prefix: str,
        unreadable: list[tuple[str, FormatError]] | None = None,
        *,
        confirm: bool = True,
    ) -> tuple[list[tuple[float, Watermark]], str | None]:
        """The watermarks under ``prefix`` (each with its listed ``last_modified``), and why
        the listing is stale (``None`` when it is not). A watermark that cannot be decoded
        raises :class:`FormatError`, or with ``unreadable`` (a list) is appended to it as
        ``(key, error)`` instead.

        A LIST is no snapshot: it may skip a key deleted while it runs (``FileStore`` does, an
        S3 listing may across pages) and miss one created while it runs. A reader records a
        checkpoint's successor before it releases the old one (``keep_last`` does so, and so
        should callers), so one listing can lack both, and its minimum would jump to another
        reader's higher step. Hence, with ``confirm``, a second LIST begun after the first
        ended and the reads: it names the successor (it was recorded before its predecessor
        went), which is read and added. Only a reader releasing a checkpoint during each LIST
        can be missed by all of them, so while a LIST adds watermarks (they are changing), one
        more is taken, up to :data:`_CONFIRMING_LISTS`; then the listing is stale. So is one
        naming a key released before it was read (the successor may be missing from it). The
        caller lists again.
        """
        marks: list[tuple[float, Watermark]] = []
        seen: set[str] = set()
        added: str | None = None
        for listing in range(1 + _CONFIRMING_LISTS if confirm else 1):
            added = None  # the last key this LIST named that none before it did
            for meta in self.store.list(prefix):
                if meta.key in seen:
                    continue
                seen.add(meta.key)
                if not self._read_listed(meta, marks, unreadable):
                    return marks, f"{meta.key!r} was gone when read"
                added = meta.key
            if not confirm or (listing and added is None):
                return marks, None
        return marks, (
            f"{_CONFIRMING_LISTS} LISTs after the first each named new watermarks (last: {added!r})"
        )

    def _read_listed(
        self,
        meta: ObjectMeta,
        marks: list[tuple[float, Watermark]],
        unreadable: list[tuple[str, FormatError]] | None,
    ) -> bool:
        """Read the listed ``meta`` into ``marks`` (or ``unreadable``) if it is a watermark;
        ``False`` if it was gone when read."""
        name = meta.key[len(self._prefix) :]
        if "/" in name or not name.endswith(_SUFFIX):
            return True
        try:
            data = self.store.get(meta.key)
        except ObjectNotFound:
            return False
        try:
            marks.append((meta.last_modified, self._decode(data, meta.key)))
        except FormatError as exc:
            if unreadable is None:
                raise
            unreadable.append((meta.key, exc))
        return True

    def boundary(self) -> int:
        """The reclamation boundary: the minimum step over live watermarks (0 when none)."""
        marks = self.live()
        return marks[0].step if marks else 0

    def _decode(self, data: bytes, key: str) -> Watermark:
        try:
            mark = decode_object(
                data,
                Watermark,
                key=key,
                magic=_MAGIC,
                limit=_MAX_BYTES,
                supported=WATERMARK_FORMAT,
            )
        except UnsupportedFormatVersion as exc:
            # A newer release's watermark is a live checkpoint's, intact: deleting or
            # re-recording it would drop that checkpoint's protection. Only this reader is old.
            raise UnsupportedFormatVersion(
                f"{exc} (the watermark belongs to a live checkpoint: leave it in place and "
                "upgrade the reclaimer, CLI or trainer reading it to the release that wrote it; "
                "nothing is reclaimed until then)"
            ) from exc
        except FormatError as exc:
            raise type(exc)(
                f"{exc} (a live checkpoint's watermark cannot be read, so nothing can be safely "
                f"reclaimed; re-record the checkpoint's watermark or delete {key!r} by hand)"
            ) from exc
        expected = f"{self._prefix}{mark.checkpoint_id}{_SUFFIX}"
        if key != expected:
            raise FormatError(
                f"{key}: holds the watermark of checkpoint {mark.checkpoint_id!r}, which belongs "
                f"under {expected!r}; the object was copied or renamed by hand"
            )
        return mark

    def _latest_version(self) -> int:
        """The namespace's latest manifest version (0 before it exists).

        The first lookup lists ``_manifests/``; later ones start from the newest manifest found
        before (``ManifestLog.latest_from``): a LIST of the versions after it, then one GET, of
        the newest listed or, when none is, of that manifest itself, confirming it is still
        there as the same commit. A checkpoint hook recording every few minutes thus costs O(1)
        requests however many versions the namespace retains, and trusts no clock: a ``known``
        the reclaimer deleted meanwhile has a newer version listed (the newest is never
        deleted), and one that is gone or different with nothing after it (the prefix deleted,
        or re-created with fewer versions) makes the lookup start afresh.
        """
        # No lock: threads racing here at worst start a later lookup from an older version
        # (or make a second log), which costs a request, never a wrong answer.
        log, known = self._manifests, self._known
        if log is None:
            log = self._manifests = ManifestLog(self.store, self.namespace, clock=self._clock)
        try:
            latest = log.latest_from(known)
        except NamespaceNotFound:
            # Gone (deleted, or not created yet): a namespace created there later is looked up
            # afresh, whatever its id.
            self._manifests, self._known = None, None
            return 0
        except (NamespaceMismatch, FormatError) as exc:
            if known is None:
                raise
            # The history changed under the cached log (the prefix deleted and re-created, an
            # older copy restored): look it up afresh, as if this were the first lookup.
            _log.warning(
                "%s/%s: manifest history changed since version %d (%s); looking it up afresh",
                self.store.url,
                self.namespace,
                known.version,
                exc,
            )
            self._manifests, self._known = None, None
            return self._latest_version()
        if self._manifests is log and (self._known is None or latest.version > self._known.version):
            self._known = latest
        return latest.version

"""``batchweave inspect``: what a namespace holds, as rich tables or JSON."""

from __future__ import annotations

import math
import re
import time
from collections import Counter
from datetime import datetime, timezone
from typing import Any, TypeVar

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from batchweave._errors import FormatError, ObjectNotFound
from batchweave._lifecycle._reclaim import _OWN_KEYS
from batchweave._manifest._log import _VERSION_RE, MANIFESTS_DIR, ManifestLog
from batchweave._store._base import ObjectStore
from batchweave._watermarks import _ID_RE, CLOCK_SKEW_TOLERANCE, WATERMARKS_DIR, Watermarks
from batchweave._watermarks import _SUFFIX as _WATERMARK_SUFFIX

__all__ = [
    "IDLE_PRODUCER_DAYS",
    "MAX_TABLE_ROWS",
    "OTHER_PREFIX",
    "first_rows",
    "gather_inspection",
    "human_bytes",
    "human_duration",
    "render_inspection",
    "step_range",
    "storage_by_prefix",
]


def _iso(ts: float) -> str | float | None:
    """``ts`` (seconds since the epoch) as an ISO 8601 UTC time; ``None`` for none (0, or not a
    finite number). A time outside what ``datetime`` can show (written by a clock in ms or ns)
    is returned as is, a number, which the tables flag ("clock skew?"): one bad clock must not
    hide the rest of the namespace."""
    if not math.isfinite(ts) or ts <= 0:
        return None
    try:
        return datetime.fromtimestamp(ts, tz=timezone.utc).isoformat(timespec="seconds")
    except (ValueError, OverflowError, OSError):
        # year > 9999 (ValueError), beyond time_t (OverflowError), EOVERFLOW from the C library
        return ts


def _age(now: float, ts: float) -> float | None:
    """Seconds from ``ts`` to ``now``, rounded; ``None`` for no time (0 or less, or not finite:
    ``--json`` must stay strict JSON, which has no infinity). Decoding refuses non-finite times
    already; this keeps the output sound whatever the model allows."""
    if not math.isfinite(ts) or ts <= 0:
        return None
    age = round(now - ts, 1)
    return age if math.isfinite(age) else None


def _shown_time(value: str | float | None, age: float | None) -> str:
    """A time from :func:`gather_inspection` as a table shows it, flagged if in the future."""
    if value is None:
        return "-"
    if not isinstance(value, str):
        return f"{value!r} (clock skew?)"
    return value + _skew_note(age)


OTHER_PREFIX = "other (not this namespace's)"
"""The ``storage`` row of objects under ``{namespace}/`` that are not in its own layout."""

_OWN_LAYOUT = re.compile(
    rf"{MANIFESTS_DIR}/(?:{_VERSION_RE.pattern})"
    rf"|(?:{_OWN_KEYS.pattern})"
    rf"|{WATERMARKS_DIR}/(?:{_ID_RE.pattern}){re.escape(_WATERMARK_SUFFIX)}"
)
"""Keys (relative to the namespace) of BatchWeave's own layout, named exactly as BatchWeave
names them (the patterns of the manifest log, the reclaimer and the watermarks, reused): a
manifest version ``_manifests/{version:020d}.manifest``, a segment or TGB object as the
reclaimer recognises its own (``_segments/{first_step:020d}-{uuid}.seg``,
``data/{producer_id}/{epoch}/{offset:020d}-{uuid}.tgb``), and a watermark
``_watermarks/{checkpoint_id}.json``. Anything else is not the namespace's: a namespace nested
under this one (``a/b``, or ``a/data/x`` created before such names were refused) has keys with
more parts, and another tool's files (a ``README``, an operator's ``c1.json.bak``) have other
names; reclaim never touches either."""


def storage_by_prefix(store: ObjectStore, namespace: str) -> list[dict[str, Any]]:
    """Object count and bytes per top-level prefix (``data/`` split per producer); one LIST.

    Only BatchWeave's own layout is counted per prefix (``"own": True``); every other object
    under ``{namespace}/`` (a namespace nested under it, another tool's files) is summed in one
    last row, :data:`OTHER_PREFIX` with ``"own": False``, present only when there are some.
    """
    root = f"{namespace}/"
    counts: Counter[str] = Counter()
    sizes: Counter[str] = Counter()
    other_objects = other_bytes = 0
    for meta in store.list(root):
        relative = meta.key[len(root) :]
        if not _OWN_LAYOUT.fullmatch(relative):
            other_objects += 1
            other_bytes += meta.size
            continue
        parts = relative.split("/")
        group = "/".join(parts[:2]) + "/" if parts[0] == "data" else parts[0] + "/"
        counts[group] += 1
        sizes[group] += meta.size
    rows = [
        {"prefix": prefix, "objects": counts[prefix], "bytes": sizes[prefix], "own": True}
        for prefix in sorted(counts)
    ]
    if other_objects:
        rows.append(
            {"prefix": OTHER_PREFIX, "objects": other_objects, "bytes": other_bytes, "own": False}
        )
    return rows


def gather_inspection(store: ObjectStore, namespace: str) -> dict[str, Any]:
    """Everything ``inspect`` shows, as plain JSON-ready data.

    Raises :class:`NamespaceNotFound` if nothing was committed under ``namespace``.
    """
    log = ManifestLog(store, namespace)
    manifest = log.latest()
    versions = list(log.versions())
    steps: Counter[str] = Counter()
    tgb_bytes = 0
    steps_error: str | None = None
    try:
        for _, desc in log.descriptors(manifest, manifest.base_step, manifest.next_step):
            steps[desc.producer_id] += 1
            tgb_bytes += desc.bytes
    except (FormatError, ObjectNotFound) as exc:
        # Show the rest of the namespace: a damaged namespace is when the operator needs it.
        steps.clear()
        steps_error = (
            f"a segment of manifest version {manifest.version} cannot be read ({exc}); live "
            "steps per producer are unknown and consumers stop there: run `batchweave verify`"
        )
    now = time.time()
    producers = [
        {
            "producer_id": pid,
            "epoch": state.epoch,
            "committed_offset": state.offset,
            "last_version": state.last_version,
            "last_commit_at": _iso(state.last_commit_at),
            "idle_seconds": _age(now, state.last_commit_at),
            "live_steps": None if steps_error else steps.get(pid, 0),
            "source": state.source,
            "retired": False,
        }
        for pid, state in sorted(manifest.producers.items())
    ]
    # Retired ids (retire_producers) have no state left, only their live steps.
    producers += [
        {
            "producer_id": pid,
            "epoch": None,
            "committed_offset": None,
            "last_version": None,
            "last_commit_at": None,
            "idle_seconds": None,
            "live_steps": count,
            "source": None,
            "retired": True,
        }
        for pid, count in sorted(steps.items())
        if pid not in manifest.producers
    ]
    # Each watermark on its own: the readable ones (live checkpoints) stay shown beside every
    # unreadable one, and the rest of the namespace with them: the operator is here to find out
    # why reclaim fails.
    marks, unreadable = Watermarks(store, namespace)._survey()
    watermark_error: str | None = None
    if unreadable:
        keys = ", ".join(repr(key) for key, _ in unreadable)
        watermark_error = (
            f"{len(unreadable)} watermark(s) cannot be read ({keys}), so the boundary is unknown "
            "and reclaim deletes nothing; each is listed with its error"
        )
    storage = storage_by_prefix(store, namespace)
    return {
        "store": store.url,
        "namespace": namespace,
        "namespace_id": manifest.namespace_id,
        "mesh": {"dp": manifest.mesh.dp, "cp": manifest.mesh.cp},
        "latest_version": manifest.version,
        "oldest_version": versions[0] if versions else manifest.version,
        "versions": len(versions),
        "created_at": _iso(manifest.created_at),
        "base_step": manifest.base_step,
        "next_step": manifest.next_step,
        "live_steps": manifest.next_step - manifest.base_step,
        "segments": len(manifest.segments),
        "tail": len(manifest.tail),
        "sealed": manifest.sealed,
        "live_tgb_bytes": None if steps_error else tgb_bytes,
        "steps_error": steps_error,
        "producers": producers,
        "watermarks": [
            {
                "checkpoint_id": m.checkpoint_id,
                "step": m.step,
                "version": m.version,
                "recorded_at": _iso(m.recorded_at),
                "age_seconds": _age(now, m.recorded_at),
            }
            for m in marks
        ],
        "boundary": None if unreadable else (marks[0].step if marks else 0),
        "watermark_error": watermark_error,
        "unreadable_watermarks": [
            {"key": key, "error": f"{type(exc).__name__}: {exc}"} for key, exc in unreadable
        ],
        "storage": storage,
        # This namespace's own objects: not those of a namespace nested under it (OTHER_PREFIX).
        "stored_bytes": sum(row["bytes"] for row in storage if row["own"]),
        "stored_objects": sum(row["objects"] for row in storage if row["own"]),
    }


_Row = TypeVar("_Row")

MAX_TABLE_ROWS = 30
"""Rows a table of ``inspect`` shows before summing the rest in one line (``--json``: all)."""


def first_rows(rows: list[_Row]) -> tuple[list[_Row], list[_Row]]:
    """``rows`` split into those a table shows and the rest, summed up in one last line."""
    if len(rows) <= MAX_TABLE_ROWS:
        return rows, []
    return rows[: MAX_TABLE_ROWS - 1], rows[MAX_TABLE_ROWS - 1 :]


_NUMERIC_COLUMNS = frozenset({"epoch", "offset", "last version", "live steps"})

SOURCE_SHOWN = 160
"""Characters of a producer's source identity the table shows, folded over lines (``--json``
has all of it): enough for a ``LanceSource.source_id`` with its version and sharding."""


def _shorten(text: str) -> str:
    """``text``, cut to :data:`SOURCE_SHOWN` characters with an ellipsis when longer."""
    return text if len(text) <= SOURCE_SHOWN else text[: SOURCE_SHOWN - 3] + "..."


def _skew_note(age: float | None) -> str:
    return " (future: clock skew?)" if age is not None and age < -CLOCK_SKEW_TOLERANCE else ""


def human_duration(seconds: float) -> str:
    """``5400`` -> ``1.5 h``: watermark ages at a glance."""
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if abs(seconds) >= size:
            # A clock in ns makes ages of 1e10 days: a few digits, not hundreds.
            value = seconds / size
            return f"{value:.1f} {unit}" if abs(value) < 1e6 else f"{value:.3g} {unit}"
    return f"{seconds:.0f} s"


def step_range(first: int, stop: int) -> str:
    """``first..stop-1``, or ``none`` for an empty range."""
    return f"{first}..{stop - 1}" if stop > first else "none"


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


IDLE_PRODUCER_DAYS = 7
"""``inspect`` suggests ``batchweave retire`` for producer ids idle this long (its default too)."""


def render_inspection(data: dict[str, Any], console: Console) -> None:
    """Print ``data`` (from :func:`gather_inspection`) as tables."""
    summary = Table(title=f"namespace {escape(data['namespace'])}", show_header=False, box=None)
    summary.add_column(style="bold")
    summary.add_column()
    mesh = data["mesh"]
    rows = [
        ("store", data["store"]),
        ("namespace id", data["namespace_id"]),
        ("mesh", f"dp={mesh['dp']} cp={mesh['cp']}"),
        (
            "versions",
            f"{data['oldest_version']}..{data['latest_version']} ({data['versions']} stored)",
        ),
        (
            "steps",
            f"{step_range(data['base_step'], data['next_step'])} ({data['live_steps']} live)",
        ),
        ("base step", str(data["base_step"])),
        (
            "boundary",
            f"{data['boundary']} (min watermark step)"
            if data["boundary"] is not None
            else "unknown: a watermark cannot be read, reclamation is blocked",
        ),
        ("segments / tail", f"{data['segments']} / {data['tail']}"),
        ("sealed", "yes" if data["sealed"] else "no"),
        ("stored", f"{human_bytes(data['stored_bytes'])} in {data['stored_objects']} objects"),
    ]
    for name, value in rows:
        summary.add_row(name, escape(value))  # store URL, namespace id: user-controlled
    console.print(summary)

    producers = Table(title="producers")
    columns = ["producer", "epoch", "offset", "last version", "last commit", "live steps"]
    # Only namespaces whose producers committed a source identity (Producer(source=...)).
    with_sources = any(p["source"] for p in data["producers"])
    if with_sources:
        columns.append("source")
    for col in columns:
        producers.add_column(
            col,
            justify="right" if col in _NUMERIC_COLUMNS else "left",
            overflow="fold" if col == "source" else "ellipsis",
        )
    shown, hidden = first_rows(data["producers"])
    for p in shown:
        if p["retired"]:
            row = [escape(p["producer_id"]), "-", "-", "-", "retired", str(p["live_steps"])]
        else:
            row = [
                escape(p["producer_id"]),
                str(p["epoch"]),
                "-" if p["committed_offset"] is None else str(p["committed_offset"]),
                str(p["last_version"]),
                _shown_time(p["last_commit_at"], p["idle_seconds"]),
                "?" if p["live_steps"] is None else str(p["live_steps"]),
            ]
        producers.add_row(*row, *([escape(_shorten(p["source"] or "-"))] if with_sources else []))
    if hidden:
        live = "?" if data.get("steps_error") else str(sum(p["live_steps"] for p in hidden))
        producers.add_row(f"... {len(hidden)} more", "", "", "", "", live)
    console.print(producers)
    if data.get("steps_error"):
        console.print(f"[red]problem[/red]: {escape(data['steps_error'])}")
    idle = [
        p
        for p in data["producers"]
        if p["idle_seconds"] is not None and p["idle_seconds"] >= IDLE_PRODUCER_DAYS * 86400
    ]
    if idle:
        console.print(
            f"{len(idle)} producer id(s) have not committed for {IDLE_PRODUCER_DAYS} days or "
            "more, and every manifest still carries them; if their streams are over, `batchweave "
            f"retire {escape(data['store'])} {escape(data['namespace'])} --dry-run` shows what "
            "would go"
        )

    marks = Table(title="watermarks (the lowest step is the boundary; an old one holds it)")
    for col in ("checkpoint", "step", "version", "recorded", "age"):
        marks.add_column(col, justify="right" if col in ("step", "version", "age") else "left")
    # Lowest step first: the rows shown include the boundary's; the rest are newer readers.
    shown_marks, hidden_marks = first_rows(data["watermarks"])
    for m in shown_marks:
        age = m.get("age_seconds")
        marks.add_row(
            escape(m["checkpoint_id"]),
            str(m["step"]),
            str(m["version"]),
            _shown_time(m["recorded_at"], None),
            "-" if age is None else human_duration(age) + _skew_note(age),
        )
    if hidden_marks:
        steps = [m["step"] for m in hidden_marks]
        marks.add_row(f"... {len(hidden_marks)} more", f"{min(steps)}..{max(steps)}", "", "", "")
    console.print(marks)
    unreadable = data.get("unreadable_watermarks")
    if unreadable:
        for bad in unreadable:  # every one: each blocks reclaim until it is dealt with
            console.print(f"[red]problem[/red]: {escape(bad['error'])}")
    elif data.get("watermark_error"):
        console.print(f"[red]problem[/red]: {escape(data['watermark_error'])}")

    storage = Table(title="storage by prefix")
    storage.add_column("prefix")
    storage.add_column("objects", justify="right")
    storage.add_column("bytes", justify="right")
    own = [row for row in data["storage"] if row.get("own", True)]
    shown, hidden = first_rows(own)
    for row in shown:
        storage.add_row(escape(row["prefix"]), str(row["objects"]), human_bytes(row["bytes"]))
    if hidden:
        storage.add_row(
            f"... {len(hidden)} more prefixes",
            str(sum(row["objects"] for row in hidden)),
            human_bytes(sum(row["bytes"] for row in hidden)),
        )
    for row in data["storage"]:  # always shown, never summed into "stored"
        if not row.get("own", True):
            storage.add_row(escape(row["prefix"]), str(row["objects"]), human_bytes(row["bytes"]))
    console.print(storage)
    if len(own) < len(data["storage"]):
        console.print(
            f"({OTHER_PREFIX}: objects under the namespace's prefix outside BatchWeave's layout, "
            "such as a namespace nested under it or another tool's files; not counted in "
            "'stored' and never touched by reclaim)"
        )
    if hidden or hidden_marks or len(data["producers"]) > MAX_TABLE_ROWS:
        console.print(f"(tables show {MAX_TABLE_ROWS} rows; --json lists every row)")

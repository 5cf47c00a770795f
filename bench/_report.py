"""Shared benchmark plumbing: a results table printed to stdout, JSON on disk, ratios to baselines.

Every benchmark measures its own baseline in the same run (these machines are shared and noisy),
so reports carry ratios, not absolute times alone.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R", bound=Mapping[str, Any])

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def parser(description: str | None) -> argparse.ArgumentParser:
    """An argument parser with the flags every benchmark accepts."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, for CI and nox -s bench")
    p.add_argument("--out", type=Path, default=None, help="JSON output path")
    return p


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``; NaN when empty."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, int(q) - 1))]


def rotated(items: Sequence[T], round_: int) -> tuple[T, ...]:
    """``items`` in the order round ``round_`` (from 0) runs them: rotated left by one more each
    round, so that over ``len(items)`` rounds each item runs once in every position and the
    machine's load drift is spread over all of them rather than favouring whichever runs first.
    """
    k = round_ % len(items) if items else 0
    return tuple(items[k:]) + tuple(items[:k])


def median_round(rounds: Sequence[R], key: str) -> R:
    """The median of ``rounds`` by ``rounds[i][key]``: a whole round, so that every figure of a
    row comes from the same run. With an even count it is the upper of the two middle rounds; a
    NaN (unmeasured) round counts as the lowest, so it is the median only when most are NaN.
    """
    if not rounds:
        raise ValueError(f"no rounds to take the median of by {key!r}")

    def rank(r: R) -> tuple[bool, float]:
        value = float(r[key])
        return (not math.isnan(value), value if not math.isnan(value) else 0.0)

    return sorted(rounds, key=rank)[len(rounds) // 2]


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by ``None``, tuples as lists.

    A value that could not be measured is NaN in the rows (and ``nan`` in the table), but
    ``NaN`` and ``Infinity`` are not JSON: strict parsers refuse the whole file. In the JSON
    it is ``null``.
    """
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


@dataclass
class Report:
    """Rows of one benchmark run, rendered as a markdown table and saved as JSON."""

    name: str
    columns: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, **row: Any) -> None:
        self.rows.append(row)

    def markdown(self) -> str:
        def cell(value: Any) -> str:
            if isinstance(value, float):
                return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"
            return str(value)

        lines = [
            "| " + " | ".join(self.columns) + " |",
            "|" + "---|" * len(self.columns),
        ]
        lines += [
            "| " + " | ".join(cell(r.get(c, "")) for c in self.columns) + " |" for r in self.rows
        ]
        return "\n".join(lines)

    def save(self, path: Path | None = None) -> Path:
        path = path or RESULTS_DIR / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "benchmark": self.name,
            "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": {"python": platform.python_version(), "platform": platform.platform()},
            "columns": self.columns,
            "rows": self.rows,
            "notes": self.notes,
        }
        path.write_text(json.dumps(json_safe(payload), indent=2, default=str, allow_nan=False))
        return path

    def emit(self, path: Path | None = None) -> None:
        """Print the table and notes, and write the JSON file."""
        print(self.markdown())
        for note in self.notes:
            print(f"- {note}")
        print(f"results: {self.save(path)}")

"""The :class:`~batchweave._consumer._core.Consumer`'s keyword arguments, checked up front.

Every count, size, number of seconds and share, and the rank's coordinates, are checked before
a consumer makes anything, with errors naming the option. Separate from the consumer so that
:class:`~batchweave.torch.WeaveDataset` runs the same checks when it is made, not in a
DataLoader worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from batchweave._checks import as_count, as_fraction, as_int, as_seconds, as_size, check_callable
from batchweave._mesh import Mesh, check_mesh
from batchweave._projection import _parse_order, coordinates_from_env

__all__ = [
    "DEFAULT_MAX_POLL_INTERVAL",
    "DEFAULT_MAX_RETRY_BACKOFF",
    "DEFAULT_POLL_INTERVAL",
    "DEFAULT_RETRY_BACKOFF",
    "check_options",
    "resolve_coordinates",
]

DEFAULT_POLL_INTERVAL: Final = 0.05
"""The :class:`Consumer`'s first delay between manifest polls, in seconds."""
DEFAULT_MAX_POLL_INTERVAL: Final = 2.0
"""The :class:`Consumer`'s longest delay between manifest polls, in seconds."""
DEFAULT_RETRY_BACKOFF: Final = 0.05
"""The :class:`Consumer`'s first delay before retrying a failed read, in seconds."""
DEFAULT_MAX_RETRY_BACKOFF: Final = 2.0
"""The :class:`Consumer`'s longest delay before retrying a failed read, in seconds."""

_COUNTS: Final = {
    "start_step": 0,
    "stride": 1,
    "prefetch": 0,
    "ramp_every": 1,
    "max_process_reads": 1,
    "max_workers": 1,
    "footer_cache": 1,
    "retry_budget": 0,
}
"""The :class:`Consumer` options that are counts, with their smallest value."""
_SIZES: Final = ("map_threshold", "split_threshold", "part_size")
"""The :class:`Consumer` options that are sizes in bytes (at least 1; ``16e6`` is taken)."""
_SECONDS: Final = ("poll_interval", "max_poll_interval", "retry_backoff", "max_retry_backoff")
"""The :class:`Consumer` options that are finite numbers of seconds, slept between reads."""
_CALLABLES: Final = {
    "clock": "time.monotonic",
    "sleep": "time.sleep",
    "cpu_clock": "time.thread_time",
}
"""The :class:`Consumer` options that are functions (injectable time), with their defaults."""
_PAIRED_DEFAULTS: Final = {
    "poll_interval": DEFAULT_POLL_INTERVAL,
    "max_poll_interval": DEFAULT_MAX_POLL_INTERVAL,
    "retry_backoff": DEFAULT_RETRY_BACKOFF,
    "max_retry_backoff": DEFAULT_MAX_RETRY_BACKOFF,
}
"""The defaults of the options :func:`check_options` checks in pairs, for those not given."""


def check_options(**options: Any) -> dict[str, Any]:
    """:class:`Consumer` keyword arguments with every count, size, number of seconds and share
    checked and made a plain ``int`` or ``float``, and ``clock``, ``sleep`` and ``cpu_clock``
    checked to be callable; the others are returned as given.

    ``TypeError`` for the wrong type (``part_size=16e6``, ``timeout="5"``, ``clock=1.5``),
    ``ValueError`` for a value out of range, naming the option. Pairs are checked against the
    consumer's defaults for the options not given, so :class:`~batchweave.torch.WeaveDataset`
    checks its consumer options with this when it is made, not in a DataLoader worker.
    """
    checked = dict(options)
    for name, minimum in _COUNTS.items():
        if name in checked:
            checked[name] = as_count(name, checked[name], minimum)
    for name in _SIZES:
        if name in checked:
            checked[name] = as_size(name, checked[name], 1)
    for name in _SECONDS:
        if name in checked:  # slept: infinity would make time.sleep raise
            checked[name] = as_seconds(name, checked[name], finite=True)
    if "prefetch_min_latency" in checked:  # a threshold: infinity never reads ahead
        checked["prefetch_min_latency"] = as_seconds(
            "prefetch_min_latency", checked["prefetch_min_latency"]
        )
    if checked.get("timeout") is not None:  # infinity waits for ever, as None does
        checked["timeout"] = as_seconds("timeout", checked["timeout"])
    for name, default in _CALLABLES.items():
        if name in checked:
            check_callable(name, checked[name], default)
    if "prefetch_max_cpu_share" in checked:
        checked["prefetch_max_cpu_share"] = as_fraction(
            "prefetch_max_cpu_share", checked["prefetch_max_cpu_share"]
        )
    both = {**_PAIRED_DEFAULTS, **checked}
    if not 0 < both["poll_interval"] <= both["max_poll_interval"]:
        raise ValueError(
            f"need 0 < poll_interval <= max_poll_interval, got {both['poll_interval']} and "
            f"{both['max_poll_interval']}"
        )
    if both["max_retry_backoff"] < both["retry_backoff"]:
        raise ValueError(
            f"need 0 <= retry_backoff <= max_retry_backoff, got {both['retry_backoff']} and "
            f"{both['max_retry_backoff']}"
        )
    return checked


def resolve_coordinates(
    mesh: Mesh,
    dp_rank: int | None,
    cp_rank: int | None,
    *,
    tp: int,
    pp: int,
    order: str,
    environ: Mapping[str, str] | None,
) -> tuple[int, int]:
    """The rank's ``(dp_rank, cp_rank)``: given, or derived from the environment.

    ``tp``, ``pp`` and ``order`` are checked either way: a job's degrees that cannot be right
    are a mistake even when explicit coordinates make them unused.
    """
    check_mesh(mesh)
    tp, pp = as_count("tp", tp, 1), as_count("pp", pp, 1)
    _parse_order(order, "rank_order")
    dp_rank = None if dp_rank is None else as_int("dp_rank", dp_rank)
    cp_rank = None if cp_rank is None else as_int("cp_rank", cp_rank)
    if dp_rank is None and cp_rank is None:
        coords = coordinates_from_env(mesh, tp=tp, pp=pp, order=order, environ=environ)
        return coords.dp_rank, coords.cp_rank
    if cp_rank is None and mesh.cp == 1:
        cp_rank = 0
    if dp_rank is None or cp_rank is None:
        raise ValueError(
            f"give both dp_rank and cp_rank for mesh ({mesh}), or neither to derive them from "
            "RANK and WORLD_SIZE"
        )
    mesh.slice_index(dp_rank, cp_rank)  # range check with a clear message
    return dp_rank, cp_rank

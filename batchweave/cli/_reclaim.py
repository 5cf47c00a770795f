"""Progress of ``batchweave reclaim``: a live line on a terminal, plain lines when asked.

A pass on a large namespace is mostly LIST requests and 1,000-key batch deletes and can run for
minutes; without this the command printed nothing until its table at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import click
from rich.markup import escape
from rich.progress import Progress, TextColumn, TimeElapsedColumn

from batchweave._lifecycle import ReclaimProgress
from batchweave.cli._common import err_console
from batchweave.cli._inspect import human_bytes

__all__ = ["LINE_INTERVAL", "ProgressLines", "describe_progress", "reclaim_progress"]

LINE_INTERVAL = 10.0
"""Seconds between two plain progress lines within one phase (logs, pipes)."""


def describe_progress(progress: ReclaimProgress) -> str:
    """One line for ``progress``: phase, keys listed, objects and bytes deleted."""
    text = (
        f"{progress.phase}: {progress.keys_listed:,} keys listed, "
        f"{progress.objects_deleted:,} objects deleted ({human_bytes(progress.bytes_deleted)})"
    )
    if progress.phase_total is not None:
        text += f", {progress.phase_done:,} of {progress.phase_total:,} in this phase"
    return text


class ProgressLines:
    """Prints a progress line on stderr when a phase begins or ends a pass, and at most every
    ``interval`` seconds (by ``clock``) within a phase: readable in a log, never a flood."""

    def __init__(
        self,
        echo: Callable[[str], None] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        interval: float = LINE_INTERVAL,
    ) -> None:
        self._echo = echo if echo is not None else lambda line: click.echo(line, err=True)
        self._clock = clock
        self._interval = interval
        self._phase: str | None = None
        self._last = 0.0

    def __call__(self, progress: ReclaimProgress) -> None:
        now = self._clock()
        if progress.phase == self._phase and now - self._last < self._interval:
            return
        self._phase, self._last = progress.phase, now
        self._echo(f"reclaiming: {describe_progress(progress)} [{progress.seconds:.0f} s]")


@contextmanager
def reclaim_progress(
    show: bool, *, quiet: bool
) -> Iterator[Callable[[ReclaimProgress], None] | None]:
    """The ``progress`` callback for a reclaimer, or ``None`` when nothing is shown.

    By default a live line on stderr when it is a terminal and not ``quiet`` (``--json``), gone
    when the block ends, like the other commands' progress bars. ``show`` (``--progress``):
    always; plain lines (see :class:`ProgressLines`) when stderr is not a terminal.
    """
    console = err_console()
    if not show and (quiet or not console.is_terminal):
        yield None
        return
    if not console.is_terminal:
        yield ProgressLines()
        return
    with Progress(
        TextColumn("reclaiming"),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("starting", total=None)
        yield lambda progress: bar.update(task, description=escape(describe_progress(progress)))

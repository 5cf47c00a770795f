"""The ``batchweave`` command-line tool: demo, inspect, verify, reclaim, seal and export.

Run ``batchweave --help`` (or ``python -m batchweave.cli --help``); see ``docs/cli.md``.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchweave.cli._app import cli

__all__ = ["cli", "main"]


def main() -> None:
    """Console-script entry point (``batchweave``).

    The command modules are imported here, not when this package is: a Ctrl-C while they load
    (they take a moment) ends with the documented line and exit status 130, not a traceback.
    """
    try:
        from batchweave.cli._app import cli

        cli(prog_name="batchweave")
    except KeyboardInterrupt:
        # Commands handle their own interrupts (_app._Group.invoke); this is one before a
        # command started, while the imports ran.
        from batchweave.cli._common import debug_enabled

        if debug_enabled():
            raise
        print("batchweave: interrupted; the command is safe to run again", file=sys.stderr)
        sys.exit(130)


def __getattr__(name: str) -> Any:
    # ``cli`` (the click group) loads the command modules on first use.
    if name == "cli":
        from batchweave.cli._app import cli

        return cli
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""The ``batchweave`` command-line tool: demo, inspect, verify, reclaim, seal and export.

Run ``batchweave --help`` (or ``python -m batchweave.cli --help``); see ``docs/cli.md``.
"""

from __future__ import annotations

from batchweave.cli._app import cli, main

__all__ = ["cli", "main"]

"""Shared helpers for CLI tests: running a command with its stderr on a pseudo-terminal."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

__all__ = ["run_on_terminal"]


def run_on_terminal(*args: str) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal; return status, stdout and the terminal."""
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchweave.cli", *args],
        stdout=subprocess.PIPE,
        stderr=follower,
        env={**os.environ, "TERM": "xterm", "COLUMNS": "100"},
    )
    os.close(follower)
    terminal = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        terminal += chunk
    stdout = proc.stdout.read() if proc.stdout else b""
    status = proc.wait(timeout=120)
    os.close(leader)
    return status, stdout.decode(), terminal.decode(errors="replace")

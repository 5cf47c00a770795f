"""The id of this process, kept current by a fork hook, so comparing it costs no system call.

Producers and consumers run threads, which a ``fork()``ed child does not inherit: a producer's
appends there would never be committed, and a consumer would wait forever for a step its
read-ahead threads were reading. Each records :func:`current_pid` when it is made and refuses
use in another process; ``os.getpid()`` per call would be a system call each time.
"""

from __future__ import annotations

import os

__all__ = ["current_pid"]

_pid = os.getpid()


def _after_fork_in_child() -> None:
    global _pid
    _pid = os.getpid()


os.register_at_fork(after_in_child=_after_fork_in_child)


def current_pid() -> int:
    """This process's id (as ``os.getpid()``, without asking the kernel)."""
    return _pid

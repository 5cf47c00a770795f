"""A fake clock for tests: time moves only when the code under test sleeps."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["FakeTime"]


class FakeTime:
    """Monotonic (``clock``) and epoch (``wall``) time that only ``sleep`` moves. Thread-safe.

    Every sleep is recorded in ``sleeps``; ``on_sleep`` runs after each one, so a test can make
    something happen "while" the code under test waits.
    """

    def __init__(self, start: float = 0.0, on_sleep: Callable[[], None] | None = None) -> None:
        self.now = start
        self.sleeps: list[float] = []
        self.on_sleep = on_sleep
        self._lock = threading.Lock()

    def clock(self) -> float:
        with self._lock:
            return self.now

    def wall(self) -> float:
        with self._lock:
            return 1.7e9 + self.now

    def sleep(self, seconds: float) -> None:
        with self._lock:
            self.sleeps.append(seconds)
            self.now += max(0.0, seconds)
        if self.on_sleep is not None:
            self.on_sleep()

    def producer_options(self) -> dict[str, Callable[..., object]]:
        """``clock``, ``wall_clock`` and ``sleep`` for a ``Producer`` (or ``Consumer``) on this
        fake time."""
        return {"clock": self.clock, "wall_clock": self.wall, "sleep": self.sleep}

    def advance(self, seconds: float) -> None:
        """Move time forward without a sleep (e.g. a slow request)."""
        with self._lock:
            self.now += seconds

"""The per-rank consumer: the iterator, its read path, options, state and counters."""

from batchweave._consumer._core import Consumer
from batchweave._consumer._state import STATE_FORMAT
from batchweave._consumer._stats import ConsumerStats

__all__ = ["STATE_FORMAT", "Consumer", "ConsumerStats"]

"""The producer: publishes TGBs into a namespace exactly once (``Producer``, ``ProducerStats``)."""

from batchweave._producer._client import Producer
from batchweave._producer._stats import ProducerStats

__all__ = ["Producer", "ProducerStats"]

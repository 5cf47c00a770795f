"""Commit policies: when a producer attempts its next manifest commit.

Every policy answers one question, :meth:`CommitPolicy.ready`, and learns from every attempt via
:meth:`CommitPolicy.record`. The producer's commit loop is the same for all of them, so benchmarks
swap policies by name (:func:`make_policy`).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["AttemptOutcome", "CommitPolicy", "make_policy", "policy_names"]


@dataclass(frozen=True)
class AttemptOutcome:
    """What one commit attempt observed."""

    committed: bool
    """True if the conditional PUT won; False on a conflict (412/409 or a lost ambiguous write)."""
    fragile_window: float
    """Seconds from reading the base version to the end of the conditional PUT."""
    active_producers: int
    """Producers the committed manifest counts as active (``N``), at least 1."""
    tgbs: int
    """TGBs the attempt tried to publish."""


class CommitPolicy(abc.ABC):
    """Decides when the commit loop starts an attempt."""

    name: ClassVar[str]

    @abc.abstractmethod
    def ready(self, pending: int, since_last_attempt: float) -> bool:
        """Whether to start an attempt now.

        ``pending`` is the number of uploaded, uncommitted TGBs (>= 1 when asked);
        ``since_last_attempt`` is the time in seconds since the previous attempt ended
        (``inf`` before the first). ``flush()``/``close()`` bypass the TGB-count condition but
        still respect the policy's time gap.
        """

    @abc.abstractmethod
    def record(self, outcome: AttemptOutcome) -> None:
        """Learn from an attempt's outcome."""

    @property
    def gap(self) -> float:
        """The current post-attempt gap in seconds (0 for count-based policies)."""
        return 0.0


_REGISTRY: dict[str, type[CommitPolicy]] = {}


def policy_names() -> list[str]:
    """Names accepted by :func:`make_policy`."""
    return sorted(_REGISTRY)


def make_policy(name: str, **options: float) -> CommitPolicy:
    """Build the policy registered under ``name`` (``dac``, ``naive``, ``fixed10``, ...)."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown commit policy {name!r}; choose one of {', '.join(policy_names())}"
        ) from None
    return cls(**options)

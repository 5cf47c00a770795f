"""The commit-policy interface, the outcome it learns from, and the registry of policies by name.

Every policy answers one question, :meth:`CommitPolicy.ready`, and learns from every attempt via
:meth:`CommitPolicy.record`. The producer's commit loop is the same for all of them, so benchmarks
swap policies by name (:func:`make_policy`). The policies themselves (``_dac.py``,
``_baselines.py``) add themselves to the registry with :func:`register`: they depend on this
module, never the other way.
"""

from __future__ import annotations

import abc
import math
import numbers
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = [
    "AttemptOutcome",
    "CommitPolicy",
    "PolicyWrapper",
    "checked_wait",
    "make_policy",
    "measured_duration",
    "policy_class",
    "policy_names",
    "register",
    "resolve_policy",
]


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
    forced: bool = False
    """Whether ``flush()``/``close()``/``seal()`` started it (a slotted attempt, for DAC)."""
    bytes_written: int = 0
    """Manifest and segment bytes the attempt sent inside its window (0 if unknown)."""


def check_number(name: str, value: object) -> None:
    """Refuse a ``value`` that is not a real number (a str, ``None``, a bool), naming ``name``.

    ``TypeError`` for those; ``ValueError`` for a number beyond the float range (``10**400``).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got the {type(value).__name__} {value!r:.100}")
    try:
        float(value)
    except OverflowError:  # an int past the float range: the arithmetic would raise it later
        raise ValueError(f"{name} must be within the float range, got {value!r:.40}...") from None


def measured_duration(began: float, ended: float) -> float:
    """Seconds from clock reading ``began`` to ``ended``, never less than 0.

    What a producer measures (an upload, a fragile window, the start-up commit) and reports to
    its policy. A clock that steps backwards in between (an NTP step under ``clock=time.time``,
    or a test's fake clock) would make the difference negative, which the policies rightly
    refuse from a caller; measured over such a step, the duration is simply unknown and counts
    as 0.
    """
    return max(0.0, ended - began)


def checked_wait(policy: CommitPolicy, method: str, seconds: float) -> float:
    """``seconds``, a wait ``policy.method`` answered, refused if it is not a number of seconds.

    A wait may be ``inf`` (never, e.g. ``gap`` with ``max_gap=math.inf``) and at most 0 means
    "now"; NaN compares false with everything, so the commit loop would neither attempt nor
    wait: refused with a ``ValueError`` naming the policy and its method.
    """
    if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or math.isnan(seconds):
        raise ValueError(
            f"commit policy {policy!r:.200}: {method} must return a number of seconds "
            f"(inf: never), got {seconds!r:.100}"
        )
    return seconds


class CommitPolicy(abc.ABC):
    """Decides when the commit loop starts an attempt.

    Subclass it for a custom policy: implement :meth:`ready` and :meth:`record`; ``name`` (the
    label metrics show) defaults to the class name.
    """

    name: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not hasattr(cls, "name"):
            cls.name = cls.__name__

    @abc.abstractmethod
    def ready(self, pending: int, since_last_attempt: float) -> bool:
        """Whether to start an attempt now.

        ``pending`` is the number of uploaded, uncommitted TGBs (>= 1 when asked);
        ``since_last_attempt`` is the time in seconds since the previous attempt ended
        (``inf`` before the first). ``flush()``/``close()`` bypass the TGB-count condition but
        still respect the policy's time gap. For a fixed ``pending`` the answer never turns from
        True to False as time passes, and the only time threshold is :attr:`gap`: a loop that
        re-asks at each new TGB and once ``since_last_attempt`` reaches ``gap`` misses nothing.
        """

    @abc.abstractmethod
    def record(self, outcome: AttemptOutcome) -> None:
        """Learn from an attempt's outcome."""

    def start(  # noqa: B027
        self,
        window: float,
        active_producers: int,
        rank: int | None = None,
        loaded_window: float | None = None,
    ) -> None:
        """Called once before the producer's first data attempt, when it first has data.

        ``window`` is the duration of the producer's start-up (epoch) commit, ``active_producers``
        the active count of the newest manifest the producer has read, and ``rank`` this
        producer's position (``0 .. active_producers - 1``) among those active producers sorted
        by id, or ``None`` if unknown; ``loaded_window`` a conservative estimate of the window
        under the data load, if the producer has one. The producer then counts the time from
        this call against :attr:`gap`, so a policy can delay (and desynchronize) first attempts.
        The default ignores it.
        """

    @property
    def gap(self) -> float:
        """The current post-attempt gap in seconds (0 for count-based policies)."""
        return 0.0

    @property
    def forced_gap(self) -> float:
        """The gap ``flush()``/``close()`` wait for (never more than :attr:`gap`; default equal)."""
        return self.gap

    def observe_put(self, seconds: float, nbytes: int) -> None:  # noqa: B027
        """A data PUT of ``nbytes`` took ``seconds`` (the producer reports every upload).

        A cost sample of the store that no commit attempt gives: DAC sizes its ``flush()`` /
        ``close()`` slots with the fastest one. The default ignores it.
        """

    def forced_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float:
        """Seconds until a ``flush()``/``close()`` attempt may start (0: start now).

        ``now`` is wall-clock time (seconds since the epoch, the one clock producers on
        different machines share, up to skew) and ``rank`` this producer's position among the
        active producers sorted by id (``None`` if unknown). The default waits out
        :attr:`forced_gap` since the last attempt. The answer is re-asked after every wait, so
        it may change as time passes. ``inf`` waits until it changes; NaN is refused (the
        producer stops with a ``ValueError`` naming the policy and the method), as it is from
        :attr:`gap` and :meth:`regular_wait`.
        """
        return max(0.0, self.forced_gap - since_last_attempt)

    def regular_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float | None:
        """Seconds until a regular attempt may start, or ``None`` to use :meth:`ready` instead.

        Same arguments as :meth:`forced_wait`; asked only when TGBs are pending. The default is
        ``None``: count-based policies decide with :meth:`ready`.
        """
        return None


class PolicyWrapper(CommitPolicy):
    """A policy that passes every hook to ``inner``: the base of policies that observe another.

    Subclasses override what they watch (usually :meth:`record`) and call ``inner``; anything
    they do not override paces exactly as ``inner`` does, including hooks added later.
    """

    name: ClassVar[str] = "wrapper"

    def __init__(self, inner: CommitPolicy) -> None:
        self.inner = inner

    def ready(self, pending: int, since_last_attempt: float) -> bool:
        return self.inner.ready(pending, since_last_attempt)

    def record(self, outcome: AttemptOutcome) -> None:
        self.inner.record(outcome)

    def start(
        self,
        window: float,
        active_producers: int,
        rank: int | None = None,
        loaded_window: float | None = None,
    ) -> None:
        self.inner.start(window, active_producers, rank, loaded_window)

    @property
    def gap(self) -> float:
        return self.inner.gap

    @property
    def forced_gap(self) -> float:
        return self.inner.forced_gap

    def observe_put(self, seconds: float, nbytes: int) -> None:
        self.inner.observe_put(seconds, nbytes)

    def forced_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float:
        return self.inner.forced_wait(since_last_attempt, now, rank)

    def regular_wait(self, since_last_attempt: float, now: float, rank: int | None) -> float | None:
        return self.inner.regular_wait(since_last_attempt, now, rank)


_REGISTRY: dict[str, type[CommitPolicy]] = {}

_P = TypeVar("_P", bound=type[CommitPolicy])


def register(cls: _P) -> _P:
    """Add ``cls`` to the policies :func:`make_policy` builds, under its ``name``."""
    if cls.name in _REGISTRY:
        raise RuntimeError(f"commit policy name {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def policy_names() -> list[str]:
    """Names accepted by :func:`make_policy`."""
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[CommitPolicy]:
    """The policy class registered under ``name``; ``ValueError`` naming the choices if none."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown commit policy {name!r}; choose one of {', '.join(policy_names())}"
        ) from None


def make_policy(name: str, **options: Any) -> CommitPolicy:
    """Build the policy registered under ``name`` (``dac``, ``naive``, ``fixed10``, ...).

    ``options`` go to the policy's constructor, e.g. ``make_policy("dac", conflict_budget=0.05)``.
    """
    cls = policy_class(name)
    try:
        return cls(**options)
    except TypeError as exc:
        raise ValueError(
            f"bad options {sorted(options)} for commit policy {name!r}: {exc}"
        ) from exc


def resolve_policy(policy: str | CommitPolicy, **options: Any) -> CommitPolicy:
    """``policy`` as a :class:`CommitPolicy`: a name is built by :func:`make_policy`.

    Anything else is refused here, when a producer is configured, rather than by its commit
    thread after the first upload.
    """
    if isinstance(policy, str):
        return make_policy(policy, **options)
    if options:
        raise ValueError(
            f"policy options {sorted(options)} apply to a policy name; this policy instance "
            f"({policy!r}) is already built"
        )
    if isinstance(policy, CommitPolicy):
        return policy
    if isinstance(policy, type) and issubclass(policy, CommitPolicy):
        raise TypeError(
            f"policy must be a CommitPolicy instance, got the class {policy.__name__}; "
            f"instantiate it (policy={policy.__name__}(...)) or pass a name "
            f"({', '.join(policy_names())})"
        )
    raise TypeError(
        f"policy must be a commit policy name ({', '.join(policy_names())}) or a CommitPolicy "
        f"instance, got the {type(policy).__name__} {policy!r:.100}"
    )

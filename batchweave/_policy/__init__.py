"""Commit policies: when a producer attempts its next manifest commit.

``_base.py`` holds the interface every policy implements and the registry that builds one by
name; ``_dac.py`` BatchWeave's Decentralized Adaptive Commit; ``_baselines.py`` the paper's
baselines. Importing the package registers every policy.
"""

from batchweave._policy._base import (
    AttemptOutcome,
    CommitPolicy,
    PolicyWrapper,
    checked_wait,
    make_policy,
    measured_duration,
    policy_class,
    policy_names,
    resolve_policy,
)
from batchweave._policy._baselines import (
    AimdPolicy,
    Fixed10Policy,
    Fixed100Policy,
    FixedCountPolicy,
    IncrPolicy,
    NaivePolicy,
)
from batchweave._policy._dac import (
    DEFAULT_CONFLICT_BUDGET,
    DEFAULT_DUTY_BUDGET,
    DEFAULT_MIN_SLOT_WINDOW,
    DacPolicy,
    UniformSource,
    conflict_probability,
    dac_gap,
    duty,
)

__all__ = [
    "DEFAULT_CONFLICT_BUDGET",
    "DEFAULT_DUTY_BUDGET",
    "DEFAULT_MIN_SLOT_WINDOW",
    "AimdPolicy",
    "AttemptOutcome",
    "CommitPolicy",
    "DacPolicy",
    "Fixed100Policy",
    "Fixed10Policy",
    "FixedCountPolicy",
    "IncrPolicy",
    "NaivePolicy",
    "PolicyWrapper",
    "UniformSource",
    "checked_wait",
    "conflict_probability",
    "dac_gap",
    "duty",
    "make_policy",
    "measured_duration",
    "policy_class",
    "policy_names",
    "resolve_policy",
]

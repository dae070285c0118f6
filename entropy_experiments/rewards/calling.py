"""moved to entropy_experiments.data.rewards.calling; kept so existing imports work."""

from entropy_experiments.data.rewards.calling import (
    EXAMPLE_COLUMNS,
    TRL_FIXED_ARGUMENTS,
    TRL_MARKERS,
    RewardStyle,
    call_reward,
    exception_line,
    reward_style,
    trl_arguments,
)

__all__ = [
    "EXAMPLE_COLUMNS",
    "TRL_FIXED_ARGUMENTS",
    "TRL_MARKERS",
    "RewardStyle",
    "call_reward",
    "exception_line",
    "reward_style",
    "trl_arguments",
]

"""moved to entropy_experiments.data.rewards.notices; kept so existing imports work."""

from entropy_experiments.data.rewards.notices import (
    clear_reward_warnings,
    logger,
    reward_warnings,
    warn_once,
)

__all__ = [
    "clear_reward_warnings",
    "logger",
    "reward_warnings",
    "warn_once",
]

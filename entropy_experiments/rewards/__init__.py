"""moved to entropy_experiments.data.rewards; kept so existing imports work."""

from entropy_experiments.data.rewards import (
    REWARD_REGISTRY,
    RewardFn,
    clear_reward_warnings,
    compute_rewards,
    describe_reward,
    get_reward,
    register_reward,
    reward_warnings,
)

__all__ = [
    "REWARD_REGISTRY",
    "RewardFn",
    "clear_reward_warnings",
    "compute_rewards",
    "describe_reward",
    "get_reward",
    "register_reward",
    "reward_warnings",
]

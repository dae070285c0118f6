"""moved to entropy_experiments.data.rewards.registry; kept so existing imports work."""

from entropy_experiments.data.rewards.registry import (
    REWARD_REGISTRY,
    RewardFn,
    compute_rewards,
    describe_reward,
    get_reward,
    register_reward,
)

__all__ = [
    "REWARD_REGISTRY",
    "RewardFn",
    "compute_rewards",
    "describe_reward",
    "get_reward",
    "register_reward",
]

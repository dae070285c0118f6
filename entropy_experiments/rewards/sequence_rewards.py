"""moved to entropy_experiments.data.rewards.sequence_rewards; kept so existing imports work."""

from entropy_experiments.data.rewards.sequence_rewards import (
    NO_EXAMPLES_WARNING,
    rewards_for_sequences,
)

__all__ = [
    "NO_EXAMPLES_WARNING",
    "rewards_for_sequences",
]

"""Rewards: `get_reward(spec)` resolves a registered name ('tag_pref', 'zero', 'math_density') or
'package.module:function'; `compute_rewards` is the validating wrapper every caller uses;
`reward_warnings()` lists the once-per-process warnings for results.json. A reward function is probe
style `fn(prompt, responses, example)` or TRL style `fn(prompts, completions, **kwargs)`; `calling.py`
documents both conventions.
"""

from entropy_experiments.data.rewards.notices import clear_reward_warnings, reward_warnings
from entropy_experiments.data.rewards.registry import (
    REWARD_REGISTRY,
    RewardFn,
    compute_rewards,
    describe_reward,
    get_reward,
    register_reward,
)

# Imported for their registration side effect.
from entropy_experiments.data.rewards import basic, tag_pref  # noqa: F401  isort: skip

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

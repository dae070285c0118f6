"""`sample_batch` in the form the legacy tests and scripts call it: a SequenceProcessor that knows its reward.

The probe calls `entropy_experiments.probe.sampling.sample_batch` with the policy engine and the config's reward name.
"""

from __future__ import annotations

from ..data.rewards.weighted import RewardSet
from ..probe import sampling
from .sequence_processor import SequenceProcessor

__all__ = ["sample_batch"]


def sample_batch(sp: SequenceProcessor, examples: list, prompt_indices: list[int], G: int, *, seed: int,
                 with_rewards: bool, reference: bool = False) -> dict:
    """`sampling.sample_batch` with the processor's `reward.name` when `with_rewards` (U), none otherwise (E)."""
    rewards = RewardSet.resolve([sp.reward_spec]) if with_rewards else None
    return sampling.sample_batch(sp, examples, prompt_indices, G, seed=seed, rewards=rewards,
                                 reference=reference).to_dict()

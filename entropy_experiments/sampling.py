"""Phase 0: turning the index plan (`data/plan.py`) into packed batches.

The index plan is drawn once from the config seed — E prompts WITH replacement (G = 1) or distinct,
U prompts distinct — so that a distributed run can draw it on rank 0 and broadcast it (probe.py), and
a resumed run can check it. Generation itself is the policy engine's (`policy/engine.py`); `sample_batch`
turns a list of prompt indices into one packed batch (rewards by the reward registry, advantages by the
objective's rule); `saved_batches` validates a resumed run's; `prompt_examples`
loads the prompt pool. IndexPlan / draw_index_plan live in data/plan.py and are re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from .data.batch import pack_batch, validate_batch, zero_advantage_prompts
from .data.datasets import load_examples
from .data.plan import IndexPlan, draw_index_plan
from .data.rewards.sequence_rewards import rewards_for_sequences
from .estimators.objectives import batch_advantages
from .policy.engine import PolicyEngine
from .policy.reference_sampler import sample_with_engine

log = logging.getLogger("entropy_experiments.sampling")

__all__ = ["IndexPlan", "draw_index_plan", "prompt_examples", "sample_batch", "saved_batches", "warn_zero_advantages"]


def sample_batch(engine: PolicyEngine, examples: list, prompt_indices: list[int], G: int, *, seed: int,
                 reward: str | None, reference: bool = False) -> dict:
    """Generate G responses for each listed prompt and pack them; with a `reward` (the config's
    `reward.name`: a U batch) also their rewards and advantages, without (an E batch) zeros.

    `reference=True` uses the plain one-prompt-at-a-time sampler instead of batched generation
    (`probe_rework.use_sequence_processor_sampling: false`): same batch dict, no batching tricks.
    """
    chosen = [examples[i] for i in prompt_indices]
    prompts = [ex.question for ex in chosen]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if reference:
            seqs = sample_with_engine(engine, prompts, G, seed=seed)
        else:
            # Each chunk seeded from (seed, chunk index): chunks saved by a killed run can be reused.
            seqs = engine.generate_batched(prompts, G, seed=seed, seed_per_chunk=True)
    seqs.examples = chosen
    seqs.prompt_ids = [int(ex.meta["global_prompt_id"]) for ex in chosen]
    if reward is None:
        return pack_batch(seqs, None)
    rewards = rewards_for_sequences(reward, prompts, seqs, chosen, engine.warn_once)
    return pack_batch(seqs, rewards, batch_advantages(rewards))


def prompt_examples(bc) -> list:
    """The prompt pool of the config's `batch_config` section (dataset registry)."""
    return load_examples(bc.dataset_name, bc.split, dataset_path=bc.dataset_path, pool_size=bc.pool_size)


def saved_batches(batches: tuple[dict, dict], logger: logging.Logger = log) -> tuple[dict, dict]:
    """Saved (E, U) batches, validated."""
    E, U = batches
    validate_batch(E, "E_batch")
    validate_batch(U, "U_batch")
    logger.info("Phase 0: reusing saved batches (E %d×%d, U %d×%d)", E["num_prompts"], E["num_responses_per_prompt"],
                U["num_prompts"], U["num_responses_per_prompt"])
    return E, U


def warn_zero_advantages(U: dict, warn: Callable[[str], None], logger: logging.Logger = log) -> int:
    """Log how many U prompts have all-zero advantages; `warn` when all of them do (v is then no policy step)."""
    n_zero = zero_advantage_prompts(U)
    logger.info("U: %d of %d prompts have all-zero advantages (they add nothing to v)", n_zero, U["num_prompts"])
    if n_zero == U["num_prompts"]:
        warn("every U prompt has all-zero advantages: the update direction is pure weight decay / "
             "momentum (check rewards and gold answers)")
    return n_zero

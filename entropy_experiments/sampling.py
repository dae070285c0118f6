"""Phase 0: turning the index plan (`data/plan.py`) into packed batches.

The index plan is drawn once from the config seed — E prompts WITH replacement (G = 1) or distinct,
U prompts distinct — so that a distributed run can draw it on rank 0 and broadcast it (probe.py), and
a resumed run can check it. Generation itself is the SequenceProcessor's; `sample_batch` turns a list
of prompt indices into one packed batch.
IndexPlan / draw_index_plan moved to entropy_experiments.data.plan and are re-exported here.
"""

from __future__ import annotations

import logging

import torch

from .data.batch import pack_batch
from .data.plan import IndexPlan, draw_index_plan

log = logging.getLogger("entropy_experiments.sampling")

__all__ = ["IndexPlan", "draw_index_plan", "sample_batch"]


def sample_batch(sp, examples: list, prompt_indices: list[int], G: int, *, seed: int, with_rewards: bool,
                 reference: bool = False) -> dict:
    """Generate G responses for each listed prompt and pack them (U: rewards + advantages).

    `reference=True` uses the plain one-prompt-at-a-time sampler instead of batched generation
    (`probe_rework.use_sequence_processor_sampling: false`): same batch dict, no batching tricks.
    """
    chosen = [examples[i] for i in prompt_indices]
    prompts = [ex.question for ex in chosen]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if reference:
            from .policy.reference_sampler import sample_one_at_a_time
            seqs = sample_one_at_a_time(sp.model, sp.tokenizer, prompts, G, sp.config, seed=seed)
        else:
            # Each chunk seeded from (seed, chunk index): chunks saved by a killed run can be reused.
            seqs = sp.generate_batched(prompts, G, seed=seed, seed_per_chunk=True)
    seqs.examples = chosen
    seqs.prompt_ids = [int(ex.meta["global_prompt_id"]) for ex in chosen]
    rewards = sp.compute_rewards(prompts, seqs, chosen) if with_rewards else None
    return pack_batch(seqs, rewards, with_advantages=with_rewards)

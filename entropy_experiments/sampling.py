"""Phase 0: turning the index plan (`data/plan.py`) into packed batches.

The index plan is drawn once from the config seed — E prompts WITH replacement (G = 1) or distinct,
U prompts distinct — so that a distributed run can draw it on rank 0 and broadcast it, and a resumed
run can check it. Generation itself is the SequenceProcessor's; this module only orchestrates it.
IndexPlan / draw_index_plan moved to entropy_experiments.data.plan and are re-exported here.
"""

from __future__ import annotations

import logging

import torch

from .data.batch import concat_batches, pack_batch
from .data.plan import IndexPlan, draw_index_plan
from .distributed import rank_seed

log = logging.getLogger("entropy_experiments.sampling")

__all__ = ["IndexPlan", "draw_index_plan", "sample_batch", "sample_batch_sharded"]


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
            from .utils.reference_sampler import sample_one_at_a_time
            seqs = sample_one_at_a_time(sp.model, sp.tokenizer, prompts, G, sp.config, seed=seed)
        else:
            # Each chunk seeded from (seed, chunk index): chunks saved by a killed run can be reused.
            seqs = sp.generate_batched(prompts, G, seed=seed, seed_per_chunk=True)
    seqs.examples = chosen
    seqs.prompt_ids = [int(ex.meta["global_prompt_id"]) for ex in chosen]
    rewards = sp.compute_rewards(prompts, seqs, chosen) if with_rewards else None
    return pack_batch(seqs, rewards, with_advantages=with_rewards)


def sample_batch_sharded(sp, examples: list, prompt_indices: list[int], G: int, *, seed: int, with_rewards: bool,
                         reference: bool = False, dist=None, what: str = "batch") -> dict:
    """`sample_batch` over the ranks of a distributed job: each rank generates its contiguous slice of
    `prompt_indices` with its own generator (`distributed.rank_seed`; rank 0 keeps `seed`), and the
    slices are all-gathered so that every rank returns the whole batch in plan order. One process:
    exactly `sample_batch`."""
    if dist is None or not dist.enabled:
        return sample_batch(sp, examples, prompt_indices, G, seed=seed, with_rewards=with_rewards,
                            reference=reference)
    mine = dist.prompt_slice(len(prompt_indices))
    local = (sample_batch(sp, examples, [prompt_indices[i] for i in mine], G, seed=rank_seed(seed, dist.rank),
                          with_rewards=with_rewards, reference=reference) if mine else None)
    parts = dist.all_gather_object(local, f"gather sampled {what}")
    return concat_batches(parts, sp.pad_token_id)

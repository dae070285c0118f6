"""Phase 0: which prompts to sample (the index plan) and turning them into packed batches.

The index plan is drawn once from the config seed — E prompts WITH replacement (G = 1) or distinct,
U prompts distinct — so that a distributed run can draw it on rank 0 and broadcast it, and a resumed
run can check it. Generation itself is the SequenceProcessor's; this module only orchestrates it.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass

import torch

from .batches import pack_batch
from .errors import DataError

log = logging.getLogger("entropy_experiments.sampling")


@dataclass(frozen=True)
class IndexPlan:
    """Pool indices of the E prompts ([B_E], repeats allowed in replacement mode) and U prompts ([B_U])."""

    E_prompt_indices: list[int]
    U_prompt_indices: list[int]
    E_responses_per_prompt: int
    U_responses_per_prompt: int

    def describe(self) -> dict:
        counts = Counter(self.E_prompt_indices)
        return {"E_sequences": len(self.E_prompt_indices) * self.E_responses_per_prompt,
                "unique_E_prompts": len(counts), "largest_E_repeat": max(counts.values(), default=0),
                "U_prompts": len(self.U_prompt_indices), "G": self.U_responses_per_prompt}


def draw_index_plan(pool_size: int, *, B_E: int, B_U: int, G: int, E_sampling_mode: str, seed: int,
                    max_prompts_pool: int | None = None) -> IndexPlan:
    """Draw the plan with a local RNG (never the global one). Raises DataError if the pool is too small."""
    pool = min(pool_size, max_prompts_pool) if max_prompts_pool else pool_size
    if pool < 1:
        raise DataError("the data set split is empty")
    if B_U > pool:
        raise DataError(f"batch_config.B_U={B_U} is larger than the prompt pool ({pool} prompts)")
    rng = random.Random(seed)
    if E_sampling_mode == "replacement":
        E, E_G = [rng.randrange(pool) for _ in range(B_E)], 1
    elif E_sampling_mode == "distinct":
        if B_E > pool:
            raise DataError(f"batch_config.B_E={B_E} distinct prompts requested but the pool has {pool}")
        E, E_G = rng.sample(range(pool), B_E), G
    else:
        raise ValueError(f"unknown E_sampling_mode {E_sampling_mode!r}")
    U = rng.sample(range(pool), B_U)
    return IndexPlan(E_prompt_indices=E, U_prompt_indices=U, E_responses_per_prompt=E_G, U_responses_per_prompt=G)


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
    from .distributed import concat_batches, rank_seed

    mine = dist.prompt_slice(len(prompt_indices))
    local = (sample_batch(sp, examples, [prompt_indices[i] for i in mine], G, seed=rank_seed(seed, dist.rank),
                          with_rewards=with_rewards, reference=reference) if mine else None)
    parts = dist.all_gather_object(local, f"gather sampled {what}")
    return concat_batches(parts, sp.pad_token_id)

"""The index plan: which pool prompts Phase 0 samples for E and for U.

The plan is drawn once from the config seed — E prompts WITH replacement (G = 1) or distinct,
U prompts distinct — so that a distributed run can draw it on rank 0 and broadcast it, and a resumed
run can check it.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

from ..errors import DataError


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

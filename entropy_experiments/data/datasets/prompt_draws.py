"""Drawing prompts from a data set's pool: distinct prompts, or independent draws with replacement.

Both use a local `random.Random(seed)`, so the caller's global RNG state is left untouched.
"""

from __future__ import annotations

import random
from collections import Counter

from entropy_experiments.data.datasets.base import Example, load_examples
from entropy_experiments.errors import DataError

__all__ = ["draw_distinct", "draw_with_replacement", "load_prompt_pool"]


def load_prompt_pool(dataset_name: str, split: str, *, dataset_path: str | None = None, pool_size: int | None = None,
                     max_prompts_pool: int | None = None) -> list[Example]:
    """The split's examples (the first `max_prompts_pool` when given); DataError when empty."""
    pool = load_examples(dataset_name, split, dataset_path=dataset_path, pool_size=pool_size)
    if max_prompts_pool is not None:
        pool = pool[: int(max_prompts_pool)]
    if not pool:
        raise DataError(f"{dataset_name}/{split}: the prompt pool is empty")
    return pool


def draw_distinct(pool: list[Example], num_prompts: int, seed: int | None, *, label: str) -> list[Example]:
    """`num_prompts` distinct examples of `pool` (`label`, e.g. "gsm8k/train", names it in errors)."""
    if num_prompts > len(pool):
        raise DataError(f"{label}: {num_prompts} distinct prompts requested but the pool has {len(pool)}")
    rng = random.Random(seed)
    return [pool[i] for i in rng.sample(range(len(pool)), num_prompts)]


def draw_with_replacement(pool: list[Example], total: int, seed: int | None) -> tuple[list[Example], Counter]:
    """`total` independent draws from `pool` → (the examples drawn, how often each pool index was drawn)."""
    rng = random.Random(seed)
    drawn = [rng.randrange(len(pool)) for _ in range(int(total))]
    return [pool[i] for i in drawn], Counter(drawn)

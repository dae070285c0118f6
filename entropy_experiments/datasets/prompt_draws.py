"""moved to entropy_experiments.data.datasets.prompt_draws; kept so existing imports work."""

from entropy_experiments.data.datasets.prompt_draws import (
    draw_distinct,
    draw_with_replacement,
    load_prompt_pool,
)

__all__ = [
    "draw_distinct",
    "draw_with_replacement",
    "load_prompt_pool",
]

"""moved to entropy_experiments.data.datasets.templates; kept so existing imports work."""

from entropy_experiments.data.datasets.templates import (
    R1_TEMPLATE,
    r1_prompt,
)

__all__ = [
    "R1_TEMPLATE",
    "r1_prompt",
]

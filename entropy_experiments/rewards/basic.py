"""moved to entropy_experiments.data.rewards.basic; kept so existing imports work."""

from entropy_experiments.data.rewards.basic import (
    math_density,
    zero,
)

__all__ = [
    "math_density",
    "zero",
]

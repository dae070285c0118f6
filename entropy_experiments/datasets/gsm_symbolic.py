"""moved to entropy_experiments.data.datasets.gsm_symbolic; kept so existing imports work."""

from entropy_experiments.data.datasets.gsm_symbolic import (
    DEFAULT_POOL_SIZE,
    NAME,
    SPLIT_SEEDS,
    gsm_symbolic_r1_template,
    split_of,
)

__all__ = [
    "DEFAULT_POOL_SIZE",
    "NAME",
    "SPLIT_SEEDS",
    "gsm_symbolic_r1_template",
    "split_of",
]

"""moved to entropy_experiments.data.datasets.gsm8k; kept so existing imports work."""

from entropy_experiments.data.datasets.gsm8k import (
    HUB_ID,
    NAME,
    gsm8k_gold,
    gsm8k_r1_template,
)

__all__ = [
    "HUB_ID",
    "NAME",
    "gsm8k_gold",
    "gsm8k_r1_template",
]

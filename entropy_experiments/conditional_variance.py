"""Moved to entropy_experiments.estimators.jackknife; kept so existing imports work."""

from .estimators.jackknife import (
    leave_one_group_out_directions,
    se_E,
    se_total,
    se_U,
)

__all__ = [
    "leave_one_group_out_directions",
    "se_E",
    "se_U",
    "se_total",
]

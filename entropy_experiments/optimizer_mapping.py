"""Kept so existing imports work: `entropy_experiments.optimizer_mapping`.

The code lives in `entropy_experiments.checkpoint.optimizer_mapping` (saved optimizer entries → parameters).
"""

from .checkpoint.optimizer_mapping import (
    TRAINER_ORDER,
    canonical_param_name,
    decay_parameter_names,
    map_by_name,
    map_by_position,
    saved_group_names,
)

__all__ = ["TRAINER_ORDER", "canonical_param_name", "decay_parameter_names", "map_by_name", "map_by_position",
           "saved_group_names"]

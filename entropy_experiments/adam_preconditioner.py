"""Moved to entropy_experiments.estimators.update_direction; kept so existing imports work."""

from .estimators.update_direction import (
    UPDATE_DIRECTIONS,
    AdamHyper,
    AdamStateError,
    DirectionFn,
    NamedTensors,
    adam_state_by_name,
    adamw_step_direction,
    clip_coefficient,
    hyper_by_name,
    leave_one_out_gradients,
    named_dot,
    named_norm,
    preconditioned_gradient_direction,
    sgd_direction,
    update_direction,
)

__all__ = [
    "UPDATE_DIRECTIONS",
    "AdamHyper",
    "AdamStateError",
    "DirectionFn",
    "NamedTensors",
    "adam_state_by_name",
    "adamw_step_direction",
    "clip_coefficient",
    "hyper_by_name",
    "leave_one_out_gradients",
    "named_dot",
    "named_norm",
    "preconditioned_gradient_direction",
    "sgd_direction",
    "update_direction",
]

"""Re-export of `entropy_experiments.policy.precision_utils` under its earlier module path."""

from entropy_experiments.policy.precision_utils import (
    ForwardProfile,
    PrecisionConfig,
    apply_global_precision,
    forward_precision_ctx,
    str_to_dtype,
)

__all__ = ["ForwardProfile", "PrecisionConfig", "apply_global_precision", "forward_precision_ctx", "str_to_dtype"]

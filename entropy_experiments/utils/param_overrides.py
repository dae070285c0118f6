"""Re-export of `entropy_experiments.policy.param_overrides` under its earlier module path."""

from entropy_experiments.policy.param_overrides import (
    build_params_override,
    live_params_mapping,
    resolve_param_names,
    unwrap_model,
)

__all__ = ["build_params_override", "live_params_mapping", "resolve_param_names", "unwrap_model"]

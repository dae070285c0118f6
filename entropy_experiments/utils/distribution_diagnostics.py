"""Re-export of `entropy_experiments.policy.distribution_diagnostics` under its earlier module path."""

from entropy_experiments.policy.distribution_diagnostics import (
    BASELINE_FEATURE_NAMES,
    DiagnosticsPack,
    DistributionDiagnostics,
    SequenceDiagnostics,
    TokenStepDiagnostics,
    baseline_features,
)

__all__ = ["BASELINE_FEATURE_NAMES", "DiagnosticsPack", "DistributionDiagnostics", "SequenceDiagnostics", "TokenStepDiagnostics", "baseline_features"]

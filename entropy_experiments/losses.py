"""Moved to entropy_experiments.estimators.surrogate; kept so existing imports work."""

from .estimators.surrogate import (
    BASELINES,
    NORMALIZE_MODES,
    X_MODES,
    SurrogateCoefficients,
    directional_pieces,
    entropy_estimate,
    entropy_to_go,
    normalizer,
    sequence_coefficients,
    surrogate_coefficients,
    surrogate_loss,
    tokens_to_go,
    weighted_logq_sum,
)

__all__ = [
    "BASELINES",
    "NORMALIZE_MODES",
    "X_MODES",
    "SurrogateCoefficients",
    "directional_pieces",
    "entropy_estimate",
    "entropy_to_go",
    "normalizer",
    "sequence_coefficients",
    "surrogate_coefficients",
    "surrogate_loss",
    "tokens_to_go",
    "weighted_logq_sum",
]

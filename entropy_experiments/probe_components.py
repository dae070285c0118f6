"""The seeds' import path of `ProbeComponents`; the façade lives in `entropy_experiments.compat.probe_components`."""

from .compat.probe_components import (
    DeltaH1Result,
    EScores,
    ProbeComponents,
    UGradients,
    chunked,
    split_into_groups,
)

__all__ = ["DeltaH1Result", "EScores", "ProbeComponents", "UGradients", "chunked", "split_into_groups"]

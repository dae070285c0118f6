"""Legacy import path of the original (seed) API: `ProbeComponents` and the names the seeds imported with it.

A thin re-export of `entropy_experiments.compat.probe_components`, where the code lives. New code calls the
phase functions of `entropy_experiments.probe.recipe` directly.
"""

from .compat.probe_components import (
    DeltaH1Result,
    EScores,
    ProbeComponents,
    UGradients,
    chunked,
    split_into_groups,
)

__all__ = ["DeltaH1Result", "EScores", "ProbeComponents", "UGradients", "chunked", "split_into_groups"]

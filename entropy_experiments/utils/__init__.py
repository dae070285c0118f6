"""Sampling/scoring utilities: SequenceProcessor (seed 004), the sampling policy, diagnostics,
parameter overrides, precision profiles and the one-at-a-time reference sampler."""

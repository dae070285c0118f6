"""Earlier import paths (re-exports of `entropy_experiments.policy` and `entropy_experiments.compat`) and the
one-at-a-time reference sampler."""

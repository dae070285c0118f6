"""The policy under probe: generation and teacher-forced scoring under one sampling policy q_θ.

`sampling_policy.py` (the temperature + nucleus rule), `generation_config.py` (settings),
`policy_model.py` (model + tokenizer + settings), `generate.py` / `stop_rule.py` (sampling),
`tf_batches.py` / `score.py` (teacher forcing, jvp), `sequences.py` (the data types), `oom.py`,
`distribution_diagnostics.py`, `param_overrides.py`, `precision_utils.py`, `reference_sampler.py` (one prompt,
one response at a time).
"""

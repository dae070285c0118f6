"""The objective keys each trainer fixes by default (`objective.trainer`; docs/objectives.md)."""

from __future__ import annotations

from typing import Any

# Trainer presets: every key a trainer fixes by default (sources in docs/objectives.md: trl 1.16.0
# grpo_config.py loss_type ≈ L801 "dapo", scale_rewards ≈ L789 "group", beta ≈ L681 0.0,
# entropy_coef ≈ L876 0.0, max_completion_length ≈ L494 (TRL generates that many tokens, so the probe's
# generation.max_new_tokens plays its part: `resolve` fills it from there), advantages ε = 1e-4 in grpo_trainer.py
# ≈ L2787, max_grad_norm 1.0 from TrainingArguments; verl 0.9.1 core_algos.py GRPO ε = 1e-6,
# FSDPActorConfig loss_agg_mode token-mean over the mini-batch's global token count, grad_clip 1.0,
# use_kl_loss false (low_var_kl when on); OpenRLHF 0.11.2 group_norm ε = 1e-9, --actor.loss_agg_mode
# token-mean: one token mean over the whole optimizer step (loss_utils.iter_grad_accum_global_norm), max_norm 1.0).
# tests/test_framework_objectives.py checks verl's and OpenRLHF's against their own loss code.
TRAINER_PRESETS: dict[str, dict[str, Any]] = {
    "trl": {"loss_type": "dapo", "scale_rewards": "group", "advantage_eps": 1e-4, "max_completion_length": None,
            "kl_coef": 0.0, "kl_estimator": "k3", "entropy_coef": 0.0, "entropy_aggregation": "token_mean",
            "max_grad_norm": 1.0, "micro_batches": 1, "use_bias_correction_kl": True},
    "verl": {"loss_type": "dapo", "scale_rewards": "group", "advantage_eps": 1e-6, "max_completion_length": None,
             "kl_coef": 0.0, "kl_estimator": "low_var_kl", "entropy_coef": 0.0, "entropy_aggregation": "loss",
             "max_grad_norm": 1.0, "micro_batches": 1},
    "openrlhf": {"loss_type": "dapo", "scale_rewards": "group", "advantage_eps": 1e-9, "max_completion_length": None,
                 "kl_coef": 0.0, "kl_estimator": "k1", "entropy_coef": 0.0, "entropy_aggregation": "loss",
                 "max_grad_norm": 1.0, "micro_batches": 1},
}

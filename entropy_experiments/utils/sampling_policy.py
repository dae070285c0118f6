"""Re-export of `entropy_experiments.policy.sampling_policy` under its earlier module path."""

from entropy_experiments.policy.sampling_policy import (
    CORE_KEYS,
    DIAG_KEYS,
    NUCLEUS_TOPK,
    NonFiniteLogitsError,
    SamplingPolicyLogitsProcessor,
    nucleus_keep_mask,
    policy_token_stats,
    sampling_logits,
    token_logq_and_entropy,
    validate_policy,
)

__all__ = ["CORE_KEYS", "DIAG_KEYS", "NUCLEUS_TOPK", "NonFiniteLogitsError", "SamplingPolicyLogitsProcessor", "nucleus_keep_mask", "policy_token_stats", "sampling_logits", "token_logq_and_entropy", "validate_policy"]

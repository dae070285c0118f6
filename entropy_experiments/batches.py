"""moved to entropy_experiments.data.batch; kept so existing imports work."""

from .data.batch import (
    BatchContractError,
    batch_to_sequences,
    count_tokens,
    pack_batch,
    subset_batch,
    validate_batch,
    zero_advantage_prompts,
)

__all__ = [
    "BatchContractError", "batch_to_sequences", "count_tokens", "pack_batch", "subset_batch", "validate_batch",
    "zero_advantage_prompts",
]

"""The probe's with-grad microbatch under `estimator.memory_budget_gb` (policy/memory_budget.py), once E and U
are sampled and their lengths known. The run's config (and its hash) is unchanged; the phases get a copy."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..config import ProbeConfig
from ..policy.memory_budget import ModelShape, microbatch_within_budget

__all__ = ["budgeted_config"]


def budgeted_config(config: ProbeConfig, model, batches: Sequence[dict], warn: Callable[[str], None]) -> ProbeConfig:
    """`config` with estimator.microbatch_size lowered to fit the budget (warned), or `config` itself."""
    budget = config.estimator.memory_budget_gb
    if budget is None:
        return config
    positions = max(int(batch.sequences.shape[-1]) for batch in batches)
    response = max(max(max(row) for row in batch.gen_lens) for batch in batches)
    rows, message = microbatch_within_budget(budget, ModelShape.of(model), positions, int(response),
                                             config.estimator.microbatch_size)
    if message is None:
        return config
    warn(message)
    return config.model_copy(update={"estimator": config.estimator.model_copy(update={"microbatch_size": rows})})

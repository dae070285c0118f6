"""What teacher forcing returns, and helpers on the packed layout (seed 004 layout, docs/maths.md §1).

Generation returns, and teacher forcing scores, one batch type: `data.batch.Batch` (the packed, left-padded
layout; a response of T tokens sits at [Lp, Lp + T) of its row). LogprobResults / DiagnosticsResults:
teacher-forcing results per [b][g]. `LogprobResults.logprobs` is log p (raw model, τ = 1, no nucleus) as in the seed; `token_logqs` is log q (the sampling policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch import Tensor

# completion_ids belongs to the batch (data/ never imports policy/); it stays importable here beside the other
# helpers on the packed layout.
from entropy_experiments.data.batch import Batch, completion_ids
from entropy_experiments.policy.distribution_diagnostics import DiagnosticsPack

__all__ = ["BatchedSequences", "DiagnosticsResults", "LogprobResults", "completion_ids", "global_prompt_id",
           "response_tokens"]


#: The seed API's name for the one batch type (`data.batch.Batch`), which generation returns and teacher forcing
#: scores; compat/ re-exports it under this name.
BatchedSequences = Batch


@dataclass
class LogprobResults:
    """Teacher-forcing results, per [b][g] over the T generated tokens (see module docstring for naming).

    logprobs: log p tensors [T]; surprisals: −log q of each sampled token (numpy [T]; the seed API calls
    them `entropies`: their mean estimates the entropy, but each is a surprisal); sequence_logprobs:
    Σ log p; rb_entropies: RB entropies H_k of q (numpy [T]; empty list unless compute_rb); rewards;
    rb_entropies_torch: graph-carrying H_k (with-grad path, compute_rb and rb_requires_grad);
    baseline_feats_torch: [T, 7] detached features (BASELINE_FEATURE_NAMES); token_logqs: log q [T];
    sequence_logqs: Σ log q (accumulated in float64); token_logps_train / token_entropies_train: log-prob
    and entropy under softmax(logits/τ) with no nucleus, what RL trainers score (graph on the with-grad path).
    """

    logprobs: list[list[Tensor]]
    surprisals: list[list[np.ndarray]]
    sequence_logprobs: list[list[float]]
    rb_entropies: list[list[np.ndarray]]
    rewards: list[list[float]]
    rb_entropies_torch: list[list[Tensor]] | None = None
    baseline_feats_torch: list[list[Tensor]] | None = None
    token_logqs: list[list[Tensor]] | None = None
    sequence_logqs: list[list[float]] | None = None
    token_logps_train: list[list[Tensor]] | None = None
    token_entropies_train: list[list[Tensor]] | None = None


@dataclass
class DiagnosticsResults:
    diagnostics: list[list[DiagnosticsPack]]


def response_tokens(sequences: Batch, b: int, g: int) -> Tensor:
    Lp, T = int(sequences.prompt_lens[b]), int(sequences.gen_lens[b][g])
    return sequences.sequences[b, g, Lp:Lp + T]


def global_prompt_id(example: Any, default: int) -> int:
    meta = getattr(example, "meta", None)
    if meta is None and isinstance(example, Mapping):
        meta = example.get("meta")
    if isinstance(meta, Mapping) and "global_prompt_id" in meta:
        return int(meta["global_prompt_id"])
    return int(default)

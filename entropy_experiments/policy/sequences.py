"""The data that flows between generation, scoring and the probe (seed 004 layout, docs/maths.md §1).

BatchedSequences: the packed, left-padded layout; a response of T tokens sits at [Lp, Lp + T) of its
row; a packed `data.batch.Batch` hands out this view (`Batch.as_sequences`) for teacher forcing.
LogprobResults / DiagnosticsResults: teacher-forcing results per [b][g]. `LogprobResults.logprobs`
is log p (raw model, τ = 1, no nucleus) as in the seed; `token_logqs` is log q (the sampling policy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from entropy_experiments.policy.distribution_diagnostics import DiagnosticsPack

__all__ = [
    "BatchedSequences", "DiagnosticsResults", "LogprobResults", "completion_ids",
    "global_prompt_id", "response_tokens", "take_prompts", "take_rows",
]


def take_prompts(tensor: Tensor, prompt_indices: Sequence[int]) -> Tensor:
    """The rows [b] of a [B, ...] tensor for the listed prompts, in that order (index on the tensor's device)."""
    index = torch.tensor([int(i) for i in prompt_indices], dtype=torch.long, device=tensor.device)
    return tensor[index]


def take_rows(rows: list | None, prompt_indices: Sequence[int]) -> list | None:
    """The entries of a per-prompt list [B] for the listed prompts (None stays None)."""
    return None if rows is None else [rows[int(i)] for i in prompt_indices]


@dataclass
class BatchedSequences:
    """Generated (or saved) sequences in the packed, left-padded layout.

    sequences / attention_masks: [B, G, L] (long); prompt_lens: [B] padded prompt length Lp;
    gen_lens: [B][G] response lengths T; responses_text: [B][G] decoded responses (special tokens
    skipped); prompts: [B]; examples: [B] data-set records (gold answers) or None; prompt_ids: [B]
    global prompt ids or None; sampler_logqs: [B, G, L] float32 or None — at a response position j,
    log q_sampler(sequences[..., j] | sequences[..., :j]) under the sampler that drew the token (its own
    precision, temperature and nucleus), 0 elsewhere; None when the sampler is the scored policy.
    """

    sequences: Tensor
    prompt_lens: list[int]
    gen_lens: list[list[int]]
    attention_masks: Tensor
    responses_text: list[list[str]]
    prompts: list[str] | None = None
    examples: list | None = None
    prompt_ids: list[int] | None = None
    sampler_logqs: Tensor | None = None

    @property
    def num_prompts(self) -> int:
        return int(self.sequences.shape[0])

    @property
    def num_responses_per_prompt(self) -> int:
        return int(self.sequences.shape[1])

    def subset(self, prompt_indices: Sequence[int]) -> BatchedSequences:
        """The same layout restricted to the listed prompts (used for microbatches)."""
        idx = [int(i) for i in prompt_indices]
        return BatchedSequences(
            sequences=take_prompts(self.sequences, idx),
            prompt_lens=take_rows(self.prompt_lens, idx),
            gen_lens=[list(row) for row in take_rows(self.gen_lens, idx)],
            attention_masks=take_prompts(self.attention_masks, idx),
            responses_text=[list(row) for row in take_rows(self.responses_text, idx)],
            prompts=take_rows(self.prompts, idx), examples=take_rows(self.examples, idx),
            prompt_ids=take_rows(self.prompt_ids, idx),
            sampler_logqs=None if self.sampler_logqs is None else take_prompts(self.sampler_logqs, idx),
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain tensors / lists / dicts only (loadable with torch.load(weights_only=True))."""
        examples = None
        if self.examples is not None:
            examples = [dataclasses.asdict(ex) if dataclasses.is_dataclass(ex) else dict(ex) for ex in self.examples]
        return {
            "sequences": self.sequences.detach().cpu(), "attention_masks": self.attention_masks.detach().cpu(),
            "prompt_lens": [int(x) for x in self.prompt_lens],
            "gen_lens": [[int(t) for t in row] for row in self.gen_lens],
            "responses_text": [list(r) for r in self.responses_text],
            "prompts": None if self.prompts is None else list(self.prompts),
            "examples": examples,
            "prompt_ids": None if self.prompt_ids is None else [int(p) for p in self.prompt_ids],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> BatchedSequences:
        """Inverse of `to_dict`; the examples stay the plain dicts they were saved as (the seed façade's
        `BatchedSequences` turns them back into data-set records)."""
        examples = d.get("examples")
        return cls(sequences=d["sequences"], prompt_lens=list(d["prompt_lens"]),
                   gen_lens=[list(r) for r in d["gen_lens"]], attention_masks=d["attention_masks"],
                   responses_text=[list(r) for r in d["responses_text"]], prompts=d.get("prompts"),
                   examples=None if examples is None else list(examples), prompt_ids=d.get("prompt_ids"))


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


def response_tokens(sequences: BatchedSequences, b: int, g: int) -> Tensor:
    Lp, T = int(sequences.prompt_lens[b]), int(sequences.gen_lens[b][g])
    return sequences.sequences[b, g, Lp:Lp + T]


def completion_ids(sequences: BatchedSequences, b: int) -> list[list[int]]:
    """Token ids of prompt b's G responses (the gen_lens[b][g] tokens after the padded prompt)."""
    start = sequences.prompt_lens[b]
    row = sequences.sequences[b]
    return [row[g, start:start + T].tolist() for g, T in enumerate(sequences.gen_lens[b])]


def global_prompt_id(example: Any, default: int) -> int:
    meta = getattr(example, "meta", None)
    if meta is None and isinstance(example, Mapping):
        meta = example.get("meta")
    if isinstance(meta, Mapping) and "global_prompt_id" in meta:
        return int(meta["global_prompt_id"])
    return int(default)

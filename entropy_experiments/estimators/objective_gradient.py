"""g = ∇L_U: the gradient of the trainer's objective on the update batch U (docs/maths.md §4, objectives.py).

The gradient is accumulated per group of U prompts (for the U jackknife): each g_k carries the loss's
whole-batch normaliser, so Σ_k g_k = g. The work is a list of items (group k, microbatch of prompts) in
single-process order; `objective_gradient_sums` runs the items it is given and returns float64 sums,
so a caller may split the items over workers and add the sums (parallel.py); `u_gradients` finishes.
Prompts that cannot contribute (all-zero advantages and no KL / entropy term) are skipped: their
contribution is exactly zero. The model stays in eval() (no dropout): the probe predicts the step of
the policy it scores.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor, nn

from ..data.batch import Batch
from ..errors import ConfigError, NumericsError
from ..policy.engine import PolicyEngine
from ..tensors import NamedTensors
from . import objectives
from .entropy_terms import TokenStatistics
from .objectives import ObjectiveOptions, SequenceTerms

U_GRADIENT = "teacher forcing with grad (U gradient)"
U_REFERENCE = "teacher forcing (E scoring)"


@dataclass(frozen=True)
class Trainable:
    """The model and its trainable parameters (names and tensors in named_parameters order)."""

    model: nn.Module
    names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]

    @classmethod
    def of(cls, model: nn.Module) -> Trainable:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters (is the LoRA adapter loaded trainable?)")
        return cls(model, tuple(n for n, _ in named), tuple(p for _, p in named))

    def zeros(self, dtype: torch.dtype = torch.float32) -> NamedTensors:
        return {n: torch.zeros_like(p, dtype=dtype) for n, p in zip(self.names, self.params)}

    def grad(self, loss: Tensor, where: str, retain_graph: bool = False) -> list[Tensor]:
        """∂loss/∂params (zeros for unused ones); a non-finite loss is a NumericsError naming `where`."""
        if not torch.isfinite(loss):
            raise NumericsError(f"non-finite loss ({loss.item()}) in {where}")
        grads = torch.autograd.grad(loss, self.params, allow_unused=True, retain_graph=retain_graph)
        return [torch.zeros_like(p) if g is None else g for g, p in zip(grads, self.params)]

    def add_grad(self, buffer: NamedTensors, loss: Tensor, where: str, retain_graph: bool = False) -> None:
        """buffer += ∂loss/∂params, in the buffer's dtype."""
        for name, g in zip(self.names, self.grad(loss, where, retain_graph)):
            buffer[name] += g.double()


@dataclass
class UGradients:
    """g = Σ_k g_k of the trainer objective over K groups of U prompts (each g_k already carries the loss's
    whole-batch normaliser, so the g_k add up to g)."""

    total: NamedTensors
    groups: list[NamedTensors]
    group_sizes: list[int]
    loss: float
    zero_advantage_prompts: int
    leave_one_out_scales: list[float] | None = None   # c_k: g₍₋k₎ = c_k·(g − g_k) (objectives.py)


def chunked(items: list, size: int) -> list[list]:
    """Consecutive slices of `items` of length `size` (the last may be shorter)."""
    return [items[i:i + size] for i in range(0, len(items), size)]


def split_into_groups(n_items: int, n_groups: int) -> list[list[int]]:
    """Contiguous near-equal groups of range(n_items) (numpy.array_split semantics)."""
    return [list(map(int, g)) for g in np.array_split(np.arange(n_items), n_groups) if len(g)]


def prompts_per_microbatch(microbatch_size: int, G: int) -> int:
    """Whole prompts per backward microbatch: `microbatch_size` sequences, at least one prompt."""
    return max(1, microbatch_size // G)


def u_terms(U_batch: Batch, options: ObjectiveOptions, stats: TokenStatistics | None = None) -> list[list[SequenceTerms]]:
    """Per prompt and response: the objective's advantage and normalisers (objectives.batch_terms). Without `stats`,
    the terms before the entropy controls' per-token weights (the same advantages; `objective_gradient_sums` adds
    the weights from `u_token_statistics`)."""
    if stats is None and options.needs_token_statistics:
        options = replace(options, top_entropy_quantile=1.0, policy_loss="vanilla")
    return objectives.batch_terms(torch.tensor(U_batch.rewards, dtype=torch.float64),
                                  torch.tensor(U_batch.gen_lens), options, stats)


def u_token_statistics(engine: PolicyEngine, U_batch: Batch) -> TokenStatistics:
    """Every U response's trainer entropies and log-probs at θ (no graph), for the entropy controls' weights."""
    lp = engine.teacher_force_logprobs(U_batch, with_grad=False, compute_rb=False, phase=U_GRADIENT)
    rows = [(b, g) for b in range(U_batch.num_prompts) for g in range(U_batch.num_responses_per_prompt)]
    return TokenStatistics(tuple(lp.token_entropies_train[b][g].detach() for b, g in rows),
                           tuple(lp.token_logps_train[b][g].detach() for b, g in rows))


def u_work_items(terms: list[list[SequenceTerms]], groups: list[list[int]], options: ObjectiveOptions,
                 per_microbatch: int) -> list[tuple[int, list[int]]]:
    """(group k, microbatch of live prompts) in single-process order."""
    active = [objectives.contributes(row, options) for row in terms]
    return [(k, idx) for k, group in enumerate(groups) for idx in chunked([p for p in group if active[p]],
                                                                          per_microbatch)]


def objective_gradient_sums(engine: PolicyEngine, trainable: Trainable, U_batch: Batch, items: list[tuple[int, list[int]]],
                            terms: list[list[SequenceTerms]], options: ObjectiveOptions, n_groups: int,
                            progress=iter) -> tuple[list[NamedTensors], float]:
    """Σ over the given work items of ∇(objective share), per group (float64), and Σ of the losses."""
    trainable.model.eval()
    group_grads = [trainable.zeros(torch.float64) for _ in range(n_groups)]
    if options.needs_token_statistics:  # the weights depend on whole trainer micro-batches: one no-grad pass first
        terms = u_terms(U_batch, options, u_token_statistics(engine, U_batch))
    total_loss = 0.0
    for k, idx in progress(items):
        loss = objective_loss(engine, trainable.model, U_batch.subset(idx), [terms[p] for p in idx], options)
        trainable.add_grad(group_grads[k], loss, f"U backward, prompts {idx}")
        total_loss += float(loss.detach())
    return group_grads, total_loss


def u_gradients(group_grads: list[NamedTensors], loss: float, U_batch: Batch, groups: list[list[int]],
                options: ObjectiveOptions) -> UGradients:
    """Finish the summed group buffers: g = Σ_k g_k, fp32 buffers, leave-one-out scales (K ≥ 2)."""
    total = {name: torch.zeros_like(t) for name, t in group_grads[0].items()}
    for buf in group_grads:
        for name in total:
            total[name] += buf[name]
    loo = (objectives.leave_one_out_scales(torch.tensor(U_batch.gen_lens), groups, options)
           if len(groups) >= 2 else None)
    return UGradients(total={n: t.float() for n, t in total.items()},
                      groups=[{n: t.float() for n, t in buf.items()} for buf in group_grads],
                      group_sizes=[len(g) for g in groups], loss=loss,
                      zero_advantage_prompts=U_batch.zero_advantage_prompts(), leave_one_out_scales=loo)


def objective_loss(engine: PolicyEngine, model: nn.Module, sub: Batch, terms: list[list[SequenceTerms]],
                   options: ObjectiveOptions) -> Tensor:
    """The objective's share of one microbatch of U prompts (graph through the trainer log-probs)."""
    lp = engine.teacher_force_logprobs(sub, with_grad=True, compute_rb=False, phase=U_GRADIENT)
    ref = reference_logps(engine, model, sub) if options.needs_reference else None
    correction = options.vllm_correction if sub.sampler_logqs is not None else None
    loss = 0.0
    for j, row in enumerate(terms):
        for g, term in enumerate(row):
            logps = lp.token_logps_train[j][g]
            ratios = None if correction is None else correction.ratios(logps, sampler_token_logqs(sub, j, g))
            loss = loss + objectives.sequence_loss(
                logps, term, options, ref_logps=None if ref is None else ref[j][g].to(logps.device),
                entropies=lp.token_entropies_train[j][g], sampler_ratios=ratios)
    return loss


def sampler_token_logqs(batch: Batch, b: int, g: int) -> Tensor:
    """log q_sampler [T] of response (b, g)'s tokens: its response positions in the batch's `sampler_logqs`."""
    start = batch.prompt_lens[b]
    return batch.sampler_logqs[b, g, start:start + batch.gen_lens[b][g]]


def reference_logps(engine: PolicyEngine, model: nn.Module, seqs: Batch) -> list[list[Tensor]]:
    """The reference policy's trainer log-probs (the base model: the adapter disabled), no graph."""
    if not hasattr(model, "disable_adapter"):
        raise ConfigError("objective.kl_coef > 0 needs a PEFT adapter: the KL reference is the base model "
                          "with the adapter disabled")
    with model.disable_adapter():
        lp = engine.teacher_force_logprobs(seqs, with_grad=False, compute_rb=False, phase=U_REFERENCE)
    return lp.token_logps_train

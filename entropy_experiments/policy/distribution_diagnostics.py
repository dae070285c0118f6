"""Per-step and per-sequence shape diagnostics of the sampling policy q_θ (temperature + nucleus).

Every per-step number describes the whole distribution q_θ(· | p, t_<k) the token was drawn from,
computed by the same chunked code as the log-probs (`sampling_policy.policy_token_stats`), so the
diagnostics can never disagree with the scoring about the policy:

    rb_entropy         H(q) in nats (the Rao-Blackwellised entropy)
    head_mass          mass of the nucleus under the tempered, untruncated softmax(z/τ); 1 when top_p = 1
    tail_mass          1 − head_mass (mass removed by the nucleus)
    two_point_entropy  binary entropy of (q_max, 1 − q_max)
    top1_prob, margin  q_max and q_max − q_second
    collision, renyi2  Σ q² and −log Σ q²
    eff_support        exp(H) (perplexity)
    logit_mean         E_q[a − max a] (a = z/τ): mean gap to the top logit, ≤ 0
    logit_var          Var_q[a] (= the varentropy Var_q[log q])
    eos_prob           q(EOS) (NaN when no EOS id is known)
    surprisal          −log q(t_k) of the realised token
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

import numpy as np
import torch
from torch import Tensor

from entropy_experiments.policy.sampling_policy import TokenStatsRequest, policy_token_stats, validate_policy

#: Columns of `baseline_features` (per-step features for regression baselines). Every feature is a
#: function of the prefix (p, t_<k) only, so a baseline fitted on them keeps the estimator unbiased.
BASELINE_FEATURE_NAMES = ("rb_entropy", "top1_prob", "margin", "collision", "eos_prob", "logit_var", "position")


@dataclass
class TokenStepDiagnostics:
    """Per-step arrays, each numpy float64 [T] (see the module docstring for definitions)."""

    rb_entropy: np.ndarray
    surprisal: np.ndarray
    head_mass: np.ndarray
    tail_mass: np.ndarray
    two_point_entropy: np.ndarray
    top1_prob: np.ndarray
    margin: np.ndarray
    collision: np.ndarray
    renyi2: np.ndarray
    eff_support: np.ndarray
    logit_mean: np.ndarray
    logit_var: np.ndarray
    eos_prob: np.ndarray | None = None


@dataclass
class SequenceDiagnostics:
    """Aggregates over one response's T steps (nats for entropies/surprisals)."""

    T: int
    rb_entropy_sum: float
    rb_entropy_mean: float
    rb_entropy_min: float
    rb_entropy_max: float
    early_rb_entropy_mean: float   # mean over the first `window` steps
    late_rb_entropy_mean: float    # mean over the last `window` steps
    surprisal_sum: float           # −Σ log q = −S (the naive sequence entropy estimate)
    surprisal_mean: float
    surprisal_max: float
    top1_prob_mean: float
    margin_mean: float
    collision_mean: float
    eff_support_mean: float
    tail_mass_mean: float
    logit_var_mean: float
    eos_prob_last: float           # q(EOS) at the final step (NaN when unknown)
    ends_with_eos: bool


@dataclass
class DiagnosticsPack:
    """Diagnostics of one response: per-step arrays and sequence aggregates."""

    step: TokenStepDiagnostics
    seq: SequenceDiagnostics


def _np(x: Tensor) -> np.ndarray:
    return x.detach().to("cpu", torch.float64).numpy()


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else float("nan")


class DistributionDiagnostics:
    """Diagnostics of q_θ with the given policy (top_p, temperature) and EOS id."""

    def __init__(self, top_p: float = 1.0, temperature: float = 1.0, eos_token_id: int | None = None, *,
                 fp64: bool = True, chunk_size: int = 256, window: int = 16):
        validate_policy(temperature, top_p)
        self.top_p = float(top_p)
        self.temperature = float(temperature)
        self.eos_token_id = eos_token_id
        self.fp64 = fp64
        self.chunk_size = chunk_size
        self.window = window

    def compute_from_logits(self, gen_logits: Tensor, gen_tokens: Tensor) -> DiagnosticsPack:
        """gen_logits [T, V] (row k scores token k), gen_tokens [T] → DiagnosticsPack."""
        with torch.no_grad():
            request = TokenStatsRequest(self.temperature, self.top_p, fp64=self.fp64, chunk_size=self.chunk_size,
                                        diagnostics=True, eos_token_id=self.eos_token_id)
            stats = policy_token_stats(gen_logits, gen_tokens, request)
        return self.from_token_stats(stats, gen_tokens)

    def from_token_stats(self, stats: Mapping[str, Tensor], gen_tokens: Tensor) -> DiagnosticsPack:
        """Build the pack from one sequence's slice of `policy_token_stats(..., diagnostics=True)` ([T] each)."""
        arrays = {k: _np(v) for k, v in stats.items()}
        step_kwargs = {f.name: arrays[f.name] for f in fields(TokenStepDiagnostics)
                       if f.name not in ("surprisal", "eos_prob")}
        step = TokenStepDiagnostics(surprisal=-arrays["logq"],
                                    eos_prob=arrays["eos_prob"] if self.eos_token_id is not None else None,
                                    **step_kwargs)
        return DiagnosticsPack(step=step, seq=self._aggregate(step, gen_tokens))

    def _aggregate(self, step: TokenStepDiagnostics, gen_tokens: Tensor) -> SequenceDiagnostics:
        h, s = step.rb_entropy, step.surprisal
        T = int(h.size)
        w = max(1, min(self.window, T))
        ends_with_eos = bool(T and self.eos_token_id is not None and int(gen_tokens[-1]) == self.eos_token_id)
        return SequenceDiagnostics(
            T=T,
            rb_entropy_sum=float(h.sum()), rb_entropy_mean=_mean(h),
            rb_entropy_min=float(h.min()) if T else float("nan"), rb_entropy_max=float(h.max()) if T else float("nan"),
            early_rb_entropy_mean=_mean(h[:w]), late_rb_entropy_mean=_mean(h[-w:]),
            surprisal_sum=float(s.sum()), surprisal_mean=_mean(s), surprisal_max=float(s.max()) if T else float("nan"),
            top1_prob_mean=_mean(step.top1_prob), margin_mean=_mean(step.margin),
            collision_mean=_mean(step.collision), eff_support_mean=_mean(step.eff_support),
            tail_mass_mean=_mean(step.tail_mass), logit_var_mean=_mean(step.logit_var),
            eos_prob_last=float(step.eos_prob[-1]) if (step.eos_prob is not None and T) else float("nan"),
            ends_with_eos=ends_with_eos,
        )


def baseline_features(stats: Mapping[str, Tensor], max_new_tokens: int) -> Tensor:
    """Per-step regression-baseline features [T, 7] (float64, detached), columns BASELINE_FEATURE_NAMES.

    `stats` is one sequence's slice of `policy_token_stats(..., diagnostics=True)`; position is
    k / max_new_tokens for k = 0 … T−1. Unknown EOS probability is reported as 0.
    """
    h = stats["rb_entropy"].detach().double()
    position = torch.arange(h.numel(), dtype=torch.float64, device=h.device) / float(max(1, max_new_tokens))
    cols = [h] + [stats[k].detach().double() for k in BASELINE_FEATURE_NAMES[1:-1]] + [position]
    feats = torch.stack(cols, dim=-1)
    return torch.nan_to_num(feats, nan=0.0)

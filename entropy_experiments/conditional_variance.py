"""Error bars for δH₁ (MATH.md §6): E side, U side, total.

- SE_E: delete-one jackknife over independent E units (sequences when G = 1, prompts otherwise) from
  the per-sequence sufficient statistics (a_i, r_i, h_i, d_i) — no extra model passes. Ĥ is recomputed
  in every replicate because it is a ratio of the same sums.
- SE_U: v depends on U through Adam. U's prompts are split into K groups whose gradients g_k are kept;
  v₍₋k₎ is rebuilt from the leave-one-group-out gradient with the full AdamW maths and the jackknife runs
  over the K values lr·X̂·v₍₋k₎.
- SE_total = √(SE_E² + SE_U²), all of δH₁ itself (never of a mean of microbatch pieces).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import adam_preconditioner as adam
from . import stats


def se_E(a: torch.Tensor, r: torch.Tensor, seq_entropies: torch.Tensor, lengths: torch.Tensor, units: list[int],
         *, normalize: str, learning_rate: float) -> tuple[float, float]:
    """(δH₁ from the pieces, its E-side SE).  Statistic lr·(A − Ĥ·B)/D, Ĥ = Σh/D, D = ΣT or N.

    a, r: per-sequence directional pieces (per unit lr); seq_entropies h_i; lengths T_i; units: the
    independent unit of each sequence. (per_sequence uses d_i = 1 so D = N.)
    """
    d = lengths.double() if normalize == "per_token" else torch.ones_like(lengths, dtype=torch.float64)
    est = stats.delta_h1_per_token(a, r, seq_entropies, d, units=units)
    return learning_rate * est.value, learning_rate * est.se


def leave_one_group_out_directions(components, u_grads, optimizer) -> list[dict[str, torch.Tensor]]:
    """v₍₋k₎ for each U group k: AdamW direction rebuilt from the gradient without group k (renormalised
    by the objective's leave-one-out scales when the U gradients carry them)."""
    loo = adam.leave_one_out_gradients(u_grads.groups, u_grads.group_sizes,
                                       getattr(u_grads, "leave_one_out_scales", None))
    return [components.update_direction(g, optimizer)[0] for g in loo]


def se_U(Xbar: dict[str, torch.Tensor], loo_directions: list[dict[str, torch.Tensor]],
         *, learning_rate: float) -> tuple[float, list[float]]:
    """Jackknife SE over K U groups of lr·X̂·v₍₋k₎; returns (SE_U, the K replicate values). NaN if K < 2."""
    replicates = [learning_rate * adam.named_dot(Xbar, v) for v in loo_directions]
    return stats.jackknife_se(np.array(replicates)), replicates


def se_total(se_e: float, se_u: float) -> float:
    """√(SE_E² + SE_U²); an unavailable side (NaN) counts as missing, not as zero."""
    return math.sqrt(se_e ** 2 + se_u ** 2)

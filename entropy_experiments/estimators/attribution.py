"""What moves the entropy (docs/attribution.md): the U prompt groups that push δH₁ and the E tokens whose
entropies change along the step. Pure maths on what the probe's phases already computed — no model pass.

- U side (docs/maths.md §6, SE_U): influence_k = δH₁ − δH₁₍₋k₎ with δH₁₍₋k₎ = lr·X̂·v₍₋k₎ the jackknife
  replicate of SE_U: v₍₋k₎ is the exact AdamW step (clipping, momentum, decay, the second-moment update) from
  the loaded state with U's gradient WITHOUT group k, renormalised as the trainer's objective would be on the
  smaller batch. It is exactly "how much lower δH₁ would be had group k not been in the batch", Adam's
  nonlinearity included. The influences do not add up to δH₁: for an objective that averages over prompts and
  a direction linear in g, influence_k = (c_k − mean_{j≠k} c_j)/K with c_k the δH₁ of group k alone, so they
  sum to 0; Adam's division by √s' makes the sum differ from 0 by a small nonlinear remainder.
- E side (docs/maths.md §3, the explicit part Σ_k D_v H_k of D_v E[h]): per realised token, H_t (the entropy of
  q at that prefix) and dH_t = lr·D_v H_t (its first-order change along the step of lr, at the fixed prefix),
  from the forward-mode jvp scores. Σ_t dH_t / D is the `direct_only` predictor (D = Σ T or N). E drawn by a
  sampler other than the policy (docs/maths.md §12): each token's dH_t carries its sequence's weight s_i (mean
  1) and D = Σ s_i d_i, so the parts still add up to the weighted estimate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from .jackknife import se_U

TOP_FRACTIONS = (0.01, 0.10, 0.20)  # the "80/20" question: what the top 1 %, 10 %, 20 % of tokens carry


def u_group_influences(delta_h1: float, X_hat: dict[str, Tensor], loo_directions: list[dict[str, Tensor]],
                       learning_rate: float, groups: list[list[int]], rewards: Sequence[Sequence[float]],
                       advantages: Sequence[Sequence[float]]) -> list[dict]:
    """[{group, prompt_index, influence, delta_h1_without, rewards, advantages}] sorted by |influence|, largest
    first. `loo_directions[k]` = v₍₋k₎ (the SE_U replicates' directions), `groups[k]` = U rows of group k;
    rewards / advantages [B_U][G] (the objective's advantages). influence in nats (per token or sequence)."""
    if len(loo_directions) != len(groups):
        raise ValueError(f"{len(loo_directions)} leave-one-out directions for {len(groups)} U groups")
    _, replicates = se_U(X_hat, loo_directions, learning_rate=learning_rate)
    rows = [{"group": k, "prompt_index": list(group), "influence": delta_h1 - without,
             "delta_h1_without": without,
             "rewards": [[float(r) for r in rewards[p]] for p in group],
             "advantages": [[float(a) for a in advantages[p]] for p in group]}
            for k, (group, without) in enumerate(zip(groups, replicates))]
    return sorted(rows, key=lambda row: -abs(row["influence"]))


def influence_summary(delta_h1: float, influences: list[dict]) -> dict:
    """How the influences relate to δH₁: their sum, the ratio sum/δH₁ and K (docs/attribution.md)."""
    total = float(sum(row["influence"] for row in influences))
    return {"sum_influence": total, "delta_h1": delta_h1, "groups": len(influences),
            "sum_over_delta_h1": total / delta_h1 if delta_h1 != 0 else None}


@dataclass
class TokenAttribution:
    """One row per realised E token, flat and float64: `sequence` (row in E's order), `position` (0-based in the
    response), `H` (nats) and `dH` = lr·D_v H (nats for a step of lr)."""

    sequence: np.ndarray
    position: np.ndarray
    H: np.ndarray
    dH: np.ndarray

    @classmethod
    def from_scores(cls, token_entropies: list[Tensor], d_entropy: list[Tensor],
                    learning_rate: float, weights: Tensor | None = None) -> TokenAttribution:
        """From the per-sequence H_ik and D_v H_ik (per unit lr) of the jvp scores (sequence_scores.py); with the
        sampler's weights s [N], dH_t = lr·s_i·D_v H_t."""
        lengths = [len(h) for h in token_entropies]
        if [len(d) for d in d_entropy] != lengths:
            raise ValueError("entropies and their directional derivatives have different lengths")
        sequence = np.repeat(np.arange(len(lengths)), lengths)
        position = np.concatenate([np.arange(t) for t in lengths]) if lengths else np.zeros(0, dtype=int)
        H = _flat64(token_entropies)
        dH = learning_rate * _flat64(d_entropy)
        if weights is not None:
            dH = dH * np.repeat(weights.detach().cpu().double().numpy(), lengths)
        return cls(sequence.astype(np.int64), position.astype(np.int64), H, dH)

    def __len__(self) -> int:
        return int(self.H.size)


def _flat64(rows: list[Tensor]) -> np.ndarray:
    if not rows:
        return np.zeros(0)
    return np.concatenate([r.detach().cpu().double().numpy().reshape(-1) for r in rows])


def top_share(dH: np.ndarray, fraction: float) -> dict:
    """The ceil(fraction·n) tokens of largest |dH|: their share of Σ dH (signed; can leave [0, 1] when the signs
    mix) and of Σ |dH| (in [0, 1]). None where the denominator is 0."""
    n = dH.size
    if n == 0:
        return {"fraction": fraction, "tokens": 0, "share_of_sum": None, "share_of_abs_sum": None}
    k = max(1, math.ceil(fraction * n))
    top = dH[np.argsort(-np.abs(dH), kind="stable")[:k]]
    total, total_abs = float(dH.sum()), float(np.abs(dH).sum())
    return {"fraction": fraction, "tokens": k,
            "share_of_sum": float(top.sum()) / total if total != 0 else None,
            "share_of_abs_sum": float(np.abs(top).sum()) / total_abs if total_abs != 0 else None}


def token_summary(tokens: TokenAttribution, normalizer: float, token_ids: Sequence[int], token_texts: Sequence[str],
                  top_k: int = 20) -> dict:
    """results.json `attribution.E_tokens`: the top_k tokens by |dH|, Σ dH, Σ dH / D (= direct_only), the
    shares of the top 1/10/20 % and the largest H. `normalizer` = D (Σ T for per_token, N for per_sequence)."""
    order = np.argsort(-np.abs(tokens.dH), kind="stable")[:top_k]
    top = [{"sequence": int(tokens.sequence[i]), "position": int(tokens.position[i]), "token_id": int(token_ids[i]),
            "token": token_texts[i], "H": float(tokens.H[i]), "dH": float(tokens.dH[i])} for i in order]
    total = float(tokens.dH.sum())
    return {"tokens": len(tokens), "sum_dH": total, "sum_abs_dH": float(np.abs(tokens.dH).sum()),
            "normalizer": normalizer, "direct_only": total / normalizer if normalizer else None,
            "top_shares": [top_share(tokens.dH, f) for f in TOP_FRACTIONS], "top": top}

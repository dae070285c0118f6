"""The entropy surrogate L_X on the evaluation batch E, defined once (docs/maths.md §3).

Its gradient is X̂; it is split into per-token coefficients so that the same numbers feed the backward
pass (X̂) and the per-sequence pieces used for error bars. (The U side — the trainers' objectives L_U —
lives in objectives.py.)

Conventions: a response of T tokens is a 1-D tensor of length T, positions k = 1..T (index k−1).
ℓ_k = log q_θ(t_k | p, t_<k) under the sampling policy; H_k = the RB entropy of q_θ(· | p, t_<k).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

NORMALIZE_MODES = ("per_token", "per_sequence")
X_MODES = ("causal", "full_return")
BASELINES = ("none", "loo_position")


# ----------------------------------------------------------------------------- E side (docs/maths.md §3)

def entropy_to_go(token_entropies: Tensor) -> Tensor:
    """G_k = Σ_{j>k} H_j, the entropy realised strictly after step k.  [T] → [T]."""
    return token_entropies.flip(0).cumsum(0).flip(0) - token_entropies


def tokens_to_go(length: int, *, dtype=torch.float64, device=None) -> Tensor:
    """R_k = T − k for k = 1..T, the number of tokens strictly after step k.  → [T]."""
    return torch.arange(length - 1, -1, -1, dtype=dtype, device=device)


def entropy_estimate(seq_entropies: Tensor, lengths: Tensor, normalize: str, weights: Tensor | None = None) -> float:
    """Ĥ: Σ h_i / Σ T_i (per_token) or mean h_i (per_sequence).  [N], [N] (tensors or arrays) → float.

    The one definition of Ĥ: the surrogate's coefficients, results.json `H_orig`, ΔH(η)'s base and the
    sweep's entropy-only measurement all call it. With the sampler's weights s [N] (docs/maths.md §12):
    Σ s_i h_i / Σ s_i d_i (d_i = T_i or 1) — any scale of s, it cancels."""
    if weights is not None:
        return float((weights * seq_entropies).sum() / normalizer(lengths, normalize, weights))
    if normalize == "per_token":
        return float(seq_entropies.sum() / lengths.sum())
    return float(seq_entropies.mean())


def entropy_estimates(seq_entropies: Tensor, lengths: Tensor, weights: Tensor | None = None) -> dict[str, float]:
    """{normalize: Ĥ} for both modes (results.json `H_orig`, entropy_only.json `H`), weighted by the sampler's
    s [N] when given."""
    return {mode: entropy_estimate(seq_entropies, lengths, mode, weights) for mode in NORMALIZE_MODES}


def normalizer(lengths: Tensor, normalize: str, weights: Tensor | None = None) -> float:
    """D of docs/maths.md §3/§6: Σ T_i (per_token) or N (per_sequence); with the sampler's weights s [N]
    (§12) Σ s_i T_i or Σ s_i, in the weights' own scale."""
    if weights is not None:
        return float((weights * lengths).sum() if normalize == "per_token" else weights.sum())
    return float(lengths.sum()) if normalize == "per_token" else float(len(lengths))


@dataclass
class SurrogateCoefficients:
    """Per-token coefficients of ℓ_ik in L_X, split as c_ik = alpha_ik − Ĥ·beta_ik.

    alpha already has the baseline b_ik subtracted. Splitting out the Ĥ term lets the jackknife
    recompute Ĥ in each delete-one replicate (δH₁/η = (A − Ĥ·B)/D with A, B from alpha, beta).
    All tensors float64, one [T_i] tensor per sequence. `weights`: the sampler's per-sequence weights s [N]
    (docs/maths.md §12; None: the sampler is the policy) — each sequence's terms of L_X are multiplied by
    s_i, and Ĥ, D are the weighted ones; alpha, beta stay per sequence, unweighted.
    """

    alpha: list[Tensor]
    beta: list[Tensor]
    H_hat: float
    D: float
    weights: Tensor | None = None

    def weights_of(self, seq_ids: list[int]) -> Tensor | None:
        """s of the listed sequences (None when unweighted)."""
        return None if self.weights is None else self.weights[seq_ids]

    def coefficient(self, i: int) -> Tensor:
        """c_i = alpha_i − Ĥ beta_i, the stop-gradient weight of ℓ_i in the surrogate.  → [T_i]."""
        return self.alpha[i] - self.H_hat * self.beta[i]


def sequence_coefficients(token_entropies: Tensor, *, normalize: str, x_mode: str) -> tuple[Tensor, Tensor]:
    """(alpha_i, beta_i) [T_i] of ONE sequence before any baseline: they depend only on its own H_ik.

    causal: alpha = G_ik, beta = R_ik (per_token) or 0 (per_sequence); full_return: alpha = h_i,
    beta = T_i (per_token) or 1 (per_sequence). float64, no graph.
    """
    h = token_entropies.detach().to(torch.float64)
    T = len(h)
    if x_mode == "causal":
        beta = (tokens_to_go(T, device=h.device) if normalize == "per_token"
                else torch.zeros(T, dtype=torch.float64, device=h.device))
        return entropy_to_go(h), beta
    return h.sum().expand(T).clone(), torch.full((T,), float(T) if normalize == "per_token" else 1.0,
                                                  dtype=torch.float64, device=h.device)


def surrogate_coefficients(token_entropies: list[Tensor], *, normalize: str, x_mode: str,
                           baseline: str, weights: Tensor | None = None) -> SurrogateCoefficients:
    """Build the L_X coefficients from the RB entropies H_ik of each E sequence (no grad, float64).

    causal:      alpha = G_ik − b_ik, beta = R_ik (per_token) or 0 (per_sequence);
    full_return: alpha = h_i − b_ik,  beta = T_i (per_token) or 1 (per_sequence)  — the whole-sequence
                 return, whose X̂·v equals the η → 0 slope of the SNIS estimate (docs/maths.md §3 identity).
    loo_position: b_ik = mean over the OTHER sequences having a position k of their c_jk (zero where no
    other sequence reaches k); it depends only on independent sequences, so it adds no bias.
    weights: the sampler's s [N] (docs/maths.md §12): Ĥ and D weighted; the baseline stays the plain mean of
    the others' c_jk — any function of the other sequences is a valid baseline under the weights too.
    """
    if normalize not in NORMALIZE_MODES or x_mode not in X_MODES or baseline not in BASELINES:
        raise ValueError(f"bad estimator options: {normalize=}, {x_mode=}, {baseline=}")
    H = [h.detach().to(torch.float64) for h in token_entropies]
    lengths = torch.tensor([len(h) for h in H], dtype=torch.float64)
    seq_h = torch.stack([h.sum() for h in H])
    H_hat = entropy_estimate(seq_h, lengths, normalize, weights)
    D = normalizer(lengths, normalize, weights)

    alpha, beta = [], []
    for h_i in H:
        alpha_i, beta_i = sequence_coefficients(h_i, normalize=normalize, x_mode=x_mode)
        alpha.append(alpha_i)
        beta.append(beta_i)

    if baseline == "loo_position":
        alpha = _subtract_loo_position_baseline(alpha, beta, H_hat)
    return SurrogateCoefficients(alpha=alpha, beta=beta, H_hat=H_hat, D=D, weights=weights)


def _subtract_loo_position_baseline(alpha: list[Tensor], beta: list[Tensor], H_hat: float) -> list[Tensor]:
    """alpha_ik − b_ik with b_ik the leave-one-out mean of c_jk = alpha_jk − Ĥ beta_jk at position k."""
    max_T = max(len(a) for a in alpha)
    total = torch.zeros(max_T, dtype=torch.float64)
    count = torch.zeros(max_T, dtype=torch.float64)
    coefs = [a - H_hat * b for a, b in zip(alpha, beta)]
    for c in coefs:
        total[: len(c)] += c
        count[: len(c)] += 1
    out = []
    for a, c in zip(alpha, coefs):
        T = len(a)
        others = count[:T] - 1
        b = torch.where(others > 0, (total[:T] - c) / others.clamp(min=1), torch.zeros_like(c))
        out.append(a - b)
    return out


def surrogate_loss(token_logqs: list[Tensor], token_entropies: list[Tensor], coefficients: list[Tensor],
                   D: float, weights: Tensor | None = None) -> Tensor:
    """Σ_i Σ_k [H_ik + sg(c_ik)·ℓ_ik] / D for a microbatch of sequences (graph through ℓ and H).

    token_logqs / token_entropies: per-sequence [T_i] tensors carrying the graph; coefficients: the
    matching [T_i] stop-gradient weights. Summing the microbatch losses gives L_X of the whole batch.
    weights: the sampler's s_i of these sequences (docs/maths.md §12), detached: Σ_i s_i Σ_k [...] / D —
    ∇E_q[f] = E_s[s(∇f + f ∇log q)], the score-function terms carry the θ-dependence of s.
    """
    if weights is not None:
        entropy_sum = sum(w * ent.sum() for w, ent in zip(_as_factors(weights, token_entropies), token_entropies))
        scaled = [w * c for w, c in zip(weights.double(), coefficients)]
        return (entropy_sum + weighted_logq_sum(token_logqs, scaled)) / D
    entropy_sum = sum(ent.sum() for ent in token_entropies)
    return (entropy_sum + weighted_logq_sum(token_logqs, coefficients)) / D


def _as_factors(weights: Tensor, like: list[Tensor]) -> list[Tensor]:
    """Each s_i as a detached scalar on its sequence's device and dtype."""
    return [w.detach().to(device=t.device, dtype=t.dtype) for w, t in zip(weights, like)]


def weighted_logq_sum(token_logqs: list[Tensor], weights: list[Tensor]) -> Tensor:
    """Σ_i Σ_k sg(w_ik)·ℓ_ik (graph through ℓ only).  Per-sequence [T_i] tensors → scalar."""
    total = 0.0
    for logq, w in zip(token_logqs, weights):
        total = total + (w.detach().to(device=logq.device, dtype=logq.dtype) * logq).sum()
    return total


def directional_pieces(d_logq: list[Tensor], d_entropy: list[Tensor],
                       coefs: SurrogateCoefficients) -> tuple[Tensor, Tensor]:
    """Per-sequence pieces of D_v L_X (docs/maths.md §6): a_i = Σ_k [D_v H_ik + alpha_ik D_v ℓ_ik], r_i = Σ_k beta_ik D_v ℓ_ik.

    Inputs are the forward-mode directional derivatives of ℓ and H along v (per sequence, [T_i]).
    Returns (a [N], r [N]) float64; X̂·v = (Σa − Ĥ Σr) / D.
    """
    a = torch.stack([(dH.double() + al * dl.double()).sum() for dl, dH, al in zip(d_logq, d_entropy, coefs.alpha)])
    r = torch.stack([(be * dl.double()).sum() for dl, be in zip(d_logq, coefs.beta)])
    return a, r

"""Delete-one jackknife error bars of the probe (docs/maths.md §6): the cores and SE_E, SE_U, SE_total.

Pure float64 numpy maths on per-sequence arrays, no model passes (inputs may be numpy arrays, lists
or torch tensors; they are copied to float64 numpy). Units: entropies in nats (h_i = Σ_k H_ik per
sequence), lengths T_i in tokens. A jackknife "unit" is an independent draw: a sequence when G = 1, a
prompt (all of its sequences) otherwise — pass `units` (one id per sequence) to group.

- SE_E: delete-one jackknife over independent E units from the per-sequence sufficient statistics
  (a_i, r_i, h_i, d_i) — no extra model passes. Ĥ is recomputed in every replicate because it is a
  ratio of the same sums.
- SE_U: v depends on U through Adam. U's prompts are split into K groups whose gradients g_k are kept;
  v₍₋k₎ is rebuilt from the leave-one-group-out gradient with the full AdamW maths and the jackknife runs
  over the K values lr·X̂·v₍₋k₎.
- SE_total = √(SE_E² + SE_U²), all of δH₁ itself (never of a mean of microbatch pieces).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
import torch

from .surrogate import NORMALIZE_MODES
from .update_direction import leave_one_out_gradients, named_dot

__all__ = [
    "Estimate",
    "Normalize",
    "as_float64",
    "check_normalize",
    "delta_h1_per_sequence",
    "delta_h1_per_token",
    "delta_h1_slope",
    "entropy_with_se",
    "jackknife_estimate",
    "jackknife_ratio_se",
    "jackknife_replicates",
    "jackknife_se",
    "leave_one_group_out_directions",
    "sampler_weighted",
    "se_E",
    "se_U",
    "se_total",
    "sum_by_unit",
]

Normalize = Literal["per_token", "per_sequence"]


class Estimate(NamedTuple):
    """A point estimate and its delete-one jackknife standard error (same units)."""

    value: float
    se: float


def as_float64(x: Any) -> np.ndarray:
    """1-D float64 copy of an array-like or torch tensor."""
    if hasattr(x, "detach"):  # torch.Tensor (duck-typed)
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1).copy()


def check_normalize(normalize: str) -> None:
    """ValueError unless `normalize` is one of NORMALIZE_MODES (estimator.normalize)."""
    if normalize not in NORMALIZE_MODES:
        raise ValueError(f"normalize must be one of {NORMALIZE_MODES}, got {normalize!r}")


# --------------------------------------------------------------------------------------------
# Delete-one jackknife from per-unit sums
# --------------------------------------------------------------------------------------------


def sum_by_unit(columns: Sequence[Any], units: Any | None = None) -> np.ndarray:
    """Stack per-sequence columns into per-unit sufficient statistics, shape [n_units, m].

    columns: m arrays of length N (one value per sequence). units: [N] unit id per sequence
    (e.g. the prompt id when G > 1), or None when every sequence is its own unit. Rows of the
    same unit are summed (rows ordered by sorted unit id).
    """
    stats = np.stack([as_float64(c) for c in columns], axis=1)
    if units is None:
        return stats
    ids = np.asarray(units).reshape(-1)
    if ids.shape[0] != stats.shape[0]:
        raise ValueError(f"{ids.shape[0]} unit ids for {stats.shape[0]} sequences")
    _, inverse = np.unique(ids, return_inverse=True)
    out = np.zeros((int(inverse.max()) + 1, stats.shape[1]))
    np.add.at(out, inverse, stats)
    return out


def sampler_weighted(columns: list[np.ndarray], sampler_weights: Any | None) -> list[np.ndarray]:
    """Each per-sequence column times the sampler weight s_i (docs/maths.md §12); None: the columns as they are.

    Every E-side statistic beyond first order is a ratio of sums over sequences, so weighting each sum by s_i
    turns it into the self-normalised estimate under the policy when E was drawn by another sampler (the
    scale of s cancels). s ≡ 1 multiplies by 1.0 exactly: the unweighted numbers, bit for bit."""
    if sampler_weights is None:
        return columns
    s = as_float64(sampler_weights)
    if s.size != columns[0].size:
        raise ValueError(f"{s.size} sampler weights for {columns[0].size} sequences")
    if not (np.isfinite(s).all() and (s >= 0).all()):
        raise ValueError("sampler weights must be finite and non-negative")
    return [s * c for c in columns]


def jackknife_se(values_minus_one: Any) -> float:
    """Delete-one jackknife SE = sqrt((n−1)/n Σ_i (θ₍₋i₎ − θ̄)²) from the n replicates θ₍₋i₎.

    NaN for n < 2 or any non-finite replicate.
    """
    theta = as_float64(values_minus_one)
    n = theta.size
    if n < 2 or not np.isfinite(theta).all():
        return float("nan")
    return float(math.sqrt((n - 1) / n * np.sum((theta - theta.mean()) ** 2)))


def jackknife_replicates(unit_stats: np.ndarray, fn: Callable[[np.ndarray], float]) -> np.ndarray:
    """θ₍₋i₎ = fn(Σ_j unit_stats[j] − unit_stats[i]) for each unit i, shape [n].

    unit_stats: [n, m] per-unit sufficient statistics; fn maps the m column sums to the statistic.
    Everything the statistic depends on (Ĥ included) must be a function of those sums, so that
    it is recomputed in every replicate.
    """
    stats = np.asarray(unit_stats, dtype=np.float64)
    if stats.ndim != 2:
        raise ValueError(f"unit_stats must be [n, m], got shape {stats.shape}")
    totals = stats.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.array([fn(totals - row) for row in stats], dtype=np.float64)


def _ratio(sums: np.ndarray) -> float:
    return float(sums[0] / sums[1])


def jackknife_ratio_se(numer_parts: Any, denom_parts: Any) -> float:
    """Jackknife SE of Σ numer / Σ denom over units ([n] each)."""
    return jackknife_estimate(sum_by_unit([numer_parts, denom_parts]), _ratio).se


def jackknife_estimate(unit_stats: np.ndarray, fn: Callable[[np.ndarray], float]) -> Estimate:
    """(fn(column sums), its jackknife SE over the units of unit_stats [n, m]), in fn's units."""
    with np.errstate(divide="ignore", invalid="ignore"):
        value = fn(unit_stats.sum(axis=0))
    return Estimate(float(value), jackknife_se(jackknife_replicates(unit_stats, fn)))


def _delta_h1_per_token_stat(sums: np.ndarray) -> float:
    # sums = (A, B, Σh, ΣT): (A − Ĥ·B)/ΣT with Ĥ = Σh/ΣT recomputed from the same sums.
    a, b, h, t = sums
    return float((a - (h / t) * b) / t)


def delta_h1_per_token(a: Any, r: Any, h: Any, T: Any, *, units: Any | None = None) -> Estimate:
    """δH₁/η for `per_token` (docs/maths.md §6) and its E-side jackknife SE.

    a_i = Σ_k [D_v H_ik + (G_ik − b_ik) D_v ℓ_ik], r_i = Σ_k R_ik D_v ℓ_ik, h_i, T_i: [N] each.
    Value (A − Ĥ·B)/ΣT with A = Σa, B = Σr, Ĥ = Σh/ΣT — nats per token per unit lr. Multiply value
    and SE by lr for δH₁ itself (an SE of the whole statistic, not of a mean of pieces).
    """
    return Estimate(*se_E(a, r, h, T, units, normalize="per_token", learning_rate=1.0))


def delta_h1_per_sequence(a: Any, *, units: Any | None = None) -> Estimate:
    """δH₁/η for `per_sequence`: mean_i a_i (Ĥ does not enter), with its jackknife SE.

    Written as Σa / Σ1 so that grouping sequences into units keeps the per-sequence mean;
    with one sequence per unit the SE is exactly std(a, ddof=1)/√N.
    """
    ones = np.ones_like(as_float64(a))
    return jackknife_estimate(sum_by_unit([a, ones], units), _ratio)


def delta_h1_slope(
    a: Any, r: Any, h: Any, T: Any, *, normalize: Normalize, units: Any | None = None
) -> Estimate:
    """δH₁/η with its jackknife SE for either `estimator.normalize`."""
    check_normalize(normalize)
    if normalize == "per_token":
        return delta_h1_per_token(a, r, h, T, units=units)
    return delta_h1_per_sequence(a, units=units)


# --------------------------------------------------------------------------------------------
# δH₁'s error bars: E side, U side, total
# --------------------------------------------------------------------------------------------


def se_E(a: torch.Tensor, r: torch.Tensor, seq_entropies: torch.Tensor, lengths: torch.Tensor, units: Any | None,
         *, normalize: str, learning_rate: float, sampler_weights: Any | None = None) -> tuple[float, float]:
    """(δH₁ from the pieces, its E-side SE).  Statistic lr·(A − Ĥ·B)/D, Ĥ = Σh/D, D = ΣT or N.

    a, r: per-sequence directional pieces (per unit lr); seq_entropies h_i; lengths T_i; units: the
    independent unit of each sequence. (per_sequence uses d_i = 1 so D = N.) `sampler_weights` s [N] (E drawn
    by another sampler, docs/maths.md §12): A, B, Σh and D are sums of s·a, s·r, s·h, s·d (None: unweighted). The statistic
    is homogeneous of degree 0 in s (a common factor of the four sums cancels), so a delete-one replicate needs no
    renormalisation of the remaining weights.
    """
    t = as_float64(lengths)
    d = t if normalize == "per_token" else np.ones_like(t)
    columns = sampler_weighted([as_float64(a), as_float64(r), as_float64(seq_entropies), d], sampler_weights)
    est = jackknife_estimate(sum_by_unit(columns, units), _delta_h1_per_token_stat)
    return learning_rate * est.value, learning_rate * est.se


def leave_one_group_out_directions(direction_of: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]],
                                   u_grads) -> list[dict[str, torch.Tensor]]:
    """v₍₋k₎ for each U group k: `direction_of` (g ↦ the AdamW direction) applied to the gradient without
    group k (renormalised by the objective's leave-one-out scales when the U gradients carry them)."""
    loo = leave_one_out_gradients(u_grads.groups, u_grads.group_sizes,
                                  u_grads.leave_one_out_scales)
    return [direction_of(g) for g in loo]


def se_U(X_hat: dict[str, torch.Tensor], loo_directions: list[dict[str, torch.Tensor]],
         *, learning_rate: float) -> tuple[float, list[float]]:
    """Jackknife SE over K U groups of lr·X̂·v₍₋k₎; returns (SE_U, the K replicate values). NaN if K < 2."""
    replicates = [learning_rate * named_dot(X_hat, v) for v in loo_directions]
    return jackknife_se(np.array(replicates)), replicates


def se_total(se_e: float, se_u: float) -> float:
    """√(SE_E² + SE_U²); an unavailable side (NaN) counts as missing, not as zero."""
    return math.sqrt(se_e ** 2 + se_u ** 2)


def entropy_with_se(h: Sequence[float], d: Sequence[float], units: Sequence, sampler_weights=None) -> Estimate:
    """(Σh/Σd, its delete-one jackknife SE over the units), nats per token (d = T) or per sequence (d = 1);
    Σ s h/Σ s d with the sampler correction's weights s (None: unweighted, docs/maths.md §12)."""
    return jackknife_estimate(sum_by_unit(sampler_weighted([as_float64(h), as_float64(d)], sampler_weights), units),
                              _ratio)

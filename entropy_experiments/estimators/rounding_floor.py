"""The fp32 rounding floor of ΔH(η) (docs/maths.md §8): how far two runs that differ only in the order of
their floating-point reductions (a CPU and a GPU, two batch layouts, two thread counts) may disagree on ΔH.

ΔH(η) = Ĥ' − Ĥ by SNIS (§5) takes the per-sequence entropies h_i (at θ) and h'_i, log w_i (at θ + η·v) from
two scorings of E. Each carries the rounding of its own forward: per token e^H_ik on H_ik, e^ℓ_ik on ℓ_ik.
Once η·v moves the activations by more than an ulp, the two scorings round independently, so the rounding
part of ΔH, to first order in the errors (w ≈ 1),

    ε(ΔH) = Σ_i [δh'_i − δh_i + c_i (δℓ'_i − δℓ_i)] / D,   δh_i = Σ_k e^H_ik, δℓ_i = Σ_k e^ℓ_ik,
    c_i = h_i − Ĥ·d_i  (d_i = T_i per token, 1 per sequence),  D = Σ_i d_i,

has a standard deviation that does not depend on η:

    F = √(2 Σ_i T_i (σ_H² + c_i² σ_ℓ²)) / D                                  (per-token errors independent)

with σ_H², σ_ℓ² the per-token rounding variances (measured as fp32 − fp64 on the same tokens). ΔH itself
grows like η, so its relative rounding error F/|ΔH(η)| grows like 1/η: a fixed relative tolerance must fail
at small enough η. Two devices each carry their own F: their ΔH differ by ≈ √2·F (one SD).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .surrogate import entropy_estimate


def per_token_rounding(low: Sequence[Tensor], reference: Sequence[Tensor]) -> float:
    """σ² of the per-token differences low − reference over every token of every sequence (float64)."""
    diffs = torch.cat([(a.double() - b.double()).reshape(-1) for a, b in zip(low, reference)])
    return float((diffs ** 2).mean()) if diffs.numel() else 0.0


def delta_h_rounding_floor(h: Tensor, T: Tensor, var_entropy: float, var_logq: float, *,
                           normalize: str = "per_token") -> float:
    """F: the SD of the rounding part of one ΔH(η) (any η), from the per-sequence entropies h [N], lengths
    T [N] and the per-token rounding variances of H and ℓ (`per_token_rounding`). Nats per token (per
    sequence with `normalize: per_sequence`)."""
    h, T = h.double(), T.double()
    d = T if normalize == "per_token" else torch.ones_like(T)
    c = h - entropy_estimate(h, d, "per_token") * d
    return math.sqrt(2.0 * float((T * (var_entropy + c ** 2 * var_logq)).sum())) / float(d.sum())


def realised_rounding_floor(h: Tensor, T: Tensor, err_entropy: Sequence[Tensor], err_logq: Sequence[Tensor], *,
                            normalize: str = "per_token") -> float:
    """F from the realised per-sequence errors instead of the pooled per-token variances (no assumption that
    tokens round independently): √(2 Σ_i (δh_i + c_i δℓ_i)²) / D, with δ the summed per-token errors."""
    h, T = h.double(), T.double()
    d = T if normalize == "per_token" else torch.ones_like(T)
    c = h - entropy_estimate(h, d, "per_token") * d
    dh = torch.stack([e.double().sum() for e in err_entropy])
    dl = torch.stack([e.double().sum() for e in err_logq])
    return math.sqrt(2.0 * float(((dh + c * dl) ** 2).sum())) / float(d.sum())


def delta_h_tolerance(delta_h: float, floor: float, *, rel: float = 1e-3, z: float = 6.0) -> float:
    """How far two devices' ΔH(η) may differ: rel·|ΔH| (what the code may legitimately change) plus z SDs of
    the difference of two independent roundings, z·√2·F."""
    return rel * abs(delta_h) + z * math.sqrt(2.0) * floor

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

At run time (`floor_from_passes`) F comes from the passes the probe made anyway, without an fp64 pass: a
small η_s and a symmetric pair ±η_L (η_L ≥ 10|η_s|, the second order's; `floor_passes`). Per sequence, for X = h and X = log w,

    u_i = X_i(η_s) − X_i(0) − (η_s/2η_L)(X_i(η_L) − X_i(−η_L)) − ½(η_s/η_L)²(X_i(η_L) − 2X_i(0) + X_i(−η_L))

removes the Taylor terms up to η_s² that the pair measures (what is left of them: (η_s·η_L²/6)·X_i‴) and keeps
X's rounding at η_s against θ (the pair's enters with weights of 1/20 or less). With u_i of h and l_i of log w,
F = √(Σ_i s_i² (u_i + c_i l_i)²) / Σ_i s_i d_i (s_i the sampler correction's weights, else 1): the realised
rounding of ΔH(η_s), which is F of any η. Rounding shared by sequences in one batch is missed, as by the jackknife.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
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


#: The pair must be this many times the small η, so that its Taylor terms are removed from the small pass's change.
PAIR_OVER_SMALL = 10.0


def floor_passes(etas: Sequence[float]) -> tuple[float, float] | None:
    """(η_s, η_L): the smallest symmetric η_L measured with an η_s of |η_s| ≤ η_L/PAIR_OVER_SMALL, and the largest
    such |η_s| (the surest to move every activation by more than an ulp); None without."""
    values = {float(e) for e in etas}
    for pair in sorted(e for e in values if e > 0 and -e in values):
        small = [e for e in values if 0 < abs(e) <= pair / PAIR_OVER_SMALL]
        if small:
            return max(small, key=lambda e: (abs(e), e)), pair
    return None


def _taylor_remainder(at_small: np.ndarray, at_zero: np.ndarray | float, plus: np.ndarray, minus: np.ndarray,
                      ratio: float) -> np.ndarray:
    return (at_small - at_zero - ratio / 2.0 * (plus - minus)
            - 0.5 * ratio ** 2 * (plus - 2.0 * at_zero + minus))


def floor_from_passes(h: Any, T: Any, per_eta: Mapping[float, Mapping[str, Any]], *, normalize: str = "per_token",
                      sampler_weights: Any | None = None) -> dict[str, float] | None:
    """{value: F, eta: η_s, pair_eta: η_L} from the ΔH passes' per-sequence values ({η: {"logw", "h_new"}}, [N])
    and h, T at θ (module docstring); None when the passes have no small η and pair (`floor_passes`)."""
    chosen = floor_passes(list(per_eta))
    if chosen is None:
        return None
    small, pair = chosen
    h0, t = np.asarray(h, dtype=np.float64), np.asarray(T, dtype=np.float64)
    d = t if normalize == "per_token" else np.ones_like(t)
    s = np.ones_like(t) if sampler_weights is None else np.asarray(sampler_weights, dtype=np.float64)
    cols = {k: [np.asarray(per_eta[e][k], dtype=np.float64) for e in (small, pair, -pair)] for k in ("h_new", "logw")}
    u = _taylor_remainder(cols["h_new"][0], h0, cols["h_new"][1], cols["h_new"][2], small / pair)
    ell = _taylor_remainder(cols["logw"][0], 0.0, cols["logw"][1], cols["logw"][2], small / pair)
    c = h0 - float((s * h0).sum() / (s * d).sum()) * d
    value = math.sqrt(float((s ** 2 * (u + c * ell) ** 2).sum())) / float((s * d).sum())
    return {"value": value, "eta": small, "pair_eta": pair}

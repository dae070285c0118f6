"""The second-order coefficient d2 = d²/dη² Ĥ(θ + η·v) at η = 0 of the SNIS estimate on E, with its SE.

On the sequences of E (sampled at θ), the SNIS estimate at θ + η·v (docs/maths.md §5) is Ĥ(η) = N(η)/D(η) with
N = Σ_i w_i h_i(η), D = Σ_i w_i d_i, where w_i = exp L_i(η), L_i(η) = Σ_k ℓ_ik(θ + ηv) − ℓ_ik(θ),
h_i(η) = Σ_k H_ik(θ + ηv), and d_i = T_i (per_token) or 1 (per_sequence). With the per-sequence
directional derivatives at η = 0 (forward over forward mode, `policy.score.jvp(order=2)`)

    s_i = Σ_k D_v ℓ_ik,  s2_i = Σ_k D²_v ℓ_ik,  dh_i = Σ_k D_v H_ik,  d2h_i = Σ_k D²_v H_ik,

L(0) = 0, L' = s, L'' = s2, so that

    N = Σ h,   N' = Σ (s h + dh),   N'' = Σ ((s2 + s²) h + 2 s dh + d2h),
    D = Σ d,   D' = Σ s d,          D'' = Σ (s2 + s²) d,
    Ĥ'' = (N'' D − N D'')/D² − 2 D' (N' D − N D')/D³.

Every term is a sum over sequences, so Ĥ'' is one statistic of six per-unit sums and the delete-one
jackknife over E units gives its SE (Ĥ, D, D' recomputed in each replicate). Ĥ' from the same sums is
the slope of the SNIS estimate at 0, i.e. X̂·v in full_return mode (docs/maths.md §3, identity).

η* = the |η| at which the second-order term ½η²·|d2| reaches 10 % of the first-order term |η·X̂·v|:
η* = 0.2·|X̂·v| / |d2|. The second-order prediction at η is η·X̂·v + ½η²·d2.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .jackknife import (
    Estimate,
    Normalize,
    as_float64,
    check_normalize,
    jackknife_estimate,
    sampler_weighted,
    sum_by_unit,
)

__all__ = ["second_derivative", "second_order_report", "snis_columns", "snis_derivatives"]

FIRST_ORDER_TOLERANCE = 0.1   # η*: where ½η²|d2| reaches this fraction of |η·X̂·v|


def snis_derivatives(sums: np.ndarray) -> tuple[float, float]:
    """(Ĥ'(0), Ĥ''(0)) from the sums (N, D, N', D', N'', D'') of the module docstring."""
    n, d, n1, d1, n2, d2 = sums
    first = (n1 * d - n * d1) / d ** 2
    second = (n2 * d - n * d2) / d ** 2 - 2 * d1 * (n1 * d - n * d1) / d ** 3
    return float(first), float(second)


def snis_columns(s: Any, s2: Any, dh: Any, d2h: Any, h: Any, T: Any, normalize: Normalize,
                 sampler_weights: Any | None = None) -> list[np.ndarray]:
    """The six per-sequence columns whose sums are (N, D, N', D', N'', D'') of the module docstring; with
    `sampler_weights` s [N] (E drawn by another sampler, docs/maths.md §12) each column times s_i: the sums of
    Ĥ(η) = Σ s w h(η) / Σ s w d, whose s does not move with η."""
    s, s2, dh, d2h, h, t = (as_float64(x) for x in (s, s2, dh, d2h, h, T))
    d = t if normalize == "per_token" else np.ones_like(t)
    curv = s2 + s ** 2
    return sampler_weighted([h, d, s * h + dh, s * d, curv * h + 2 * s * dh + d2h, curv * d], sampler_weights)


def second_derivative(s: Any, s2: Any, dh: Any, d2h: Any, h: Any, T: Any, *, normalize: Normalize,
                      units: Any | None = None, sampler_weights: Any | None = None) -> Estimate:
    """d2 = Ĥ''(0) of the SNIS estimate on E with its jackknife SE over `units` (nats per token per unit η²).

    s, s2, dh, d2h: per-sequence sums of D_v ℓ, D²_v ℓ, D_v H, D²_v H; h, T: entropies and lengths; all [N];
    `sampler_weights`: the sampler correction's s [N] (None: E was drawn by the policy).
    """
    check_normalize(normalize)
    columns = snis_columns(s, s2, dh, d2h, h, T, normalize, sampler_weights)
    return jackknife_estimate(sum_by_unit(columns, units), lambda sums: snis_derivatives(sums)[1])


def second_order_report(d2: Estimate, x_hat_dot_v: float, etas: list[float], method: str) -> dict[str, Any]:
    """results.json's `second_order` {d2, se, method, eta_star} and, per η, the prediction η·X̂·v + ½η²·d2."""
    eta_star = (2 * FIRST_ORDER_TOLERANCE * abs(x_hat_dot_v) / abs(d2.value)
                if math.isfinite(d2.value) and d2.value != 0 else None)  # None: no curvature measured
    return {"d2": d2.value, "se": d2.se, "method": method, "eta_star": eta_star,
            "predictions": {f"{eta:g}": eta * x_hat_dot_v + 0.5 * eta ** 2 * d2.value for eta in etas}}

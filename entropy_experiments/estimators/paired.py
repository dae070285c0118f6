"""Paired residuals: how far the measured ΔH(η) is from the first-order prediction η·D_v H on the SAME E.

Both numbers are computed from the same sequences, so their errors are strongly correlated: their SEs
(each as large as the value in the demo) say little about their difference. The residual

    ρ(η) = ΔH(η) − η·D_v H,   ΔH(η) = Σ w h' / Σ w d − Σ h / Σ d,   D_v H = (A − Ĥ·B) / Σ d

(d = T per_token, 1 per_sequence; A = Σ a_i, B = Σ r_i the per-sequence directional pieces of docs/maths.md
§6 per unit lr; w the importance weights at θ + η·v, docs/maths.md §5) is one statistic of the per-unit sums
(Σ w h', Σ w d, Σ h, Σ d, Σ a, Σ r), so the delete-one jackknife over the same E units gives its SE,
with Ĥ, both normalisers and the weights' normalisation recomputed in every replicate. z = ρ / SE:
|z| < 2 says first order holds at this η within the noise of this E.

The symmetric slope's residual σ(η) = (ΔH(η) − ΔH(−η))/2η − D_v H (`symmetric_slope_residual`) cancels ΔH's even
part, ½η²·d2 among it: with d2 the pair's own second difference (ΔH(η) + ΔH(−η))/η², the second-order residual
ΔH(±η) − (±η·D_v H + ½η²·d2) is ±η·σ(η) exactly, so σ's z is the check of first order at that η.
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
from .snis import weights_from_log

__all__ = ["paired_residual", "residual_entry", "symmetric_slope_residual"]


def _residual_stat(eta: float):
    def stat(sums: np.ndarray) -> float:
        wh, wd, h, d, a, r = sums
        return float((wh / wd - h / d) - eta * (a - (h / d) * r) / d)
    return stat


def paired_residual(logw: Any, h_new: Any, h: Any, T: Any, a: Any, r: Any, eta: float, *, normalize: Normalize,
                    units: Any | None = None, sampler_weights: Any | None = None) -> Estimate:
    """ρ(η) = ΔH(η) − η·D_v H with its jackknife SE over `units` (nats per token, or per sequence).

    logw, h_new: log-weights and new sequence entropies at θ + η·v; h, T: entropies and lengths at θ;
    a, r: per-sequence directional pieces along v per unit lr; all [N] in the same sequence order.
    `sampler_weights` s [N] (docs/maths.md §12): every sum carries s — ΔH(η) with total weights s·w and
    D_v H = (Σ s a − Ĥ Σ s r)/Σ s d with Ĥ = Σ s h / Σ s d, the pieces a, r themselves unweighted.
    """
    check_normalize(normalize)
    w, hn, hh, t = weights_from_log(logw), as_float64(h_new), as_float64(h), as_float64(T)
    d = t if normalize == "per_token" else np.ones_like(t)
    columns = sampler_weighted([w * hn, w * d, hh, d, as_float64(a), as_float64(r)], sampler_weights)
    return jackknife_estimate(sum_by_unit(columns, units), _residual_stat(float(eta)))


def symmetric_slope_residual(plus: tuple[Any, Any], minus: tuple[Any, Any], h: Any, T: Any, a: Any, r: Any,
                             eta: float, *, normalize: Normalize, units: Any | None = None,
                             sampler_weights: Any | None = None) -> Estimate:
    """σ(η) = (ΔH(η) − ΔH(−η))/2η − D_v H with its jackknife SE: `plus`, `minus` = (log w, h') at θ ± η·v (η > 0);
    the other arguments as in `paired_residual`."""
    check_normalize(normalize)
    hh, t = as_float64(h), as_float64(T)
    d = t if normalize == "per_token" else np.ones_like(t)
    (wp, hp), (wm, hm) = ((weights_from_log(lw), as_float64(hn)) for lw, hn in (plus, minus))
    columns = sampler_weighted([wp * hp, wp * d, wm * hm, wm * d, hh, d, as_float64(a), as_float64(r)],
                               sampler_weights)

    def stat(sums: np.ndarray) -> float:
        whp, wdp, whm, wdm, h_sum, d_sum, a_sum, r_sum = sums
        return float((whp / wdp - whm / wdm) / (2 * eta) - (a_sum - (h_sum / d_sum) * r_sum) / d_sum)

    return jackknife_estimate(sum_by_unit(columns, units), stat)


def residual_entry(estimate: Estimate) -> dict[str, float]:
    """{value, se, z} for results.json (z NaN when the SE is not positive and finite)."""
    value, se = float(estimate.value), float(estimate.se)
    z = value / se if math.isfinite(se) and se > 0 else float("nan")
    return {"value": value, "se": se, "z": z}

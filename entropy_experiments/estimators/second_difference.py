"""d2 = Ĥ''(0) of the SNIS estimate on E by a second difference of the ΔH(±η) passes (docs/maths.md §5).

The ΔH(η) phase scores E at θ ± η·v (no grad) and phase 1 scored it at θ. With the SNIS estimate
Ĥ(η) = Σ w_i(η) h_i(η) / Σ w_i(η) d_i (w_i = exp log w_i, d_i = T_i per_token or 1 per_sequence), the
central second difference

    d2(η) = (Ĥ(η) − 2 Ĥ(0) + Ĥ(−η)) / η² = (ΔH(+η) + ΔH(−η)) / η²

costs no model pass. It is one statistic of six per-unit sums (Σ w₊h₊, Σ w₊d, Σ w₋h₋, Σ w₋d, Σ h, Σ d), so
the delete-one jackknife over E units (jackknife.py) gives its SE with every Ĥ recomputed in each replicate.

Bias. Taylor's theorem on the same E: d2(η) = Ĥ''(0) + (η²/12)·Ĥ''''(0) + O(η⁴) (the odd terms cancel).
Two symmetric η₁ < η₂ give Ĥ'''' ≈ 12 (d2(η₂) − d2(η₁)) / (η₂² − η₁²), so the bias of d2(η₂) is

    bias(η₂) ≈ η₂² (d2(η₂) − d2(η₁)) / (η₂² − η₁²).

Rounding. The forwards round (fp32, worse in bf16), and that noise, of roughly fixed size in ΔH(±η)
(rounding_floor.py), is divided by η² in d2(η). The jackknife sees it only where it is independent across
E's units: sequences that share prefixes in one batch round alike, and then it is missing from the SE (on the
enumerable toy model d2(3e−4) sat 4 SE from the jvp's on the same E, with an SE no larger than at 1e−3). A difference
d2(η₁) − d2(η₂) may be either: truncation, growing as η², or rounding, growing as 1/η². The reported d2 is
therefore the LARGEST η's (least rounding), and its `bias_estimate` the expression above with the next smaller η:
if the difference is truncation it estimates the bias of d2(η₂); if it is rounding at η₁ it overstates the
error of d2(η₂) (whose rounding is (η₁/η₂)² of η₁'s). Every other η carries the same expression with its next
larger η, η² of the larger in the numerator (the error of either if the two differ by truncation or rounding).
It is an estimate of the leading terms, not a bound; every η's d2, SE and bias estimate are reported.

Window. The same passes say how far ±η moved E's weights: s_i = D_v log q(y_i) ≈ (log w_i(η) − log w_i(−η))/2η, so
η·SD(s_i) is the spread of log w at ±η, and each side's ESS/N is that of its own weights. On the embedded
SmolLM2-135M (docs/maths.md §10) η·SD(s_i) = 0.23 at η = 1e−3 left d2 0.03 SE from the jvp's, 0.7 (η = 3e−3)
0.15 SE, and 2.4 (η = 1e−2) degenerate weights: `window_warning` flags the reported η past ETA_SD_S_MAX or below
ESS_FRAC_MIN on either side, where the quadratic regime was not measured to hold.
"""

from __future__ import annotations

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
from .snis import ess, weights_from_log

__all__ = ["finite_difference_report", "second_difference", "symmetric_etas", "window_warning"]

#: The measured window (module docstring): η·SD(s_i) up to here, every side's ESS/N above ESS_FRAC_MIN (the ESS/N
#: of log-normal weights of that spread, e^(−0.25) ≈ 0.78).
ETA_SD_S_MAX = 0.5
ESS_FRAC_MIN = 0.75


def second_difference(logw_plus: Any, h_plus: Any, logw_minus: Any, h_minus: Any, h: Any, T: Any, eta: float, *,
                      normalize: Normalize, units: Any | None = None, sampler_weights: Any | None = None) -> Estimate:
    """(Ĥ(η) − 2Ĥ(0) + Ĥ(−η))/η² of the SNIS estimate on E with its jackknife SE over `units`.

    logw_±, h_±: per-sequence log-weights and entropies at θ ± η·v; h, T: entropies and lengths at θ; all [N]
    (float64). Units: nats per token (per_token) or per sequence, per unit η². `sampler_weights` s [N]: every
    column times s (E drawn by another sampler, docs/maths.md §12).
    """
    check_normalize(normalize)
    t = as_float64(T)
    d = t if normalize == "per_token" else np.ones_like(t)
    w_plus, w_minus = weights_from_log(logw_plus), weights_from_log(logw_minus)
    columns = sampler_weighted([w_plus * as_float64(h_plus), w_plus * d, w_minus * as_float64(h_minus),
                                w_minus * d, as_float64(h), d], sampler_weights)

    def statistic(sums: np.ndarray) -> float:
        a, b, c, e, f, g = sums
        return float((a / b + c / e - 2 * f / g) / eta ** 2)

    return jackknife_estimate(sum_by_unit(columns, units), statistic)


def symmetric_etas(etas: Any) -> list[float]:
    """The η > 0 whose −η is also among `etas`, ascending."""
    values = {float(e) for e in etas}
    return sorted(e for e in values if e > 0 and -e in values)


def weight_spread(logw_plus: Any, logw_minus: Any) -> dict[str, float]:
    """{eta_sd_s: η·SD(s_i) with s_i ≈ (log w_i(η) − log w_i(−η))/2η, ess_frac_plus, ess_frac_minus} of one pair."""
    plus, minus = as_float64(logw_plus), as_float64(logw_minus)
    spread = float(np.std((plus - minus) / 2.0)) if plus.size else float("nan")
    return {"eta_sd_s": spread, "ess_frac_plus": ess(plus) / plus.size, "ess_frac_minus": ess(minus) / minus.size}


def window_warning(row: dict[str, Any]) -> str | None:
    """A results.json warning when a `finite_difference_report` row's η is outside the measured window (None: inside)."""
    low_ess = min(row["ess_frac_plus"], row["ess_frac_minus"])
    if row["eta_sd_s"] <= ETA_SD_S_MAX and low_ess >= ESS_FRAC_MIN:
        return None
    return (f"second_order: at η = {row['eta']:g} the weights moved past the measured window: η·SD(s_i) = "
            f"{row['eta_sd_s']:.2g} (measured up to {ETA_SD_S_MAX:g}), ESS/N {low_ess:.2f} (from {ESS_FRAC_MIN:g}); "
            "d2 there may be past the quadratic regime: set a smaller second_order.eta_list or "
            "second_order.method: jvp (docs/maths.md §10)")


def _bias(one: tuple[float, Estimate], other: tuple[float, Estimate]) -> float:
    """|d2(η₁) − d2(η₂)|·max(η₁, η₂)²/|η₂² − η₁²| (module docstring)."""
    (e1, d1), (e2, d2) = one, other
    return abs(max(e1, e2) ** 2 * (d2.value - d1.value) / (e2 ** 2 - e1 ** 2))


def finite_difference_report(per_eta: dict[float, dict[str, Any]], h: Any, T: Any, *, normalize: Normalize,
                             units: Any | None = None, sampler_weights: Any | None = None) -> dict[str, Any]:
    """d2 from the ΔH(±η) passes: {"d2", "se", "eta", "bias_estimate", "per_eta": [{eta, d2, se, bias_estimate,
    eta_sd_s, ess_frac_plus, ess_frac_minus}]} (`weight_spread`).

    per_eta: {η: {"logw": [N], "h_new": [N]}} (the ΔH phase's per-sequence values, η of both signs); h, T: at θ;
    sampler_weights: the sampler correction's s [N] (None: E was drawn by the policy).
    ValueError without a symmetric pair. The reported d2 is the largest η's; each η's `bias_estimate` comes from it and
    the next larger η (the largest: the next smaller); None with one symmetric η (nothing to compare).
    """
    etas = symmetric_etas(per_eta)
    if not etas:
        raise ValueError(f"the second difference needs ΔH at +η and −η, got η = {sorted(per_eta)}")
    found = [(eta, second_difference(per_eta[eta]["logw"], per_eta[eta]["h_new"], per_eta[-eta]["logw"],
                                     per_eta[-eta]["h_new"], h, T, eta, normalize=normalize, units=units,
                                     sampler_weights=sampler_weights))
             for eta in etas]
    partner = [k + 1 if k + 1 < len(found) else k - 1 for k in range(len(found))]
    biases = [_bias(found[k], found[j]) if j >= 0 else None for k, j in enumerate(partner)]
    rows = [{"eta": eta, "d2": est.value, "se": est.se, "bias_estimate": bias,
             **weight_spread(per_eta[eta]["logw"], per_eta[-eta]["logw"])}
            for (eta, est), bias in zip(found, biases)]
    best = rows[-1]
    return {"d2": best["d2"], "se": best["se"], "eta": best["eta"], "bias_estimate": best["bias_estimate"],
            "per_eta": rows}

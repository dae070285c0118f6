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
therefore the LARGEST η's (least rounding), and its `bias_bound` the expression above with the next smaller η:
if the difference is truncation it estimates the bias of d2(η₂); if it is rounding at η₁ it overstates the
error of d2(η₂) (whose rounding is (η₁/η₂)² of η₁'s). Every other η carries the same expression with its next
larger η, η² of the larger in the numerator (the error of either if the two differ by truncation or rounding).
It is an estimate of the leading terms, not a rigorous bound; every η's d2, SE and bias estimate are reported.
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
from .snis import weights_from_log

__all__ = ["finite_difference_report", "second_difference", "symmetric_etas"]


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


def _bias(one: tuple[float, Estimate], other: tuple[float, Estimate]) -> float:
    """|d2(η₁) − d2(η₂)|·max(η₁, η₂)²/|η₂² − η₁²| (module docstring)."""
    (e1, d1), (e2, d2) = one, other
    return abs(max(e1, e2) ** 2 * (d2.value - d1.value) / (e2 ** 2 - e1 ** 2))


def finite_difference_report(per_eta: dict[float, dict[str, Any]], h: Any, T: Any, *, normalize: Normalize,
                             units: Any | None = None, sampler_weights: Any | None = None) -> dict[str, Any]:
    """d2 from the ΔH(±η) passes: {"d2", "se", "eta", "bias_bound", "per_eta": [{eta, d2, se, bias_bound}]}.

    per_eta: {η: {"logw": [N], "h_new": [N]}} (the ΔH phase's per-sequence values, η of both signs); h, T: at θ;
    sampler_weights: the sampler correction's s [N] (None: E was drawn by the policy).
    ValueError without a symmetric pair. The reported d2 is the largest η's; each η's `bias_bound` comes from it and
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
    rows = [{"eta": eta, "d2": est.value, "se": est.se, "bias_bound": bias}
            for (eta, est), bias in zip(found, biases)]
    best = rows[-1]
    return {"d2": best["d2"], "se": best["se"], "eta": best["eta"], "bias_bound": best["bias_bound"],
            "per_eta": rows}

"""The realised change of the entropy between two checkpoints, counting the responses that would change
(docs/maths.md §9, with §5's self-normalised importance sampling).

E_N (sampled at θ_N) and E_{N'} (sampled at θ_{N'}) are drawn with common random numbers: when the policy moves
a little, no response changes, and Ĥ(E_{N'}; θ_{N'}) − Ĥ(E_N; θ_N) sees only the per-token change along fixed
responses. Importance weights see the rest: every sequence of E_N scored at θ_{N'} carries
log w_i = Σ_k (ℓ_{N',ik} − ℓ_{N,ik}) (float64, from per-token differences), and

    forward   Δ_f = Σ w h' / Σ w d − Σ h / Σ d                 on E_N (w = q_{N'}/q_N, h' scored at θ_{N'})
    reverse   Δ_r = Σ h / Σ d − Σ w̃ h̃ / Σ w̃ d                 on E_{N'} (w̃ = q_N/q_{N'}, h̃ scored at θ_N)
    averaged  Δ   = (Δ_f + Δ_r) / 2

(d = T per_token, 1 per_sequence). The averaged statistic is ONE function of per-unit sums of both batches,
side by side (zeros where a unit is absent): the delete-one jackknife over the units of both removes a unit
from both at once, so the correlation the common draws put between Δ_f and Δ_r is measured. Each direction
alone is `snis.snis_delta_h` (the probe's own ΔH(η) estimator); the weights' diagnostics are
`snis.importance_diagnostics`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .jackknife import Estimate, Normalize, as_float64, check_normalize, jackknife_estimate, sum_by_unit
from .snis import importance_diagnostics, snis_delta_h, weights_from_log

__all__ = ["CrossScored", "importance_realised_change", "realised_change_entry"]


@dataclass
class CrossScored:
    """One E batch scored at the policy that sampled it (`h_own`, `T`) and at the other checkpoint's policy
    (`h_other`, `logw` = Σ_k ℓ_other − ℓ_own per sequence, nats); `units`: the jackknife unit of each sequence
    (a key that names the same draw in both batches). All [N], float64 after `as_float64`."""

    logw: Any
    h_own: Any
    h_other: Any
    T: Any
    units: list


def _columns(side: CrossScored, normalize: Normalize) -> list[np.ndarray]:
    """[w h_other, w d, h_own, d] of one batch (w unnormalised, exp(log w − max))."""
    w, t = weights_from_log(side.logw), as_float64(side.T)
    d = t if normalize == "per_token" else np.ones_like(t)
    return [w * as_float64(side.h_other), w * d, as_float64(side.h_own), d]


def _averaged(sums: np.ndarray) -> float:
    # sums = (forward: Σwh', Σwd, Σh, Σd; reverse: Σw̃h̃, Σw̃d, Σh, Σd)
    fwh, fwd, fh, fd, rwh, rwd, rh, rd = sums
    return float(0.5 * ((fwh / fwd - fh / fd) + (rh / rd - rwh / rwd)))


def importance_realised_change(forward: CrossScored, reverse: CrossScored, *, normalize: Normalize) -> Estimate:
    """Δ = (Δ_f + Δ_r)/2 with its delete-one jackknife SE over the union of both batches' units (units of the
    entropies: nats per token or per sequence). NaN when every weight of one side is zero."""
    check_normalize(normalize)
    cf, cr = _columns(forward, normalize), _columns(reverse, normalize)
    nf, nr = len(cf[0]), len(cr[0])
    columns = [np.concatenate([c, np.zeros(nr)]) for c in cf] + [np.concatenate([np.zeros(nf), c]) for c in cr]
    units = [str(u) for u in forward.units] + [str(u) for u in reverse.units]
    return jackknife_estimate(sum_by_unit(columns, units), _averaged)


def _side_entry(side: CrossScored, normalize: Normalize, sign: float) -> dict:
    est = snis_delta_h(side.logw, side.h_other, side.h_own, side.T, normalize=normalize,
                       units=[str(u) for u in side.units])
    diag = importance_diagnostics(side.logw)
    return {"value": sign * est.value, "se": est.se, "ess_frac": diag["ess_frac"], "psis_khat": diag["psis_khat"],
            "khat_threshold": diag["khat_threshold"], "zero_weight_count": diag["zero_weight_count"],
            "logw": diag["logw"]}


def realised_change_entry(forward: CrossScored, reverse: CrossScored, *, normalize: Normalize) -> dict:
    """{value, se, forward {value, se, ess_frac, psis_khat, …}, reverse {…}, ess_frac (the smaller side's)}:
    the averaged estimate and each direction alone (the reverse's value already signed as N → N')."""
    est = importance_realised_change(forward, reverse, normalize=normalize)
    fwd, rev = _side_entry(forward, normalize, 1.0), _side_entry(reverse, normalize, -1.0)
    return {"value": est.value, "se": est.se, "forward": fwd, "reverse": rev,
            "ess_frac": min(fwd["ess_frac"], rev["ess_frac"])}

"""The realised change of the entropy between two checkpoints, counting the responses that would change
(docs/maths.md §9, with §5's self-normalised importance sampling).

E_N (sampled at θ_N) and E_{N'} (sampled at θ_{N'}) are drawn with common random numbers: when the policy moves
a little, no response changes, and Ĥ(E_{N'}; θ_{N'}) − Ĥ(E_N; θ_N) sees only the per-token change along fixed
responses. Importance weights see the rest: every sequence of E_N scored at θ_{N'} carries
log w_i = Σ_k (ℓ_{N',ik} − ℓ_{N,ik}) (float64, from per-token differences), and

    forward   Δ_f = Σ w h' / Σ w d − Σ h / Σ d                 on E_N (w = q_{N'}/q_N, h' scored at θ_{N'})
    reverse   Δ_r = Σ h / Σ d − Σ w̃ h̃ / Σ w̃ d                 on E_{N'} (w̃ = q_N/q_{N'}, h̃ scored at θ_N)
    averaged  Δ   = (Δ_f + Δ_r) / 2

When a batch was drawn by a sampler other than its checkpoint's policy (docs/maths.md §12), each of its sums
carries that batch's sampler weight s_i = q_own(y_i)/q_sampler(y_i) too: Σ s w h' / Σ s w d − Σ s h / Σ s d —
the weights are relative to the sampler, so s·w is the total weight of the other checkpoint against it.

(d = T per_token, 1 per_sequence). The averaged statistic is ONE function of per-unit sums of both batches,
side by side (zeros where a unit is absent): the delete-one jackknife over the units of both removes a unit
from both at once, so the correlation the common draws put between Δ_f and Δ_r is measured. Each direction
alone is `snis.snis_delta_h` (the probe's own ΔH(η) estimator); the weights' diagnostics are
`snis.importance_diagnostics`.

Both the averaged change and the paired difference Ĥ(E_{N'}; θ_{N'}) − Ĥ(E_N; θ_N) (shown as a diagnostic) are
also available as `UnitReplicates`: the value and its delete-one replicates θ₍₋u₎ per unit of the union, so
that a statistic sharing E_N (the first-order residual D̂ − δH_Δθ, estimators/displacement.py; docs/maths.md
§9) is jackknifed jointly with it: its replicates are subtracted unit by unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .jackknife import (
    Estimate,
    Normalize,
    as_float64,
    check_normalize,
    jackknife_replicates,
    jackknife_se,
    sampler_weighted,
    sum_by_unit,
)
from .snis import importance_diagnostics, snis_delta_h, weights_from_log

__all__ = ["CrossScored", "UnitReplicates", "importance_realised_change", "importance_realised_replicates",
           "paired_change_replicates", "realised_change_entry"]


@dataclass
class CrossScored:
    """One E batch scored at the policy that sampled it (`h_own`, `T`) and at the other checkpoint's policy
    (`h_other`, `logw` = Σ_k ℓ_other − ℓ_own per sequence, nats); `units`: the jackknife unit of each sequence
    (a key that names the same draw in both batches). All [N], float64 after `as_float64`. `sampler_weights`:
    s [N] when the batch was drawn by a sampler other than its own policy (docs/maths.md §12), else None."""

    logw: Any
    h_own: Any
    h_other: Any
    T: Any
    units: list
    sampler_weights: Any | None = None


@dataclass
class UnitReplicates:
    """A statistic of per-unit sums: its value, the units (sorted keys, the rows of the sums) and its delete-one
    replicates θ₍₋u₎ in that order (entropy units)."""

    value: float
    units: list[str]
    replicates: np.ndarray

    @property
    def estimate(self) -> Estimate:
        """(value, delete-one jackknife SE of the replicates)."""
        return Estimate(self.value, jackknife_se(self.replicates))


def _unit_replicates(columns: list[np.ndarray], units: list[str], statistic) -> UnitReplicates:
    keys = sorted(set(units))  # the row order of sum_by_unit (np.unique sorts the same way)
    stats = sum_by_unit(columns, units)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = statistic(stats.sum(axis=0))
    return UnitReplicates(float(value), keys, jackknife_replicates(stats, statistic))


def _side_by_side(first: list[np.ndarray], second: list[np.ndarray]) -> list[np.ndarray]:
    """The columns of two batches stacked row-wise, each batch's columns zero on the other's rows."""
    n1, n2 = len(first[0]), len(second[0])
    return ([np.concatenate([c, np.zeros(n2)]) for c in first] +
            [np.concatenate([np.zeros(n1), c]) for c in second])


def _columns(side: CrossScored, normalize: Normalize) -> list[np.ndarray]:
    """[w h_other, w d, h_own, d] of one batch (w unnormalised, exp(log w − max))."""
    w, t = weights_from_log(side.logw), as_float64(side.T)
    d = t if normalize == "per_token" else np.ones_like(t)
    return sampler_weighted([w * as_float64(side.h_other), w * d, as_float64(side.h_own), d], side.sampler_weights)


def _averaged(sums: np.ndarray) -> float:
    # sums = (forward: Σwh', Σwd, Σh, Σd; reverse: Σw̃h̃, Σw̃d, Σh, Σd)
    fwh, fwd, fh, fd, rwh, rwd, rh, rd = sums
    return float(0.5 * ((fwh / fwd - fh / fd) + (rh / rd - rwh / rwd)))


def importance_realised_replicates(forward: CrossScored, reverse: CrossScored, *,
                                   normalize: Normalize) -> UnitReplicates:
    """Δ = (Δ_f + Δ_r)/2 and its delete-one replicates over the union of both batches' units (a unit removed
    from both batches at once). NaN when every weight of one side is zero."""
    check_normalize(normalize)
    columns = _side_by_side(_columns(forward, normalize), _columns(reverse, normalize))
    units = [str(u) for u in forward.units] + [str(u) for u in reverse.units]
    return _unit_replicates(columns, units, _averaged)


def importance_realised_change(forward: CrossScored, reverse: CrossScored, *, normalize: Normalize) -> Estimate:
    """Δ = (Δ_f + Δ_r)/2 with its delete-one jackknife SE over the union of both batches' units (units of the
    entropies: nats per token or per sequence). NaN when every weight of one side is zero."""
    return importance_realised_replicates(forward, reverse, normalize=normalize).estimate


def _difference(sums: np.ndarray) -> float:
    h_from, d_from, h_to, d_to = sums
    return float(h_to / d_to - h_from / d_from)


def paired_change_replicates(h_from: Any, d_from: Any, units_from: list, h_to: Any, d_to: Any,
                             units_to: list, s_from: Any | None = None, s_to: Any | None = None) -> UnitReplicates:
    """The paired difference Σh_to/Σd_to − Σh_from/Σd_from (each batch scored at its own policy; d = T or 1)
    and its delete-one replicates over the union of units: a unit's sums sit side by side in both batches
    (zeros where it is absent) and are removed from both at once, both ratios recomputed in every replicate.
    `s_from`, `s_to`: each batch's sampler weights (Σ s h/Σ s d; None: unweighted, docs/maths.md §12)."""
    columns = _side_by_side(sampler_weighted([as_float64(h_from), as_float64(d_from)], s_from),
                            sampler_weighted([as_float64(h_to), as_float64(d_to)], s_to))
    units = [str(u) for u in units_from] + [str(u) for u in units_to]
    return _unit_replicates(columns, units, _difference)


def _side_entry(side: CrossScored, normalize: Normalize, sign: float) -> dict:
    est = snis_delta_h(side.logw, side.h_other, side.h_own, side.T, normalize=normalize,
                       units=[str(u) for u in side.units], sampler_weights=side.sampler_weights)
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

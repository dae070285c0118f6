"""The realised change of one interval N → N' of a sweep: which estimator, its error bar, and what to warn.

* `importance` (when both E batches were saved and scored at both checkpoints, cross_scores.py, and the
  smaller ESS/N of the two directions is ≥ MIN_ESS_FRAC): the average of the forward (E_N reweighted to θ_{N'})
  and reverse (E_{N'} reweighted to θ_N) SNIS changes, one jackknife over the units of both batches
  (estimators/realised_change.py). It counts the responses that would change, through their weights.
* `independent_batches` (otherwise): Ĥ(E_{N'}) − Ĥ(E_N) with the SE of two independent batches,
  √(SE_N² + SE_{N'}²). The common draws make the two batches positively correlated where responses coincide,
  so this SE errs on the large side; when the weights are degenerate most responses have changed anyway.

The paired difference (common draws, one jackknife over the units of both batches) is kept as
`paired_diagnostic`: it sees only the per-token change along the responses that did not change plus the
`n_changed` draws whose responses did, and is never used as the realised change (docs/realised-change.md).
"""

from __future__ import annotations

import math

from ..estimators.jackknife import entropy_with_se
from ..estimators.realised_change import realised_change_entry
from .stats import paired_difference

__all__ = ["MIN_CHANGED_UNITS", "MIN_ESS_FRAC", "interval_realised_change"]

MIN_ESS_FRAC = 0.5
MIN_CHANGED_UNITS = 10


def _finite(x) -> float | None:
    return float(x) if x is not None and math.isfinite(float(x)) else None


def _independent(run_a, run_b, normalize: str) -> tuple[float, float]:
    a = entropy_with_se(run_a.h, run_a.d(normalize), run_a.slots, run_a.sampler_weights)
    b = entropy_with_se(run_b.h, run_b.d(normalize), run_b.slots, run_b.sampler_weights)
    return b.value - a.value, math.hypot(a.se, b.se)


def _warnings(label: str, entry: dict) -> list[str]:
    out = []
    n_changed, n = entry["n_changed"], entry["n_common_draws"]
    if n_changed is not None and n_changed < MIN_CHANGED_UNITS:
        out.append(f"interval {label}: only {n_changed} of {n} E draws changed response between the checkpoints "
                   f"(common random numbers): the paired difference {entry['paired_diagnostic']['value']:+.4g} ± "
                   f"{entry['paired_diagnostic']['se']:.2g} rests on them and is not used; the realised change is "
                   f"by {entry['method']}")
    if entry["method"] == "independent_batches":
        why = ("the E batches were not scored at both checkpoints" if entry["ess_frac"] is None else
               f"ESS/N {entry['ess_frac']:.3f} < {MIN_ESS_FRAC}: the step is too large for importance weights")
        out.append(f"interval {label}: {why}; the realised change is Ĥ(to) − Ĥ(from) with the SE of independent "
                   "batches (wide)")
    return out


def interval_realised_change(run_a, run_b, normalize: str, cross, label: str) -> tuple[dict, list[str]]:
    """(sweep.json fields of the realised change of run_a → run_b, warnings); `cross`: read_cross_scores' tuple
    or None."""
    diff = paired_difference(run_a.h, run_a.d(normalize), run_a.pair_keys,
                             run_b.h, run_b.d(normalize), run_b.pair_keys, run_a.sampler_weights, run_b.sampler_weights)
    paired = {"value": _finite(diff.value), "se": _finite(diff.se), "n_paired_units": diff.n_paired,
              "n_unpaired_units": diff.n_from_only + diff.n_to_only}
    importance = None if cross is None else realised_change_entry(cross[0], cross[1], normalize=normalize)
    counts = {"n_changed": None, "n_common_draws": None} if cross is None else cross[2]
    ess = None if importance is None else _finite(importance["ess_frac"])
    if ess is not None and ess >= MIN_ESS_FRAC and _finite(importance["se"]) is not None:
        method, value, se = "importance", importance["value"], importance["se"]
    else:
        method, (value, se) = "independent_batches", _independent(run_a, run_b, normalize)
    khats = [] if importance is None else [importance[s]["psis_khat"] for s in ("forward", "reverse")]
    entry = {"dH_realised": _finite(value), "se": _finite(se), "method": method, **counts, "ess_frac": ess,
             "psis_khat": max((k for k in khats if math.isfinite(k)), default=None),
             "n_paired_units": diff.n_paired, "n_unpaired_units": diff.n_from_only + diff.n_to_only,
             "importance": importance, "paired_diagnostic": paired}
    return entry, _warnings(label, entry)

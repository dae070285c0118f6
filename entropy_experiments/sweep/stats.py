"""The sweep's statistics: pure float64 functions of per-sequence values and of per-checkpoint numbers.

Units: h in nats (Σ_k H_k of one sequence), d = T (tokens) for `per_token` or 1 for `per_sequence`, so that
every entropy here is in nats per token (per sequence). A jackknife unit is one independent E draw — one
prompt drawn from the pool with its response(s), the probe's own unit (`prompt_index`) — its sequences summed
(estimators/jackknife.py).

- `entropy_with_se` (estimators/jackknife.py): Ĥ = Σh/Σd and its delete-one jackknife SE over the units.
- `paired_difference`: Ĥ(to) − Ĥ(from) on two E batches, with the jackknife over the units of either batch,
  the difference of the two ratios recomputed in every replicate (paired where a unit is in both).
- `pearson`, `spearman` (Pearson of average ranks), `bootstrap_ci` (percentile bootstrap over rows),
  `fisher_ci` (the Fisher-z interval of a correlation from n alone), and the calibration summaries `sign_agreement`, `coverage`, `rms`, `median_ratio`;
- `fitted_scale`, `loo_scale_z`: for a scale-free predictor x (no units of its own), the one scale c that
  best maps it onto the measured y (weighted least squares through 0, weights 1/SE²), and the z of each pair
  under the scale fitted without it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from statistics import NormalDist
from typing import NamedTuple

import numpy as np

from ..estimators.jackknife import as_float64
from ..estimators.realised_change import paired_change_replicates

__all__ = ["BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "PairedDifference", "bootstrap_ci", "coverage",
           "fisher_ci", "fitted_scale", "loo_scale_z", "median_ratio", "paired_difference", "pearson",
           "rank_average", "rms", "sign_agreement", "spearman"]

BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


class PairedDifference(NamedTuple):
    """Ĥ(to) − Ĥ(from) with its jackknife SE, and how many units were in both batches or in one only."""

    value: float
    se: float
    n_paired: int
    n_from_only: int
    n_to_only: int


def paired_difference(h_from, d_from, units_from, h_to, d_to, units_to, s_from=None, s_to=None) -> PairedDifference:
    """Ĥ(to) − Ĥ(from) = Σh_to/Σd_to − Σh_from/Σd_from, with the delete-one jackknife over the union of units.

    `units_from` / `units_to` name each sequence's unit (a sweep passes "draw:prompt id", so that a draw pairs
    only when it holds the same prompt in both batches). A unit's sums (h, d) in the `from` batch and in the
    `to` batch sit side by side (zeros on the side it is absent from); deleting it removes it from both
    batches at once, so the correlation between the two estimates — same prompts, and responses drawn with the
    same generator seed — is measured, not assumed away; both ratios are recomputed in every replicate
    (estimators/realised_change.paired_change_replicates). Units of the result: those of the entropies.
    `s_from`, `s_to`: each batch's sampler correction weights (None: drawn by its policy).
    """
    ids_from, ids_to = [str(u) for u in units_from], [str(u) for u in units_to]
    est = paired_change_replicates(h_from, d_from, ids_from, h_to, d_to, ids_to, s_from, s_to).estimate
    both = len(set(ids_from) & set(ids_to))
    return PairedDifference(est.value, est.se, both, len(set(ids_from)) - both, len(set(ids_to)) - both)


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson correlation of x and y (NaN when n < 3 or either is constant); dimensionless."""
    x, y = as_float64(x), as_float64(y)
    if x.size < 3 or x.min() == x.max() or y.min() == y.max():  # (a mean of equal floats need not equal them)
        return float("nan")
    dx, dy = x - x.mean(), y - y.mean()
    return float(np.sum(dx * dy) / np.sqrt(np.sum(dx * dx) * np.sum(dy * dy)))


def rank_average(x: Sequence[float]) -> np.ndarray:
    """Ranks 1…n of x, ties given the mean of the ranks they span."""
    x = as_float64(x)
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size)
    sorted_x = x[order]
    start = 0
    for end in range(1, x.size + 1):
        if end == x.size or sorted_x[end] != sorted_x[start]:
            ranks[order[start:end]] = 0.5 * (start + end - 1) + 1.0
            start = end
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman rank correlation: Pearson of the average ranks (NaN when n < 3 or ranks are constant)."""
    return pearson(rank_average(x), rank_average(y))


def bootstrap_ci(x: Sequence[float], y: Sequence[float], statistic: Callable[[np.ndarray, np.ndarray], float], *,
                 resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                 level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of statistic(x, y) over the rows (pairs).

    Scheme (reproducible): idx = numpy.random.default_rng(seed).integers(0, n, size=(resamples, n)); the
    statistic of each resample (x[idx[b]], y[idx[b]]); the (1−level)/2 and (1+level)/2 quantiles (numpy's
    linear interpolation) of the finite ones. (NaN, NaN) when n < 3 or fewer than half the resamples are finite
    (e.g. a correlation of resamples that repeat one row).
    """
    x, y = as_float64(x), as_float64(y)
    n = x.size
    if n < 3:
        return float("nan"), float("nan")
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.array([statistic(x[i], y[i]) for i in idx])
    values = values[np.isfinite(values)]
    if values.size < resamples / 2:
        return float("nan"), float("nan")
    lo, hi = np.quantile(values, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def fisher_ci(r: float, n: int, *, rank: bool = False, level: float = 0.95) -> tuple[float, float]:
    """Fisher-z interval of a correlation r over n pairs: tanh(atanh r ± z_q·s), s = 1/√(n − 3) for Pearson and
    √(1.06/(n − 3)) for Spearman (`rank`; Fieller, Hartley & Pearson 1957). It assumes independent pairs drawn
    from a bivariate normal; unlike the bootstrap it widens with few pairs as it should. (NaN, NaN) when
    n < 4 or r is not finite; r = ±1 gives the point."""
    if n < 4 or not np.isfinite(r):
        return float("nan"), float("nan")
    q = NormalDist().inv_cdf((1 + level) / 2)
    s = float(np.sqrt((1.06 if rank else 1.0) / (n - 3)))
    with np.errstate(divide="ignore"):
        centre = float(np.arctanh(np.clip(r, -1.0, 1.0)))
    return float(np.tanh(centre - q * s)), float(np.tanh(centre + q * s))


def sign_agreement(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Fraction of pairs whose signs agree (a zero agrees only with a zero); NaN for no pairs."""
    p, m = as_float64(predicted), as_float64(measured)
    return float(np.mean(np.sign(p) == np.sign(m))) if p.size else float("nan")


def coverage(z: Sequence[float], half_width: float = 1.96) -> float:
    """Fraction of |z| < half_width among the finite z (NaN when none): how often ±1.96·SE covers zero."""
    z = as_float64(z)
    z = z[np.isfinite(z)]
    return float(np.mean(np.abs(z) < half_width)) if z.size else float("nan")


def median_ratio(predicted: Sequence[float], measured: Sequence[float]) -> float:
    """Median of predicted / measured over the pairs with measured ≠ 0 (NaN when none); dimensionless."""
    p, m = as_float64(predicted), as_float64(measured)
    keep = m != 0
    return float(np.median(p[keep] / m[keep])) if keep.any() else float("nan")


def rms(z: Sequence[float]) -> float:
    """√(mean z²) over the finite z (NaN when none): 1 for well-calibrated error bars."""
    z = as_float64(z)
    z = z[np.isfinite(z)]
    return float(np.sqrt(np.mean(z * z))) if z.size else float("nan")


def fitted_scale(x: Sequence[float], y: Sequence[float], se: Sequence[float]) -> float:
    """c minimising Σ (y − c·x)²/se² over the pairs with finite x, y and se > 0: Σxy/se² / Σx²/se² (NaN when
    Σx²/se² = 0); units of y per unit of x."""
    x, y, se = as_float64(x), as_float64(y), as_float64(se)
    keep = np.isfinite(x) & np.isfinite(y) & np.isfinite(se) & (se > 0)
    w = 1.0 / se[keep] ** 2
    den = float(np.sum(w * x[keep] ** 2))
    return float(np.sum(w * x[keep] * y[keep]) / den) if den > 0 else float("nan")


def loo_scale_z(x: Sequence[float], y: Sequence[float], se: Sequence[float]) -> np.ndarray:
    """z_i = (c₍₋ᵢ₎·x_i − y_i)/se_i with c₍₋ᵢ₎ = `fitted_scale` without pair i (NaN where se_i is not a finite
    positive number or c₍₋ᵢ₎ is undefined). Only the measured SE enters: the scale-free predictor has none."""
    x, y, se = as_float64(x), as_float64(y), as_float64(se)
    z = np.full(x.size, np.nan)
    for i in range(x.size):
        if not (np.isfinite(se[i]) and se[i] > 0 and np.isfinite(x[i]) and np.isfinite(y[i])):
            continue
        others = np.arange(x.size) != i
        c = fitted_scale(x[others], y[others], se[others])
        z[i] = (c * x[i] - y[i]) / se[i]
    return z

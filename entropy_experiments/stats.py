"""Statistics cores of the probe (MATH.md §5, §6): SNIS entropy, importance-weight diagnostics,
delete-one jackknife from per-unit sufficient statistics, and the ΔH(η) linearity fit.

Pure float64 numpy maths on per-sequence arrays; no model passes. Inputs may be numpy arrays,
lists or torch tensors (they are copied to float64 numpy).

Units: entropies in nats (h_i = Σ_k H_ik per sequence), lengths T_i in tokens, log-weights
log w_i = Σ_k (ℓ'_ik − ℓ_ik) in nats. A jackknife "unit" is an independent draw: a sequence when
G = 1, a prompt (all of its sequences) otherwise — pass `units` (one id per sequence) to group.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

__all__ = [
    "Estimate",
    "delta_h1_per_sequence",
    "delta_h1_per_token",
    "delta_h1_slope",
    "ess",
    "importance_diagnostics",
    "jackknife_from_unit_sums",
    "jackknife_ratio_se",
    "jackknife_replicates",
    "jackknife_se",
    "khat_threshold",
    "linearity_fit",
    "logw_summary",
    "psis_khat",
    "snis_delta_h",
    "snis_entropy",
    "sum_by_unit",
    "zero_weight_count",
]

Normalize = Literal["per_token", "per_sequence"]
_NORMALIZE = ("per_token", "per_sequence")


class Estimate(NamedTuple):
    """A point estimate and its delete-one jackknife standard error (same units)."""

    value: float
    se: float


def _f64(x: Any) -> np.ndarray:
    """1-D float64 copy of an array-like or torch tensor."""
    if hasattr(x, "detach"):  # torch.Tensor, without importing torch here
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1).copy()


def _check_normalize(normalize: str) -> None:
    if normalize not in _NORMALIZE:
        raise ValueError(f"normalize must be one of {_NORMALIZE}, got {normalize!r}")


# --------------------------------------------------------------------------------------------
# Importance weights
# --------------------------------------------------------------------------------------------


def _weights(logw: Any) -> np.ndarray:
    """Unnormalised w_i = exp(log w_i − max finite log w) ∈ [0, 1], shape [N].

    Subtracting the max keeps exp() in range; every statistic here is a ratio, so it cancels.
    log w = −∞ (a realised token outside the new nucleus) gives w = 0. NaN or +∞ is a bug upstream.
    """
    lw = _f64(logw)
    if np.isnan(lw).any() or np.isposinf(lw).any():
        bad = int(np.flatnonzero(np.isnan(lw) | np.isposinf(lw))[0])
        raise ValueError(f"log-weights must be finite or -inf; entry {bad} is {lw[bad]}")
    finite = np.isfinite(lw)
    if not finite.any():
        return np.zeros_like(lw)
    return np.exp(lw - lw[finite].max())


def snis_entropy(logw: Any, h_new: Any, T: Any, *, normalize: Normalize) -> float:
    """Self-normalised IS estimate of the entropy under θ' on the old sequences (MATH.md §5).

    logw, h_new, T: [N] (log w_i, h'_i in nats, T_i in tokens).
    per_token: Σ w h' / Σ w T (nats per token); per_sequence: Σ w h' / Σ w (nats per sequence).
    NaN when every weight is zero.
    """
    _check_normalize(normalize)
    w, hn, t = _weights(logw), _f64(h_new), _f64(T)
    denom = np.dot(w, t) if normalize == "per_token" else w.sum()
    return float(np.dot(w, hn) / denom) if denom > 0 else float("nan")


def ess(logw: Any) -> float:
    """Effective sample size (Σw)²/Σw² ∈ [1, N]; 0 when every weight is zero."""
    w = _weights(logw)
    sq = float(np.dot(w, w))
    return float(w.sum() ** 2 / sq) if sq > 0 else 0.0


def zero_weight_count(logw: Any) -> int:
    """Number of sequences with log w = −∞ (w = 0)."""
    return int(np.isneginf(_f64(logw)).sum())


def logw_summary(logw: Any) -> dict[str, float]:
    """{'min', 'median', 'max'} of the finite log-weights (NaN when none is finite)."""
    lw = _f64(logw)
    lw = lw[np.isfinite(lw)]
    if lw.size == 0:
        return {"min": float("nan"), "median": float("nan"), "max": float("nan")}
    return {"min": float(lw.min()), "median": float(np.median(lw)), "max": float(lw.max())}


def khat_threshold(n: int) -> float:
    """Sample-size-dependent PSIS k̂ threshold min(1 − 1/log10 n, 0.7) (Vehtari et al. 2024)."""
    if n <= 1:
        return float("nan")
    return min(1.0 - 1.0 / math.log10(n), 0.7)


# arviz-stats shrinks the fitted shape towards 0.5 with this many pseudo-draws (Zhang & Stephens'
# weak prior): k̂ = (M·k + 10·0.5) / (M + 10), so with few tail draws k̂ sits near 0.5 whatever the tail.
PSIS_PRIOR_DRAWS = 10


def psis_tail_size(n: int) -> int:
    """M, the number of largest weights the PSIS fit uses for n draws (as arviz-stats picks it)."""
    return math.floor(3 * math.sqrt(n)) if n > 225 else n // 5


def psis_khat(logw: Any) -> float:
    """Pareto-smoothed importance sampling shape k̂ of the weights' right tail.

    Uses arviz-stats' implementation of Vehtari et al. (2024): a Zhang & Stephens (2009)
    generalized-Pareto fit (with its weak prior towards 0.5) to the M = min(0.2 N, 3√N) largest
    weights; r_eff = 1 because the E sequences are independent draws. k̂ < threshold: the SNIS
    estimate is reliable; k̂ > 0.7: it is not.

    NaN when k̂ is undefined: fewer than 25 weights (M < 5), zero weights (log w = −∞) inside the
    M + 1 largest, a constant tail (e.g. η = 0, all w equal), or a non-finite fit.
    """
    from arviz_stats.base import array_stats

    lw = _f64(logw)
    if np.isnan(lw).any() or np.isposinf(lw).any():
        raise ValueError("log-weights must be finite or -inf")
    tail = psis_tail_size(lw.size)
    # Too few draws for a tail fit, or zero weights reaching into the tail (a degenerate fit;
    # zero_weight_count and the ESS already tell that story).
    if tail < 5 or int(np.isfinite(lw).sum()) <= tail:
        return float("nan")
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            # psislw takes log-LIKELIHOODS and fits the weights exp(−input): pass −log w. (Its
            # sibling pareto_khat(log_weights=True) fits the log-weights themselves, not exp of
            # them, and reports k̂ ≈ 0 for any tail — not usable here.)
            _, khat = array_stats.psislw(-lw, r_eff=1.0)
    except ValueError:  # arviz raises on a constant tail
        return float("nan")
    khat = float(khat)
    return khat if math.isfinite(khat) else float("nan")


def importance_diagnostics(logw: Any) -> dict[str, Any]:
    """All weight diagnostics of one η, keyed as in results.json `true[...]`:
    ess, ess_frac, zero_weight_count, psis_khat, khat_threshold, logw {min, median, max}."""
    n = _f64(logw).size
    e = ess(logw)
    return {
        "ess": e,
        "ess_frac": e / n if n else float("nan"),
        "zero_weight_count": zero_weight_count(logw),
        "psis_khat": psis_khat(logw),
        "khat_threshold": khat_threshold(n),
        "logw": logw_summary(logw),
    }


# --------------------------------------------------------------------------------------------
# Delete-one jackknife from per-unit sums
# --------------------------------------------------------------------------------------------


def sum_by_unit(columns: Sequence[Any], units: Any | None = None) -> np.ndarray:
    """Stack per-sequence columns into per-unit sufficient statistics, shape [n_units, m].

    columns: m arrays of length N (one value per sequence). units: [N] unit id per sequence
    (e.g. the prompt id when G > 1), or None when every sequence is its own unit. Rows of the
    same unit are summed (rows ordered by sorted unit id).
    """
    stats = np.stack([_f64(c) for c in columns], axis=1)
    if units is None:
        return stats
    ids = np.asarray(units).reshape(-1)
    if ids.shape[0] != stats.shape[0]:
        raise ValueError(f"{ids.shape[0]} unit ids for {stats.shape[0]} sequences")
    _, inverse = np.unique(ids, return_inverse=True)
    out = np.zeros((int(inverse.max()) + 1, stats.shape[1]))
    np.add.at(out, inverse, stats)
    return out


def jackknife_se(values_minus_one: Any) -> float:
    """Delete-one jackknife SE = sqrt((n−1)/n Σ_i (θ₍₋i₎ − θ̄)²) from the n replicates θ₍₋i₎.

    NaN for n < 2 or any non-finite replicate.
    """
    theta = _f64(values_minus_one)
    n = theta.size
    if n < 2 or not np.isfinite(theta).all():
        return float("nan")
    return float(math.sqrt((n - 1) / n * np.sum((theta - theta.mean()) ** 2)))


def jackknife_replicates(unit_stats: np.ndarray, fn: Callable[[np.ndarray], float]) -> np.ndarray:
    """θ₍₋i₎ = fn(Σ_j unit_stats[j] − unit_stats[i]) for each unit i, shape [n].

    unit_stats: [n, m] per-unit sufficient statistics; fn maps the m column sums to the statistic.
    Everything the statistic depends on (Ĥ included) must be a function of those sums, so that
    it is recomputed in every replicate.
    """
    stats = np.asarray(unit_stats, dtype=np.float64)
    if stats.ndim != 2:
        raise ValueError(f"unit_stats must be [n, m], got shape {stats.shape}")
    totals = stats.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.array([fn(totals - row) for row in stats], dtype=np.float64)


def jackknife_from_unit_sums(unit_stats: np.ndarray, fn: Callable[[np.ndarray], float]) -> float:
    """Jackknife SE of fn(column sums) over the units (rows) of unit_stats [n, m]."""
    return jackknife_se(jackknife_replicates(unit_stats, fn))


def _ratio(sums: np.ndarray) -> float:
    return float(sums[0] / sums[1])


def jackknife_ratio_se(numer_parts: Any, denom_parts: Any) -> float:
    """Jackknife SE of Σ numer / Σ denom over units ([n] each)."""
    return jackknife_from_unit_sums(sum_by_unit([numer_parts, denom_parts]), _ratio)


def _estimate(unit_stats: np.ndarray, fn: Callable[[np.ndarray], float]) -> Estimate:
    with np.errstate(divide="ignore", invalid="ignore"):
        value = fn(unit_stats.sum(axis=0))
    return Estimate(float(value), jackknife_from_unit_sums(unit_stats, fn))


def _delta_h1_per_token_stat(sums: np.ndarray) -> float:
    # sums = (A, B, Σh, ΣT): (A − Ĥ·B)/ΣT with Ĥ = Σh/ΣT recomputed from the same sums.
    a, b, h, t = sums
    return float((a - (h / t) * b) / t)


def delta_h1_per_token(a: Any, r: Any, h: Any, T: Any, *, units: Any | None = None) -> Estimate:
    """δH₁/η for `per_token` (MATH.md §6) and its E-side jackknife SE.

    a_i = Σ_k [D_v H_ik + (G_ik − b_ik) D_v ℓ_ik], r_i = Σ_k R_ik D_v ℓ_ik, h_i, T_i: [N] each.
    Value (A − Ĥ·B)/ΣT with A = Σa, B = Σr, Ĥ = Σh/ΣT — nats per token per unit lr. Multiply value
    and SE by lr for δH₁ itself (an SE of the whole statistic, not of a mean of pieces).
    """
    return _estimate(sum_by_unit([a, r, h, T], units), _delta_h1_per_token_stat)


def delta_h1_per_sequence(a: Any, *, units: Any | None = None) -> Estimate:
    """δH₁/η for `per_sequence`: mean_i a_i (Ĥ does not enter), with its jackknife SE.

    Written as Σa / Σ1 so that grouping sequences into units keeps the per-sequence mean;
    with one sequence per unit the SE is exactly std(a, ddof=1)/√N.
    """
    ones = np.ones_like(_f64(a))
    return _estimate(sum_by_unit([a, ones], units), _ratio)


def delta_h1_slope(
    a: Any, r: Any, h: Any, T: Any, *, normalize: Normalize, units: Any | None = None
) -> Estimate:
    """δH₁/η with its jackknife SE for either `estimator.normalize`."""
    _check_normalize(normalize)
    if normalize == "per_token":
        return delta_h1_per_token(a, r, h, T, units=units)
    return delta_h1_per_sequence(a, units=units)


def _snis_delta_stat(sums: np.ndarray) -> float:
    # sums = (Σ w h', Σ w d, Σ h, Σ d), d = T (per_token) or 1 (per_sequence): Ĥ' − Ĥ.
    wh, wd, hh, d = sums
    return float(wh / wd - hh / d)


def snis_delta_h(
    logw: Any, h_new: Any, h: Any, T: Any, *, normalize: Normalize, units: Any | None = None
) -> Estimate:
    """ΔH(η) = Ĥ' − Ĥ by SNIS on the E sequences, with a delete-one jackknife SE over units.

    logw, h_new, h, T: [N]. Per-unit statistics (w h', w T, h, T) for per_token and
    (w h', w, h, 1) for per_sequence, with unnormalised w = exp(log w − max log w). Both Ĥ' and Ĥ
    are recomputed in each replicate. Value NaN when every weight is zero.
    """
    _check_normalize(normalize)
    w, hn, hh, t = _weights(logw), _f64(h_new), _f64(h), _f64(T)
    d = t if normalize == "per_token" else np.ones_like(t)
    return _estimate(sum_by_unit([w * hn, w * d, hh, d], units), _snis_delta_stat)


# --------------------------------------------------------------------------------------------
# ΔH(η) against η
# --------------------------------------------------------------------------------------------


def linearity_fit(etas: Sequence[float], deltas: Sequence[float]) -> dict[str, Any]:
    """How linear ΔH(η) is; each slope should sit near δH₁/η in the linear regime (MATH.md §5).

    - slope_through_origin: least squares ΔH ≈ c·η over all finite (η, ΔH), i.e. Σ ηΔH / Σ η²;
    - loglog_slope: least-squares slope of log|ΔH| on log η over η > 0 (1 when linear, 2 when
      quadratic); NaN with fewer than 2 distinct positive η or any |ΔH| ≤ 0 among them;
    - symmetric_slopes: [{eta, slope}] with slope (ΔH(+η) − ΔH(−η)) / 2η for every η > 0 whose −η
      is also present (this cancels the even, curvature part of ΔH).
    Non-finite ΔH values are left out.
    """
    eta = _f64(etas)
    dh = _f64(deltas)
    if eta.size != dh.size:
        raise ValueError(f"{eta.size} etas but {dh.size} deltas")
    ok = np.isfinite(eta) & np.isfinite(dh)
    eta, dh = eta[ok], dh[ok]

    ss = float(np.dot(eta, eta))
    slope0 = float(np.dot(eta, dh) / ss) if ss > 0 else float("nan")

    pos = eta > 0
    loglog = float("nan")
    if np.unique(eta[pos]).size >= 2 and np.all(np.abs(dh[pos]) > 0):
        loglog = float(np.polyfit(np.log(eta[pos]), np.log(np.abs(dh[pos])), 1)[0])

    symmetric = []
    for e in np.unique(eta[pos]):
        minus = np.isclose(eta, -e, rtol=1e-9, atol=0.0)
        plus = np.isclose(eta, e, rtol=1e-9, atol=0.0)
        if minus.any():
            slope = (dh[plus].mean() - dh[minus].mean()) / (2.0 * e)
            symmetric.append({"eta": float(e), "slope": float(slope)})

    return {"slope_through_origin": slope0, "loglog_slope": loglog, "symmetric_slopes": symmetric}

"""Self-normalised importance sampling of the probe (docs/maths.md §5): SNIS entropy and ΔH(η), importance-weight
diagnostics (ESS, PSIS k̂, log-weight range, zero weights) and the ΔH(η) linearity fit.

Pure float64 numpy maths on per-sequence arrays; no model passes. Inputs may be numpy arrays, lists or
torch tensors (they are copied to float64 numpy). Units: entropies in nats (h_i = Σ_k H_ik per
sequence), lengths T_i in tokens, log-weights log w_i = Σ_k (ℓ'_ik − ℓ_ik) in nats. Jackknife SEs and
their units (`units`: one id per sequence) come from jackknife.py.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
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

__all__ = [
    "PSIS_PRIOR_DRAWS",
    "ess",
    "importance_diagnostics",
    "khat_threshold",
    "linearity_fit",
    "logw_summary",
    "psis_khat",
    "psis_tail_size",
    "snis_delta_h",
    "snis_entropy",
    "zero_weight_count",
]


# --------------------------------------------------------------------------------------------
# Importance weights
# --------------------------------------------------------------------------------------------


def weights_from_log(logw: Any) -> np.ndarray:
    """Unnormalised w_i = exp(log w_i − max finite log w) ∈ [0, 1], shape [N].

    Subtracting the max keeps exp() in range; every statistic here is a ratio, so it cancels.
    log w = −∞ (a realised token outside the new nucleus) gives w = 0. NaN or +∞ is a bug upstream.
    """
    lw = as_float64(logw)
    if np.isnan(lw).any() or np.isposinf(lw).any():
        bad = int(np.flatnonzero(np.isnan(lw) | np.isposinf(lw))[0])
        raise ValueError(f"log-weights must be finite or -inf; entry {bad} is {lw[bad]}")
    finite = np.isfinite(lw)
    if not finite.any():
        return np.zeros_like(lw)
    return np.exp(lw - lw[finite].max())


def snis_entropy(logw: Any, h_new: Any, T: Any, *, normalize: Normalize) -> float:
    """Self-normalised IS estimate of the entropy under θ' on the old sequences (docs/maths.md §5).

    logw, h_new, T: [N] (log w_i, h'_i in nats, T_i in tokens).
    per_token: Σ w h' / Σ w T (nats per token); per_sequence: Σ w h' / Σ w (nats per sequence).
    NaN when every weight is zero.
    """
    check_normalize(normalize)
    w, hn, t = weights_from_log(logw), as_float64(h_new), as_float64(T)
    denom = np.dot(w, t) if normalize == "per_token" else w.sum()
    return float(np.dot(w, hn) / denom) if denom > 0 else float("nan")


def ess(logw: Any) -> float:
    """Effective sample size (Σw)²/Σw² ∈ [1, N]; 0 when every weight is zero."""
    w = weights_from_log(logw)
    sq = float(np.dot(w, w))
    return float(w.sum() ** 2 / sq) if sq > 0 else 0.0


def zero_weight_count(logw: Any) -> int:
    """Number of sequences with log w = −∞ (w = 0)."""
    return int(np.isneginf(as_float64(logw)).sum())


def logw_summary(logw: Any) -> dict[str, float]:
    """{'min', 'median', 'max'} of the finite log-weights (NaN when none is finite)."""
    lw = as_float64(logw)
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

    lw = as_float64(logw)
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
    n = as_float64(logw).size
    e = ess(logw)
    return {
        "ess": e,
        "ess_frac": e / n if n else float("nan"),
        "zero_weight_count": zero_weight_count(logw),
        "psis_khat": psis_khat(logw),
        "khat_threshold": khat_threshold(n),
        "logw": logw_summary(logw),
    }


def _snis_delta_stat(sums: np.ndarray) -> float:
    # sums = (Σ w h', Σ w d, Σ h, Σ d), d = T (per_token) or 1 (per_sequence): Ĥ' − Ĥ.
    wh, wd, hh, d = sums
    return float(wh / wd - hh / d)


def snis_delta_h(
    logw: Any, h_new: Any, h: Any, T: Any, *, normalize: Normalize, units: Any | None = None,
    sampler_weights: Any | None = None,
) -> Estimate:
    """ΔH(η) = Ĥ' − Ĥ by SNIS on the E sequences, with a delete-one jackknife SE over units.

    logw, h_new, h, T: [N]. Per-unit statistics (w h', w T, h, T) for per_token and
    (w h', w, h, 1) for per_sequence, with unnormalised w = exp(log w − max log w). Both Ĥ' and Ĥ
    are recomputed in each replicate. Value NaN when every weight is zero.

    `sampler_weights` s [N] (E drawn by a sampler other than the policy, docs/maths.md §12): every column
    carries s too, Ĥ = Σ s h / Σ s d and Ĥ' = Σ s w h' / Σ s w d (total weights s·w against the sampler).
    """
    check_normalize(normalize)
    w, hn, hh, t = weights_from_log(logw), as_float64(h_new), as_float64(h), as_float64(T)
    d = t if normalize == "per_token" else np.ones_like(t)
    columns = sampler_weighted([w * hn, w * d, hh, d], sampler_weights)
    return jackknife_estimate(sum_by_unit(columns, units), _snis_delta_stat)



# --------------------------------------------------------------------------------------------
# ΔH(η) against η
# --------------------------------------------------------------------------------------------


def linearity_fit(etas: Sequence[float], deltas: Sequence[float]) -> dict[str, Any]:
    """How linear ΔH(η) is; each slope should sit near δH₁/η in the linear regime (docs/maths.md §5).

    - slope_through_origin: least squares ΔH ≈ c·η over all finite (η, ΔH), i.e. Σ ηΔH / Σ η²;
    - loglog_slope: least-squares slope of log|ΔH| on log η over η > 0 (1 when linear, 2 when
      quadratic); NaN with fewer than 2 distinct positive η or any |ΔH| ≤ 0 among them;
    - symmetric_slopes: [{eta, slope}] with slope (ΔH(+η) − ΔH(−η)) / 2η for every η > 0 whose −η
      is also present (this cancels the even, curvature part of ΔH).
    Non-finite ΔH values are left out.
    """
    eta = as_float64(etas)
    dh = as_float64(deltas)
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

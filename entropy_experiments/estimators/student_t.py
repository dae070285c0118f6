"""Student-t quantiles for intervals built on a jackknife with few groups (docs/maths.md §6, "Few U groups").

SE_U is a delete-one jackknife over K U groups: its square is a variance estimate with K − 1 degrees of freedom,
so an interval from it needs a t quantile, not the normal's. SE_total² = SE_E² + SE_U² mixes that side with the
E side (n_E − 1 degrees of freedom); `welch_df` gives the Welch–Satterthwaite degrees of freedom of the sum.

Pure float64 maths (no scipy at run time): the two-sided tail P(|T| > t) = I_{ν/(ν+t²)}(ν/2, ½), the regularised
incomplete beta by its continued fraction (Lentz), and the quantile by bisection on that tail. Tested against
scipy.stats.t (tests/test_what_if_intervals.py).
"""

from __future__ import annotations

import math
from statistics import NormalDist

NORMAL_DF = 1e7  # beyond this many degrees of freedom the t quantile is the normal's to better than 1e-7


def _beta_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), converged to 1e-15 relative."""
    tiny, c, d = 1e-300, 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    out = d
    for m in range(1, 500):
        for num in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                    -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            out *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return out


def regularized_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b) for a, b > 0 and 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = a * math.log(x) + b * math.log1p(-x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_fraction(b, a, 1.0 - x) / b


def t_two_sided_tail(t: float, df: float) -> float:
    """P(|T| > t) for T Student-t with `df` degrees of freedom (t ≥ 0)."""
    return regularized_beta(0.5 * df, 0.5, df / (df + t * t))


def t_quantile(level: float, df: float) -> float:
    """q with P(|T| ≤ q) = level: the multiplier of SE for a two-sided interval at `level` (the normal's for
    df ≥ NORMAL_DF or infinite df; NaN for df < 1 or not a number)."""
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level!r}")
    normal = NormalDist().inv_cdf(0.5 + 0.5 * level)
    if not df >= 1.0:
        return math.nan
    if df >= NORMAL_DF:
        return normal
    lo, hi = 0.0, normal
    while t_two_sided_tail(hi, df) > 1.0 - level:
        lo, hi = hi, 2.0 * hi
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_two_sided_tail(mid, df) > 1.0 - level:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def welch_df(parts: list[tuple[float, float]]) -> float:
    """Welch–Satterthwaite degrees of freedom of Σ SE² over `parts` (SE, its df): (Σ SE²)² / Σ SE⁴/df.
    A part with SE 0 adds nothing; NaN when a part's SE is not a number or every SE is 0."""
    total, denominator = 0.0, 0.0
    for se, df in parts:
        if not (math.isfinite(se) and df >= 1):
            return math.nan
        total += se * se
        denominator += se ** 4 / df
    return total * total / denominator if denominator > 0 else math.nan

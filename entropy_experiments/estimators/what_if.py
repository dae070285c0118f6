"""What-if maths (docs/maths.md §6, "What-if"): δH₁ of another objective on the SAME E and U, its difference from
the baseline with the paired delete-one jackknife SE, and the coefficient at which δH₁ reaches a target.

Pure float64 maths, no model passes. One direction's error bars come from the per-sequence pieces a, r along
its v (E side) and the K leave-one-group-out replicates lr·X̂·v₍₋k₎ (U side), exactly as δH₁'s own (jackknife.py).
The difference of two directions on the same E and U is paired: the E-side statistic (A − Ĥ·B)/D is linear in
(a, r) for fixed h, T, so the E replicates of the difference are those of (a₁ − a₀, r₁ − r₀); the U replicates
of the difference are the differences of the replicates, group by group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from . import jackknife
from .student_t import t_quantile, welch_df

NAN = float("nan")


class TotalSE:
    """What SE_E and SE_U make together: SE_total = √(SE_E² + SE_U²), NaN where a side is missing (one U group:
    it is not SE_E alone, which would leave out U's sampling noise), its Welch–Satterthwaite degrees of freedom
    from the sides' (df_E = E units − 1, df_U = U groups − 1) and the half-width of a two-sided interval."""

    se_E: float
    se_U: float
    df_E: float
    df_U: float

    @property
    def se(self) -> float:
        return jackknife.se_total(self.se_E, self.se_U)

    @property
    def df(self) -> float:
        return welch_df([(self.se_E, self.df_E), (self.se_U, self.df_U)])

    def half_width(self, level: float) -> float:
        """t_{df}((1 + level)/2)·SE_total (NaN where either is missing)."""
        return t_quantile(level, self.df) * self.se if math.isfinite(self.se) else NAN


def groups_df(n_groups: int) -> float:
    """Degrees of freedom of a delete-one jackknife variance over `n_groups` groups (NaN below 2)."""
    return float(n_groups - 1) if n_groups >= 2 else NAN


@dataclass(frozen=True)
class EStatistic:
    """What the E side of every direction shares: h_i, T_i, the units, normalize, lr and the sampler weights."""

    seq_entropies: Tensor
    lengths: Tensor
    units: list[int]
    normalize: str
    learning_rate: float
    sampler_weights: Tensor | None = None

    @property
    def df(self) -> float:
        """Degrees of freedom of SE_E: independent E units − 1."""
        return groups_df(len(set(self.units)))

    def se(self, a: Tensor, r: Tensor) -> float:
        """SE_E of the δH₁ whose pieces are (a, r)."""
        return jackknife.se_E(a, r, self.seq_entropies, self.lengths, self.units, normalize=self.normalize,
                              learning_rate=self.learning_rate, sampler_weights=self.sampler_weights)[1]


@dataclass(frozen=True)
class DirectionEstimate(TotalSE):
    """δH₁ = lr·X̂·v of one direction, its pieces (a, r) [N], its K U replicates and its SEs."""

    value: float
    a: Tensor
    r: Tensor
    u_replicates: tuple[float, ...]
    se_E: float
    se_U: float
    df_E: float
    df_U: float


def direction_estimate(value: float, a: Tensor, r: Tensor, u_replicates: list[float],
                       e_stat: EStatistic) -> DirectionEstimate:
    """The estimate of one direction from its δH₁, pieces and U replicates (SE_U NaN for fewer than 2 groups)."""
    reps = tuple(float(x) for x in u_replicates)
    se_u = jackknife.jackknife_se(np.array(reps)) if len(reps) >= 2 else NAN
    return DirectionEstimate(float(value), a, r, reps, e_stat.se(a, r), se_u, e_stat.df, groups_df(len(reps)))


@dataclass(frozen=True)
class PairedDifference(TotalSE):
    """δH₁(variant) − δH₁(baseline) on the same E and U, with its paired SE_E, SE_U and SE_total."""

    value: float
    se_E: float
    se_U: float
    df_E: float
    df_U: float


def paired_difference(variant: DirectionEstimate, baseline: DirectionEstimate, e_stat: EStatistic) -> PairedDifference:
    """The variant's difference from the baseline and its delete-one jackknife SE over E units and U groups."""
    se_e = e_stat.se(variant.a - baseline.a, variant.r - baseline.r)
    se_u = NAN
    if len(variant.u_replicates) >= 2 and len(variant.u_replicates) == len(baseline.u_replicates):
        se_u = jackknife.jackknife_se(np.subtract(variant.u_replicates, baseline.u_replicates))
    return PairedDifference(variant.value - baseline.value, se_e, se_u, e_stat.df, variant.df_U)


def find_root(f: Callable[[float], float], target: float, start: float, step: float, *,
              max_doublings: int = 60, tol: float = 1e-12) -> float | None:
    """A c with f(c) = target: the bracket around `start` widened by doubling `step` until f − target changes sign,
    then bisection to |Δc| ≤ tol·max(1, |c|). None when no sign change is found (f need only be continuous)."""
    lo, f_lo = start, f(start) - target
    if f_lo == 0:
        return start
    hi = None
    for k in range(max_doublings):
        width = step * 2.0 ** k
        for c in (start + width, start - width):
            fc = f(c) - target
            if fc == 0:
                return c
            if math.copysign(1.0, fc) != math.copysign(1.0, f_lo):
                hi = c
                break
        if hi is not None:
            break
    if hi is None:
        return None
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        f_mid = f(mid) - target
        if f_mid == 0 or abs(hi - lo) <= tol * max(1.0, abs(mid)):
            return mid
        if math.copysign(1.0, f_mid) == math.copysign(1.0, f_lo):
            lo, f_lo = mid, f_mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def interpolated(a: dict[str, Tensor], b: dict[str, Tensor], t: float) -> dict[str, Tensor]:
    """a + t·(b − a), name by name: the gradient at coefficient c_a + t·(c_b − c_a) of a loss affine in c."""
    return {n: a[n] + t * (b[n] - a[n]) for n in a}

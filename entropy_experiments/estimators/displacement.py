"""The step the run really took, Δθ = θ_{N'} − θ_N, and what first order explains of it (docs/maths.md §9).

Pure float64 maths on named tensors and per-sequence arrays; no model passes.

At one checkpoint (the `displacement` predictor):

    δH_Δθ = X̂·Δθ            no lr: Δθ is a displacement, not a direction per unit lr
    SE_E  = §6's jackknife of (A − Ĥ·B)/D over the E units, with the pieces a_i, r_i taken along Δθ
    ½·D²_Δθ H               the second-order term, ½·d2 of the SNIS estimate (second_order.py) along Δθ

Across an interval (N → N'; the sweep): both checkpoints' E batches hold the same prompt draws, so a unit
(draw b, `keys`) has sums in both. With D̂ the realised change (estimators/realised_change.py: the importance
estimate that counts the responses that would change, or the paired difference shown as a diagnostic), given
as its value and delete-one replicates over the union of units,

    first-order residual   ρ₁ = D̂ − δH_Δθ
    second-order residual  ρ₂ = ρ₁ − ½·D²_Δθ H

are each ONE jackknife statistic over the units of both batches (docs/maths.md §9): the replicate without unit
u is D̂ without u minus δH_Δθ (and ½·D²_Δθ H) from E_N's sums without u — D̂ and δH_Δθ share E_N, their errors
are correlated, and this measures it. When the realised change is taken over two independent batches (the
sweep's fallback), ρ = Ĥ(E_{N'}) − [Ĥ(E_N) + δH_Δθ], the bracket jackknifed over E_N, Ĥ(E_{N'}) over E_{N'},
their SEs in quadrature (`independent_residuals`).

    U noise   P − δH_Δθ = X̂·(K·lr·v − Δθ) (P = K·δH₁: the probe's own step from a fresh U, over K steps)
              var ≈ K²·SE_U² + K·(n_U / n_trainer)·SE_U² + SE_E(diff)²: the probe's U draw, the trainer's K
              batches (their step noise scaled from the probe's U size n_U to the trainer's n_trainer), and
              the E noise of the difference (jackknife of its pieces). With K = 1 and equal batch sizes
              this is 2·SE_U² + SE_E².
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from ..tensors import NamedTensors
from .jackknife import (
    Estimate,
    as_float64,
    jackknife_estimate,
    jackknife_replicates,
    jackknife_se,
    sampler_weighted,
    se_E,
    sum_by_unit,
)
from .realised_change import UnitReplicates
from .second_order import snis_columns, snis_derivatives
from .update_direction import named_dot, named_norm

__all__ = ["BatchColumns", "DisplacementPieces", "displacement_entry", "independent_residuals", "interval_residuals",
           "step_comparison", "u_noise"]

NAN = float("nan")


# ----------------------------------------------------------------------------- at one checkpoint
def step_comparison(v: NamedTensors, learning_rate: float, delta: NamedTensors) -> dict:
    """cos(lr·v, Δθ) and ‖lr·v‖/‖Δθ‖ (None where Δθ = 0 or v = 0)."""
    norm_v, norm_d = named_norm(v), named_norm(delta)
    if norm_d == 0 or norm_v == 0:
        return {"cos_with_probe_step": None, "probe_step_norm_ratio": None}
    return {"cos_with_probe_step": named_dot(v, delta) / (norm_v * norm_d),
            "probe_step_norm_ratio": abs(learning_rate) * norm_v / norm_d}


def displacement_entry(X: NamedTensors, delta: NamedTensors, pieces: tuple[Tensor, Tensor] | None, scores, *,
                       normalize: str, second: Estimate | None, sampler_weights: Tensor | None = None) -> dict:
    """results.json `predictors.displacement`: δH_Δθ = X̂·Δθ (as `delta_h1`, the predictors' common name), its
    SE_E from the pieces along Δθ (None: NaN; `sampler_weights` s [N]: the sums weighted by the sampler
    correction, docs/maths.md §12), no SE_U (Δθ does not depend on the probe's U), and ½·D²_Δθ H."""
    value = named_dot(X, delta)
    se, from_pieces = NAN, NAN
    if pieces is not None:
        from_pieces, se = se_E(pieces[0], pieces[1], scores.seq_entropies, scores.lengths, scores.unit_of_sequence,
                               normalize=normalize, learning_rate=1.0, sampler_weights=sampler_weights)
    norm = named_norm(delta)
    half = None if second is None else {"value": 0.5 * second.value, "se": 0.5 * second.se}
    return {"delta_h1": value, "se": se, "se_E": se, "se_U": NAN, "from_pieces": from_pieces,
            "second_order": half, "delta_theta_norm": norm, "zero_displacement": norm == 0.0}


# ----------------------------------------------------------------------------- across an interval
@dataclass
class BatchColumns:
    """One checkpoint's E: per sequence h_i (nats), d_i (T_i per_token, 1 per_sequence) and its unit key, and
    the sampler correction's s_i when E was drawn by another sampler (None: by its policy; docs/maths.md §12):
    every sum over the batch is then Σ s_i (·)."""

    h: np.ndarray
    d: np.ndarray
    keys: list[str]
    s: np.ndarray | None = None


@dataclass
class DisplacementPieces:
    """Per E_N sequence: the pieces a, r along Δθ, the second-order sums along Δθ (s, s2, dh, d2h; None: not
    measured), and the pieces a_v, r_v along the probe's v per unit lr (None: not saved)."""

    a: np.ndarray
    r: np.ndarray
    second: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    a_v: np.ndarray | None = None
    r_v: np.ndarray | None = None


def _difference_slope(sums: np.ndarray) -> float:
    # sums = (A, B, Σh, Σd, …): δH along the pieces, (A − Ĥ·B)/D with Ĥ = Σh/D from the same sums
    a, r, h, d = sums[:4]
    return float((a - (h / d) * r) / d)


def _with_second_order(sums: np.ndarray) -> float:
    return _difference_slope(sums) + 0.5 * snis_derivatives(sums[4:10])[1]


def _entropy_and_slope(sums: np.ndarray) -> float:
    return float(sums[2] / sums[3]) + _difference_slope(sums)


def _entropy_and_second_order(sums: np.ndarray) -> float:
    return float(sums[2] / sums[3]) + _with_second_order(sums)


def _entropy(sums: np.ndarray) -> float:
    return float(sums[0] / sums[1])


def _from_columns(frm: BatchColumns, pieces: DisplacementPieces, normalize: str, second: bool) -> list[np.ndarray]:
    """[a, r, h, d] of E_N, and the six SNIS columns of ½·D²_Δθ H (second_order.snis_columns) when `second`."""
    columns = [as_float64(pieces.a), as_float64(pieces.r), as_float64(frm.h), as_float64(frm.d)]
    if second:
        columns += snis_columns(*pieces.second, frm.h, frm.d, normalize)
    return sampler_weighted(columns, frm.s)


def _joint_residual(realised: UnitReplicates, frm: BatchColumns, columns: list[np.ndarray], statistic) -> Estimate:
    """realised − statistic(E_N's sums), with D̂'s replicates minus the statistic's without the same unit (a
    unit absent from E_N leaves the statistic whole)."""
    index = {u: i for i, u in enumerate(realised.units)}
    missing = sorted(set(frm.keys) - index.keys())
    if missing:
        raise ValueError(f"E_N unit {missing[0]!r} is not among the realised change's units")
    stats = np.zeros((len(realised.units), len(columns)))
    rows = [index[k] for k in frm.keys]
    for j, column in enumerate(columns):
        np.add.at(stats, (rows, j), column)
    with np.errstate(divide="ignore", invalid="ignore"):
        value = statistic(stats.sum(axis=0))
    return Estimate(realised.value - float(value),
                    jackknife_se(realised.replicates - jackknife_replicates(stats, statistic)))


def interval_residuals(frm: BatchColumns, pieces: DisplacementPieces, realised: UnitReplicates,
                       normalize: str) -> dict[str, Estimate | None]:
    """{"first_order": ρ₁ = D̂ − δH_Δθ, "second_order": ρ₂ = ρ₁ − ½·D²_Δθ H (None without the second-order sums)},
    each with ONE delete-one jackknife SE over `realised.units` (module docstring)."""
    out: dict[str, Estimate | None] = {
        "first_order": _joint_residual(realised, frm, _from_columns(frm, pieces, normalize, False),
                                       _difference_slope),
        "second_order": None}
    if pieces.second is not None:
        out["second_order"] = _joint_residual(realised, frm, _from_columns(frm, pieces, normalize, True),
                                              _with_second_order)
    return out


def independent_residuals(frm: BatchColumns, pieces: DisplacementPieces, to: BatchColumns,
                          normalize: str) -> dict[str, Estimate | None]:
    """The residuals of `interval_residuals` when the realised change is Ĥ(E_{N'}) − Ĥ(E_N) over two batches
    taken as independent: Ĥ(E_{N'}) − [Ĥ(E_N) + δH_Δθ (+ ½·D²_Δθ H)], the bracket jackknifed over E_N's units,
    Ĥ(E_{N'}) over E_{N'}'s, the two SEs in quadrature."""
    h_to = jackknife_estimate(sum_by_unit(sampler_weighted([as_float64(to.h), as_float64(to.d)], to.s), to.keys),
                              _entropy)

    def residual(second: bool, statistic) -> Estimate:
        bracket = jackknife_estimate(sum_by_unit(_from_columns(frm, pieces, normalize, second), frm.keys),
                                     statistic)
        return Estimate(h_to.value - bracket.value, math.hypot(h_to.se, bracket.se))

    return {"first_order": residual(False, _entropy_and_slope),
            "second_order": None if pieces.second is None else residual(True, _entropy_and_second_order)}


def u_noise(frm: BatchColumns, pieces: DisplacementPieces, *, step_lr: float, steps: int, se_U: float | None,
            u_batch_ratio: float) -> dict | None:
    """P − δH_Δθ with P = steps·lr·X̂·v, from the pieces on E_N: {value, se_E, se, z, variance} (None without
    the pieces along v). `u_batch_ratio` = the probe's U size / the trainer's batch size (module docstring)."""
    if pieces.a_v is None or pieces.r_v is None:
        return None
    scale = steps * step_lr
    a = scale * as_float64(pieces.a_v) - as_float64(pieces.a)
    r = scale * as_float64(pieces.r_v) - as_float64(pieces.r)
    diff = jackknife_estimate(sum_by_unit(sampler_weighted([a, r, as_float64(frm.h), as_float64(frm.d)], frm.s),
                                          frm.keys), _difference_slope)
    se = None
    if se_U is not None and math.isfinite(se_U) and math.isfinite(diff.se):
        se = math.sqrt((steps ** 2 + steps * u_batch_ratio) * se_U ** 2 + diff.se ** 2)
    return {"value": diff.value, "se_E": diff.se, "se": se,
            "z": diff.value / se if se else None,
            "variance": f"SE_U²·(K² + K·{u_batch_ratio:.3g}) + SE_E(diff)², K = {steps}"}

"""The step the run really took, Δθ = θ_{N'} − θ_N, and what first order explains of it (MATH.md §9).

Pure float64 maths on named tensors and per-sequence arrays; no model passes.

At one checkpoint (the `displacement` predictor):

    δH_Δθ = X̂·Δθ            no lr: Δθ is a displacement, not a direction per unit lr
    SE_E  = §6's jackknife of (A − Ĥ·B)/D over the E units, with the pieces a_i, r_i taken along Δθ
    ½·D²_Δθ H               the second-order term, ½·d2 of the SNIS estimate (second_order.py) along Δθ

Across an interval (N → N'; the sweep): both checkpoints' E batches hold the same prompt draws, so a unit
(draw b, `keys`) has sums in both. With per-unit columns side by side (zeros where a unit is absent),

    first-order residual   ρ₁ = [Ĥ(E_{N'}) − Ĥ(E_N)] − δH_Δθ
    second-order residual  ρ₂ = ρ₁ − ½·D²_Δθ H

are each ONE statistic of the column sums, and the delete-one jackknife over the units removes a unit from
both batches and from δH_Δθ at once (they share E_N: their errors are correlated, and this measures it).

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

from .jackknife import Estimate, as_float64, jackknife_estimate, se_E, sum_by_unit
from .second_order import snis_columns, snis_derivatives
from .update_direction import named_dot, named_norm

__all__ = ["BatchColumns", "DisplacementPieces", "displacement_entry", "interval_residuals", "step_comparison",
           "u_noise"]

NamedTensors = dict[str, Tensor]
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
                       normalize: str, second: Estimate | None) -> dict:
    """results.json `predictors.displacement`: δH_Δθ = X̂·Δθ (as `delta_h1`, the predictors' common name), its
    SE_E from the pieces along Δθ (None: NaN), no SE_U (Δθ does not depend on the probe's U), and ½·D²_Δθ H."""
    value = named_dot(X, delta)
    se, from_pieces = NAN, NAN
    if pieces is not None:
        from_pieces, se = se_E(pieces[0], pieces[1], scores.seq_entropies, scores.lengths, scores.unit_of_sequence,
                               normalize=normalize, learning_rate=1.0)
    norm = named_norm(delta)
    half = None if second is None else {"value": 0.5 * second.value, "se": 0.5 * second.se}
    return {"delta_h1": value, "se": se, "se_E": se, "se_U": NAN, "from_pieces": from_pieces,
            "second_order": half, "delta_theta_norm": norm, "zero_displacement": norm == 0.0}


# ----------------------------------------------------------------------------- across an interval
@dataclass
class BatchColumns:
    """One checkpoint's E: per sequence h_i (nats), d_i (T_i per_token, 1 per_sequence) and its unit key."""

    h: np.ndarray
    d: np.ndarray
    keys: list[str]


@dataclass
class DisplacementPieces:
    """Per E_N sequence: the pieces a, r along Δθ, the second-order sums along Δθ (s, s2, dh, d2h; None: not
    measured), and the pieces a_v, r_v along the probe's v per unit lr (None: not saved)."""

    a: np.ndarray
    r: np.ndarray
    second: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None
    a_v: np.ndarray | None = None
    r_v: np.ndarray | None = None


def _joint_stats(frm: BatchColumns, extra: list[np.ndarray], to: BatchColumns) -> np.ndarray:
    """[units, m]: (h, d, *extra) of E_N and (h, d) of E_{N'} per unit of the union of keys (zeros: absent)."""
    universe = sorted(set(frm.keys) | set(to.keys))
    index = {u: i for i, u in enumerate(universe)}
    cols_from = [frm.h, frm.d, *extra]
    stats = np.zeros((len(universe), len(cols_from) + 2))
    rows_from, rows_to = [index[u] for u in frm.keys], [index[u] for u in to.keys]
    for j, col in enumerate(cols_from):
        np.add.at(stats, (rows_from, j), as_float64(col))
    np.add.at(stats, (rows_to, len(cols_from)), as_float64(to.h))
    np.add.at(stats, (rows_to, len(cols_from) + 1), as_float64(to.d))
    return stats


def _first_order_residual(sums: np.ndarray) -> float:
    h, d, a, r = sums[:4]
    h_to, d_to = sums[-2:]
    return float(h_to / d_to - h / d - (a - (h / d) * r) / d)


def _second_order_residual(sums: np.ndarray) -> float:
    return _first_order_residual(sums) - 0.5 * snis_derivatives(sums[4:10])[1]


def interval_residuals(frm: BatchColumns, pieces: DisplacementPieces, to: BatchColumns,
                       normalize: str) -> dict[str, Estimate | None]:
    """{"first_order": ρ₁, "second_order": ρ₂ (None without the second-order sums)}, each with its joint
    delete-one jackknife SE over the units of both batches (module docstring)."""
    out: dict[str, Estimate | None] = {
        "first_order": jackknife_estimate(_joint_stats(frm, [pieces.a, pieces.r], to), _first_order_residual),
        "second_order": None}
    if pieces.second is not None:
        s, s2, dh, d2h = pieces.second
        extra = [pieces.a, pieces.r, *snis_columns(s, s2, dh, d2h, frm.h, frm.d, normalize)]
        out["second_order"] = jackknife_estimate(_joint_stats(frm, extra, to), _second_order_residual)
    return out


def _difference_slope(sums: np.ndarray) -> float:
    a, r, h, d = sums
    return float((a - (h / d) * r) / d)


def u_noise(frm: BatchColumns, pieces: DisplacementPieces, *, step_lr: float, steps: int, se_U: float | None,
            u_batch_ratio: float) -> dict | None:
    """P − δH_Δθ with P = steps·lr·X̂·v, from the pieces on E_N: {value, se_E, se, z, variance} (None without
    the pieces along v). `u_batch_ratio` = the probe's U size / the trainer's batch size (module docstring)."""
    if pieces.a_v is None or pieces.r_v is None:
        return None
    scale = steps * step_lr
    a = scale * as_float64(pieces.a_v) - as_float64(pieces.a)
    r = scale * as_float64(pieces.r_v) - as_float64(pieces.r)
    diff = jackknife_estimate(sum_by_unit([a, r, frm.h, frm.d], frm.keys), _difference_slope)
    se = None
    if se_U is not None and math.isfinite(se_U) and math.isfinite(diff.se):
        se = math.sqrt((steps ** 2 + steps * u_batch_ratio) * se_U ** 2 + diff.se ** 2)
    return {"value": diff.value, "se_E": diff.se, "se": se,
            "z": diff.value / se if se else None,
            "variance": f"SE_U²·(K² + K·{u_batch_ratio:.3g}) + SE_E(diff)², K = {steps}"}

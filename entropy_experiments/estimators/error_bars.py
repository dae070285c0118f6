"""The error bars of one probe run (docs/maths.md §6) from the typed results of its phases.

- `error_bars`: SE_E (delete-one jackknife over E units of the per-sequence pieces a, r), SE_U
  (jackknife over U groups of lr·X̂·v₍₋k₎, v rebuilt without group k, with its K − 1 degrees of freedom) and
  SE_total = √(SE_E² + SE_U²), missing (NaN) with SE_U; a warning below FEW_U_GROUPS groups;
- `paired_residuals`: per η, ρ(η) = ΔH(η) − η·D_v H with its paired SE and z (paired.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from . import jackknife
from .delta_h import DeltaH
from .jackknife import Estimate
from .paired import paired_residual, residual_entry, symmetric_slope_residual
from .student_t import t_quantile

NAN = float("nan")
FEW_U_GROUPS = 5  # below this many U groups SE_U is itself uncertain by more than ±35 % (1/√(2(K − 1)))


def few_groups_warning(n_groups: int) -> str:
    """What an SE_U from 2 ≤ K < FEW_U_GROUPS groups means for the numbers built on it."""
    df = n_groups - 1
    return (f"SE_U rests on {n_groups} U groups ({df} degrees of freedom, fewer than {FEW_U_GROUPS} groups): it is "
            f"itself uncertain by about ±{100 / math.sqrt(2 * df):.0f} %, and a z on it is a t with {df} df (95 % "
            f"at |t| ≤ {t_quantile(0.95, df):.3g}, not 1.96); raise batch_config.B_U and variance.u_groups to "
            f"≥ {FEW_U_GROUPS}")


@dataclass
class ErrorBars:
    """SE_E, SE_U, SE_total (NaN where unavailable) and U_df (SE_U's degrees of freedom, K − 1), the pieces check,
    the pieces a, r [N] (or None) and the leave-one-group-out directions v₍₋k₎ of SE_U (empty when
    unavailable)."""

    se: dict[str, float]
    consistency: dict
    a: Tensor | None = None
    r: Tensor | None = None
    loo_directions: list[dict[str, Tensor]] = field(default_factory=list)

    @classmethod
    def unavailable(cls) -> ErrorBars:
        return cls({"E": NAN, "U": NAN, "total": NAN, "U_df": NAN}, {})


def error_bars(res, u_groups: list[list[int]], *, normalize: str, direction_of: Callable[[dict], dict],
               warn: Callable[[str], None]) -> ErrorBars:
    """From `res` (probe.results.DeltaH1Result with pieces): SE_E, SE_U over `u_groups`, SE_total; `direction_of`
    maps a U gradient to its AdamW direction; `warn` records what makes the bars unreliable or missing."""
    a, r = res.pieces
    s = res.scores
    from_pieces, se_E = jackknife.se_E(a, r, s.seq_entropies, s.lengths, s.unit_of_sequence,
                                       normalize=normalize, learning_rate=res.learning_rate,
                                       sampler_weights=res.sampler_weights)
    rel = abs(from_pieces - res.delta_h1) / max(abs(res.delta_h1), 1e-300)
    if rel > 1e-3:
        warn(f"per-sequence pieces disagree with the backward X̂·v by {rel:.2e} "
             "relative; error bars may be unreliable")
    se_U, loo = NAN, []
    if len(u_groups) >= 2:
        loo = jackknife.leave_one_group_out_directions(direction_of, res.u_gradients)
        se_U, _ = jackknife.se_U(res.X_hat, loo, learning_rate=res.learning_rate)
        if len(u_groups) < FEW_U_GROUPS:
            warn(few_groups_warning(len(u_groups)))
    else:
        warn("SE_U unavailable: U has a single prompt (need ≥ 2 groups), so SE_total is n/a (null): SE_E alone "
             "would leave out U's sampling noise, usually the larger side")
    consistency = {"deltaH1_from_pieces": from_pieces, "relative_difference": rel, "r_method": res.r_method,
                   "r_eta": res.r_eta}
    U_df = float(len(u_groups) - 1) if len(u_groups) >= 2 else NAN
    return ErrorBars({"E": se_E, "U": se_U, "total": jackknife.se_total(se_E, se_U), "U_df": U_df}, consistency,
                     a, r, loo)


def paired_residuals(truth: DeltaH, res, bars: ErrorBars, *, normalize: str) -> list[dict]:
    """Per η of `truth` (delta_h.measure_delta_h): {value, se, z} of ρ(η) = ΔH(η) − η·D_v H over the same E
    units. D_v H comes from the pieces a, r; without them (variance off) from X̂·v, with SE NaN. With the
    sampler correction (`res.sampler_weights`, docs/maths.md §12) every sum carries s."""
    out = []
    for row in truth.rows:
        eta = row["eta"]
        if bars.a is None:
            out.append(residual_entry(Estimate(row["deltaH_true"] - eta * res.x_hat_dot_v, NAN)))
            continue
        per = truth.per_sequence[eta]
        out.append(residual_entry(paired_residual(
            per["logw"], per["h_new"], truth.h, truth.T, bars.a.numpy(), bars.r.numpy(), eta,
            normalize=normalize, units=res.scores.unit_of_sequence, sampler_weights=res.sampler_weights)))
    return out


def with_slope_residuals(linearity: dict, truth: DeltaH, res, bars: ErrorBars, *, normalize: str) -> dict:
    """`linearity` whose symmetric_slopes each carry `residual` {value, se, z} of σ(η) = slope − D_v H on the same
    E units (paired.symmetric_slope_residual); without the pieces (variance off) slope − X̂·v with SE NaN."""
    out = []
    for item in linearity.get("symmetric_slopes") or []:
        eta = item["eta"]
        if bars.a is None:
            out.append({**item, "residual": residual_entry(Estimate(item["slope"] - res.x_hat_dot_v, NAN))})
            continue
        plus, minus = ((truth.per_sequence[e]["logw"], truth.per_sequence[e]["h_new"]) for e in (eta, -eta))
        out.append({**item, "residual": residual_entry(symmetric_slope_residual(
            plus, minus, truth.h, truth.T, bars.a.numpy(), bars.r.numpy(), eta, normalize=normalize,
            units=res.scores.unit_of_sequence, sampler_weights=res.sampler_weights))})
    return {**linearity, "symmetric_slopes": out}

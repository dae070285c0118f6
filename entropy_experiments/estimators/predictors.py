"""Competing predictors of the same step (README "Competing predictors"): what simpler analyses predict.

Each predicts the entropy change of one step of the run's lr, from the X̂ and U gradient g the probe has:

    adamw_step     lr·X̂·v     v = the trainer's exact AdamW step per unit lr (the probe's δH₁)
    no_momentum    lr·X̂·v_P   v_P = −g / (√(s/(1−β₂ᵗ)) + ε): this U's gradient alone through the SAVED second
                              moments s at the saved step t — no momentum, no weight decay, no clipping (the
                              seeds' historical Ȳ): `no_momentum_direction` below
    sgd_same_norm  lr·X̂·v_S   v_S = −g·‖v‖/‖g‖: the SGD direction scaled to the AdamW step's length
    direct_only    lr·X_H·v   X_H = ∇_θ(Σ_ik H_ik)/D: only the explicit dependence of the per-token entropies
                              on θ along the real step — no score-function term (the α·ℓ part of L_X: the
                              change of WHICH sequences are sampled) and no −Ĥ·R term (what per-token closed
                              forms such as token-covariance scores capture)

Units: nats per token (per_token) or per sequence (per_sequence), for a step of lr. Error bars as δH₁'s
(docs/maths.md §6): SE_E = delete-one jackknife over E units of the pieces along the predictor's own direction
(direct_only: d_i = D_v h_i), SE_U = jackknife over U groups with the direction rebuilt without each group
(direct_only: X_H·v₍₋k₎), SE = √(SE_E² + SE_U²). `residual` {value, se, z, eta} = ΔH(η₊)·lr/η₊ − the prediction
with ONE delete-one jackknife over the E units (estimators/paired.py, as the probe's own residual along v): both
come from the same E, so their E errors are correlated and adding SE_E² and SE(ΔH)² would miss it; the U error
is left out (the ΔH along v shares it only in part). `measured_over_predicted` = (ΔH(η₊)·lr/η₊) / prediction, η₊ the
smallest positive η of the ΔH measurement (the most linear one) — the measured change along v scaled to lr.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..registry import registrar
from ..tensors import NamedTensors
from . import jackknife
from .adam_state import adam_state_by_name, hyper_by_name
from .paired import paired_residual, residual_entry
from .update_direction import named_dot, named_norm, preconditioned_gradient_direction

NAN = float("nan")


@dataclass(frozen=True)
class StepContext:
    """What a direction predictor may use besides g: the loaded AdamW (its saved state and param groups), the
    trainable parameter names in optimizer order, and g ↦ the probe's own v (step_directions.probe_step)."""

    optimizer: Any
    names: list[str]
    probe_direction: Callable[[NamedTensors], NamedTensors]


# Predictors that are a direction v' in parameter space (the prediction is lr·X̂·v'): (g, context) ↦ v'.
DirectionFn = Callable[[NamedTensors, StepContext], NamedTensors]
DIRECTION_PREDICTORS: dict[str, DirectionFn] = {}
# Decorator: `@register_direction_predictor("name")` where the direction is defined (registry.py's style).
register_direction_predictor: Callable[[str], Callable[[DirectionFn], DirectionFn]] = registrar(
    DIRECTION_PREDICTORS, "predictor")


# ----------------------------------------------------------------------------- the directions
@register_direction_predictor("no_momentum")
def no_momentum_direction(grads: NamedTensors, ctx: StepContext) -> NamedTensors:
    """v_P = −g/(√(s/(1−β₂ᵗ)) + ε) with the SAVED second moments s and step t of the loaded AdamW
    (no momentum, decay or clipping; AdamStateError on a fresh state, step 0)."""
    return preconditioned_gradient_direction(grads, adam_state_by_name(ctx.optimizer, ctx.names),
                                             hyper_by_name(ctx.optimizer, ctx.names))


@register_direction_predictor("sgd_same_norm")
def sgd_same_norm_direction(grads: NamedTensors, ctx: StepContext) -> NamedTensors:
    """v_S = −g·‖v‖/‖g‖, v = the probe's own step from the same g (zero when g = 0)."""
    g_norm = named_norm(grads)
    scale = named_norm(ctx.probe_direction(grads)) / g_norm if g_norm > 0 else 0.0
    return {n: -g.detach().float() * scale for n, g in grads.items()}


def zero_second_moment_caveat(grads: NamedTensors, exp_avg_sq: NamedTensors) -> str | None:
    """Why no_momentum's number cannot be trusted on this state, or None: where the saved second moment s is
    exactly 0 but g is not (LoRA's zero-initialised B after the first step, whose gradient there was 0),
    v_P = −g/ε — entries 1/ε ≈ 1e8 times larger than Adam would ever take."""
    zero = total = 0
    for name, g in grads.items():
        hit = (exp_avg_sq[name] == 0) & (g != 0)
        zero, total = zero + int(hit.sum()), total + g.numel()
    if not zero:
        return None
    return (f"{zero} of {total} trainable entries have a saved second moment of exactly 0 and a nonzero "
            "gradient; there v_P = −g/ε, so this predictor is dominated by them")


# ----------------------------------------------------------------------------- the estimates
@dataclass(frozen=True)
class PairedTruth:
    """ΔH at the smallest positive η₊ per E sequence, for the predictors' paired residuals: log-weights and
    entropies at θ + η₊·v, entropies and lengths at θ, the E units, the sampler weights (None: none)."""

    eta: float
    logw: Any
    h_new: Any
    h: Any
    T: Any
    units: Any
    sampler_weights: Any
    normalize: str

    @classmethod
    def of(cls, truth, scores, sampler_weights, normalize: str) -> PairedTruth | None:
        """From the probe's ΔH measurement (delta_h.DeltaH); None without a positive η measured per sequence."""
        etas = [row["eta"] for row in truth.rows if row["eta"] > 0 and row["eta"] in truth.per_sequence]
        if not etas or truth.h is None:
            return None
        per = truth.per_sequence[min(etas)]
        return cls(min(etas), per["logw"], per["h_new"], truth.h, truth.T, scores.unit_of_sequence,
                   sampler_weights, normalize)

    def residual(self, pieces: tuple[Tensor, Tensor], learning_rate: float) -> dict:
        """{value, se, z, eta}: ΔH(η₊)·lr/η₊ − lr·D_v'H from the pieces along v', one jackknife over E units."""
        est = paired_residual(self.logw, self.h_new, self.h, self.T, pieces[0], pieces[1], self.eta,
                              normalize=self.normalize, units=self.units, sampler_weights=self.sampler_weights)
        entry, scale = residual_entry(est), learning_rate / self.eta
        return {"value": entry["value"] * scale, "se": entry["se"] * scale, "z": entry["z"], "eta": self.eta}


def estimate_entry(value: float, se_E: float, se_U: float, from_pieces: float | None = None) -> dict:
    """{delta_h1, se, se_E, se_U, from_pieces} of one predictor; se combines the available sides (NaN if none)."""
    sides = [s for s in (se_E, se_U) if math.isfinite(s)]
    se = math.sqrt(sum(s * s for s in sides)) if sides else NAN
    return {"delta_h1": value, "se": se, "se_E": se_E, "se_U": se_U, "from_pieces": from_pieces}


def unavailable_entry(reason: str) -> dict:
    """The entry of a predictor that cannot be formed on this checkpoint: every number None, and why."""
    return {"delta_h1": None, "se": None, "se_E": None, "se_U": None, "from_pieces": None,
            "measured_over_predicted": None, "unavailable": reason}


def direction_estimate(X: NamedTensors, direction: NamedTensors, pieces: tuple[Tensor, Tensor] | None, scores,
                       learning_rate: float, loo_directions: list[NamedTensors], *, normalize: str,
                       sampler_weights: Tensor | None = None, paired: PairedTruth | None = None) -> dict:
    """lr·X̂·v' with SE_E from the pieces (a', r') along v' (None: NaN) and SE_U over the rebuilt v'₍₋k₎;
    `sampler_weights` s [N]: the sampler correction's weights of the E sums (docs/maths.md §12; None: none);
    with `paired` and the pieces, also its paired `residual` against ΔH(η₊)·lr/η₊."""
    value = learning_rate * named_dot(X, direction)
    se_E = from_pieces = NAN
    if pieces is not None:
        from_pieces, se_E = jackknife.se_E(pieces[0], pieces[1], scores.seq_entropies, scores.lengths,
                                           scores.unit_of_sequence, normalize=normalize, learning_rate=learning_rate,
                                           sampler_weights=sampler_weights)
    se_U = jackknife.se_U(X, loo_directions, learning_rate=learning_rate)[0] if len(loo_directions) >= 2 else NAN
    entry = estimate_entry(value, se_E, se_U, from_pieces)
    if paired is not None and pieces is not None:
        entry["residual"] = paired.residual(pieces, learning_rate)
    return entry


def direct_only_estimate(X_H: NamedTensors, d: Tensor | None, scores, learning_rate: float, v: NamedTensors,
                         loo_directions: list[NamedTensors], *, normalize: str,
                         sampler_weights: Tensor | None = None, paired: PairedTruth | None = None) -> dict:
    """lr·X_H·v (X_H = ∇Σ H / D, with the sampler weights: ∇Σ s H / Σ s d) with SE_E from d_i = D_v h_i
    (None: NaN) and SE_U over X_H·v₍₋k₎."""
    pieces = None if d is None else (d, torch.zeros_like(d))   # r ≡ 0: the −Ĥ·R term is left out
    return direction_estimate(X_H, v, pieces, scores, learning_rate, loo_directions, normalize=normalize,
                              sampler_weights=sampler_weights, paired=paired)


def measured_reference(true_rows: list[dict], learning_rate: float) -> dict | None:
    """The measured change the predictors are compared with: ΔH(η₊)·lr/η₊ and its SE at the smallest
    positive η of `true_rows` (results.json `true`); None when ΔH was not measured at a positive η."""
    positive = [row for row in true_rows if row["eta"] > 0]
    if not positive:
        return None
    row = min(positive, key=lambda r: r["eta"])
    scale = learning_rate / row["eta"]
    return {"eta": row["eta"], "deltaH_scaled": row["deltaH_true"] * scale, "se": row["se"] * scale}


def with_ratios(predictors: dict[str, dict], measured: dict | None) -> dict[str, dict]:
    """Each predictor's entry with measured_over_predicted = measured / delta_h1 (the convention of every ratio the
    probe prints; None without a measurement, or where delta_h1 is 0)."""
    out = {}
    for name, entry in predictors.items():
        ratio = None
        if measured is not None and entry["delta_h1"] not in (0, None):
            ratio = measured["deltaH_scaled"] / entry["delta_h1"]
        out[name] = {**entry, "measured_over_predicted": ratio}
    return out

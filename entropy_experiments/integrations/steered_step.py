"""The autopilot's prediction: the trainer's next step and the entropy term, both on one fresh E in one pass.

The autopilot steers with two levers (autopilot_rule.py): the lr multiplier m and an entropy term added to the
parameters right after `optimizer.step()`, outside AdamW's moments:

    Δθ(m, κ) = m·(Δθ_next + κ·‖Δθ_next‖·u)      u = X̂_prev less its components along g and AdamW's m, unit norm

X̂_prev is a moving average of the unit entropy gradients ∇Ĥ on the PREVIOUS probed steps' evaluation batches
(`remembered`), made orthogonal to the directions the trainer is learning along: its gradient g now in
`.grad` and AdamW's first moment (the average of its past gradients). The term then does not change the
trainer's loss to first order, on this batch or on the recent ones: it moves the entropy without trading away
the objective the trainer is climbing. Both
are independent of this step's batch E, so X̂_E·u is an unbiased estimate of the term's effect (on its own
batch, X̂·X̂ would be biased upward by X̂'s noise and the controller would steer on that noise). No second
batch is drawn.

One forward and backward pass over E (`one_pass_phase`) gives the per-sequence pieces along Δθ_next and along u
— so δ ± s and e ± s_e share E's jackknife, and any (m, κ) has a paired SE — and X̂_E, the next step's u.
The step is exactly linear in (m, κ): m scales every group's lr (AdamW's step is linear in it) and the term is
added after the moments, so the prediction of the step really taken needs no second pass.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from entropy_experiments.config import ProbeConfig
from entropy_experiments.data.batch import Batch
from entropy_experiments.estimators.delta_h import DeltaH
from entropy_experiments.estimators.entropy_gradient import sampler_weights
from entropy_experiments.estimators.jackknife import entropy_with_se, se_E
from entropy_experiments.estimators.update_direction import named_norm
from entropy_experiments.integrations import ranks
from entropy_experiments.integrations.autopilot_rule import Estimate
from entropy_experiments.integrations.live_state import copy_of
from entropy_experiments.integrations.next_step import NextStep, next_adamw_step
from entropy_experiments.integrations.trainer_step import PendingTrainerStep
from entropy_experiments.integrations.trl_step_probe import named_params
from entropy_experiments.probe.e_pass import one_pass_phase
from entropy_experiments.probe.parallel import SINGLE, DistContext
from entropy_experiments.probe.results import Policy

STEP, TERM = "step", "term"


@dataclass(frozen=True)
class SteerablePass:
    """The trainer's step predicted on E, the term's effect per unit κ (None: no direction yet), and X̂ on E."""

    pending: PendingTrainerStep
    term_pieces: tuple[Tensor, Tensor] | None   # pieces along ‖Δθ_next‖·u: the effect of κ = 1 at m = 1
    direction: dict[str, Tensor] | None         # u (unit norm)
    X_hat: dict[str, Tensor]

    def term_effect(self, config: ProbeConfig) -> Estimate | None:
        """e ± s_e: the predicted entropy change of κ = 1 at m = 1."""
        if self.term_pieces is None:
            return None
        return Estimate(*pieces_estimate(config, self.pending, self.term_pieces))


def pieces_estimate(config: ProbeConfig, pending: PendingTrainerStep, pieces: tuple[Tensor, Tensor]) -> tuple:
    """(value, SE_E) of the first-order change along the direction whose pieces are given, on pending's E."""
    scores = pending.scores
    return se_E(pieces[0], pieces[1], scores.seq_entropies, scores.lengths, scores.unit_of_sequence,
                normalize=config.estimator.normalize, learning_rate=1.0, sampler_weights=pending.weights)


def unit(direction: dict[str, Tensor]) -> dict[str, Tensor] | None:
    """direction / ‖direction‖ (None where it is 0)."""
    norm = named_norm(direction)
    return {n: t / norm for n, t in direction.items()} if norm > 0 else None


def remembered(previous: dict[str, Tensor] | None, X_hat: dict[str, Tensor], memory: float) -> dict[str, Tensor]:
    """The next term direction: memory·previous + (1 − memory)·X̂/‖X̂‖, a moving average of the unit entropy
    gradients of the probed steps so far. One batch's X̂ is mostly noise at a few sequences; the entropy
    gradient's direction changes slowly, so earlier batches sharpen it (all of them independent of the next E)."""
    current = unit(X_hat)
    if previous is None or current is None:
        return current if current is not None else previous
    return {n: memory * previous[n] + (1 - memory) * current[n] for n in current}


def learning_directions(optimizer: torch.optim.Optimizer, named: dict) -> list[dict[str, Tensor]]:
    """The directions the trainer is learning along: its gradients in `.grad`, and AdamW's first moment
    (the moving average of past gradients) where the optimizer has one."""
    grads = {n: p.grad.detach() for n, p in named.items() if p.grad is not None}
    moments = {n: optimizer.state[p]["exp_avg"] for n, p in named.items()
               if "exp_avg" in optimizer.state.get(p, {})}
    return [d for d in (grads, moments) if d]


@torch.no_grad()
def preconditioned(direction: dict[str, Tensor], optimizer: torch.optim.Optimizer, named: dict) -> dict[str, Tensor]:
    """direction / (√v̂ + ε) with the second moment v̂ this step's AdamW update will divide by (its state and the
    gradient in `.grad`, bias-corrected; read, never written): the term then spreads over the coordinates as
    the trainer's steps do, instead of piling onto the few where X̂ is largest."""
    out, name_of = {}, {id(q): n for n, q in named.items()}
    for group in optimizer.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        for p in group["params"]:
            name = name_of.get(id(p))
            if name is None or name not in direction:
                continue
            state = optimizer.state.get(p, {})
            v = state["exp_avg_sq"].double() if "exp_avg_sq" in state else torch.zeros_like(p, dtype=torch.float64)
            t = int(state["step"]) + 1 if "step" in state else 1
            g = p.grad.double() if p.grad is not None else torch.zeros_like(v)
            v_hat = (beta2 * v + (1 - beta2) * g * g) / (1 - beta2 ** t)
            out[name] = (direction[name].double() / (v_hat.sqrt() + eps)).to(direction[name].dtype)
    return {n: out.get(n, d) for n, d in direction.items()}


def orthogonal_to(direction: dict[str, Tensor], others: list[dict[str, Tensor]]) -> dict[str, Tensor] | None:
    """The unit vector along `direction` less its components in the span of `others` (Gram–Schmidt, float64;
    a parameter missing from one of them has no component along it)."""
    d = {n: t.double() for n, t in direction.items()}
    basis: list[dict[str, Tensor]] = []
    for other in others:
        b = {n: other[n].double().to(d[n].device) for n in d if n in other}
        for q in basis:
            share = _dot(b, q)
            b = {n: t - share * q[n] if n in q else t for n, t in b.items()}
        norm = _dot(b, b) ** 0.5
        if norm > 0:
            basis.append({n: t / norm for n, t in b.items()})
    for q in basis:
        share = _dot(d, q)
        d = {n: t - share * q[n] if n in q else t for n, t in d.items()}
    out = unit(d)
    return None if out is None else {n: t.to(direction[n].dtype) for n, t in out.items()}


def _dot(x: dict[str, Tensor], y: dict[str, Tensor]) -> float:
    return sum(float((x[n] * y[n]).sum()) for n in x if n in y)


def steerable_prediction(config: ProbeConfig, policy: Policy, E: Batch, step: int, t0: float,
                         direction: dict[str, Tensor] | None, dist: DistContext = SINGLE) -> SteerablePass:
    """δ ± s of the trainer's next step (gradients now in `.grad`), the pieces along ‖Δθ_next‖·u (u: `direction`,
    the earlier steps' X̂, made orthogonal to the learning directions), and X̂ on E."""
    named = named_params(policy)
    upcoming = next_adamw_step(policy.optimizer, named)
    if direction is not None:
        direction = orthogonal_to(preconditioned(direction, policy.optimizer, named),
                                  learning_directions(policy.optimizer, named))
    directions = {STEP: upcoming.step, **({TERM: direction} if direction is not None else {})}
    surrogate = one_pass_phase(config, policy, E, directions, dist)  # each rank its share; pieces and X̂ reduced
    scores = surrogate.scores
    weights = sampler_weights(scores, E.sampler_response_logqs())
    d = scores.lengths if config.estimator.normalize == "per_token" else torch.ones_like(scores.lengths)
    H = entropy_with_se(scores.seq_entropies, d, scores.unit_of_sequence, weights)
    pending = PendingTrainerStep(step, E, scores, surrogate.pieces[STEP], weights, copy_of(named), upcoming,
                                 H.value, H.se, 0.0, 0.0, 0.0)
    value, se = pieces_estimate(config, pending, pending.pieces)
    pending = dataclasses.replace(pending, delta_h_next=value, se_E=se, seconds=time.perf_counter() - t0)
    term = None
    if direction is not None:
        a, r = surrogate.pieces[TERM]
        term = (upcoming.norm * a, upcoming.norm * r)
    return SteerablePass(pending, term, direction, surrogate.X_hat)


def term_displacement(steerable: SteerablePass, multiplier: float, kappa: float) -> dict[str, Tensor]:
    """m·κ·‖Δθ_next‖·u by parameter name (empty where κ is 0 or there is no direction)."""
    if not kappa or steerable.direction is None:
        return {}
    scale = multiplier * kappa * steerable.pending.next_step.norm
    return {n: scale * u for n, u in steerable.direction.items()}


def displacement(steerable: SteerablePass, multiplier: float, kappa: float) -> dict[str, Tensor]:
    """Δθ(m, κ) = m·(Δθ_next + κ·‖Δθ_next‖·u) by parameter name."""
    m = float(multiplier)
    term = term_displacement(steerable, m, kappa)
    return {n: m * s + term[n].to(s) if n in term else m * s for n, s in steerable.pending.next_step.step.items()}


def measurement(config: ProbeConfig, policy: Policy, steerable: SteerablePass, multiplier: float, kappa: float,
                dist: DistContext = SINGLE) -> DeltaH:
    """ΔĤ on E of the step at (m, κ), measured before it is taken: E scored at θ + Δθ(m, κ) by SNIS. It holds
    the step's curvature, which δ and e (first order) miss at a large lr: AdamW's first step, whose every
    coordinate moves by the lr, lowers the entropy where δ says ≈ 0. The chosen step's measurement is its
    `realised` change where torch takes that step to float rounding (`trainer_step.check_trainer_step`)."""
    pending = steerable.pending
    weights = None if pending.weights is None else pending.weights.numpy()
    return ranks.measured_on_shares(config, policy.engine, pending.E, displacement(steerable, multiplier, kappa),
                                    base=pending.scores, sampler_weights=weights, dist=dist)


def change_of(measured: DeltaH) -> Estimate:
    """ΔĤ ± SE of a measurement (NaN where it has none)."""
    row = measured.rows[0]
    return Estimate(*(math.nan if row[k] is None else float(row[k]) for k in ("deltaH_true", "se")))


def steered(config: ProbeConfig, steerable: SteerablePass, multiplier: float, kappa: float,
            measured: DeltaH | None = None, **extra) -> PendingTrainerStep:
    """The prediction of the step taken at (m, κ): pieces, displacement, δH_next and SE_E of m·(Δθ + κ‖Δθ‖u),
    with that step's measurement on E where it was made (`measurement`), and `extra` row fields."""
    pending, m = steerable.pending, float(multiplier)
    a, r = pending.pieces
    if kappa and steerable.term_pieces is not None:
        a, r = a + kappa * steerable.term_pieces[0], r + kappa * steerable.term_pieces[1]
    pieces = (m * a, m * r)
    step = displacement(steerable, m, kappa)
    value, se = pieces_estimate(config, pending, pieces)
    upcoming = NextStep(step, tuple(m * lr for lr in pending.next_step.lrs))
    return dataclasses.replace(pending, pieces=pieces, next_step=upcoming, delta_h_next=value, se_E=se,
                               measured=measured, extra={**pending.extra, **extra})


@torch.no_grad()
def add_to_parameters(policy: Policy, displacement: dict[str, Tensor]) -> None:
    """θ += displacement in place (the live parameters, right after the optimizer's step)."""
    for name, p in named_params(policy).items():
        if name in displacement:
            p.add_(displacement[name].to(p))

"""The autopilot's second knob: an entropy-gradient term added to the trainer's gradient, to push entropy UP.

Scaling the lr can only slow a fall (m·δH_next has the sign of δH_next). Where the wanted change is a rise that
the step at m does not give, the autopilot (with `max_push` > 0) adds −c·X̂₂ to the trainer's gradients right
before `optimizer.step()` — the gradient of (loss − c·Ĥ₂), as an entropy bonus in the loss would add it, so
AdamW's moments see it too:

    X̂₂      ∇Ĥ (the probe's entropy surrogate) on a SECOND fresh evaluation batch E₂ (its own seed): the
            direction of the added term
    c       = κ·‖g‖/‖X̂₂‖: κ is the term's size relative to the trainer's clipped gradient g, 0 ≤ κ ≤ max_push
    κ       the smallest with m·X̂₁·Δθ(κ) ≥ wanted, by bisection (`push_weight`), where Δθ(κ) is the exact AdamW
            step the gradients g − c·X̂₂ make at the scheduler's lr (`next_step.next_adamw_step`: AdamW is not
            linear in its gradient, so each κ gets its own exact step) and X̂₁ = ∇Ĥ on the step's own E (E₁);
            max_push where even that falls short

E₁ and E₂ are drawn independently, so the added term's effect is never predicted on the sample it was built
from: on E₂ itself, X̂₂·Δθ(κ) ∝ X̂₂·X̂₂ would be biased upward by X̂₂'s own noise (E|X̂₂|² = |∇H|² + tr Var X̂₂),
and the controller would steer on that noise. After the push, the row's δH_next ± SE_E is recomputed on E₁ along
the step really taken (its `push_on_E2` keeps E₂'s own, biased, estimate for comparison).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from entropy_experiments.config import ProbeConfig
from entropy_experiments.data.batch import Batch
from entropy_experiments.estimators.entropy_gradient import coefficients, sampler_weights
from entropy_experiments.estimators.sequence_scores import SequenceScores
from entropy_experiments.estimators.update_direction import named_dot, named_norm
from entropy_experiments.integrations.next_step import NextStep, next_adamw_step
from entropy_experiments.integrations.trainer_step import PendingTrainerStep, predict_on_E, sample_E
from entropy_experiments.integrations.trl_step_probe import named_params
from entropy_experiments.probe.e_pass import score_E, surrogate_gradient_phase
from entropy_experiments.probe.results import Policy

BISECTIONS = 30
E2_SEED_OFFSET = 2  # E₂ is drawn with the step's seed + 3 (E₁: + 1, the probe_U mode's U: + 2)


@dataclass(frozen=True)
class Push:
    """The added term's weight κ (relative to ‖g‖), its coefficient c, and the step it makes (scheduler lr)."""

    weight: float
    c: float
    step: NextStep


def entropy_gradient(config: ProbeConfig, policy: Policy, E: Batch,
                     scores: SequenceScores | None = None) -> dict[str, Tensor]:
    """X̂ = ∇Ĥ on E (the probe's surrogate gradient; `scores`: E already scored, else scored here)."""
    if scores is None:
        scores = score_E(config, policy, E, None)
    weights = sampler_weights(scores, E.sampler_response_logqs())
    return surrogate_gradient_phase(config, policy, E, coefficients(scores, config.entropy_options(), weights))


def pushed_gradients(grads: dict[str, Tensor | None], direction: dict[str, Tensor], c: float) -> dict:
    """g − c·d for every parameter with a gradient (one without stays None: torch does not step it)."""
    return {n: None if g is None else g - c * direction[n].to(g) for n, g in grads.items()}


def push_weight(step_of: Callable[[float], NextStep], X_hat: dict[str, Tensor], wanted: float,
                multiplier: float, max_push: float) -> tuple[float, NextStep]:
    """(κ, its step): the smallest κ in [0, max_push] with multiplier·X̂·Δθ(κ) ≥ wanted by bisection (κ = 0
    where the step already reaches it, max_push where no κ does)."""
    def reached(step: NextStep) -> bool:
        return multiplier * named_dot(X_hat, step.step) >= wanted

    low, low_step = 0.0, step_of(0.0)
    if reached(low_step):
        return low, low_step
    high, high_step = max_push, step_of(max_push)
    if not reached(high_step):
        return high, high_step
    for _ in range(BISECTIONS):
        middle = 0.5 * (low + high)
        middle_step = step_of(middle)
        if reached(middle_step):
            high, high_step = middle, middle_step
        else:
            low = middle
    return high, high_step


def choose_push(optimizer: torch.optim.Optimizer, named: dict, direction: dict[str, Tensor],
                X_hat: dict[str, Tensor], wanted: float, multiplier: float, max_push: float) -> Push:
    """The push that makes the predicted change (on X̂, independent of `direction`) reach `wanted` at the lr
    multiplier, from the gradients now in `.grad` (read, not written)."""
    grads = {n: (None if p.grad is None else p.grad.detach()) for n, p in named.items()}
    scale = named_norm({n: g for n, g in grads.items() if g is not None}) / max(named_norm(direction), 1e-30)

    def step_of(weight: float) -> NextStep:
        return next_adamw_step(optimizer, named, pushed_gradients(grads, direction, weight * scale))

    weight, step = push_weight(step_of, X_hat, wanted, multiplier, max_push)
    return Push(weight, weight * scale, step)


@torch.no_grad()
def apply_push(named: dict, direction: dict[str, Tensor], c: float) -> None:
    """Add −c·d to the live gradients in place (the trainer's `.grad` tensors, which its optimizer then steps)."""
    for name, p in named.items():
        if p.grad is not None:
            p.grad.sub_(c * direction[name].to(p.grad))


def push_step(config: ProbeConfig, policy: Policy, examples: list, pending: PendingTrainerStep, multiplier: float,
              max_push: float) -> tuple[PendingTrainerStep, dict]:
    """Choose the push for `pending`'s step (its wanted change at lr × `multiplier`), add it to the live gradients,
    and predict the pushed step on the same E₁ (at the scheduler's lr) → (that prediction, the row's fields:
    `entropy_push` κ, `push_c` c, `push_on_E1` / `push_on_E2` the pushed step's m·X̂·Δθ on E₁ and on E₂)."""
    t0 = time.perf_counter()
    named = named_params(policy)
    X1 = entropy_gradient(config, policy, pending.E, pending.scores)
    E2 = sample_E(config.model_copy(update={"seed": config.seed + E2_SEED_OFFSET}), policy, examples)
    X2 = entropy_gradient(config, policy, E2)
    push = choose_push(policy.optimizer, named, X2, X1, pending.extra["wanted"], multiplier, max_push)
    apply_push(named, X2, push.c)
    again = predict_on_E(config, policy, pending.E, pending.step, t0)
    return again, {"entropy_push": push.weight, "push_c": push.c,
                   "push_on_E1": multiplier * named_dot(X1, push.step.step),
                   "push_on_E2": multiplier * named_dot(X2, push.step.step)}

"""A perfect-information entropy controller, possible only in the enumerable world (enumerable_world.py).

After every optimizer step `OracleHold` moves the parameters along

    d = P·(∇H − α·∇R),   α = ⟨∇R, P∇H⟩ / ⟨∇R, P∇R⟩,   P = 1/(√v̂ + ε) of AdamW's second moment

with the exact gradients of the entropy H and the expected reward R (by enumeration), by the exact line search
that puts H back on its value before training. d is the entropy direction preconditioned as AdamW's steps are,
made orthogonal to the reward's gradient in P's metric: to first order the correction costs no reward. No
estimate can do better along this direction, so the reward it keeps is what a controller that holds the entropy
by correcting the trainer's step can hope to keep in this world (examples/entropy_autopilot.py, arm "oracle").
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor
from transformers import TrainerCallback

from entropy_experiments.testing.enumerable_world import PROMPTS, exact_sums

log = logging.getLogger("entropy_experiments.oracle")
FIRST_TRY, GROWTH, FARTHEST, HALVINGS = 0.02, 1.3, 50.0, 25  # the line search's scan (parameter-norm units)


def held_direction(grad_H: list[Tensor], grad_R: list[Tensor], precondition: list[Tensor]) -> list[Tensor]:
    """d = P·(∇H − α·∇R) with ⟨∇R, d⟩ = 0, unit norm, float64."""
    PH = [p * g.double() for p, g in zip(precondition, grad_H)]
    PR = [p * g.double() for p, g in zip(precondition, grad_R)]
    alpha = _dot(grad_R, PH) / _dot(grad_R, PR)
    d = [h - alpha * r for h, r in zip(PH, PR)]
    norm = _dot(d, d) ** 0.5
    return [t / norm for t in d]


def adamw_preconditioner(optimizer, params: list[Tensor]) -> list[Tensor]:
    """1/(√v̂ + ε) of the step just taken (v̂ the bias-corrected second moment), float64."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    wanted, by_id = {id(p) for p in params}, {}
    for group in inner.param_groups:
        beta2, eps = group["betas"][1], group["eps"]
        for p in (q for q in group["params"] if id(q) in wanted):
            state = inner.state[p]
            v_hat = state["exp_avg_sq"].double() / (1 - beta2 ** int(state["step"]))
            by_id[id(p)] = 1 / (v_hat.sqrt() + eps)
    return [by_id[id(p)] for p in params]


class OracleHold(TrainerCallback):
    """After every optimizer step, the exact entropy put back on its initial value along `held_direction`."""

    def __init__(self, trainer):
        self.trainer, self.H0, self.moves = trainer, None, []

    def exact(self, model) -> tuple[Tensor, Tensor]:
        num, den, reward = exact_sums(model, self.trainer.processing_class)
        return num / den, reward / len(PROMPTS)

    def on_train_begin(self, args, state, control, **kwargs):
        with torch.no_grad():
            self.H0 = float(self.exact(self.model())[0])

    def model(self):
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def on_optimizer_step(self, args, state, control, **kwargs):
        model = self.model()
        params = [p for p in model.parameters() if p.requires_grad]
        training = model.training
        model.eval()
        H, R = self.exact(model)
        grad_H = torch.autograd.grad(H, params, retain_graph=True)
        grad_R = torch.autograd.grad(R, params)
        d = held_direction(grad_H, grad_R, adamw_preconditioner(self.trainer.optimizer, params))
        toward = 1.0 if H.item() < self.H0 else -1.0  # d raises H to first order
        self.moves.append(toward * self.line_search(model, params, [toward * t for t in d]))
        model.train(training)

    @torch.no_grad()
    def line_search(self, model, params: list[Tensor], d: list[Tensor]) -> float:
        """The first c > 0 of a geometric scan at which H(θ + c·d) reaches H0 (d points toward it), bisected;
        the closest scanned c where none does. The parameters are left at θ + c·d."""
        base = [p.detach().clone() for p in params]

        def off(c: float) -> float:  # H − H0 at θ + c·d
            for p, b, t in zip(params, base, d):
                p.copy_(b + c * t.to(p.dtype))
            return float(self.exact(model)[0]) - self.H0

        start = off(0.0)
        side = 1.0 if start < 0 else -1.0
        low, c, closest = 0.0, FIRST_TRY, (abs(start), 0.0)
        while c <= FARTHEST:
            gap = side * off(c)
            closest = min(closest, (abs(gap), c))
            if gap >= 0:
                high = c
                for _ in range(HALVINGS):
                    mid = (low + high) / 2
                    low, high = (mid, high) if side * off(mid) < 0 else (low, mid)
                off(high)
                return high
            low, c = c, c * GROWTH
        log.warning("oracle: no step up to %g along d reaches H0 = %.4f; the closest leaves H %.4f off",
                    FARTHEST, self.H0, closest[0])
        off(closest[1])
        return closest[1]


def _dot(a: list[Tensor], b: list[Tensor]) -> float:
    return float(sum((x.double() * y.double()).sum() for x, y in zip(a, b)))

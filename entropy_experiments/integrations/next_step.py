"""The exact AdamW step a live optimizer is about to take, from its gradients and state (no copy is stepped).

Called right before `optimizer.step()` (transformers' `on_pre_optimizer_step`: after gradient clipping), with
the gradients the step will use in `.grad`, the optimizer's state and the learning rate the scheduler set in
each param group:

    Δθ_next[name] = lr_g · v[name]      v: `update_direction.adamw_step_direction` (torch's op order: moments,
                                         bias corrections, √ŝ + ε, decoupled weight decay; amsgrad), from the
                                         optimizer's own hyperparameters (never replaced), state and `.grad`

The gradients are taken as they are (already clipped by the trainer: no clipping here). A parameter without a
`.grad` is not stepped by torch, and gets Δθ = 0. The first step (no state yet) starts from zero moments, as
torch does. `next_adamw_step(...).step` equals `θ_after − θ_before` of the real step to float rounding
(tests/test_trainer_step_prediction.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from entropy_experiments.estimators.update_direction import (
    adam_state_by_name,
    adamw_step_direction,
    hyper_by_name,
    named_norm,
)

__all__ = ["NextStep", "next_adamw_step", "optimizer_lrs"]


@dataclass(frozen=True)
class NextStep:
    """The displacement the optimizer's next step will make, by parameter name (θ units), and the learning
    rates it uses: `lrs` one per param group (the scheduler's values now), `lr` the first group's."""

    step: dict[str, Tensor]
    lrs: tuple[float, ...]

    @property
    def lr(self) -> float:
        return self.lrs[0]

    @property
    def norm(self) -> float:
        return named_norm(self.step)


def optimizer_lrs(optimizer: torch.optim.Optimizer) -> tuple[float, ...]:
    """The learning rate of each param group now (floats, also when torch holds a tensor lr)."""
    return tuple(float(g["lr"].item() if isinstance(g["lr"], Tensor) else g["lr"]) for g in optimizer.param_groups)


def next_adamw_step(optimizer: torch.optim.Optimizer, named_params: dict[str, nn.Parameter],
                    grads: dict[str, Tensor | None] | None = None) -> NextStep:
    """Δθ of the `optimizer.step()` about to run. `named_params`: {name: parameter} in the optimizer's flattened
    param-group order (every parameter it holds). Nothing is written: state and hyperparameters are read
    (cloned), the gradients and parameters only read. `grads` ({name: gradient}): the step these gradients would
    make instead of those in `.grad` (None: `.grad`)."""
    names = list(named_params)
    hyper = hyper_by_name(optimizer, names)
    state = adam_state_by_name(optimizer, names)
    params = {n: p.detach() for n, p in named_params.items()}
    if grads is None:
        grads = {n: (None if p.grad is None else p.grad.detach()) for n, p in named_params.items()}
    wide = any(p.dtype == torch.float64 for p in params.values())
    v = adamw_step_direction(params, grads, state, hyper, max_grad_norm=None,
                             dtype=torch.float64 if wide else torch.float32)
    return NextStep({n: hyper[n].lr * v[n] for n in names}, optimizer_lrs(optimizer))

"""The step directions of a probe run from a U gradient g: the probe's own v (the trainer's AdamW step per unit
lr, docs/maths.md §4, `probe_step`) and the competing predictors' directions (estimators/predictors.py), each a
function of g so that the U-side jackknife can rebuild it without a group of prompts. The config hands these
functions a `StepOptions` (`ProbeConfig.step_options()`), never itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

from ..tensors import NamedTensors
from .adam_state import AdamStateError, adam_state_by_name
from .objective_gradient import Trainable
from .objectives import ObjectiveOptions
from .predictors import DIRECTION_PREDICTORS, StepContext, zero_second_moment_caveat
from .update_direction import optimizer_step_direction


class Policy(Protocol):
    """What the step directions read of the loaded policy: its trainable parameters and their AdamW state."""

    trainable: Trainable
    optimizer: Any


@dataclass(frozen=True)
class StepOptions:
    """What the step directions read from the config."""

    direction: str               # estimator.update_direction: adamw_step | preconditioned_gradient | sgd
    objective: ObjectiveOptions  # the resolved objective: its max_grad_norm clips adamw_step; described in results
    predictors: bool = True      # predictors.enabled: form the competing predictors' directions


def step_direction(options: StepOptions, policy: Policy, grads: NamedTensors,
                   kind: str | None = None) -> tuple[NamedTensors, dict]:
    """v per unit lr from g and the loaded AdamW state (kind: `options.direction` unless given), with its
    description for results.json. Clipping (the objective's max_grad_norm) applies to adamw_step only."""
    t = policy.trainable
    objective = options.objective
    v, info = optimizer_step_direction(kind or options.direction,
                                       {n: p.detach() for n, p in zip(t.names, t.params)}, grads, policy.optimizer,
                                       max_grad_norm=objective.max_grad_norm)
    info = {**{k: info[k] for k in ("direction", "norm", "grad_norm", "clipped", "max_grad_norm")},
            "objective": objective.to_dict(), "hyperparameters": info["hyperparameters"]}
    return v, info


def probe_step(options: StepOptions, policy: Policy, grads: NamedTensors) -> NamedTensors:
    """g ↦ the probe's own v (`step_direction` without its description): what SE_U rebuilds per left-out group."""
    return step_direction(options, policy, grads)[0]


def predictor_direction_fns(options: StepOptions, policy: Policy) -> dict[str, Callable[[NamedTensors], NamedTensors]]:
    """{predictor name: g ↦ its direction} of the registered direction predictors (empty when they are off)."""
    if not options.predictors:
        return {}
    context = StepContext(policy.optimizer, list(policy.trainable.names), partial(probe_step, options, policy))
    return {name: partial(fn, ctx=context) for name, fn in DIRECTION_PREDICTORS.items()}


def predictor_directions(options: StepOptions, policy: Policy,
                         grads: NamedTensors) -> tuple[dict[str, NamedTensors], dict[str, str]]:
    """({name: direction} of the competing predictors at g, {name: why it is unavailable}) — e.g. no_momentum
    needs saved second moments, which a fresh optimizer state (step 0) does not have."""
    directions, unavailable = {}, {}
    for name, fn in predictor_direction_fns(options, policy).items():
        try:
            directions[name] = fn(grads)
        except AdamStateError as exc:
            unavailable[name] = str(exc)
    return directions, unavailable


def no_momentum_caveat(policy: Policy, grads: NamedTensors) -> str | None:
    """`zero_second_moment_caveat` of the loaded AdamW state at g (None: nothing to say)."""
    state = adam_state_by_name(policy.optimizer, list(policy.trainable.names))
    return zero_second_moment_caveat(grads, {name: st["exp_avg_sq"] for name, st in state.items()})

"""The step directions of a probe run from a U gradient g: the probe's own v (the trainer's AdamW step per unit
lr, MATH.md §4) and the competing predictors' directions (estimators/predictors.py), each a function of g so
that the U-side jackknife can rebuild it without a group of prompts."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from .config import ProbeConfig
from .estimators.adam_state import AdamStateError, adam_state_by_name
from .estimators.predictors import DIRECTION_PREDICTORS, zero_second_moment_caveat
from .estimators.update_direction import optimizer_step_direction
from .phase_results import Policy

NamedTensors = dict[str, Tensor]


def step_direction(config: ProbeConfig, policy: Policy, grads: NamedTensors,
                   kind: str | None = None) -> tuple[NamedTensors, dict]:
    """v per unit lr from g and the loaded AdamW state (kind: `estimator.update_direction` unless given), with
    its description for results.json. Clipping (the objective's max_grad_norm) applies to adamw_step only."""
    t = policy.trainable
    options = config.objective_options()
    v, info = optimizer_step_direction(kind or config.estimator.update_direction,
                                       {n: p.detach() for n, p in zip(t.names, t.params)}, grads, policy.optimizer,
                                       max_grad_norm=options.max_grad_norm)
    info = {**{k: info[k] for k in ("direction", "norm", "grad_norm", "clipped", "max_grad_norm")},
            "objective": options.to_dict(), "hyperparameters": info["hyperparameters"]}
    return v, info


def predictor_direction_fns(config: ProbeConfig, policy: Policy) -> dict[str, Callable[[NamedTensors], NamedTensors]]:
    """{predictor name: g ↦ its direction} of the competing predictors (empty when `predictors` is off)."""
    if not config.predictors.enabled:
        return {}

    def step_of(kind: str, grads: NamedTensors) -> NamedTensors:
        return step_direction(config, policy, grads, None if kind == "probe" else kind)[0]

    return {name: (lambda g, fn=fn: fn(g, step_of)) for name, fn in DIRECTION_PREDICTORS.items()}


def predictor_directions(config: ProbeConfig, policy: Policy,
                         grads: NamedTensors) -> tuple[dict[str, NamedTensors], dict[str, str]]:
    """({name: direction} of the competing predictors at g, {name: why it is unavailable}) — e.g. no_momentum
    needs saved second moments, which a fresh optimizer state (step 0) does not have."""
    directions, unavailable = {}, {}
    for name, fn in predictor_direction_fns(config, policy).items():
        try:
            directions[name] = fn(grads)
        except AdamStateError as exc:
            unavailable[name] = str(exc)
    return directions, unavailable


def no_momentum_caveat(policy: Policy, grads: NamedTensors) -> str | None:
    """`zero_second_moment_caveat` of the loaded AdamW state at g (None: nothing to say)."""
    state = adam_state_by_name(policy.optimizer, list(policy.trainable.names))
    return zero_second_moment_caveat(grads, {name: st["exp_avg_sq"] for name, st in state.items()})

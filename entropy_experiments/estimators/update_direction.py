"""AdamW maths for the update direction v (docs/maths.md §4) and the grouped-U rebuilds (docs/maths.md §6).

Everything here is a pure function of tensors keyed by parameter NAME (the PeftModel's
`named_parameters()` names of the trainable parameters, in the optimizer's flattened param-group
order). Nothing runs the model; nothing mutates its inputs. The saved state is read by adam_state.py
(re-exported here, so that this module is the whole AdamW side).

v is a displacement *per unit learning rate*: the probe moves θ to θ + η·v, and for the default
`adamw_step` direction that is exactly where `torch.optim.AdamW.step()` with lr = η would put it.

    hyper = hyper_by_name(optimizer, names)          # adam_state.py: β1, β2, ε, wd, amsgrad (SAVED groups)
    state = adam_state_by_name(optimizer, names)     # adam_state.py: m, s, (max s), step t — cloned
    v = update_direction("adamw_step", params, grads, state, hyper, max_grad_norm=1.0)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from ..errors import ConfigError, closest_match
from .adam_state import AdamHyper, AdamStateError, NamedTensors, adam_state_by_name, hyper_by_name

__all__ = [
    "UPDATE_DIRECTIONS",
    "AdamHyper",
    "AdamStateError",
    "adam_state_by_name",
    "adamw_step_direction",
    "clip_coefficient",
    "hyper_by_name",
    "leave_one_out_gradients",
    "named_dot",
    "named_norm",
    "optimizer_step_direction",
    "preconditioned_gradient_direction",
    "sgd_direction",
    "update_direction",
]


# --------------------------------------------------------------------------------------------
# Directions
# --------------------------------------------------------------------------------------------


def _hyper_for(hyper: AdamHyper | Mapping[str, AdamHyper], name: str) -> AdamHyper:
    return hyper if isinstance(hyper, AdamHyper) else hyper[name]


def _clip_coef_tensor(grads: Sequence[Tensor], max_grad_norm: float | None) -> tuple[Tensor, Tensor]:
    """(total_norm, clamped coef) as 0-dim tensors, with torch.nn.utils.clip_grad_norm_'s ops:
    norm of the stacked per-tensor 2-norms, coef = clamp(max / (norm + 1e-6), max=1)."""
    norms = [torch.linalg.vector_norm(g, 2.0) for g in grads]
    if not norms:
        zero = torch.zeros(())
        return zero, torch.ones(())
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), 2.0)
    if max_grad_norm is None:
        return total, torch.ones((), dtype=total.dtype, device=total.device)
    coef = torch.clamp(float(max_grad_norm) / (total + 1e-6), max=1.0)
    return total, coef


def clip_coefficient(grads: NamedTensors, max_grad_norm: float | None) -> tuple[float, float]:
    """(total_norm, coef) exactly as clip_grad_norm_ computes them; coef = min(1, max/(norm+1e-6)).

    grads: {name: Tensor} (None entries are skipped, as torch skips params without .grad).
    With max_grad_norm None, coef is 1.
    """
    total, coef = _clip_coef_tensor([g for g in grads.values() if g is not None], max_grad_norm)
    return float(total), float(coef)


def _as(t: Tensor, like: Tensor, dtype: torch.dtype) -> Tensor:
    return t.detach().to(device=like.device, dtype=dtype)


def _check_shape(name: str, what: str, t: Tensor, like: Tensor) -> None:
    if t.shape != like.shape:
        raise AdamStateError(
            f"optimizer {what} of parameter {name!r} has shape {tuple(t.shape)} but the parameter has "
            f"{tuple(like.shape)}"
        )


def adamw_step_direction(
    params: NamedTensors,
    grads: Mapping[str, Tensor | None],
    state: Mapping[str, Mapping[str, Tensor | int]],
    hyper: AdamHyper | Mapping[str, AdamHyper],
    *,
    max_grad_norm: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """v = Δθ / lr of the step torch.optim.AdamW.step() would take (docs/maths.md §4).

    params, grads: {name: Tensor[*shape]} (current θ and the U-loss gradient g = ∇L_U);
    state: from `adam_state_by_name`; hyper: one AdamHyper or {name: AdamHyper}.
    Returns {name: Tensor[*shape]} in `dtype`, dimensionless "θ units per unit lr".

    Mirrors torch's single-tensor op order (lerp for m, mul/addcmul for s, sqrt/bc2 + ε, then
    m/denom scaled by 1/bc1) so that θ + lr·v matches a real fp32 step to float precision:
        [clip g]  m' = β1 m + (1−β1) g;  s' = β2 s + (1−β2) g²;  ŝ = max(max_s, s') if amsgrad
        v = −wd·θ − (m'/(1−β1^{t+1})) / (√(ŝ/(1−β2^{t+1})) + ε)
    The −wd·θ term is the decoupled decay θ ← θ(1 − lr·wd) that torch applies first.
    A parameter whose grad is None is not stepped by torch (no decay either): v = 0 there.
    """
    names = list(grads)
    present = [n for n in names if grads[n] is not None]
    g = {n: _as(grads[n], grads[n], dtype) for n in present}  # type: ignore[arg-type]
    if max_grad_norm is not None:
        _, coef = _clip_coef_tensor(list(g.values()), max_grad_norm)
        g = {n: gn * coef.to(gn.device, gn.dtype) for n, gn in g.items()}

    out: dict[str, Tensor] = {}
    for name in names:
        theta = params[name]
        if name not in g:
            out[name] = torch.zeros(theta.shape, dtype=dtype, device=theta.device)
            continue
        gn, h, st = g[name], _hyper_for(hyper, name), state[name]
        if h.maximize:
            raise AdamStateError(f"parameter {name!r}: maximize=True is not supported")
        for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if h.amsgrad else ()):
            _check_shape(name, key, st[key], theta)  # type: ignore[arg-type]
        t = int(st["step"]) + 1

        m = torch.lerp(_as(st["exp_avg"], gn, dtype), gn, 1.0 - h.beta1)  # type: ignore[arg-type]
        s = _as(st["exp_avg_sq"], gn, dtype).mul(h.beta2).addcmul_(gn, gn, value=1.0 - h.beta2)  # type: ignore[arg-type]
        if h.amsgrad:
            s = torch.maximum(_as(st["max_exp_avg_sq"], gn, dtype), s)  # type: ignore[arg-type]
        bias_correction1 = 1.0 - h.beta1**t
        bias_correction2_sqrt = (1.0 - h.beta2**t) ** 0.5
        denom = (s.sqrt() / bias_correction2_sqrt).add_(h.eps)
        v = (m / denom).mul_(-1.0 / bias_correction1)
        if h.weight_decay != 0.0:
            v = v.sub_(_as(theta, gn, dtype), alpha=h.weight_decay)
        out[name] = v
    return out


def preconditioned_gradient_direction(
    grads: NamedTensors,
    state: Mapping[str, Mapping[str, Tensor | int]],
    hyper: AdamHyper | Mapping[str, AdamHyper],
    *,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """The historical Ȳ: v = −g / (√(s/(1−β2^t)) + ε), t = saved step, s = saved exp_avg_sq.

    No momentum, no weight decay, no clipping (docs/maths.md §4). {name: Tensor[*shape]} in `dtype`.
    """
    out: dict[str, Tensor] = {}
    for name, grad in grads.items():
        h, st = _hyper_for(hyper, name), state[name]
        t = int(st["step"])
        if t == 0:
            raise AdamStateError(
                f"preconditioned_gradient needs a trained optimizer state (step ≥ 1); parameter {name!r} "
                "has step 0"
            )
        gn = _as(grad, grad, dtype)
        _check_shape(name, "exp_avg_sq", st["exp_avg_sq"], gn)  # type: ignore[arg-type]
        s = _as(st["exp_avg_sq"], gn, dtype)  # type: ignore[arg-type]
        denom = (s.sqrt() / (1.0 - h.beta2**t) ** 0.5).add_(h.eps)
        out[name] = -gn / denom
    return out


def sgd_direction(grads: NamedTensors, *, dtype: torch.dtype = torch.float32) -> dict[str, Tensor]:
    """v = −g (ablation). {name: Tensor[*shape]} in `dtype`."""
    return {name: -_as(g, g, dtype) for name, g in grads.items()}


# One adapter per kind with a common signature; clipping belongs to the AdamW step only.
DirectionFn = Callable[..., dict[str, Tensor]]

UPDATE_DIRECTIONS: dict[str, DirectionFn] = {
    "adamw_step": lambda params, grads, state, hyper, *, max_grad_norm, dtype: adamw_step_direction(
        params, grads, state, hyper, max_grad_norm=max_grad_norm, dtype=dtype
    ),
    "preconditioned_gradient": lambda params, grads, state, hyper, *, max_grad_norm, dtype: (
        preconditioned_gradient_direction(grads, state, hyper, dtype=dtype)
    ),
    "sgd": lambda params, grads, state, hyper, *, max_grad_norm, dtype: sgd_direction(grads, dtype=dtype),
}


def update_direction(
    kind: str,
    params: NamedTensors,
    grads: NamedTensors,
    state: Mapping[str, Mapping[str, Tensor | int]],
    hyper: AdamHyper | Mapping[str, AdamHyper],
    *,
    max_grad_norm: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, Tensor]:
    """v for `estimator.update_direction` ∈ {adamw_step, preconditioned_gradient, sgd}.

    `max_grad_norm` only affects adamw_step (it clips the gradient the AdamW step sees); the other
    two are defined on the raw gradient.
    """
    fn = UPDATE_DIRECTIONS.get(kind)
    if fn is None:
        hint = closest_match(kind, UPDATE_DIRECTIONS)
        raise ConfigError(
            f"estimator.update_direction: unknown value {kind!r}; expected one of "
            f"{', '.join(UPDATE_DIRECTIONS)}" + (f" (did you mean {hint!r}?)" if hint else "")
        )
    return fn(params, grads, state, hyper, max_grad_norm=max_grad_norm, dtype=dtype)


# --------------------------------------------------------------------------------------------
# Grouped-U rebuilds and named-tensor algebra
# --------------------------------------------------------------------------------------------


def leave_one_out_gradients(
    group_grads: Sequence[NamedTensors], group_sizes: Sequence[int], scales: Sequence[float] | None = None
) -> list[dict[str, Tensor]]:
    """g₍₋k₎ for each of the K prompt groups of U (docs/maths.md §6, U side).

    group_grads[k] = g_k = ∇ of group k's share of L_U, each carrying the loss's whole-batch
    normaliser Z, so the full gradient is g = Σ_k g_k. Leaving group k out renormalises by the
    normaliser Z₍₋k₎ of the remaining prompts:
        g₍₋k₎ = c_k · (g − g_k),  c_k = Z / Z₍₋k₎.
    `scales` gives c_k (objectives.leave_one_out_scales); by default L_U is a MEAN over the
    B_U = Σ n_k prompts and c_k = B_U / (B_U − n_k). g − g_k is summed directly over the other groups
    in float64 (no cancellation); results come back in each tensor's input dtype. Zero-advantage
    prompts still count in n_k and B_U.
    """
    if len(group_grads) != len(group_sizes):
        raise ValueError(f"{len(group_grads)} group gradients but {len(group_sizes)} group sizes")
    if len(group_grads) < 2:
        raise ValueError("leave-one-out needs at least 2 groups of U prompts")
    if any(n <= 0 for n in group_sizes):
        raise ValueError(f"group sizes must be positive, got {list(group_sizes)}")
    names = list(group_grads[0])
    for k, gk in enumerate(group_grads):
        if list(gk) != names:
            raise ValueError(f"group {k} gradient has parameter names that differ from group 0's")
    b_u = sum(group_sizes)
    if scales is None:
        scales = [b_u / (b_u - n_k) for n_k in group_sizes]
    if len(scales) != len(group_grads):
        raise ValueError(f"{len(scales)} leave-one-out scales for {len(group_grads)} groups")

    out: list[dict[str, Tensor]] = []
    for k, scale in enumerate(scales):
        loo: dict[str, Tensor] = {}
        for name in names:
            rest = sum(gj[name].detach().double() for j, gj in enumerate(group_grads) if j != k)
            loo[name] = (rest * scale).to(group_grads[k][name].dtype)  # type: ignore[union-attr]
        out.append(loo)
    return out


def named_dot(a: NamedTensors, b: NamedTensors) -> float:
    """Σ_name ⟨a[name], b[name]⟩ accumulated in float64 (names must match)."""
    if set(a) != set(b):
        raise ValueError(f"named_dot: parameter names differ ({sorted(set(a) ^ set(b))[:3]} ...)")
    total = 0.0
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape:
            raise ValueError(f"named_dot: {name!r} has shapes {tuple(x.shape)} and {tuple(y.shape)}")
        total += float(torch.sum(x.detach().double() * y.detach().to(x.device).double()))
    return total


def named_norm(a: NamedTensors) -> float:
    """Euclidean norm over all named tensors, float64 accumulation."""
    return math.sqrt(named_dot(a, a))


def optimizer_step_direction(direction: str, params: NamedTensors, grads: NamedTensors, optimizer, *,
                             max_grad_norm: float | None) -> tuple[dict[str, Tensor], dict]:
    """v per unit lr from g and a loaded optimizer's saved state and groups, with a description of it
    (direction, ‖v‖, ‖g‖, clipping, the saved hyperparameters and step) for results.json."""
    names = list(params)
    hyper = hyper_by_name(optimizer, names)
    state = adam_state_by_name(optimizer, names)
    v = update_direction(direction, params, grads, state, hyper, max_grad_norm=max_grad_norm)
    grad_norm, coef = clip_coefficient(grads, max_grad_norm)
    first = hyper[names[0]]
    info = {"direction": direction, "norm": named_norm(v), "grad_norm": grad_norm, "clipped": bool(coef < 1.0),
            "max_grad_norm": max_grad_norm,
            "hyperparameters": {"lr": first.lr, "betas": [first.beta1, first.beta2], "eps": first.eps,
                                "weight_decay": first.weight_decay, "amsgrad": first.amsgrad,
                                "step": int(state[names[0]]["step"])}}
    return v, info

"""The AdamW state and hyperparameters as saved with the optimizer, keyed by parameter NAME (docs/maths.md §4).

Names are the PeftModel's `named_parameters()` names of the trainable parameters, in the optimizer's
flattened param-group order. Nothing here mutates its inputs: the state is cloned.

    hyper = hyper_by_name(optimizer, names)          # β1, β2, ε, wd, amsgrad from the SAVED groups
    state = adam_state_by_name(optimizer, names)     # m, s, (max s), step t — cloned
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..errors import OptimizerStateError
from ..tensors import NamedTensors

__all__ = ["AdamHyper", "AdamStateError", "NamedTensors", "adam_state_by_name", "hyper_by_name"]


class AdamStateError(OptimizerStateError, ValueError):
    """The optimizer's saved state or hyperparameters cannot give a faithful AdamW direction.

    A ValueError too, so that callers treating it as a bad value catch it; a ProbeError, so that the
    CLI prints its one line and exits with code 2.
    """


@dataclass(frozen=True)
class AdamHyper:
    """Hyperparameters of one parameter's AdamW param group, as saved with the optimizer.

    `lr` is only reported (v is per unit lr and does not depend on it).
    """

    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    amsgrad: bool
    maximize: bool = False


# --------------------------------------------------------------------------------------------
# Reading the optimizer
# --------------------------------------------------------------------------------------------


def _saved_state_dict(optimizer: torch.optim.Optimizer | Mapping[str, Any]) -> Mapping[str, Any]:
    """The {'state', 'param_groups'} dict: `optimizer.state_dict()` or an already-loaded optimizer.pt.

    After `load_state_dict`, a live optimizer's param_groups hold the *saved* hyperparameters (torch
    copies every saved group key over the constructor's), so both sources are the saved values.
    """
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer.state_dict()
    if isinstance(optimizer, Mapping) and "param_groups" in optimizer and "state" in optimizer:
        return optimizer
    raise TypeError(
        f"expected a torch.optim.Optimizer or an optimizer state dict, got {type(optimizer).__name__}"
    )


def _flat_param_slots(saved: Mapping[str, Any], names: Sequence[str]) -> list[tuple[Any, Mapping]]:
    """[(state key, param group)] for names[i] ↔ the i-th param in flattened group order.

    Checks the count, and the names too when the saved groups carry `param_names` (optimizers
    built from named_parameters() save them), because a positional mapping with no check is a
    known trap (docs/maths.md §8).
    """
    slots: list[tuple[Any, Mapping]] = []
    saved_names: list[str | None] = []
    for group in saved["param_groups"]:
        group_names = group.get("param_names")
        for j, key in enumerate(group["params"]):
            slots.append((key, group))
            saved_names.append(group_names[j] if group_names is not None else None)
    if len(slots) != len(names):
        raise AdamStateError(
            f"optimizer state has {len(slots)} parameters in its param_groups but the model has "
            f"{len(names)} trainable parameters"
        )
    for i, (want, got) in enumerate(zip(names, saved_names)):
        if got is not None and got != want:
            raise AdamStateError(
                f"optimizer param_groups name parameter {i} {got!r} but the model's is {want!r}"
            )
    return slots


def _scalar(x: Any) -> float:
    """A python float from a float or a 1-element tensor (torch allows Tensor lr / betas)."""
    return float(x.item()) if isinstance(x, Tensor) else float(x)


def _group_hyper(group: Mapping[str, Any]) -> AdamHyper:
    for key in ("lr", "betas", "eps", "weight_decay", "amsgrad"):
        if key not in group:
            # Never fall back to constructor defaults: a silently-zero weight decay is a known trap.
            raise AdamStateError(
                f"optimizer param_groups lack the key {key!r}; cannot rebuild the AdamW step"
            )
    hyper = AdamHyper(
        lr=_scalar(group["lr"]),
        beta1=_scalar(group["betas"][0]),
        beta2=_scalar(group["betas"][1]),
        eps=_scalar(group["eps"]),
        weight_decay=_scalar(group["weight_decay"]),
        amsgrad=bool(group["amsgrad"]),
        maximize=bool(group.get("maximize", False)),
    )
    if hyper.maximize:
        raise AdamStateError("optimizer param_groups have maximize=True, which the probe does not support")
    # torch.optim.Adam saves decoupled_weight_decay=False: its weight decay is an L2 term added to
    # the gradient before the moments, a different step. With wd = 0 the two coincide.
    if group.get("decoupled_weight_decay", True) is False and hyper.weight_decay != 0.0:
        raise AdamStateError(
            f"optimizer state is plain Adam with L2 weight_decay={hyper.weight_decay} "
            "(decoupled_weight_decay=False); only AdamW's decoupled decay is supported"
        )
    return hyper


def hyper_by_name(
    optimizer: torch.optim.Optimizer | Mapping[str, Any], names: Sequence[str]
) -> dict[str, AdamHyper]:
    """{name: AdamHyper} from the optimizer's saved param_groups (names[i] ↔ i-th flattened param)."""
    saved = _saved_state_dict(optimizer)
    slots = _flat_param_slots(saved, names)
    by_group: dict[int, AdamHyper] = {}
    out: dict[str, AdamHyper] = {}
    for name, (_, group) in zip(names, slots):
        gid = id(group)
        if gid not in by_group:
            by_group[gid] = _group_hyper(group)
        out[name] = by_group[gid]
    return out


def adam_state_by_name(
    optimizer: torch.optim.Optimizer | Mapping[str, Any],
    names: Sequence[str],
    *,
    params: NamedTensors | None = None,
) -> dict[str, dict[str, Tensor | int]]:
    """{name: {'exp_avg', 'exp_avg_sq', ['max_exp_avg_sq'], 'step'}} — CLONED, so stepping the
    optimizer later (the `real_step` mode) cannot change them.

    A parameter with no state yet (fresh optimizer) gets step 0 and zero tensors shaped like the
    parameter: taken from the live optimizer, or from `params` when a bare state dict is given.
    `max_exp_avg_sq` is present exactly when the parameter's group has amsgrad=True.
    """
    saved = _saved_state_dict(optimizer)
    slots = _flat_param_slots(saved, names)
    live: list[Tensor] | None = None
    if isinstance(optimizer, torch.optim.Optimizer):
        live = [p for group in optimizer.param_groups for p in group["params"]]

    out: dict[str, dict[str, Tensor | int]] = {}
    for i, (name, (key, group)) in enumerate(zip(names, slots)):
        amsgrad = bool(group.get("amsgrad", False))
        st = saved["state"].get(key)
        if st:
            missing = [k for k in ("exp_avg", "exp_avg_sq", "step") if k not in st]
            if amsgrad:
                missing += [] if "max_exp_avg_sq" in st else ["max_exp_avg_sq"]
            if missing:
                raise AdamStateError(f"optimizer state of parameter {name!r} lacks {', '.join(missing)}")
            entry: dict[str, Tensor | int] = {
                "exp_avg": st["exp_avg"].detach().clone(),
                "exp_avg_sq": st["exp_avg_sq"].detach().clone(),
                "step": int(_scalar(st["step"])),
            }
            if amsgrad:
                entry["max_exp_avg_sq"] = st["max_exp_avg_sq"].detach().clone()
        else:
            if live is not None:
                like = live[i]
            elif params is not None and name in params:
                like = params[name]
            else:
                raise AdamStateError(
                    f"parameter {name!r} has no optimizer state and its shape is unknown (pass params=)"
                )
            zeros = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
            entry = {"exp_avg": zeros, "exp_avg_sq": zeros.clone(), "step": 0}
            if amsgrad:
                entry["max_exp_avg_sq"] = zeros.clone()
        out[name] = entry
    return out

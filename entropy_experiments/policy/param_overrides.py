"""Parameter-only mappings θ + η·v for `torch.func.functional_call` (docs/maths.md §5, §7).

The live model is never modified: a mapping replaces the named (LoRA) parameters by θ + η·v,
formed in fp32 (or wider) before the forward, and passes every other parameter through as the live
tensor itself (a detached view sharing storage, never a copy) — so an override costs memory only
for the displaced parameters, and η = 0 reproduces the live forward bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from entropy_experiments.errors import ConfigError, closest_match


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DistributedDataParallel / DataParallel wrappers (`.module`); keep PEFT wrappers intact."""
    while isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        model = model.module
    return model


def resolve_param_names(params: Mapping[str, Tensor], names: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Map each key of an update vector onto a parameter name of `params`.

    Accepts exact names and names carrying (or lacking) a DDP 'module.' prefix; anything else is a
    ConfigError naming the key and the closest parameter name.
    """
    resolved: dict[str, str] = {}
    for key in names:
        for candidate in (key, key.removeprefix("module."), "module." + key):
            if candidate in params:
                resolved[key] = candidate
                break
        else:
            hint = closest_match(key, list(params))
            raise ConfigError(f"update vector: unknown parameter '{key}'" + (f" (closest: '{hint}')" if hint else ""))
    return resolved


def live_params_mapping(model: nn.Module) -> dict[str, Tensor]:
    """{name: param.detach()} over named_parameters(): views of the live storage (no copies)."""
    return {name: p.detach() for name, p in model.named_parameters()}


def build_params_override(
    model: nn.Module,
    v_named: Mapping[str, Tensor],
    eta: float,
    *,
    dtype: torch.dtype = torch.float32,
    cast_params: bool = True,
    base: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """θ + η·v on the parameters named in `v_named`, live detached tensors for all others.

    The sum is formed in promote(param dtype, `dtype`) — fp32 at least by default — before the
    forward; with `cast_params=False` it is cast back to the parameter's own dtype. `base` is an
    optional precomputed `live_params_mapping(model)` (saves rebuilding it per η).
    Shapes of v must equal the parameters' shapes (ConfigError naming the parameter otherwise).
    """
    mapping = dict(base) if base is not None else live_params_mapping(model)
    for key, name in resolve_param_names(mapping, list(v_named)).items():
        theta = mapping[name]
        v = v_named[key]
        if tuple(v.shape) != tuple(theta.shape):
            raise ConfigError(f"update vector: '{key}' has shape {tuple(v.shape)}, parameter has {tuple(theta.shape)}")
        work = torch.promote_types(theta.dtype, dtype)
        new = torch.add(theta.to(work), v.detach().to(device=theta.device, dtype=work), alpha=float(eta))
        mapping[name] = new if cast_params else new.to(theta.dtype)
    return mapping


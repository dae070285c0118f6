"""AdamW state for the probe: loading a saved state onto the model's parameters, or a fresh optimizer.

`load_adam_optimizer_from_path` maps the saved state back onto the model's parameters by name (or by
position in the model's or a Hugging Face Trainer's order, checking every shape; `optimizer_mapping.py`)
and keeps the *saved* hyperparameters. A state that cannot be matched is an error, never a silent fresh
optimizer.

The parameter order of `trainable_named_parameters(model)` is the param-group order used by every
optimizer this project creates, saves or loads.
"""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, OptimizerStateError
from .file_names import PARAM_NAMES_FILE
from .messages import first_line
from .optimizer_mapping import TRAINER_ORDER, map_by_name, map_by_position, saved_group_names

__all__ = ["fresh_adam_optimizer", "load_adam_optimizer_from_path", "load_adam_optimizer_from_state",
           "trainable_named_parameters"]

logger = logging.getLogger(__name__)

# Adam state tensors that must have exactly the parameter's shape.
_ADAM_STATE_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")


def trainable_named_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) for every parameter with requires_grad, in `named_parameters()` order.

    This order is the param-group order of every optimizer created, saved or loaded here.
    """
    return [(name, p) for name, p in model.named_parameters() if p.requires_grad]


def _trainable_or_raise(model: torch.nn.Module, error: type[Exception],
                        where: str) -> list[tuple[str, torch.nn.Parameter]]:
    named = trainable_named_parameters(model)
    if not named:
        raise error(f"{where}: the model has no trainable parameters "
                    "(adapter not loaded with is_trainable=True?)")
    return named


def fresh_adam_optimizer(
    model: torch.nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """A new AdamW (no state) over `trainable_named_parameters(model)`.

    Only for `checkpoint.allow_fresh_optimizer: true`; the caller must warn loudly, because without
    the saved moments the probed update is not the one training would take.
    """
    named = _trainable_or_raise(model, CheckpointError, "fresh optimizer")
    return torch.optim.AdamW([p for _, p in named], lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)


def read_optimizer_file(path: Path) -> dict[str, Any]:
    """torch.load with weights_only=True and one-line errors; validates the state_dict skeleton."""
    if not path.exists():
        raise OptimizerStateError(f"optimizer state file not found: {path}")
    if not path.is_file():
        raise OptimizerStateError(f"optimizer state path is not a file: {path}")
    try:
        # weights_only=True: a checkpoint is data; unpickling arbitrary objects would run their code.
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = first_line(exc.__context__) if exc.__context__ is not None else first_line(exc)
        raise OptimizerStateError(f"refused to unpickle {path}: it contains code/objects that are not plain "
                                  f"tensors, or is not a torch.save file ({reason})") from exc
    except Exception as exc:  # truncated zip, empty file, random bytes, ...
        raise OptimizerStateError(f"cannot read optimizer state {path}: corrupt or not a torch.save file "
                                  f"({type(exc).__name__}: {first_line(exc)})") from exc

    if (not isinstance(saved, dict) or not isinstance(saved.get("state"), dict)
            or not isinstance(saved.get("param_groups"), list)):
        raise OptimizerStateError(f"{path} is not an optimizer state_dict (no 'state'/'param_groups')")
    for index, group in enumerate(saved["param_groups"]):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            raise OptimizerStateError(f"{path}: param_groups[{index}] has no 'params' list")
    return saved


def _read_param_names(names_path: Path, n_saved: int, optimizer_path: Path) -> list[dict[str, Any]]:
    """Read and validate optimizer_param_names.json against the saved state's parameter count."""
    try:
        entries = json.loads(names_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise OptimizerStateError(f"cannot read {names_path}: {first_line(exc)}") from exc
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) and isinstance(e.get("shape"), list)
            for e in entries):
        raise OptimizerStateError(f"{names_path} must be a JSON list of {{\"name\", \"shape\"}} objects")
    if len(entries) != n_saved:
        raise OptimizerStateError(f"{names_path} lists {len(entries)} parameters but {optimizer_path} "
                                  f"holds {n_saved}")
    seen: set[str] = set()
    for entry in entries:
        if entry["name"] in seen:
            raise OptimizerStateError(f"{names_path}: parameter {entry['name']!r} is listed twice")
        seen.add(entry["name"])
    return entries


def _check_state_shapes(state: dict[str, Any], param: torch.Tensor, label: str, path: Path) -> None:
    """Adam moments must have the parameter's shape; a non-empty state must be Adam's."""
    if not state:
        return  # parameter never stepped: nothing to check
    if not isinstance(state, dict) or "exp_avg" not in state or "exp_avg_sq" not in state:
        keys = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise OptimizerStateError(f"{path}: state of {label} has keys {keys}, not Adam's exp_avg/exp_avg_sq")
    for key in _ADAM_STATE_KEYS:
        value = state.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(param.shape):
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise OptimizerStateError(f"{path}: {key} of {label} has shape {shape} but the parameter has "
                                      f"shape {tuple(param.shape)}")


def _saved_positions(model: torch.nn.Module, named: list[tuple[str, torch.nn.Parameter]], saved: dict[str, Any],
                     path: Path, names_path: Path, position_order: str) -> tuple[list[int], list[str]]:
    """Flat saved position of every trainable parameter (model order), and a label per parameter."""
    model_names = [name for name, _ in named]
    group_sizes = [len(g["params"]) for g in saved["param_groups"]]
    in_file = saved_group_names(saved, path)
    if in_file is not None:
        positions = map_by_name(in_file, model_names, path, f"{path.name} param_groups param_names")
        how = f"by name (param_names saved in {path.name})"
    elif names_path.is_file():
        entries = _read_param_names(names_path, sum(group_sizes), path)
        positions = map_by_name([e["name"] for e in entries], model_names, path, names_path.name)
        for (name, p), pos in zip(named, positions, strict=True):
            if tuple(entries[pos]["shape"]) != tuple(p.shape):
                raise OptimizerStateError(f"{path}: parameter {name!r} was saved with shape "
                                          f"{tuple(entries[pos]['shape'])} but has shape {tuple(p.shape)}")
        how = f"by name ({names_path.name})"
    else:
        positions = map_by_position(model, model_names, group_sizes, path, position_order)
        how = f"by position ({TRAINER_ORDER if position_order == 'trainer' else 'model order'})"
        logger.info("optimizer state %s mapped %s", path, how)
        return positions, [f"parameter #{i} ({name!r}, mapped {how})" for i, name in enumerate(model_names)]
    logger.info("optimizer state %s mapped %s", path, how)
    return positions, [f"parameter {name!r}" for name in model_names]


def _model_order_runs(group_of_param: list[int]) -> list[tuple[int, list[int]]]:
    """[(saved group, parameter indices)]: consecutive parameters (model order) of the same saved group.

    Param groups whose members interleave in the model's order (a Trainer's decay / no-decay split
    with norms in modules_to_save) become several groups with the same hyperparameters, so that the
    loaded optimizer's flattened order is always the model's order.
    """
    runs: list[tuple[int, list[int]]] = []
    for index, group in enumerate(group_of_param):
        if runs and runs[-1][0] == group:
            runs[-1][1].append(index)
        else:
            runs.append((group, [index]))
    return runs


def _mapped_optimizer(named: list[tuple[str, torch.nn.Parameter]], positions: list[int], saved: dict[str, Any],
                      path: Path, defaults: dict[str, Any]) -> torch.optim.AdamW:
    """AdamW over the saved groups (as runs in model order) holding each parameter's saved state.

    torch gets a state_dict indexed in model order; load_state_dict replaces every hyperparameter by
    the saved one and casts the moments to each parameter's device.
    """
    saved_ids = [key for group in saved["param_groups"] for key in group["params"]]
    saved_group_of = [g for g, group in enumerate(saved["param_groups"]) for _ in group["params"]]
    runs = _model_order_runs([saved_group_of[pos] for pos in positions])
    if len(runs) > len({g for g, _ in runs}):
        logger.info("%s: %d saved param groups interleave in the model's parameter order; loaded as %d groups "
                    "with the same hyperparameters", path, len({g for g, _ in runs}), len(runs))
    optimizer = torch.optim.AdamW([{"params": [named[i][1] for i in members]} for _, members in runs], **defaults)
    new_state = {i: saved["state"][saved_ids[pos]] for i, pos in enumerate(positions)
                 if saved["state"].get(saved_ids[pos])}
    new_groups = [{**{k: v for k, v in saved["param_groups"][g].items() if k not in ("params", "param_names")},
                   "params": members} for g, members in runs]
    try:
        optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise OptimizerStateError(f"{path}: torch could not load the mapped state: {first_line(exc)}") from exc
    return optimizer


def _drop_unsupported_fused(optimizer: torch.optim.Optimizer, path: Path) -> None:
    """A group saved with fused=True keeps it where torch has a fused kernel for its device and dtype
    (the same maths either way); elsewhere the flag is dropped and the log says so."""
    for index, group in enumerate(optimizer.param_groups):
        if not group.get("fused"):
            continue
        p = group["params"][0]
        try:  # the constructor is where torch checks fused support
            torch.optim.AdamW([torch.zeros(1, device=p.device, dtype=p.dtype, requires_grad=True)], fused=True)
        except RuntimeError as exc:
            group["fused"] = False
            logger.info("%s: param group %d was saved with fused=True, which torch %s refuses for %s %s (%s); "
                        "using the unfused AdamW (same update)", path, index, torch.__version__, p.device,
                        p.dtype, first_line(exc))


def load_adam_optimizer_from_path(
    model: torch.nn.Module,
    optimizer_path: str | Path,
    *,
    lr: float | None = None,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    param_names_path: str | Path | None = None,
    position_order: str = "model",
) -> torch.optim.AdamW:
    """AdamW over `trainable_named_parameters(model)` with the saved state loaded onto it.

    Mapping (see optimizer_mapping.py): by name when torch saved `param_names` in the param groups or
    when `param_names_path` (default: optimizer_param_names.json beside the file, if present) exists;
    otherwise by position, in the model's order (`position_order="model"`) or in a Hugging Face
    Trainer's order (`"trainer"`: decay parameters first, then the no-decay ones). Every moment's
    shape is checked against its parameter either way.

    Hyperparameters (lr, betas, eps, weight_decay, amsgrad, initial_lr, fused, ...) come from the
    SAVED param_groups; `weight_decay`, `betas`, `eps` only seed the throw-away constructor values.
    `lr`, when given, overrides the saved lr (and nothing else). Saved param groups keep their
    hyperparameters; empty ones are dropped, and one whose members interleave with another's in the
    model's order is split into consecutive runs, so the loaded groups always follow the model's order.

    Raises:
        OptimizerStateError: on any missing, unreadable, unsafe or mismatched state (never falls
        back to a fresh optimizer).
    """
    path = Path(optimizer_path).expanduser()
    names_path = Path(param_names_path) if param_names_path is not None else path.with_name(PARAM_NAMES_FILE)
    return load_adam_optimizer_from_state(model, read_optimizer_file(path), path, lr=lr, weight_decay=weight_decay,
                                          betas=betas, eps=eps, param_names_path=names_path,
                                          position_order=position_order)


def load_adam_optimizer_from_state(
    model: torch.nn.Module,
    saved: dict[str, Any],
    path: Path,
    *,
    lr: float | None = None,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    param_names_path: Path | None = None,
    position_order: str = "model",
) -> torch.optim.AdamW:
    """`load_adam_optimizer_from_path` for a state_dict already in memory (a framework checkpoint consolidated
    by checkpoint/verl_fsdp.py or deepspeed_zero.py); `path` names where it came from in every message."""
    named = _trainable_or_raise(model, OptimizerStateError, f"loading {path}")
    names_path = param_names_path if param_names_path is not None else path.with_name(PARAM_NAMES_FILE)
    positions, labels = _saved_positions(model, named, saved, path, names_path, position_order)

    saved_ids = [key for group in saved["param_groups"] for key in group["params"]]
    for (_, p), pos, label in zip(named, positions, labels, strict=True):
        _check_state_shapes(saved["state"].get(saved_ids[pos], {}), p, label, path)
    # Constructor values are placeholders: load_state_dict replaces them by the saved hyperparameters.
    defaults = {"lr": lr if lr is not None else 1e-3, "weight_decay": weight_decay, "betas": betas, "eps": eps}
    optimizer = _mapped_optimizer(named, positions, saved, path, defaults)
    _drop_unsupported_fused(optimizer, path)

    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    return optimizer

"""Which saved optimizer-state entry belongs to which trainable parameter of the model.

A torch optimizer `state_dict()` numbers parameters 0..N-1 in param-group order and stores no names,
unless it was built from `named_parameters()` (torch then saves `param_names` in every group). The
mapping, in order of preference:

1. by name, from the saved `param_names` (the optimizer file itself) or from this project's
   `optimizer_param_names.json` — names are compared after removing wrapper prefixes
   (`base_model.model.` of a PeftModel, `module.` of DDP, `_orig_mod.` of torch.compile), so that an
   optimizer built on the PeftModel and one built on the model inside it both match;
2. by position in the model's order (`named_parameters()` with requires_grad: this project's and the
   seeds' trainers, one group);
3. by position in a Hugging Face Trainer's order: `Trainer.create_optimizer` makes two groups,
   the parameters that get weight decay first and the others (biases, norms) second, each in
   `named_parameters()` order.

Each function returns, for every trainable parameter in model order, its flat position among the
saved entries; the caller checks every moment's shape against its parameter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..errors import OptimizerStateError

__all__ = ["canonical_param_name", "decay_parameter_names", "map_by_name", "map_by_position",
           "saved_group_names"]

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
# transformers' Trainer.get_decay_parameter_names (5.x): no decay for nn.LayerNorm and for these names.
_NO_DECAY_NAME_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]

TRAINER_ORDER = "Trainer order: decay then no-decay"


def canonical_param_name(name: str) -> str:
    """`name` without leading wrapper prefixes (PeftModel `base_model.model.`, DDP, torch.compile)."""
    stripped = True
    while stripped:
        stripped = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, stripped = name[len(prefix):], True
    return name


def saved_group_names(saved: dict[str, Any], path: Path) -> list[str] | None:
    """The `param_names` torch saved in every param group, flattened; None when it saved none."""
    groups = saved["param_groups"]
    if not any("param_names" in g for g in groups):
        return None
    names: list[str] = []
    for index, group in enumerate(groups):
        group_names = group.get("param_names")
        if (not isinstance(group_names, list) or len(group_names) != len(group["params"])
                or not all(isinstance(n, str) for n in group_names)):
            raise OptimizerStateError(f"{path}: param_groups[{index}] has no param_names list matching its "
                                      f"{len(group['params'])} params")
        names.extend(group_names)
    return names


def _canonical_index(names: list[str], what: str, path: Path) -> dict[str, int]:
    index: dict[str, int] = {}
    for i, name in enumerate(names):
        key = canonical_param_name(name)
        if key in index:
            raise OptimizerStateError(f"{path}: {what} {names[index[key]]!r} and {name!r} are the same parameter "
                                      "once wrapper prefixes are removed")
        index[key] = i
    return index


def map_by_name(saved_names: list[str], model_names: list[str], path: Path, listed_in: str) -> list[int]:
    """Saved position of every model parameter, matched by (prefix-normalised) name."""
    saved_index = _canonical_index(saved_names, "saved names", path)
    model_index = _canonical_index(model_names, "parameter names", path)
    unknown = [saved_names[i] for key, i in saved_index.items() if key not in model_index]
    missing = [model_names[i] for key, i in model_index.items() if key not in saved_index]
    if unknown:
        raise OptimizerStateError(f"{path}: {len(unknown)} saved parameter(s) are not trainable parameters of "
                                  f"the model, e.g. {unknown[0]!r} (listed in {listed_in})")
    if missing:
        raise OptimizerStateError(f"{path}: no saved state for {len(missing)} trainable parameter(s), e.g. "
                                  f"{missing[0]!r} (not in {listed_in})")
    return [saved_index[canonical_param_name(name)] for name in model_names]


def decay_parameter_names(model: torch.nn.Module) -> set[str]:
    """Names of the parameters a Hugging Face Trainer gives weight decay (its decay group)."""
    from transformers.trainer_pt_utils import get_parameter_names

    return set(get_parameter_names(model, [torch.nn.LayerNorm], _NO_DECAY_NAME_PATTERNS))


def _trainer_order(model: torch.nn.Module, model_names: list[str], group_sizes: list[int],
                   path: Path) -> list[int]:
    decay = decay_parameter_names(model)
    first = [i for i, name in enumerate(model_names) if name in decay]
    second = [i for i, name in enumerate(model_names) if name not in decay]
    expected = [len(first), len(second)]
    allowed = [expected, [len(first)]] if not second else [expected]  # no no-decay parameters: one group may do
    if group_sizes not in allowed:
        raise OptimizerStateError(
            f"{path}: saved param groups have sizes {group_sizes}, but a Hugging Face Trainer's decay / no-decay "
            f"groups over this model's trainable parameters would have sizes {expected} (another optimizer "
            "set-up or transformers version?); save the optimizer with parameter names to map by name")
    return first + second


def map_by_position(model: torch.nn.Module, model_names: list[str], group_sizes: list[int], path: Path,
                    order: str) -> list[int]:
    """Saved position of every model parameter when the saved state has no names.

    order "model": the saved entries follow `model_names`; "trainer": they follow a Hugging Face
    Trainer's groups (decay parameters first, then the rest).
    """
    n_saved = sum(group_sizes)
    if n_saved != len(model_names):
        raise OptimizerStateError(f"{path} holds state for {n_saved} parameters but the model has "
                                  f"{len(model_names)} trainable parameters (and no parameter names to map "
                                  "by name)")
    if order == "model":
        return list(range(len(model_names)))
    if order != "trainer":
        raise ValueError(f"unknown position order {order!r}")
    saved_order = _trainer_order(model, model_names, group_sizes, path)
    position = [0] * len(model_names)
    for flat, current in enumerate(saved_order):
        position[current] = flat
    return position

"""Another checkpoint of the same run onto a PeftModel already loaded: adapter weights swapped, AdamW loaded.

`entropy-probe sweep` probes many checkpoints of one run; loading the base model once and replacing only
the LoRA weights and the optimizer state is what makes that cheap. `swap_adapter` followed by
`load.load_optimizer` (sweep/policies.py) gives the model, optimizer and lr that `load.load_for_probe` would
give for the same files (tests/test_sweep.py compares every tensor and the optimizer state_dict with a fresh
load): the adapter must have the LoRA configuration (rank, alpha, target modules, ...) and the base model of
the one loaded, else one line names the difference. `saved_lr_ended` tells a checkpoint whose saved lr is 0 (the end of a schedule)
before its optimizer is loaded, so that the sweep can measure only its entropy there.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import CheckpointError
from .adapter import check_adapter_finite, check_adapter_matches_base
from .base_model import BaseModelChoice
from .layout import CheckpointFiles
from .learning_rate import schedule_hint
from .optimizer_state import read_optimizer_file

__all__ = ["check_same_lora", "put_adapter_weights", "saved_lr_ended", "swap_adapter"]

log = logging.getLogger("entropy_experiments.probe")

# LoRA settings that change shapes or the forward: two adapters differing in one of them are not swappable.
_LORA_KEYS = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "fan_in_fan_out", "bias",
              "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "task_type")


def _comparable(value: Any) -> Any:
    """Sets and lists compare by content (peft stores target_modules as either)."""
    if isinstance(value, set | frozenset | list | tuple):
        return sorted(str(v) for v in value)
    return value


def check_same_lora(model: nn.Module, adapter_dir: Path) -> None:
    """CheckpointError naming the first LoRA setting in which `adapter_dir` differs from the loaded adapter."""
    from peft import PeftConfig

    loaded = model.peft_config["default"]
    try:
        saved = PeftConfig.from_pretrained(str(adapter_dir))
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"adapter {adapter_dir}: cannot read adapter_config.json "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    for key in _LORA_KEYS:
        mine, theirs = _comparable(getattr(loaded, key, None)), _comparable(getattr(saved, key, None))
        if mine != theirs:
            raise CheckpointError(f"adapter {adapter_dir}: {key} = {theirs!r} differs from the adapter already "
                                  f"loaded ({mine!r}); the checkpoints of one run must share one LoRA configuration")


def swap_adapter(model: nn.Module, adapter_dir: Path, base: BaseModelChoice, loaded_base: str) -> None:
    """Replace the LoRA weights of `model` (a PeftModel on `loaded_base`) by those saved in `adapter_dir`.

    The same checks as a fresh load: the base model named for this checkpoint must be the one loaded, the
    LoRA configuration the same, every saved tensor must land and every weight be finite.
    """
    if base.name != loaded_base:
        raise CheckpointError(f"adapter {adapter_dir}: base model {base.name!r} (from {base.source}) is not the "
                              f"base model loaded for this sweep ({loaded_base!r})")
    check_same_lora(model, adapter_dir)
    put_adapter_weights(model, adapter_dir, base.name)


def put_adapter_weights(model: nn.Module, adapter_dir: Path, base_name: str) -> None:
    """The LoRA weights saved in `adapter_dir` into `model` (same LoRA configuration: `check_same_lora`): every
    saved tensor must land, every weight be finite (CheckpointError naming `adapter_dir` otherwise)."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    check_adapter_matches_base(model, adapter_dir, base_name)  # the file's tensor names against the model's
    state = load_peft_weights(str(adapter_dir), device="cpu")
    with torch.no_grad():
        result = set_peft_model_state_dict(model, state, adapter_name="default")
    stray = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if stray:
        raise CheckpointError(f"adapter {adapter_dir}: {len(stray)} saved tensors did not land (first: {stray[0]})")
    check_adapter_finite(model, adapter_dir)
    model.set_adapter("default")  # also keeps the LoRA parameters trainable
    model.eval()


def saved_lr_ended(files: CheckpointFiles, config_lr: float | None) -> str | None:
    """Why no step follows this checkpoint (its saved lr is 0.0 in every param group, and the config sets no
    learning_rate), or None. Reads only the optimizer file's param_groups; a missing file is left to the loader."""
    if config_lr is not None or files.optimizer_path is None or not Path(files.optimizer_path).is_file():
        return None
    groups = [g for g in read_optimizer_file(Path(files.optimizer_path))["param_groups"] if g.get("params")]
    lrs = {float(g["lr"].item() if hasattr(g["lr"], "item") else g["lr"]) for g in groups if "lr" in g}
    if not lrs or lrs != {0.0}:
        return None
    hint = schedule_hint(files.trainer_state_path)
    return (f"the saved lr is 0.0 ({hint + ': ' if hint else ''}a schedule that ended): no next step follows this "
            "checkpoint, so δH₁ would be 0 by construction; only its entropy is measured")

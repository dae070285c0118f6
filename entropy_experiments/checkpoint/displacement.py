"""The step the run really took: Δθ = θ_next − θ over the adapter parameters (`displacement_to`).

`predictors.next_checkpoint` names the checkpoint the run reached after the one probed (the sweep fills it in
from the next swept checkpoint). Its LoRA weights are put on the loaded model for a moment — after the same
checks as a sweep's adapter swap: the same base model (adapter_config.json `base_model_name_or_path`), the
same LoRA configuration (rank, alpha, target modules, ...), every saved tensor landing in a parameter of the
same name and shape, every weight finite — then the probed checkpoint's weights are put back exactly. Every
mismatch is one `CheckpointError` line naming the key and the path.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from ..tensors import NamedTensors
from .base_model import resolve_base_model_id, same_base_model
from .layout import adapter_dir_of
from .swap import check_same_lora, put_adapter_weights

__all__ = ["NEXT_CHECKPOINT_KEY", "displacement_to"]

NEXT_CHECKPOINT_KEY = "predictors.next_checkpoint"


def _checked_adapter_dir(model: nn.Module, next_checkpoint: str | Path) -> Path:
    """The next checkpoint's adapter directory, after the base model and LoRA configuration checks."""
    adapter_dir = adapter_dir_of(next_checkpoint)
    loaded = getattr(model, "peft_config", {}).get("default")
    if loaded is None:
        raise CheckpointError("the probed model carries no LoRA adapter: there is no adapter displacement")
    theirs = resolve_base_model_id(None, adapter_dir).name
    mine = loaded.base_model_name_or_path
    if mine is not None and not same_base_model(mine, theirs):
        raise CheckpointError(f"adapter {adapter_dir}: base model {theirs!r} is not the probed checkpoint's "
                              f"({mine!r})")
    check_same_lora(model, adapter_dir)
    return adapter_dir


def displacement_to(model: nn.Module, next_checkpoint: str | Path, names: list[str],
                    params: list[nn.Parameter]) -> NamedTensors:
    """Δθ = θ_next − θ for each trainable parameter (`names`, `params` of the loaded PeftModel `model`), fp32,
    with `model` left exactly as it was. CheckpointError (one line, naming `predictors.next_checkpoint`) when
    the next checkpoint is missing or its adapter does not match the probed one."""
    try:
        adapter_dir = _checked_adapter_dir(model, next_checkpoint)
        before = [p.detach().clone() for p in params]
        try:
            put_adapter_weights(model, adapter_dir, str(adapter_dir))
            after = [p.detach().clone() for p in params]
        except RuntimeError as exc:  # e.g. a size mismatch that the configuration check did not catch
            raise CheckpointError(f"adapter {adapter_dir}: {str(exc).splitlines()[0]}") from exc
        finally:
            with torch.no_grad():
                for p, saved in zip(params, before, strict=True):
                    p.copy_(saved)
    except CheckpointError as exc:
        raise CheckpointError(f"{NEXT_CHECKPOINT_KEY} {next_checkpoint}: {exc}") from exc
    return {n: (a.float() - b.float()) for n, a, b in zip(names, after, before, strict=True)}

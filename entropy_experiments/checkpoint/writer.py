"""Writing a checkpoint in this project's layout (`own`): adapter, AdamW state and parameter names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from .. import io_utils
from .file_names import ADAPTER_SUBDIR, CHECKPOINT_META_FILE, OPTIMIZER_FILE, PARAM_NAMES_FILE

__all__ = ["save_checkpoint"]


def save_checkpoint(model: Any, optimizer: torch.optim.Optimizer, out_dir: str | Path, **meta: Any) -> Path:
    """Write a checkpoint directory that `load_peft_for_probe` + `load_adam_optimizer_from_path` read.

    Layout: `model/` (adapter via save_pretrained), `optimizer.pt` (optimizer.state_dict()),
    `optimizer_param_names.json` ([{"name", "shape"}] in param-group order, names as in
    `model.named_parameters()`), `checkpoint.json` (base_id, step, lr, plus `meta`).
    Every piece is written to a temp name and renamed into place. Returns `out_dir`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    names_by_id = {id(p): name for name, p in model.named_parameters()}
    param_names: list[dict[str, Any]] = []
    for group_index, group in enumerate(optimizer.param_groups):
        for position, p in enumerate(group["params"]):
            if id(p) not in names_by_id:
                raise ValueError(f"optimizer param_groups[{group_index}].params[{position}] "
                                 "is not a parameter of the model being saved")
            param_names.append({"name": names_by_id[id(p)], "shape": list(p.shape)})

    steps = [float(st["step"]) for st in optimizer.state.values() if "step" in st]
    peft_config = getattr(model, "peft_config", {}).get("default")
    info: dict[str, Any] = {
        "base_id": getattr(peft_config, "base_model_name_or_path", None),
        "step": int(max(steps)) if steps else 0,
        "lr": float(optimizer.param_groups[0]["lr"]),
        "optimizer": type(optimizer).__name__,
    }
    info.update(meta)

    io_utils.atomic_replace_dir(out / ADAPTER_SUBDIR, lambda tmp: model.save_pretrained(str(tmp)))
    io_utils.atomic_write(out / OPTIMIZER_FILE, lambda f: torch.save(optimizer.state_dict(), f))
    io_utils.atomic_write_text(out / PARAM_NAMES_FILE, json.dumps(param_names, indent=1) + "\n")
    io_utils.atomic_write_text(out / CHECKPOINT_META_FILE, json.dumps(info, indent=2, sort_keys=True) + "\n")
    return out

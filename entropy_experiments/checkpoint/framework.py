"""Checkpoints of other training frameworks (verl FSDP2), consolidated in memory for the probe.

`consolidate_framework_checkpoint` is the one entry: it reads the checkpoint and writes its adapter where it has no
PEFT one. `read_framework_checkpoint` dispatches on the layout `layout.resolve_checkpoint` recognised and returns a
`FrameworkCheckpoint`: the LoRA weights, the adapter's settings, one torch AdamW state_dict keyed by
parameter name, and the scheduler's lr. `write_peft_adapter` writes the adapter as PEFT's
`save_pretrained` would (adapter_config.json + adapter_model.safetensors) into a scratch directory, so that
the policy loads through the same `load_peft_for_probe` as every other layout.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError
from .file_names import ADAPTER_CONFIG_FILE
from .layout import VERL_FSDP_LAYOUT, CheckpointFiles
from .verl_fsdp import FrameworkCheckpoint, read_verl_actor

__all__ = ["FrameworkCheckpoint", "consolidate_framework_checkpoint", "read_framework_checkpoint",
           "write_peft_adapter"]

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"


def consolidate_framework_checkpoint(files: CheckpointFiles, base_model: str,
                                     scratch: Path) -> tuple[FrameworkCheckpoint, Path]:
    """(the checkpoint consolidated in memory, its PEFT adapter directory — written under `scratch` when the
    framework saved none)."""
    checkpoint = read_framework_checkpoint(files)
    adapter_dir = files.adapter_dir
    if not (adapter_dir / ADAPTER_CONFIG_FILE).is_file():
        adapter_dir = write_peft_adapter(checkpoint, base_model, scratch)
    return checkpoint, adapter_dir


def read_framework_checkpoint(files: CheckpointFiles) -> FrameworkCheckpoint:
    """The consolidated checkpoint of a framework layout (`files.layout` in layout.FRAMEWORK_LAYOUTS)."""
    if files.optimizer_path is None:
        raise CheckpointError(f"{files.adapter_dir}: no {files.layout} optimizer shards")
    if files.layout == VERL_FSDP_LAYOUT:
        return read_verl_actor(files.optimizer_path)
    raise CheckpointError(f"{files.optimizer_path}: no reader for layout {files.layout!r}")


def write_peft_adapter(checkpoint: FrameworkCheckpoint, base_model: str, directory: Path) -> Path:
    """adapter_config.json (peft's LoraConfig with the saved r / lora_alpha / targets) and the LoRA weights."""
    from peft import LoraConfig
    from safetensors.torch import save_file

    settings = checkpoint.lora_settings
    config = LoraConfig(r=settings["r"], lora_alpha=settings["lora_alpha"], task_type=settings["task_type"],
                        target_modules=settings["target_modules"], base_model_name_or_path=base_model).to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else getattr(v, "value", v)) for k, v in config.items()}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=2), encoding="utf-8")
    save_file(checkpoint.adapter_tensors, str(directory / ADAPTER_WEIGHTS_FILE))
    return directory

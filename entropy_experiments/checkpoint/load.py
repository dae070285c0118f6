"""Everything the probe loads from a checkpoint: `locate_checkpoint` (files, base model), then `load_for_probe`.

The files come from `layout.resolve_checkpoint` (the layout decides every file), the base model from
the config or the adapter's own record (`base_model`), then the adapter on the base model (trainable,
fp32 compute: docs/maths.md §7), the AdamW state mapped onto it (`optimizer_state`) and the learning rate of
δH₁ with its provenance (`learning_rate`). Warnings that change how a result must be read are
returned, not logged away, so that the caller keeps them for results.json.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import CheckpointError, OptimizerStateError
from .adapter import load_peft_for_probe
from .base_model import BaseModelChoice, resolve_base_model_id
from .framework import framework_tokenizer_dir, read_framework_checkpoint, write_peft_adapter
from .layout import (
    ADAPTER_CONFIG_FILE,
    FRAMEWORK_LAYOUTS,
    CheckpointFiles,
    checkpoint_info,
    log_checkpoint_files,
    resolve_checkpoint,
)
from .learning_rate import LearningRate, resolve_learning_rate, schedule_hint
from .optimizer_state import (
    fresh_adam_optimizer,
    load_adam_optimizer_from_path,
    load_adam_optimizer_from_state,
)
from .runtime_precision import to_runtime_precision
from .tokenizer_source import choose_tokenizer, load_chosen_tokenizer, tokenizer_info

log = logging.getLogger("entropy_experiments.probe")


@dataclass
class LoadedCheckpoint:
    """The policy, its tokenizer, the AdamW optimizer, the lr of δH₁, what was used (results.json) and warnings."""

    model: nn.Module
    tokenizer: Any
    optimizer: Any
    learning_rate: LearningRate
    files: CheckpointFiles
    info: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


def locate_checkpoint(ck: Any, logger: logging.Logger = log) -> tuple[CheckpointFiles, BaseModelChoice]:
    """The files of the config's `checkpoint` section `ck` (logged) and the base model to load under them."""
    files = resolve_checkpoint(ck.checkpoint_path, ck.adapter_path, ck.optimizer_path)
    log_checkpoint_files(files, logger)
    if files.layout in FRAMEWORK_LAYOUTS and not (files.adapter_dir / ADAPTER_CONFIG_FILE).is_file():
        if ck.base_model is None:
            raise CheckpointError(f"{files.adapter_dir}: a {files.layout} checkpoint does not name its base model; "
                                  "set checkpoint.base_model")
        base = resolve_base_model_id(ck.base_model, None)
    else:
        base = resolve_base_model_id(ck.base_model, files.adapter_dir)
    logger.info("base model: %s (from %s)", base.name, base.source)
    return files, base


def load_for_probe(ck: Any, files: CheckpointFiles, base: BaseModelChoice, config_lr: float | None, *,
                   device_map: str | None = None, runtime_dtype: str = "fp32",
                   logger: logging.Logger = log) -> LoadedCheckpoint:
    """Load what `locate_checkpoint` found; `config_lr` is the config's learning_rate (None: the optimizer's
    saved lr); `device_map` replaces ck.device_map (one GPU per rank). The warnings are returned, not logged."""
    if files.layout in FRAMEWORK_LAYOUTS:
        return _load_framework_checkpoint(ck, files, base, config_lr, device_map=device_map,
                                         runtime_dtype=runtime_dtype, logger=logger)
    model, tokenizer = load_policy(ck, str(files.adapter_dir), base, device_map or ck.device_map, runtime_dtype)
    optimizer, lr, fresh_warning = load_optimizer(ck, model, files, config_lr, logger)
    info = checkpoint_info(files, base, lr)
    info["tokenizer"] = tokenizer_info(choose_tokenizer(files.adapter_dir, base), tokenizer)
    logger.info("tokenizer: from the %s (%s)", info["tokenizer"]["source"].replace("_", " "), info["tokenizer"]["path"])
    return LoadedCheckpoint(model, tokenizer, optimizer, lr, files, info, [fresh_warning] if fresh_warning else [])


def load_policy(ck: Any, adapter_dir: str, base: BaseModelChoice, device_map: str | None,
                runtime_dtype: str = "fp32", tokenizer_dir: Path | None = None) -> tuple[nn.Module, Any]:
    """Base model + LoRA adapter (trainable, active) at `runtime_dtype` (fp32: all upcast; bf16: base bf16,
    adapter fp32 — checkpoint/runtime_precision.py), eval mode (docs/maths.md §7), and the tokenizer (from
    `tokenizer_dir`, default the adapter directory, when it holds one; else the base model's)."""
    try:
        model = load_peft_for_probe(base.name, adapter_dir, use_qlora=ck.use_qlora, dtype=ck.dtype,
                                    device_map=device_map, trust_remote_code=ck.trust_remote_code)
        choice = choose_tokenizer(tokenizer_dir or Path(adapter_dir), base)
        tokenizer = load_chosen_tokenizer(choice, trust_remote_code=ck.trust_remote_code)
    except CheckpointError as exc:
        if base.source == "checkpoint.base_model" or f"base model {base.name!r}" not in str(exc):
            raise
        raise CheckpointError(f"{exc} (the base model came from {base.source}; set checkpoint.base_model "
                              "to load another)") from exc
    if not ck.use_qlora:
        # Stored in bf16/fp16, computed in fp32 unless runtime_dtype says bf16 (then the adapter still in fp32).
        model = to_runtime_precision(model, runtime_dtype).eval()
    return model, tokenizer


def load_optimizer(ck: Any, model: nn.Module, files: CheckpointFiles, config_lr: float | None,
                   logger: logging.Logger = log) -> tuple[Any, LearningRate, str | None]:
    """(the AdamW state mapped onto the model as the layout says, the lr of δH₁, a FRESH OPTIMIZER warning or None).

    A missing state is an error unless checkpoint.allow_fresh_optimizer; a resolved lr of 0 (a
    schedule that ended) is an error here, before any sampling.
    """
    fresh_warning = None
    try:
        if files.optimizer_path is None:
            raise OptimizerStateError(f"optimizer state file not found: {files.sources['optimizer']}; "
                                      "set checkpoint.optimizer_path")
        optimizer = load_adam_optimizer_from_path(
            model, files.optimizer_path, lr=config_lr, param_names_path=files.param_names_path,
            position_order=files.position_order)
    except OptimizerStateError as exc:
        if not ck.allow_fresh_optimizer:
            raise
        fresh_warning = (f"FRESH OPTIMIZER: {exc} — checkpoint.allow_fresh_optimizer is true, so v is the first "
                         "Adam step from zero moments, NOT the step training would take")
        optimizer = fresh_adam_optimizer(model, lr=config_lr or 1e-5)
    lr = resolve_learning_rate(config_lr, optimizer.param_groups, schedule=schedule_hint(files.trainer_state_path))
    if fresh_warning and config_lr is None:
        lr = LearningRate(lr.value, "the fresh optimizer's default (no optimizer state)", None)
    logger.info("learning rate %.6g from %s%s", lr.value, lr.source,
                "" if lr.initial_lr is None else f" (saved initial_lr {lr.initial_lr})")
    return optimizer, lr, fresh_warning


def _load_framework_checkpoint(ck: Any, files: CheckpointFiles, base: BaseModelChoice, config_lr: float | None, *,
                               device_map: str | None, runtime_dtype: str,
                               logger: logging.Logger) -> LoadedCheckpoint:
    """`load_for_probe` of a framework layout: its shards consolidated in memory (framework.py), the adapter
    written to a scratch directory and loaded like any other, the AdamW state mapped by name; the lr is the
    config's, else the scheduler's (the next step's), else the saved param groups'."""
    consolidated = read_framework_checkpoint(files)
    for what, where in consolidated.sources.items():
        logger.info("checkpoint %s: %s — from %s", what, files.optimizer_path, where)
    with tempfile.TemporaryDirectory(prefix="probe-adapter-") as scratch:
        adapter_dir = files.adapter_dir
        if not (adapter_dir / ADAPTER_CONFIG_FILE).is_file():
            adapter_dir = write_peft_adapter(consolidated, base.name, Path(scratch))
        model, tokenizer = load_policy(ck, str(adapter_dir), base, device_map or ck.device_map, runtime_dtype,
                                       tokenizer_dir=framework_tokenizer_dir(files))
    path = files.optimizer_path or files.adapter_dir
    optimizer = load_adam_optimizer_from_state(model, consolidated.optimizer_state, path, lr=config_lr)
    if config_lr is None and consolidated.lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = consolidated.lr
    lr = resolve_learning_rate(config_lr, optimizer.param_groups)
    if config_lr is None and consolidated.lr is not None:
        lr = LearningRate(lr.value, consolidated.sources["learning_rate"], lr.initial_lr)
    logger.info("learning rate %.6g from %s", lr.value, lr.source)
    info = checkpoint_info(files, base, lr)
    info["sources"].update(consolidated.sources)
    choice = choose_tokenizer(framework_tokenizer_dir(files), base)
    info["tokenizer"] = tokenizer_info(choice, tokenizer)
    return LoadedCheckpoint(model, tokenizer, optimizer, lr, files, info, [])

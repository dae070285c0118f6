"""Everything the probe loads from a checkpoint, in one sequence: `load_for_probe`.

    locate          the files, their layout, and the base model they name     (layout.py, base_model.py)
    layout          a framework's shards consolidated in memory, its adapter written to a scratch
                    directory; other layouts are read where they lie              (framework.py)
    base model      + the LoRA adapter on it, trainable, at the runtime precision (adapter.py, runtime_precision.py)
    tokenizer       the checkpoint's own when it holds one, else the base model's (tokenizer_source.py)
    optimizer state the AdamW state mapped onto the adapter                        (optimizer_state.py)
    lr              the lr of δH₁ and where it came from                           (learning_rate.py)

Each step is one call from `load_for_probe`, in that order. `load_policy` and `load_optimizer` are the same
steps for a sweep, which loads the base model once and swaps adapters (sweep/policies.py). Warnings that
change how a result must be read are returned, not logged away, so that the caller keeps them for results.json.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import CheckpointError, OptimizerStateError
from .adapter import load_peft_for_probe
from .base_model import BaseModelChoice, resolve_base_model_id
from .framework import FrameworkCheckpoint, consolidate_framework_checkpoint
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
from .tokenizer_source import load_checkpoint_tokenizer

log = logging.getLogger("entropy_experiments.probe")

FRESH_LR_SOURCE = "the fresh optimizer's default (no optimizer state)"


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


@dataclass(frozen=True)
class LayoutRead:
    """Where the adapter is read from once the layout is read, and a framework checkpoint consolidated in memory
    (None: the optimizer state is read from `files.optimizer_path`)."""

    adapter_dir: Path
    framework: FrameworkCheckpoint | None = None


def load_for_probe(ck: Any, config_lr: float | None, *,
                   before_loading: Callable[[CheckpointFiles, BaseModelChoice], None] | None = None,
                   device_map: str | None = None, runtime_dtype: str = "fp32",
                   logger: logging.Logger = log) -> LoadedCheckpoint:
    """The checkpoint of the config's `checkpoint` section `ck`, step by step (module docstring).

    `config_lr`: the config's learning_rate (None: the optimizer's saved lr); `before_loading(files, base)`: the
    caller's checks that need only the files, run before the minutes of loading; `device_map` replaces
    ck.device_map (one GPU per rank). The warnings are returned, not logged."""
    files, base = locate_checkpoint(ck, logger)
    if before_loading is not None:
        before_loading(files, base)
    with tempfile.TemporaryDirectory(prefix="probe-adapter-") as scratch:
        read = read_layout(files, base, Path(scratch), logger)
        model = load_model(ck, read.adapter_dir, base, device_map or ck.device_map, runtime_dtype)
    tokenizer, tokenizer_entry = load_policy_tokenizer(ck, files.tokenizer_dir, base)
    optimizer, fresh_warning = load_optimizer_state(ck, model, files, read.framework, config_lr)
    lr = learning_rate_of(config_lr, optimizer, files, read.framework, fresh_warning is not None, logger)
    info = checkpoint_info(files, base, lr)
    if read.framework is not None:
        info["sources"].update(read.framework.sources)
    info["tokenizer"] = tokenizer_entry
    return LoadedCheckpoint(model, tokenizer, optimizer, lr, files, info, [fresh_warning] if fresh_warning else [])


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


def read_layout(files: CheckpointFiles, base: BaseModelChoice, scratch: Path, logger: logging.Logger) -> LayoutRead:
    """A framework layout consolidated (its adapter written under `scratch` when it has no PEFT one); any other
    layout is read where it lies."""
    if files.layout not in FRAMEWORK_LAYOUTS:
        return LayoutRead(files.adapter_dir)
    framework, adapter_dir = consolidate_framework_checkpoint(files, base.name, scratch)
    for what, where in framework.sources.items():
        logger.info("checkpoint %s: %s — from %s", what, files.optimizer_path, where)
    return LayoutRead(adapter_dir, framework)


@contextlib.contextmanager
def _naming_the_base_source(base: BaseModelChoice) -> Iterator[None]:
    """A base model that fails to load is named with where that choice came from, unless the config chose it."""
    try:
        yield
    except CheckpointError as exc:
        if base.source == "checkpoint.base_model" or f"base model {base.name!r}" not in str(exc):
            raise
        raise CheckpointError(f"{exc} (the base model came from {base.source}; set checkpoint.base_model "
                              "to load another)") from exc


def load_model(ck: Any, adapter_dir: Path, base: BaseModelChoice, device_map: str | None,
               runtime_dtype: str = "fp32") -> nn.Module:
    """Base model + LoRA adapter (trainable, active) at `runtime_dtype` (fp32: all upcast; bf16: base bf16,
    adapter fp32 — checkpoint/runtime_precision.py), eval mode (docs/maths.md §7)."""
    with _naming_the_base_source(base):
        model = load_peft_for_probe(base.name, str(adapter_dir), use_qlora=ck.use_qlora, dtype=ck.dtype,
                                    device_map=device_map, trust_remote_code=ck.trust_remote_code)
    if not ck.use_qlora:
        # Stored in bf16/fp16, computed in fp32 unless runtime_dtype says bf16 (then the adapter still in fp32).
        model = to_runtime_precision(model, runtime_dtype).eval()
    return model


def load_policy_tokenizer(ck: Any, directory: Path | None, base: BaseModelChoice) -> tuple[Any, dict[str, Any]]:
    """The tokenizer (from `directory` when it holds one, else the base model's) and its results.json entry."""
    with _naming_the_base_source(base):
        return load_checkpoint_tokenizer(directory, base, trust_remote_code=ck.trust_remote_code)


def load_policy(ck: Any, adapter_dir: str, base: BaseModelChoice, device_map: str | None,
                runtime_dtype: str = "fp32") -> tuple[nn.Module, Any]:
    """Base model + adapter (`load_model`) and the tokenizer (`load_policy_tokenizer`) of an adapter directory."""
    model = load_model(ck, Path(adapter_dir), base, device_map, runtime_dtype)
    return model, load_policy_tokenizer(ck, Path(adapter_dir), base)[0]


def load_optimizer_state(ck: Any, model: nn.Module, files: CheckpointFiles, framework: FrameworkCheckpoint | None,
                         config_lr: float | None) -> tuple[Any, str | None]:
    """(the AdamW state mapped onto the model, a FRESH OPTIMIZER warning or None). A framework's state comes
    consolidated, its lr the scheduler's next one; a missing state is an error unless
    checkpoint.allow_fresh_optimizer."""
    if framework is not None:
        lr = config_lr if config_lr is not None else framework.lr
        path = files.optimizer_path or files.adapter_dir
        return load_adam_optimizer_from_state(model, framework.optimizer_state, path, lr=lr), None
    try:
        if files.optimizer_path is None:
            raise OptimizerStateError(f"optimizer state file not found: {files.sources['optimizer']}; "
                                      "set checkpoint.optimizer_path")
        return load_adam_optimizer_from_path(model, files.optimizer_path, lr=config_lr,
                                             param_names_path=files.param_names_path,
                                             position_order=files.position_order), None
    except OptimizerStateError as exc:
        if not ck.allow_fresh_optimizer:
            raise
        warning = (f"FRESH OPTIMIZER: {exc} — checkpoint.allow_fresh_optimizer is true, so v is the first "
                   "Adam step from zero moments, NOT the step training would take")
        return fresh_adam_optimizer(model, lr=config_lr or 1e-5), warning


def learning_rate_of(config_lr: float | None, optimizer: Any, files: CheckpointFiles,
                     framework: FrameworkCheckpoint | None, fresh: bool, logger: logging.Logger) -> LearningRate:
    """The lr of δH₁: the config's, else a framework scheduler's next lr, else the saved param groups'. A
    resolved lr of 0 (a schedule that ended) is an error here, before any sampling."""
    lr = resolve_learning_rate(config_lr, optimizer.param_groups, schedule=schedule_hint(files.trainer_state_path))
    if config_lr is None and framework is not None and framework.lr is not None:
        lr = LearningRate(lr.value, framework.sources["learning_rate"], lr.initial_lr)
    elif config_lr is None and fresh:
        lr = LearningRate(lr.value, FRESH_LR_SOURCE, None)
    logger.info("learning rate %.6g from %s%s", lr.value, lr.source,
                "" if lr.initial_lr is None else f" (saved initial_lr {lr.initial_lr})")
    return lr


def load_optimizer(ck: Any, model: nn.Module, files: CheckpointFiles, config_lr: float | None,
                   logger: logging.Logger = log) -> tuple[Any, LearningRate, str | None]:
    """The optimizer-state and lr steps for a checkpoint read where it lies (a sweep's):
    (optimizer, lr of δH₁, a FRESH OPTIMIZER warning or None)."""
    optimizer, fresh_warning = load_optimizer_state(ck, model, files, None, config_lr)
    lr = learning_rate_of(config_lr, optimizer, files, None, fresh_warning is not None, logger)
    return optimizer, lr, fresh_warning

"""Which files a checkpoint is made of, where the base model comes from, and which learning rate applies.

`checkpoint.checkpoint_path` names whatever the user's trainer wrote (TRAINERS.md "Checkpoint layouts"):

* ``own``: this project's `save_checkpoint` layout — `model/` (the adapter), `optimizer.pt`,
  `optimizer_param_names.json`, `checkpoint.json`;
* ``trainer``: a Hugging Face Trainer / TRL `checkpoint-N/` — adapter_config.json, the adapter weights,
  optimizer.pt, scheduler.pt and trainer_state.json side by side (training_args.bin is a pickle and is
  never opened);
* ``adapter_with_parent_optimizer``: the adapter directory itself with optimizer.pt in its parent
  (the seeds' `step_N/model` + `step_N/optimizer.pt`);
* ``adapter_only``: an adapter directory with no optimizer.pt beside it or in its parent;
* ``explicit``: no checkpoint_path, or both `checkpoint.adapter_path` and `checkpoint.optimizer_path`
  given. Explicit paths always win over what a layout would give.

verl (FSDP-sharded `optim_world_size_W_rank_R.pt`) and DeepSpeed (`*optim_states.pt`, `latest`)
optimizer states are refused with one line naming the file: they need consolidation first.

Everything here only looks at files (and reads two small JSON files); nothing is loaded.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, ConfigError
from .model_loader import (
    ADAPTER_SUBDIR,
    EMBEDDED_MODEL_NAME,
    OPTIMIZER_FILE,
    PARAM_NAMES_FILE,
    embedded_model_dir,
)

__all__ = [
    "LR_FROM_CONFIG",
    "LR_FROM_OPTIMIZER",
    "BaseModelChoice",
    "CheckpointFiles",
    "LearningRate",
    "checkpoint_info",
    "log_checkpoint_files",
    "resolve_base_model_id",
    "resolve_checkpoint",
    "resolve_learning_rate",
    "schedule_hint",
]

ADAPTER_CONFIG_FILE = "adapter_config.json"
SCHEDULER_FILE = "scheduler.pt"
TRAINER_STATE_FILE = "trainer_state.json"
LR_FROM_CONFIG = "config"
LR_FROM_OPTIMIZER = "optimizer param_groups lr (the next step's lr)"

_VERL_SHARD_GLOB = "optim_world_size_*_rank_*.pt"
_DEEPSPEED_GLOB = "*optim_states.pt"


@dataclass(frozen=True)
class CheckpointFiles:
    """The files one checkpoint is made of, and where each came from (`sources`: what -> where from)."""

    layout: str  # own | trainer | adapter_with_parent_optimizer | adapter_only | explicit
    adapter_dir: Path
    optimizer_path: Path | None  # None: no optimizer state anywhere the layout looks
    param_names_path: Path | None = None  # optimizer_param_names.json beside the optimizer state
    scheduler_path: Path | None = None
    trainer_state_path: Path | None = None
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def position_order(self) -> str:
        """How saved state without names maps onto parameters: "trainer" (a Hugging Face Trainer's
        decay / no-decay groups) when trainer_state.json lies beside the optimizer state, else "model"."""
        return "trainer" if self.trainer_state_path is not None else "model"


# ----------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------

def _explicit_adapter_dir(adapter_path: str) -> Path:
    """`checkpoint.adapter_path`: a directory with adapter_config.json, or one whose `model/` has it."""
    path = Path(adapter_path).expanduser()
    if not path.exists():
        raise CheckpointError(f"adapter directory not found: {path}")
    if not path.is_dir():
        raise CheckpointError(f"adapter path is not a directory: {path}")
    if (path / ADAPTER_CONFIG_FILE).is_file():
        return path
    if (path / ADAPTER_SUBDIR / ADAPTER_CONFIG_FILE).is_file():
        return path / ADAPTER_SUBDIR
    raise CheckpointError(f"{path} is not a PEFT adapter (no adapter_config.json)")


def _detect_layout(root: Path) -> tuple[str | None, Path | None, Path | None]:
    """(layout, adapter_dir, directory of the optimizer state) recognised in checkpoint_path `root`."""
    if (root / ADAPTER_CONFIG_FILE).is_file():
        if (root / OPTIMIZER_FILE).is_file() or (root / TRAINER_STATE_FILE).is_file():
            return "trainer", root, root
        if (root.parent / OPTIMIZER_FILE).is_file():
            return "adapter_with_parent_optimizer", root, root.parent
        return "adapter_only", root, None
    if (root / ADAPTER_SUBDIR / ADAPTER_CONFIG_FILE).is_file():
        return "own", root / ADAPTER_SUBDIR, root
    if (root / OPTIMIZER_FILE).is_file():
        return "own", None, root  # the adapter must then come from checkpoint.adapter_path
    return None, None, None


def _sharded_optimizer_file(folders: list[Path]) -> tuple[str, Path] | None:
    """(trainer, file) of a verl / DeepSpeed optimizer state in or under `folders`, if there is one."""
    for folder in folders:
        for pattern in (_VERL_SHARD_GLOB, f"actor/{_VERL_SHARD_GLOB}"):
            hits = sorted(folder.glob(pattern))
            if hits:
                return "verl", hits[0]
        for pattern in (_DEEPSPEED_GLOB, f"global_step*/{_DEEPSPEED_GLOB}"):
            hits = sorted(folder.glob(pattern))
            if hits:
                return "DeepSpeed", hits[0]
        if (folder / "latest").is_file():
            return "DeepSpeed", folder / "latest"
    return None


def _refuse_sharded(kind: str, file: Path) -> CheckpointError:
    what = "FSDP-sharded" if kind == "verl" else "DeepSpeed"
    return CheckpointError(
        f"{file}: a {kind} checkpoint — its {what} optimizer state is not loadable without consolidation; "
        f"consolidate it into one torch optimizer state_dict and set checkpoint.optimizer_path")


def _refuse_named_shard(path: Path) -> None:
    """An explicit optimizer_path naming a verl shard or a DeepSpeed optimizer file is refused by name."""
    if path.match(_VERL_SHARD_GLOB):
        raise _refuse_sharded("verl", path)
    if path.match(_DEEPSPEED_GLOB):
        raise _refuse_sharded("DeepSpeed", path)


def _checkpoint_root(checkpoint_path: str) -> Path:
    root = Path(checkpoint_path).expanduser()
    if not root.exists():
        raise CheckpointError(f"checkpoint directory not found: {root}")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path is not a directory: {root}")
    return root


def _adapter_from_layout(root: Path, adapter_dir: Path | None) -> Path:
    if adapter_dir is not None:
        return adapter_dir
    found = _sharded_optimizer_file([root])
    if found is not None:
        raise _refuse_sharded(*found)
    raise CheckpointError(f"checkpoint {root}: no adapter found (no {ADAPTER_CONFIG_FILE} in it or in its "
                          f"{ADAPTER_SUBDIR}/ subdirectory); set checkpoint.adapter_path")


def _optimizer_from_layout(root: Path, layout: str, opt_dir: Path | None) -> tuple[Path | None, str]:
    """(optimizer path or None, where it came from) for a layout, refusing sharded states."""
    if layout == "adapter_only":
        found = _sharded_optimizer_file([root, root.parent])
        if found is not None:
            raise _refuse_sharded(*found)
        return None, f"looked for {root / OPTIMIZER_FILE} and {root.parent / OPTIMIZER_FILE}"
    candidate = (opt_dir or root) / OPTIMIZER_FILE
    if candidate.is_file():
        where = "parent of checkpoint_path" if candidate.parent != root else "checkpoint_path"
        return candidate, f"{where} ({layout} layout)"
    found = _sharded_optimizer_file([root])
    if found is not None:
        raise _refuse_sharded(*found)
    return candidate, f"checkpoint_path ({layout} layout; the file does not exist)"  # the loader reports it


def resolve_checkpoint(checkpoint_path: str | None, adapter_path: str | None,
                       optimizer_path: str | None) -> CheckpointFiles:
    """The adapter directory, optimizer state and side files of a checkpoint; explicit paths win."""
    if checkpoint_path is None and adapter_path is None:
        raise ConfigError("checkpoint.checkpoint_path (or checkpoint.adapter_path) must be set")
    root = _checkpoint_root(checkpoint_path) if checkpoint_path is not None else None
    layout, found_adapter, opt_dir = _detect_layout(root) if root is not None else (None, None, None)
    sources: dict[str, str] = {}
    if adapter_path is not None:
        adapter_dir, sources["adapter"] = _explicit_adapter_dir(adapter_path), "checkpoint.adapter_path"
    else:
        adapter_dir = _adapter_from_layout(root, found_adapter)
        sources["adapter"] = f"checkpoint_path ({layout} layout)"
    if optimizer_path is not None:
        optimizer, sources["optimizer"] = Path(optimizer_path).expanduser(), "checkpoint.optimizer_path"
        _refuse_named_shard(optimizer)
    elif root is None:
        optimizer, sources["optimizer"] = None, "no checkpoint.checkpoint_path or checkpoint.optimizer_path given"
    else:
        optimizer, sources["optimizer"] = _optimizer_from_layout(root, layout or "own", opt_dir)
    if root is None or (adapter_path is not None and optimizer_path is not None):
        layout = "explicit"
    return _with_side_files(layout or "own", adapter_dir, optimizer, sources)


def _with_side_files(layout: str, adapter_dir: Path, optimizer: Path | None,
                     sources: dict[str, str]) -> CheckpointFiles:
    """Add optimizer_param_names.json, scheduler.pt and trainer_state.json found beside the optimizer."""
    side: dict[str, Path | None] = {"param_names": None, "scheduler": None, "trainer_state": None}
    if optimizer is not None:
        for key, name in (("param_names", PARAM_NAMES_FILE), ("scheduler", SCHEDULER_FILE),
                          ("trainer_state", TRAINER_STATE_FILE)):
            candidate = optimizer.with_name(name)
            if candidate.is_file():
                side[key] = candidate
                sources[key] = "beside the optimizer state"
    return CheckpointFiles(layout=layout, adapter_dir=adapter_dir, optimizer_path=optimizer,
                           param_names_path=side["param_names"], scheduler_path=side["scheduler"],
                           trainer_state_path=side["trainer_state"], sources=sources)


def log_checkpoint_files(files: CheckpointFiles, logger: logging.Logger) -> None:
    """INFO lines: the layout recognised and where every file came from."""
    logger.info("checkpoint layout: %s", files.layout)
    paths = {"adapter": files.adapter_dir, "optimizer": files.optimizer_path, "param_names": files.param_names_path,
             "scheduler": files.scheduler_path, "trainer_state": files.trainer_state_path}
    for what, where in files.sources.items():
        if paths.get(what) is None:
            logger.info("checkpoint %s: none — %s", what, where)
        else:
            logger.info("checkpoint %s: %s — from %s", what, paths[what], where)


# ----------------------------------------------------------------------------------------------
# Base model
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BaseModelChoice:
    """The base model to load, where that choice came from, and a mismatch warning (or None)."""

    name: str
    source: str
    warning: str | None = None


def _adapter_recorded_base(adapter_dir: Path) -> str | None:
    path = adapter_dir / ADAPTER_CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {path}: {' '.join(str(exc).split())}") from exc
    recorded = data.get("base_model_name_or_path") if isinstance(data, dict) else None
    return recorded if isinstance(recorded, str) and recorded.strip() else None


def _canonical_base(name: str) -> str:
    """The embedded name and local directories as resolved paths; hub ids as written."""
    text = str(name).strip()
    if text.lower() == EMBEDDED_MODEL_NAME:
        return str(embedded_model_dir().expanduser().resolve())
    local = Path(text).expanduser()
    return str(local.resolve()) if local.is_dir() else text.rstrip("/")


def resolve_base_model_id(config_base_model: str | None, adapter_dir: Path | None) -> BaseModelChoice:
    """`checkpoint.base_model` if set (warning when it differs from the adapter's record), else the
    adapter_config.json `base_model_name_or_path`; with no adapter at all, the embedded model."""
    if adapter_dir is None:
        if config_base_model is None:
            return BaseModelChoice(EMBEDDED_MODEL_NAME, "default (the embedded model; no checkpoint)")
        return BaseModelChoice(config_base_model, "checkpoint.base_model")
    recorded = _adapter_recorded_base(adapter_dir)
    where = adapter_dir / ADAPTER_CONFIG_FILE
    if config_base_model is None:
        if recorded is None:
            raise CheckpointError(f"{where} names no base_model_name_or_path: set checkpoint.base_model")
        return BaseModelChoice(recorded, f"{where} base_model_name_or_path")
    warning = None
    if recorded is not None and _canonical_base(config_base_model) != _canonical_base(recorded):
        warning = (f"checkpoint.base_model {config_base_model!r} differs from the adapter's base model "
                   f"{recorded!r} ({where} base_model_name_or_path): the adapter may be measured on a base "
                   "it was not trained on")
    return BaseModelChoice(config_base_model, "checkpoint.base_model", warning)


# ----------------------------------------------------------------------------------------------
# Learning rate
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LearningRate:
    """The lr of δH₁ = lr·X̂·v, where it came from, and the schedule's saved initial_lr (if any)."""

    value: float
    source: str
    initial_lr: float | list[float] | None = None


def _float(x: Any) -> float:
    return float(x.item()) if hasattr(x, "item") else float(x)


def _initial_lr(groups: list[dict[str, Any]]) -> float | list[float] | None:
    values = sorted({_float(g["initial_lr"]) for g in groups if "initial_lr" in g})
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def schedule_hint(trainer_state_path: Path | None) -> str | None:
    """'trainer_state.json step N of max_steps M' from a Trainer checkpoint (None without one)."""
    if trainer_state_path is None:
        return None
    try:
        state = json.loads(Path(trainer_state_path).read_text(encoding="utf-8"))
        return f"{TRAINER_STATE_FILE} step {state['global_step']} of max_steps {state['max_steps']}"
    except (OSError, ValueError, KeyError, TypeError):
        return f"{TRAINER_STATE_FILE} unreadable"


def resolve_learning_rate(config_lr: float | None, param_groups: list[dict[str, Any]], *,
                          schedule: str | None = None) -> LearningRate:
    """config `learning_rate` if set, else the saved param-group lr (every non-empty group must agree).

    A saved lr of 0 (a schedule that ended) or a non-positive / non-finite one is a ConfigError asking
    for `learning_rate`: δH₁ would be exactly 0. `schedule` ('trainer_state.json step N of …') only
    enriches that message.
    """
    groups = [g for g in param_groups if len(g.get("params", ())) > 0]
    initial = _initial_lr(groups)
    if config_lr is not None:
        return LearningRate(float(config_lr), LR_FROM_CONFIG, initial)
    lrs = sorted({_float(g["lr"]) for g in groups})
    if not lrs:
        raise ConfigError("learning_rate: the optimizer holds no parameters, so it has no saved lr; set learning_rate")
    if len(lrs) > 1:
        raise ConfigError(f"learning_rate: the optimizer's param groups have different learning rates {lrs}; "
                          "set learning_rate")
    lr = lrs[0]
    if lr == 0.0:
        ended = f"a schedule that ended: {schedule}?" if schedule else "a schedule that ended?"
        was = f" (initial_lr was {initial:g})" if isinstance(initial, float) else ""
        raise ConfigError(f"learning_rate: the optimizer's saved lr is 0.0 ({ended}) — δH₁ would be exactly 0; "
                          f"set learning_rate{was}")
    if not math.isfinite(lr) or lr < 0:
        raise ConfigError(f"learning_rate: the optimizer's saved lr is {lr!r}, not a positive number; "
                          "set learning_rate")
    return LearningRate(lr, LR_FROM_OPTIMIZER, initial)


def checkpoint_info(files: CheckpointFiles, base: BaseModelChoice, lr: LearningRate) -> dict[str, Any]:
    """The JSON-safe `checkpoint` entry of results.json."""
    paths = {"adapter": files.adapter_dir, "optimizer": files.optimizer_path, "param_names": files.param_names_path,
             "scheduler": files.scheduler_path, "trainer_state": files.trainer_state_path}
    return {"layout": files.layout,
            "files": {k: str(v) for k, v in paths.items() if v is not None},
            "sources": dict(files.sources),
            "base_model": base.name, "base_model_source": base.source,
            "learning_rate_source": lr.source, "initial_lr": lr.initial_lr}

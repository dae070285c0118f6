"""Which files a checkpoint is made of.

`checkpoint.checkpoint_path` names whatever the user's trainer wrote (docs/user-guide.md "Checkpoints"):

* ``own``: this project's `save_checkpoint` layout — `model/` (the adapter), `optimizer.pt`,
  `optimizer_param_names.json`, `checkpoint.json`;
* ``trainer``: a Hugging Face Trainer / TRL `checkpoint-N/` — adapter_config.json, the adapter weights,
  optimizer.pt, scheduler.pt and trainer_state.json side by side (training_args.bin is a pickle and is
  never opened);
* ``adapter_with_parent_optimizer``: the adapter directory itself with optimizer.pt in its parent
  (the seeds' `step_N/model` + `step_N/optimizer.pt`);
* ``adapter_only``: an adapter directory with no optimizer.pt beside it or in its parent;
* ``verl_fsdp``: a verl FSDP2 actor, `global_step_N/actor/` (or `global_step_N/`): the ranks' model and
  optimizer shards, `fsdp_config.json`, `lora_train_meta.json`; `adapter_dir` and `optimizer_path` are then
  that directory, read by verl_fsdp.py when loaded;
* ``explicit``: no checkpoint_path, or both `checkpoint.adapter_path` and `checkpoint.optimizer_path`
  given. Explicit paths always win over what a layout would give.

Other verl shards (FSDP1, or files without fsdp_config.json) and DeepSpeed (`*optim_states.pt`, `latest`)
optimizer states are refused with one line naming the file and the consolidation command.

Everything here only looks at files; nothing is loaded.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError, ConfigError
from .file_names import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_SUBDIR,
    CHECKPOINT_META_FILE,
    OPTIMIZER_FILE,
    PARAM_NAMES_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
)
from .verl_fsdp import is_verl_actor_dir

if TYPE_CHECKING:
    from .base_model import BaseModelChoice
    from .learning_rate import LearningRate

# the file names (file_names.py) are part of what a layout is, and are importable from here with it
__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_SUBDIR",
    "CHECKPOINT_META_FILE",
    "FRAMEWORK_LAYOUTS",
    "OPTIMIZER_FILE",
    "PARAM_NAMES_FILE",
    "SCHEDULER_FILE",
    "TRAINER_STATE_FILE",
    "VERL_FSDP_LAYOUT",
    "CheckpointFiles",
    "adapter_dir_of",
    "checkpoint_info",
    "log_checkpoint_files",
    "resolve_checkpoint",
]

VERL_FSDP_LAYOUT = "verl_fsdp"
FRAMEWORK_LAYOUTS = (VERL_FSDP_LAYOUT,)  # read shard by shard and consolidated in memory when loaded

_VERL_SHARD_GLOB = "optim_world_size_*_rank_*.pt"
_DEEPSPEED_GLOB = "*optim_states.pt"


@dataclass(frozen=True)
class CheckpointFiles:
    """The files one checkpoint is made of, and where each came from (`sources`: what -> where from)."""

    layout: str  # own | trainer | adapter_with_parent_optimizer | adapter_only | explicit | verl_fsdp
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

    @property
    def tokenizer_dir(self) -> Path:
        """Where the trainer saved its tokenizer, if it saved one: verl beside its shards (`huggingface/`), every
        other layout in the adapter directory (tokenizer_source.py decides whether one is there)."""
        if self.layout == VERL_FSDP_LAYOUT and self.optimizer_path is not None:
            return self.optimizer_path / "huggingface"
        return self.adapter_dir


# ----------------------------------------------------------------------------------------------
# Layouts
# ----------------------------------------------------------------------------------------------

def adapter_dir_of(adapter_path: str | Path) -> Path:
    """The directory holding adapter_config.json: `adapter_path` itself, or its `model/` subdir
    (so a checkpoint written by `save_checkpoint` can be passed as a whole)."""
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


def _framework_dir(root: Path) -> Path | None:
    """The verl FSDP actor directory at or under `root` (`global_step_N/` or `global_step_N/actor/`)."""
    for candidate in (root, root / "actor"):
        if is_verl_actor_dir(candidate):
            return candidate
    return None


def _detect_layout(root: Path) -> tuple[str | None, Path | None, Path | None]:
    """(layout, adapter_dir, directory of the optimizer state) recognised in checkpoint_path `root`."""
    framework = _framework_dir(root)
    if framework is not None:
        return VERL_FSDP_LAYOUT, framework, framework
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


_CONSOLIDATE = {
    "verl": ("the probe reads verl FSDP2 actors directly (fsdp_config.json beside the shards, strategy fsdp2); "
             "for this one `python -m verl.model_merger merge --backend fsdp --local_dir <actor> --target_dir "
             "<out>` gives the adapter but no AdamW moments"),
    "DeepSpeed": ("`python -m deepspeed.checkpoint.ds_to_universal --input_folder <global_stepN> --output_folder "
                  "<out>` writes per-parameter zero/<name>/exp_avg.pt, exp_avg_sq.pt (zero_to_fp32.py drops them)"),
}


def _refuse_sharded(kind: str, file: Path) -> CheckpointError:
    what = "FSDP-sharded" if kind == "verl" else "DeepSpeed"
    return CheckpointError(
        f"{file}: a {kind} checkpoint — its {what} optimizer state is not loadable without consolidation; "
        f"consolidate it into one torch optimizer state_dict (name → exp_avg, exp_avg_sq, step) and set "
        f"checkpoint.optimizer_path: {_CONSOLIDATE[kind]}")


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


RUN_CHECKPOINT = re.compile(r"(?:checkpoint-|step_)(\d+)")


def saved_checkpoints(run_dir: Path) -> list[Path]:
    """The `checkpoint-N/` / `step_N/` subdirectories of a training run that hold an adapter, by step N."""
    found = [(int(m.group(1)), p) for p in run_dir.iterdir() if p.is_dir()
             and (m := RUN_CHECKPOINT.fullmatch(p.name)) and _holds_adapter(p)]
    return [p for _, p in sorted(found)]


def _holds_adapter(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG_FILE).is_file() or (folder / ADAPTER_SUBDIR / ADAPTER_CONFIG_FILE).is_file()


def _adapter_from_layout(root: Path, adapter_dir: Path | None) -> Path:
    if adapter_dir is not None:
        return adapter_dir
    found = _sharded_optimizer_file([root])
    if found is not None:
        raise _refuse_sharded(*found)
    saved = saved_checkpoints(root)
    if saved:
        latest = ", ".join(p.name for p in saved[-3:])
        raise CheckpointError(f"checkpoint {root} is a training run, not one checkpoint: set checkpoint_path to one "
                              f"of its checkpoint-N/ directories (latest: {latest}), or probe them all with "
                              f"`entropy-probe sweep {root}`")
    raise CheckpointError(f"checkpoint {root}: no adapter found (no {ADAPTER_CONFIG_FILE} in it or in its "
                          f"{ADAPTER_SUBDIR}/ subdirectory); set checkpoint.adapter_path")


def _optimizer_from_layout(root: Path, layout: str, opt_dir: Path | None) -> tuple[Path | None, str]:
    """(optimizer path or None, where it came from) for a layout, refusing sharded states."""
    if layout == "adapter_only":
        found = _sharded_optimizer_file([root, root.parent])
        if found is not None:
            raise _refuse_sharded(*found)
        return None, f"looked for {root / OPTIMIZER_FILE} and {root.parent / OPTIMIZER_FILE}"
    if layout in FRAMEWORK_LAYOUTS:
        return opt_dir, f"checkpoint_path ({layout} layout: the ranks' shards, consolidated when loaded)"
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
        adapter_dir, sources["adapter"] = adapter_dir_of(adapter_path), "checkpoint.adapter_path"
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
    if optimizer is not None and layout not in FRAMEWORK_LAYOUTS:
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


def checkpoint_info(files: CheckpointFiles, base: BaseModelChoice, lr: LearningRate) -> dict[str, Any]:
    """The JSON-safe `checkpoint` entry of results.json."""
    paths = {"adapter": files.adapter_dir, "optimizer": files.optimizer_path, "param_names": files.param_names_path,
             "scheduler": files.scheduler_path, "trainer_state": files.trainer_state_path}
    return {"layout": files.layout,
            "files": {k: str(v) for k, v in paths.items() if v is not None},
            "sources": dict(files.sources),
            "base_model": base.name, "base_model_source": base.source,
            "learning_rate_source": lr.source, "initial_lr": lr.initial_lr}

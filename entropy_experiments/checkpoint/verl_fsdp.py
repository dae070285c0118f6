"""A verl FSDP actor checkpoint (`global_step_N/actor/`) read back into one adapter and one AdamW state.

What verl's FSDPCheckpointManager (verl 0.9.1) writes, every rank its own files (`W` ranks):

* `model_world_size_W_rank_R.pt`: the rank's `model.state_dict()` — the PEFT model's weights (base and
  LoRA, or LoRA only with `checkpoint.save_lora_only`);
* `optim_world_size_W_rank_R.pt`: the rank's `optimizer.state_dict()` — a torch AdamW built on
  `module.parameters()` (every parameter, frozen ones included, in `named_parameters()` order), with
  exp_avg / exp_avg_sq for the trainable ones;
* `extra_state_world_size_W_rank_R.pt`: `{"lr_scheduler": scheduler.state_dict(), "rng": ...}`;
* `fsdp_config.json` {FSDP_version, world_size}, `lora_train_meta.json` {r, lora_alpha, task_type},
  `huggingface/` (model config and tokenizer).

With FSDP2 (`strategy: fsdp2`) every tensor is a DTensor on a 1-D mesh, sharded on one dimension
(Shard(0) unless verl's shard placement chose another): the full tensor is the ranks' local tensors
concatenated on that dimension in rank order. FSDP1 saves ShardedTensors of flat parameters, which map back to
names only through FSDP's own flat-parameter metadata: refused, with the consolidation command.

Every file is read with weights_only=True (DTensors need only `torch.distributed.tensor` imported).
"""

from __future__ import annotations

import json
import logging
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, OptimizerStateError
from .messages import first_line

__all__ = ["FSDP_CONFIG_FILE", "LORA_META_FILE", "FrameworkCheckpoint", "is_verl_actor_dir", "read_verl_actor"]

log = logging.getLogger("entropy_experiments.probe")

FSDP_CONFIG_FILE = "fsdp_config.json"
LORA_META_FILE = "lora_train_meta.json"
MERGE_COMMAND = ("python -m verl.model_merger merge --backend fsdp --local_dir {dir} --target_dir <out> "
                 "(weights and adapter only: verl has no tool that consolidates the AdamW moments)")


@dataclass
class FrameworkCheckpoint:
    """A framework checkpoint consolidated in memory: the LoRA weights (PEFT adapter keys), the adapter's
    LoRA settings, a torch AdamW state_dict with `param_names` over the trainable parameters, the lr of
    the next step and where each came from."""

    adapter_tensors: dict[str, torch.Tensor]
    lora_settings: dict[str, Any]
    optimizer_state: dict[str, Any]
    lr: float | None
    sources: dict[str, str] = field(default_factory=dict)


def _rank_file(actor: Path, kind: str, world: int, rank: int) -> Path:
    return actor / f"{kind}_world_size_{world}_rank_{rank}.pt"


def is_verl_actor_dir(path: Path) -> bool:
    """Whether `path` holds verl FSDP shards (an `fsdp_config.json` and rank-0 optimizer / model files)."""
    return (path / FSDP_CONFIG_FILE).is_file() and any(path.glob("optim_world_size_*_rank_0.pt"))


def _load(path: Path) -> Any:
    """torch.load(weights_only=True) of one rank file, with one-line errors."""
    import torch.distributed.tensor

    if not path.is_file():
        raise CheckpointError(f"verl checkpoint file missing: {path}")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(f"refused to unpickle {path}: it holds objects that are not tensors "
                              f"({first_line(exc)})") from exc
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {first_line(exc)}") from exc


def _gathered(shards: list[Any], what: str) -> Any:
    """The full tensor of one entry saved by every rank (DTensor shards or identical plain values)."""
    first = shards[0]
    placements = getattr(first, "placements", None)
    if placements is None:
        return first
    if len(placements) != 1:
        raise CheckpointError(f"{what}: a DTensor on a {len(placements)}-D device mesh (HSDP?) is not supported")
    local = [s.to_local() for s in shards]
    placement = placements[0]
    if placement.is_replicate():
        return local[0]
    if not placement.is_shard():
        raise CheckpointError(f"{what}: DTensor placement {placement} is neither Shard nor Replicate")
    full = torch.cat(local, dim=placement.dim)
    if tuple(full.shape) != tuple(first.shape):
        raise CheckpointError(f"{what}: the ranks' shards make shape {tuple(full.shape)}, the DTensor says "
                              f"{tuple(first.shape)}")
    return full


def _fsdp_config(actor: Path) -> tuple[int, int]:
    try:
        cfg = json.loads((actor / FSDP_CONFIG_FILE).read_text(encoding="utf-8"))
        return int(cfg["FSDP_version"]), int(cfg["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{actor / FSDP_CONFIG_FILE}: unreadable ({first_line(exc)})") from exc


def _lora_settings(actor: Path) -> dict[str, Any]:
    path = actor / LORA_META_FILE
    if not path.is_file():
        raise CheckpointError(f"{actor}: no {LORA_META_FILE} (verl writes it for a LoRA actor): this is not a LoRA "
                              "run, or an older verl; merge it with " + MERGE_COMMAND.format(dir=actor))
    meta = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(meta, dict) or int(meta.get("r", 0)) <= 0 or not meta.get("lora_alpha"):
        raise CheckpointError(f"{path}: needs a positive r and lora_alpha, has {meta}")
    return {"r": int(meta["r"]), "lora_alpha": meta["lora_alpha"], "task_type": meta.get("task_type") or "CAUSAL_LM"}


def _gathered_model(actor: Path, world: int) -> dict[str, torch.Tensor]:
    shards = [_load(_rank_file(actor, "model", world, r)) for r in range(world)]
    return {key: _gathered([s[key] for s in shards], f"{actor} {key}") for key in shards[0]}


def _state_names(model_keys: list[str], group_params: list[int], stateful: list[int], path: Path) -> dict[int, str]:
    """Name of every optimizer entry that has state: the optimizer was built on `module.parameters()`, so entry i
    is the model's i-th parameter (full state dict) — or, for a LoRA-only model file, the stateful entries are
    the saved LoRA weights in order."""
    if len(model_keys) == len(group_params):
        return {i: model_keys[pos] for pos, i in enumerate(group_params) if i in set(stateful)}
    if len(model_keys) == len(stateful):
        return dict(zip(stateful, model_keys, strict=True))
    raise OptimizerStateError(f"{path}: {len(group_params)} optimizer entries ({len(stateful)} with state) do not "
                              f"match the {len(model_keys)} tensors of the model files; cannot name them")


def _gathered_optimizer(actor: Path, world: int, model: dict[str, torch.Tensor]) -> dict[str, Any]:
    path = _rank_file(actor, "optim", world, 0)
    shards = [_load(_rank_file(actor, "optim", world, r)) for r in range(world)]
    saved = shards[0]
    if not isinstance(saved, dict) or "state" not in saved or "param_groups" not in saved:
        raise OptimizerStateError(f"{path} is not an optimizer state_dict (no 'state'/'param_groups')")
    group_params = [i for g in saved["param_groups"] for i in g["params"]]
    stateful = [i for i in group_params if saved["state"].get(i)]
    names = _state_names(list(model), group_params, stateful, path)
    state = {}
    for i in stateful:
        entry = {k: _gathered([s["state"][i][k] for s in shards], f"{path} {names[i]} {k}")
                 for k in saved["state"][i]}
        if tuple(entry["exp_avg"].shape) != tuple(model[names[i]].shape):
            raise OptimizerStateError(f"{path}: exp_avg of {names[i]!r} has shape {tuple(entry['exp_avg'].shape)}, "
                                      f"the weight {tuple(model[names[i]].shape)}")
        state[names[i]] = entry
    groups = []
    for group in saved["param_groups"]:
        members = [names[i] for i in group["params"] if i in names]
        if members:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "param_names": members})
    flat = [n for g in groups for n in g["param_names"]]
    for index, group in enumerate(groups):
        group["params"] = [flat.index(n) for n in group["param_names"]]
    return {"state": {flat.index(n): s for n, s in state.items()}, "param_groups": groups}


def _scheduler_lr(actor: Path, world: int, sources: dict[str, str]) -> float | None:
    """The scheduler's `_last_lr` (the lr of the next step) from extra_state; None when unreadable."""
    path = _rank_file(actor, "extra_state", world, 0)
    try:
        with torch.serialization.safe_globals(_numpy_rng_globals()):
            extra = torch.load(path, map_location="cpu", weights_only=True)
        last = extra["lr_scheduler"]["_last_lr"]
    except (OSError, RuntimeError, pickle.UnpicklingError, KeyError, TypeError) as exc:  # absent, unsafe, no scheduler
        sources["learning_rate"] = f"the optimizer's param groups ({path.name} unreadable: {first_line(exc)})"
        return None
    values = sorted({float(v) for v in last})
    if len(values) != 1:
        return None
    sources["learning_rate"] = f"{path} lr_scheduler _last_lr"
    return values[0]


def _numpy_rng_globals() -> list[Any]:
    """numpy's array reconstruction (the RNG state verl saves beside the scheduler): data, no code."""
    import numpy as np

    multiarray = getattr(np, "_core", np).multiarray
    return [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def _peft_key(name: str) -> str:
    """A PeftModel state-dict key as `save_pretrained` writes it (the adapter name dropped)."""
    return name.replace(".default.weight", ".weight").replace(".default.bias", ".bias")


def read_verl_actor(actor: Path) -> FrameworkCheckpoint:
    """The adapter and AdamW state of a verl FSDP2 LoRA actor directory, gathered from all ranks."""
    version, world = _fsdp_config(actor)
    if version != 2:
        raise CheckpointError(f"{actor}: FSDP{version} checkpoint (flat-parameter shards) — only FSDP2 "
                              f"(actor strategy fsdp2) is read directly; merge the weights with "
                              + MERGE_COMMAND.format(dir=actor))
    settings = _lora_settings(actor)
    model = _gathered_model(actor, world)
    lora = {k: v for k, v in model.items() if "lora_" in k}
    if not lora:
        raise CheckpointError(f"{actor}: the model files hold no LoRA weights")
    optimizer = _gathered_optimizer(actor, world, model)
    sources = {"adapter": f"{world} model_world_size_{world}_rank_*.pt shards + {LORA_META_FILE}",
               "optimizer": f"{world} optim_world_size_{world}_rank_*.pt shards (FSDP2 DTensors gathered)"}
    lr = _scheduler_lr(actor, world, sources)
    settings["target_modules"] = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in lora})
    return FrameworkCheckpoint({_peft_key(k): v.contiguous() for k, v in lora.items()}, settings, optimizer, lr,
                               sources)

"""Which learning rate δH₁ = lr·X̂·v uses, and where it came from (config or the saved param groups)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .file_names import TRAINER_STATE_FILE

__all__ = ["LR_FROM_CONFIG", "LR_FROM_OPTIMIZER", "LearningRate", "resolve_learning_rate", "schedule_hint"]

LR_FROM_CONFIG = "config"
LR_FROM_OPTIMIZER = "optimizer param_groups lr (the next step's lr)"


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


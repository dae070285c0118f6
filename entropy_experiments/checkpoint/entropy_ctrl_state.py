"""TRL's adaptive entropy controller state saved with a checkpoint (`entropy_ctrl_state.json`).

GRPOTrainer (trl 1.16.0, grpo_trainer.py `_save_checkpoint`) writes {"entropy_coef", "last_world_entropy"} into every
checkpoint of a run with `use_adaptive_entropy`: the coefficient after the last step's update and the entropy of that
step's window. The next step applies the coefficient only when that entropy ≤ `entropy_target`
(estimators/entropy_terms.adaptive_entropy_coef), so the probe reads both here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..errors import ConfigError

__all__ = ["STATE_FILE", "read_entropy_ctrl_state"]

STATE_FILE = "entropy_ctrl_state.json"


def read_entropy_ctrl_state(checkpoint_path: str | Path) -> tuple[float, float]:
    """(entropy_coef, last_world_entropy) from the checkpoint's entropy_ctrl_state.json; ConfigError (one line) when
    the file is absent or not TRL's."""
    root = Path(checkpoint_path)
    path = (root if root.is_dir() else root.parent) / STATE_FILE
    if not path.is_file():
        raise ConfigError(f"objective.use_adaptive_entropy: true, but {path} does not exist (TRL saves it with every "
                          "checkpoint of an adaptive run; set objective.use_adaptive_entropy: false and "
                          "objective.entropy_coef to the coefficient the run applies at this step)")
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        coef, last = float(state["entropy_coef"]), float(state["last_world_entropy"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: not TRL's entropy controller state ({type(exc).__name__}: {exc}); expected "
                          '{"entropy_coef": float, "last_world_entropy": float}') from None
    if math.isnan(coef) or math.isnan(last) or coef < 0:
        raise ConfigError(f"{path}: entropy_coef {coef!r} / last_world_entropy {last!r} are not a controller state")
    return coef, last

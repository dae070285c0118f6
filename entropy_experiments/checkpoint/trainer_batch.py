"""Does U (B_U prompts × G) have the size of the trainer's optimizer step? SE_U and a sweep's comparison with
the run assume it does.

The trainer's completions per step come from `objective.trainer_batch_completions` (TRL:
per_device_train_batch_size × processes × gradient_accumulation_steps) or, when unset, only partly from the
checkpoint's trainer_state.json: its `train_batch_size` is the per-device batch × devices, before gradient
accumulation (training_args.bin, which holds the rest, is a pickle and never opened).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .file_names import CHECKPOINT_META_FILE, TRAINER_STATE_FILE


def saved_train_batch_size(trainer_state_path: Path | None) -> int | None:
    """`train_batch_size` of a trainer_state.json (None when absent or unreadable)."""
    if trainer_state_path is None:
        return None
    try:
        value = json.loads(Path(trainer_state_path).read_text()).get("train_batch_size")
    except (OSError, ValueError, AttributeError):
        return None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def recorded_trainer_batch(checkpoint_dir: Path) -> tuple[int | None, str]:
    """(sequences per optimizer step of the run that wrote `checkpoint_dir`, where that came from): make-checkpoint's
    checkpoint.json `data` B_U·G, else trainer_state.json `train_batch_size` (before gradient accumulation)."""
    try:
        data = json.loads((Path(checkpoint_dir) / CHECKPOINT_META_FILE).read_text(encoding="utf-8"))["data"]
        value = int(data["B_U"]) * int(data["G"])
        if value > 0:
            return value, f"{CHECKPOINT_META_FILE} (data B_U·G)"
    except (OSError, ValueError, KeyError, TypeError):
        pass
    saved = saved_train_batch_size(Path(checkpoint_dir) / TRAINER_STATE_FILE)
    if saved is not None:
        return saved, f"{TRAINER_STATE_FILE} (train_batch_size)"
    return None, "not recorded in the checkpoint"


def trainer_batch_record(configured: int | None, trainer_state_path: Path | None, B_U: int,
                         G: int) -> tuple[dict[str, Any], str | None]:
    """(the `counts.trainer_batch` entry of results.json, a warning when U's size is not the trainer's step)."""
    u = B_U * G
    saved = saved_train_batch_size(trainer_state_path)
    record = {"U_completions": u, "trainer_step_completions": configured, "trainer_state_train_batch_size": saved,
              "source": "objective.trainer_batch_completions" if configured is not None else None}
    if configured is not None:
        if configured != u:
            return record, (f"U has B_U×G = {u} completions but the trainer's step has {configured} "
                            "(objective.trainer_batch_completions): SE_U and the comparison with the run are for a "
                            "step of U's size, not the trainer's")
        return record, None
    if saved is not None and saved > u:
        return record, (f"U has B_U×G = {u} completions but the trainer's per-step batch is at least {saved} "
                        "(trainer_state.json train_batch_size, before gradient accumulation); set "
                        "objective.trainer_batch_completions to the trainer's completions per step to compare")
    return record, None

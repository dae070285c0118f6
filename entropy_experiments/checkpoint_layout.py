"""Kept so existing imports work: `entropy_experiments.checkpoint_layout`.

The code lives in `entropy_experiments.checkpoint`: `layout` (which files a checkpoint is made of),
`base_model` (the base model from the config or adapter_config.json) and `learning_rate` (the lr's
provenance).
"""

from .checkpoint.base_model import BaseModelChoice, resolve_base_model_id
from .checkpoint.layout import (
    ADAPTER_CONFIG_FILE,
    SCHEDULER_FILE,
    TRAINER_STATE_FILE,
    CheckpointFiles,
    checkpoint_info,
    log_checkpoint_files,
    resolve_checkpoint,
)
from .checkpoint.learning_rate import (
    LR_FROM_CONFIG,
    LR_FROM_OPTIMIZER,
    LearningRate,
    resolve_learning_rate,
    schedule_hint,
)

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "LR_FROM_CONFIG",
    "LR_FROM_OPTIMIZER",
    "SCHEDULER_FILE",
    "TRAINER_STATE_FILE",
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

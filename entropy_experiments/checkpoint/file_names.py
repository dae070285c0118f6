"""The names of the files a checkpoint is made of (docs/user-guide.md "Checkpoints").

A module of names only, so that every module that reads or writes one of these files imports them from here and
none of them has to import `layout` (which recognises layouts and, for results.json, names the base model and
the lr) to know a file name.
"""

from __future__ import annotations

__all__ = ["ADAPTER_CONFIG_FILE", "ADAPTER_SUBDIR", "CHECKPOINT_META_FILE", "OPTIMIZER_FILE", "PARAM_NAMES_FILE",
           "SCHEDULER_FILE", "TRAINER_STATE_FILE"]

OPTIMIZER_FILE = "optimizer.pt"
PARAM_NAMES_FILE = "optimizer_param_names.json"
CHECKPOINT_META_FILE = "checkpoint.json"
ADAPTER_SUBDIR = "model"
ADAPTER_CONFIG_FILE = "adapter_config.json"
SCHEDULER_FILE = "scheduler.pt"
TRAINER_STATE_FILE = "trainer_state.json"

"""Which checkpoints a training run left in a directory, in step order (`find_checkpoints`).

Recognised subdirectories of `--checkpoints DIR` (one level down):

* `checkpoint-N/`: a Hugging Face Trainer / TRL checkpoint (adapter files, optimizer.pt, trainer_state.json);
* `global_step_N/` (also `global_stepN/`): verl's, with the FSDP2 actor in `actor/` (checkpoint/verl_fsdp.py);
* `step_N/` (also `step-N/`): the seeds' layout (`step_N/model/` + `step_N/optimizer.pt`) and this
  project's (`entropy-probe make-checkpoint --save-every K`, `save_checkpoint`).

The step is trainer_state.json's `global_step` when there is one, else checkpoint.json's `step`, else the
N of the name. Every checkpoint's files are resolved here (checkpoint/layout.py), so that a directory that
is not a checkpoint, or one without an optimizer state, stops the sweep with one line before any model is
loaded. Nothing is loaded here.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ..checkpoint.layout import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_SUBDIR,
    CHECKPOINT_META_FILE,
    FRAMEWORK_LAYOUTS,
    TRAINER_STATE_FILE,
    CheckpointFiles,
    resolve_checkpoint,
)
from ..errors import CheckpointError, ConfigError

__all__ = ["SweepCheckpoint", "find_checkpoints", "select_every"]

log = logging.getLogger("entropy_experiments.sweep")

CHECKPOINT_NAME = re.compile(r"^(?:checkpoint-|step[_-]|global_step_?)(\d+)$")


@dataclass(frozen=True)
class SweepCheckpoint:
    """One checkpoint of the run: its directory, training step, where the step came from, and its files."""

    name: str
    path: Path
    step: int
    step_source: str
    files: CheckpointFiles


def _read_int(path: Path, key: str) -> int | None:
    """`key` of the JSON file `path` as an int; None when the file is absent; CheckpointError when unreadable."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text(encoding="utf-8"))[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or int(value) != value:
            raise ValueError(f"{key} = {value!r} is not an integer")
        return int(value)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"unreadable checkpoint {path.parent}: {path.name} has no usable {key!r} "
                              f"({type(exc).__name__}: {exc})") from exc


def checkpoint_step(path: Path, name_step: int) -> tuple[int, str]:
    """(step, where it came from) of the checkpoint directory `path` named with step `name_step`."""
    for file, key in ((path / TRAINER_STATE_FILE, "global_step"), (path / CHECKPOINT_META_FILE, "step")):
        step = _read_int(file, key)
        if step is not None:
            if step != name_step:
                log.warning("checkpoint %s: %s says %s = %d, its name says %d; using %d", path, file.name, key,
                            step, name_step, step)
            return step, f"{file.name} {key}"
    return name_step, "directory name"


def _checkpoint_files(path: Path, allow_fresh_optimizer: bool) -> CheckpointFiles:
    """The checkpoint's files (layout.py); an adapter or an optimizer state missing is one line naming `path`."""
    framework = resolve_checkpoint(str(path), None, None) if (path / "actor").is_dir() else None
    if framework is not None and framework.layout in FRAMEWORK_LAYOUTS:
        return framework  # verl's global_step_N/actor/ (checkpoint/verl_fsdp.py)
    if not ((path / ADAPTER_CONFIG_FILE).is_file() or (path / ADAPTER_SUBDIR / ADAPTER_CONFIG_FILE).is_file()):
        raise CheckpointError(f"unreadable checkpoint {path}: no {ADAPTER_CONFIG_FILE} in it or in its "
                              f"{ADAPTER_SUBDIR}/ subdirectory")
    files = resolve_checkpoint(str(path), None, None)
    if not allow_fresh_optimizer and (files.optimizer_path is None or not files.optimizer_path.is_file()):
        raise CheckpointError(f"unreadable checkpoint {path}: no optimizer state ({files.sources.get('optimizer')}); "
                              "the probe needs each checkpoint's AdamW state")
    return files


def find_checkpoints(directory: str | Path, *, allow_fresh_optimizer: bool = False) -> list[SweepCheckpoint]:
    """Every `checkpoint-N/` / `step_N/` under `directory`, sorted by step; ConfigError when there is none,
    CheckpointError for a checkpoint that cannot be used or two with the same step."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise ConfigError(f"--checkpoints {root}: not a directory")
    if (root / ADAPTER_CONFIG_FILE).is_file() or (root / ADAPTER_SUBDIR / ADAPTER_CONFIG_FILE).is_file():
        raise ConfigError(f"--checkpoints {root} is itself one checkpoint; pass the directory that holds the "
                          "run's checkpoint-N/ or step_N/ directories (or use entropy-probe run)")
    found = []
    for entry in sorted(root.iterdir()):
        match = CHECKPOINT_NAME.match(entry.name)
        if match and entry.is_dir():
            step, source = checkpoint_step(entry, int(match.group(1)))
            found.append(SweepCheckpoint(entry.name, entry, step, source,
                                         _checkpoint_files(entry, allow_fresh_optimizer)))
    if not found:
        raise ConfigError(f"no checkpoints found in {root} (looked for checkpoint-N/ and step_N/ subdirectories)")
    found.sort(key=lambda c: c.step)
    for a, b in itertools.pairwise(found):
        if a.step == b.step:
            raise CheckpointError(f"checkpoints {a.path} and {b.path} are both step {a.step}")
    return found


def select_every(checkpoints: list[SweepCheckpoint], every: int) -> list[SweepCheckpoint]:
    """Every `every`-th checkpoint in step order (the first, the 1+every-th, ...) and always the last one."""
    if every < 1:
        raise ConfigError(f"--every {every}: must be >= 1")
    chosen = checkpoints[::every]
    if chosen[-1] is not checkpoints[-1]:
        chosen.append(checkpoints[-1])
    return chosen

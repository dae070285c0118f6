"""What a TRL run's trainer_state.json says about its vLLM importance-sampling correction.

TRL's settings live in training_args.bin, a pickle the probe never opens, so `objective.vllm_importance_sampling_*`
cannot be read from a checkpoint. Its log can: GRPOTrainer (trl 1.16.0 grpo_trainer.py ≈ L2860–2896) logs
`sampling/importance_sampling_ratio/{min,mean,max}` with every training log entry whenever the correction acts
(`use_vllm` and `vllm_importance_sampling_correction`), and the HF Trainer keeps those entries in
trainer_state.json's `log_history`. The mode and the bounds are not logged: the warnings name the keys to set.

The log also shows rollout reuse: GRPOTrainer records its generation metrics (`reward`, `completions/*`) when it
generates and clears them at every log, so with logging_steps = 1 and num_iterations = μ > 1 only one training
entry in μ carries them. `rollout_reuse_warnings` warns when the log shows that and objective.num_iterations is 1.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

__all__ = ["logged_rollout_reuse", "logged_vllm_correction", "rollout_reuse_warnings", "vllm_correction_warnings"]

IS_METRIC = "sampling/importance_sampling_ratio/"
KEY = "objective.vllm_importance_sampling_correction"


GENERATION_METRICS = ("reward", "completions/")
REUSE_KEY = "objective.num_iterations"


def _training_entries(trainer_state_path: Path | None) -> list[dict] | None:
    """trainer_state.json's training log entries (those with `learning_rate`); None when absent or unreadable."""
    if trainer_state_path is None:
        return None
    try:
        history = json.loads(Path(trainer_state_path).read_text(encoding="utf-8"))["log_history"]
        return [row for row in history if isinstance(row, dict) and "learning_rate" in row]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _generated(row: dict) -> bool:
    return any(str(key) == GENERATION_METRICS[0] or str(key).startswith(GENERATION_METRICS[1]) for key in row)


def logged_rollout_reuse(trainer_state_path: Path | None) -> tuple[int, int] | None:
    """(training log entries one step apart, those of them with generation metrics) when the log shows steps
    without generation between steps with it; None when it does not (or logs every step's generation)."""
    entries = _training_entries(trainer_state_path)
    if not entries:
        return None
    steps = [row.get("step") for row in entries]
    per_step = all(isinstance(s, int) for s in steps) and all(b - a == 1 for a, b in itertools.pairwise(steps))
    generated = sum(_generated(row) for row in entries)
    if not per_step or generated == 0 or generated == len(entries):
        return None
    return len(entries), generated


def rollout_reuse_warnings(trainer_state_path: Path | None, num_iterations: int) -> list[str]:
    """[a warning] when the run's log shows steps that reused rollouts but `objective.num_iterations` is 1."""
    logged = logged_rollout_reuse(trainer_state_path)
    if logged is None or num_iterations != 1:
        return []
    entries, generated = logged
    return [(f"{trainer_state_path}: {entries - generated} of {entries} logged training steps have no generation "
            f"metrics (reward, completions/*), so the run reused rollouts (TRL num_iterations ≈ "
            f"{round(entries / generated)}), but {REUSE_KEY} is 1: set it to the run's num_iterations so that only "
            "checkpoints whose next step takes fresh rollouts are probed")]


def logged_vllm_correction(trainer_state_path: Path | None) -> tuple[int, int] | None:
    """(training log entries, those of them that log TRL's importance-sampling ratio) of trainer_state.json's
    `log_history` (a training entry: one with `learning_rate`); None when the file is absent or unreadable."""
    training = _training_entries(trainer_state_path)
    if training is None:
        return None
    return len(training), sum(any(str(key).startswith(IS_METRIC) for key in row) for row in training)


def vllm_correction_warnings(trainer_state_path: Path | None, enabled: bool) -> list[str]:
    """[a warning] when the run's log and `objective.vllm_importance_sampling_correction` disagree ([]: they agree,
    or nothing is logged)."""
    logged = logged_vllm_correction(trainer_state_path)
    if logged is None or logged[0] == 0:
        return []
    entries, corrected = logged
    if corrected and not enabled:
        message = (f"{trainer_state_path} logs TRL's vLLM importance-sampling ratio ({IS_METRIC}*) in {corrected} of "
                   f"{entries} training log entries: the run trained with vllm_importance_sampling_correction, but "
                   f"{KEY} is false, so a U batch drawn by the probe's own sampler is not corrected as the run's "
                   "were; set it true, and vllm_importance_sampling_mode / _clip_min / _clip_max to the run's (not "
                   "logged; TRL 1.16's defaults: sequence_mask, clip_max 3.0)")
    elif enabled and not corrected:
        message = (f"{KEY} is true but none of the {entries} training log entries of {trainer_state_path} logs "
                   f"{IS_METRIC}*, which TRL logs whenever the correction acts: the run may not have used it")
    else:
        return []
    return [message]

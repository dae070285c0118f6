"""What a TRL run's trainer_state.json says about its vLLM importance-sampling correction.

TRL's settings live in training_args.bin, a pickle the probe never opens, so `objective.vllm_importance_sampling_*`
cannot be read from a checkpoint. Its log can: GRPOTrainer (trl 1.16.0 grpo_trainer.py ≈ L2860–2896) logs
`sampling/importance_sampling_ratio/{min,mean,max}` with every training log entry whenever the correction acts
(`use_vllm` and `vllm_importance_sampling_correction`), and the HF Trainer keeps those entries in
trainer_state.json's `log_history`. The mode and the bounds are not logged: the warnings name the keys to set.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["logged_vllm_correction", "vllm_correction_warnings"]

IS_METRIC = "sampling/importance_sampling_ratio/"
KEY = "objective.vllm_importance_sampling_correction"


def logged_vllm_correction(trainer_state_path: Path | None) -> tuple[int, int] | None:
    """(training log entries, those of them that log TRL's importance-sampling ratio) of trainer_state.json's
    `log_history` (a training entry: one with `learning_rate`); None when the file is absent or unreadable."""
    if trainer_state_path is None:
        return None
    try:
        history = json.loads(Path(trainer_state_path).read_text(encoding="utf-8"))["log_history"]
        training = [row for row in history if isinstance(row, dict) and "learning_rate" in row]
    except (OSError, ValueError, KeyError, TypeError):
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

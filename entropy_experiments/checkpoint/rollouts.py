"""Which optimizer steps of a GRPO run take fresh rollouts, when each rollout batch serves several steps.

TRL's GRPOTrainer generates once every `steps_per_generation × num_iterations` micro-batches. With
steps_per_generation = gradient_accumulation_steps (its default) that is one generation every μ = num_iterations
optimizer steps: counting from the first step of a training session, steps 1, 1 + μ, 1 + 2μ, … take fresh
rollouts and the μ − 1 steps after each reuse them. A fresh step is on-policy (every ratio π_θ/π_old is 1, no
clipping acts): the probe's objective gradient is its gradient. A reuse step is taken at parameters one or more
steps past those that sampled its rollouts (ratios ≠ 1, clipped): the probe, which samples from the current
policy, does not represent it.

So the step after a checkpoint saved at global_step k takes fresh rollouts iff k − k₀ is a multiple of μ,
where k₀ is the global_step the session started from (0 for a run trained without interruption; a run resumed
from checkpoint-k₀ regenerates at its first step). Offline, k₀ = 0 is assumed.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError, ConfigError

__all__ = ["checkpoint_global_step", "refuse_rollout_reuse", "reuse_note", "reuse_refusal", "reuses_rollouts"]

NUM_ITERATIONS_KEY = "objective.num_iterations"


def reuses_rollouts(step: int, num_iterations: int, session_start: int = 0) -> bool:
    """Whether optimizer step `step` (1-based, global) reuses rollouts generated for an earlier step, in a
    session that started at global_step `session_start` with μ = `num_iterations`."""
    return (step - 1 - session_start) % num_iterations != 0


def reuse_note(step: int, num_iterations: int, session_start: int = 0) -> str:
    """One line: step `step` reuses the rollouts of the last fresh step before it (why it is not probed)."""
    fresh = step - (step - 1 - session_start) % num_iterations
    return (f"step {step} reuses the rollouts generated for step {fresh} (num_iterations = {num_iterations}: "
            "off-policy, ratios ≠ 1 and clipping; the probe represents the on-policy step)")


def reuse_refusal(checkpoint: str, global_step: int, num_iterations: int) -> str | None:
    """Why the checkpoint saved at `global_step` cannot be probed under μ = `num_iterations` (None: its next
    step takes fresh rollouts)."""
    if not reuses_rollouts(global_step + 1, num_iterations):
        return None
    before = global_step - global_step % num_iterations
    return (f"{NUM_ITERATIONS_KEY} = {num_iterations}: the step after {checkpoint} (global_step {global_step}) "
            f"cannot be probed: {reuse_note(global_step + 1, num_iterations)}; probe a checkpoint whose "
            f"global_step is a multiple of {num_iterations} (here {before} or {before + num_iterations})")


def checkpoint_global_step(trainer_state_path: Path | None, checkpoint: str) -> int:
    """trainer_state.json's `global_step` (ConfigError when the checkpoint has none: with num_iterations > 1 the
    probe must know which step follows it; training_args.bin is never opened)."""
    if trainer_state_path is None or not Path(trainer_state_path).is_file():
        raise ConfigError(f"{NUM_ITERATIONS_KEY} > 1 needs the checkpoint's step to tell whether its next step takes "
                          f"fresh rollouts, and {checkpoint} has no trainer_state.json (global_step)")
    try:
        step = json.loads(Path(trainer_state_path).read_text(encoding="utf-8"))["global_step"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"unreadable {trainer_state_path}: no usable global_step "
                              f"({type(exc).__name__}: {exc})") from exc
    if isinstance(step, bool) or not isinstance(step, int):
        raise CheckpointError(f"unreadable {trainer_state_path}: global_step = {step!r} is not an integer")
    return step


def refuse_rollout_reuse(num_iterations: int, trainer_state_path: Path | None, checkpoint: str) -> None:
    """ConfigError (one line naming objective.num_iterations) when the step after `checkpoint` reuses rollouts."""
    if num_iterations == 1:
        return
    reason = reuse_refusal(checkpoint, checkpoint_global_step(trainer_state_path, checkpoint), num_iterations)
    if reason is not None:
        raise ConfigError(reason)

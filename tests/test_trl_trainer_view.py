"""What the TRL callback reads off a live GRPOTrainer (integrations/trl_trainer_view.py), checked against
TRL's own accounting, with no training step taken.

With gradient accumulation the trainer's optimizer step consumes several micro-batches: the probe's
`micro_batches`, its trainer batch (completions per optimizer step, the denominator of the U-noise ratio
B_U·G / n_trainer) and β must be the trainer's. The reference is TRL's `generation_batch_size`, the
completions one generation round produces (per_device_train_batch_size × steps_per_generation, computed by
GRPOConfig itself); with steps_per_generation = gradient_accumulation_steps (the only setting the callback
accepts) one round serves exactly one optimizer step.
"""

from __future__ import annotations

import pytest

pytest.importorskip("trl")

from entropy_experiments.integrations.trl_callback import EntropyProbeCallback
from entropy_experiments.testing.trl_run import tiny_grpo_trainer


@pytest.mark.parametrize("accumulation", [1, 2])
def test_the_callback_mirrors_the_trainers_batch_and_accumulation(accumulation, tmp_path, tiny_model_dir):
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir, num_generations=2, prompts_per_step=2,
                                gradient_accumulation_steps=accumulation, beta=0.04)
    args = trainer.args
    assert args.steps_per_generation == accumulation  # TRL's default: one generation round per optimizer step
    callback = EntropyProbeCallback(trainer, every=1, B_E=4, B_U=4)
    objective = callback.config.objective
    assert objective.micro_batches == accumulation
    assert objective.trainer_batch_completions == args.generation_batch_size == 4 * accumulation
    bc = callback.config.batch_config
    assert callback.u_batch_ratio == pytest.approx(bc.B_U * bc.G / args.generation_batch_size, rel=1e-15)
    assert objective.kl_coef == 0.04

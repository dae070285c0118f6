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


def test_the_callback_mirrors_trls_entropy_coef_and_mask(tmp_path, tiny_model_dir):
    """entropy_coef and top_entropy_quantile are mirrored (no longer refused): the probe's objective is TRL's."""
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir, entropy_coef=0.02,
                                top_entropy_quantile=0.2)
    options = EntropyProbeCallback(trainer, every=1, B_E=4, B_U=4).config.objective_options()
    assert (options.entropy_coef, options.top_entropy_quantile, options.trainer) == (0.02, 0.2, "trl")


def test_adaptive_entropy_coefficient_live_and_from_the_saved_checkpoint(tmp_path, tiny_model_dir):
    """use_adaptive_entropy: the callback takes the live controller's gated coefficient each step; offline, the probe
    reads the entropy_ctrl_state.json TRL itself saved with the checkpoint, and both agree with TRL's state."""
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.estimators.entropy_terms import adaptive_entropy_coef
    from entropy_experiments.integrations import trl_trainer_view as view

    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir, use_adaptive_entropy=True,
                                entropy_coef=0.01, entropy_target=50.0, save_strategy="steps", save_steps=1)
    callback = EntropyProbeCallback(trainer, every=1, B_E=4, B_U=4)
    assert callback.config.objective.entropy_coef == 0.0  # before the first step: TRL's window entropy is inf
    assert view.step_objective(callback.config, trainer).objective_options().entropy_coef == 0.0
    trainer.train()  # the callback is not added: the step trains and saves checkpoint-1 only
    saved = tmp_path / "checkpoint-1"
    assert (saved / "entropy_ctrl_state.json").is_file()
    live = adaptive_entropy_coef(trainer.entropy_coef, trainer._last_world_entropy, 50.0)
    assert live == trainer.entropy_coef > 0  # the tiny model's entropy is far below the target: the bonus applies
    assert view.step_objective(callback.config, trainer).objective_options().entropy_coef == live
    offline = config_from_dict({"checkpoint": {"checkpoint_path": str(saved)},
                                "objective": {"trainer": "trl", "use_adaptive_entropy": True, "entropy_target": 50.0}})
    assert offline.objective_options().entropy_coef == live
    gated = config_from_dict({"checkpoint": {"checkpoint_path": str(saved)},
                              "objective": {"trainer": "trl", "use_adaptive_entropy": True, "entropy_target": 1e-9}})
    assert gated.objective_options().entropy_coef == 0.0

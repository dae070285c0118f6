"""`EntropyProbeCallback(predict="trainer_step")` inside a real trl.GRPOTrainer run (tiny model, CPU).

- The predicted step is the step the trainer takes: θ_after − θ_before of each optimizer step, read by an
  independent callback around `optimizer.step()`, equals the prediction's Δθ_next.
- Training is untouched (bit-identical parameters), TRL's log_history is the run's without the callback plus
  the `entropy_probe/` entries, every=1 probes every step, and each row carries the documented keys.
- The mode takes the trainer's gradients, so it accepts what the probe_U mode refuses: a loss the probe does not
  mirror (cispo, trained here) and `use_vllm=True` (accepted at construction; vLLM is not installed in the test
  environment, so the run generates with transformers — the callback never touches the trainer's generation).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import TrainerCallback

pytest.importorskip("trl")

from entropy_experiments.errors import ConfigError
from entropy_experiments.integrations.trl_callback import LOG_FILE, PREFIX, EntropyProbeCallback
from entropy_experiments.testing.trl_run import tiny_grpo_trainer

pytestmark = pytest.mark.xdist_group("trl_callback")
STEPS = 3
OPTIONS = {"B_E": 6, "seed": 7, "predict": "trainer_step"}
ROW_KEYS = {"step", "H", "delta_h_next", "se_E", "lr", "realised", "realised_se"}
TIMINGS = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time"}


class StepWatcher(TrainerCallback):
    """θ before and after every optimizer step, and the probe's prediction made before it (added after the
    probe, so it runs after the prediction)."""

    def __init__(self, trainer, probe):
        self.trainer, self.probe, self.errors, self.before, self.lrs_after = trainer, probe, [], None, []

    def _params(self):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.before = self._params()

    def on_optimizer_step(self, args, state, control, **kwargs):
        predicted = self.probe.pending.next_step.step
        after = self._params()
        self.errors.append(max(float((after[n] - self.before[n] - predicted[n]).abs().max()) for n in after))
        self.lrs_after.append([g["lr"] for g in self.trainer.optimizer.param_groups])  # before the scheduler's step


def _train(out, model_dir, probe: bool, **overrides):
    trainer = tiny_grpo_trainer(out, steps=STEPS, model_dir=model_dir, learning_rate=2e-2, max_completion_length=6,
                                max_grad_norm=0.1, weight_decay=0.05, save_strategy="no", **overrides)
    callback = watcher = None
    if probe:
        callback = EntropyProbeCallback(trainer, every=1, **OPTIONS)
        watcher = StepWatcher(trainer, callback)
        trainer.add_callback(callback)
        trainer.add_callback(watcher)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trainer, callback, watcher, params


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    base = tmp_path_factory.mktemp("trainer_step")
    return _train(base / "plain", tiny_model_dir, False), _train(base / "probed", tiny_model_dir, True), base


@pytest.mark.e2e
def test_the_predicted_step_is_the_step_the_trainer_takes(runs):
    _, (_, callback, watcher, _), _ = runs
    print("max |Δθ − Δθ_next| per step:", watcher.errors)
    assert len(watcher.errors) == STEPS and max(watcher.errors) < 1e-6
    rows = [r for r in callback.rows if "realised" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["step_norm"] > 0 and r["step_error"] < 1e-6 for r in rows)


@pytest.mark.e2e
def test_training_and_the_trainers_log_are_untouched(runs):
    (plain, _, _, plain_params), (probed, _, _, probed_params), base = runs
    for name in plain_params:
        assert torch.equal(plain_params[name], probed_params[name]), name
    own = [{k: v for k, v in h.items() if k not in TIMINGS} for h in probed.state.log_history
           if not any(k.startswith(PREFIX) for k in h)]
    assert own == [{k: v for k, v in h.items() if k not in TIMINGS} for h in plain.state.log_history]
    logged = [h for h in probed.state.log_history if PREFIX + "delta_h_next" in h]
    lines = [json.loads(x) for x in (base / "probed" / LOG_FILE).read_text().splitlines()]
    assert [h["step"] for h in logged] == [r["step"] for r in lines] == [1, 2, 3]
    for row, entry in zip(lines, logged):
        assert ROW_KEYS <= row.keys() and row["predict"] == "trainer_step"
        assert row["lr"] > 0 and row["se_E"] > 0 and row["realised_se"] > 0
        assert entry[PREFIX + "delta_h_next"] == pytest.approx(row["delta_h_next"])
        assert entry[PREFIX + "realised"] == pytest.approx(row["realised"])
        print(f"step {row['step']}: δH_next {row['delta_h_next']:+.3e} ± {row['se_E']:.1e}, realised "
              f"{row['realised']:+.3e} ± {row['realised_se']:.1e}, residual z {row['first_order_z']}")


@pytest.mark.e2e
def test_a_loss_the_probe_does_not_mirror_and_vllm_are_accepted(tmp_path, tiny_model_dir):
    trainer = tiny_grpo_trainer(tmp_path, steps=2, model_dir=tiny_model_dir, loss_type="cispo", learning_rate=2e-2,
                                max_completion_length=6, save_strategy="no")
    with pytest.raises(ConfigError, match="loss_type"):
        EntropyProbeCallback(trainer, every=1)
    trainer.args.use_vllm = True  # as configured for vLLM; this trainer was built without it (no vLLM here)
    callback = EntropyProbeCallback(trainer, every=1, **OPTIONS)
    watcher = StepWatcher(trainer, callback)
    trainer.add_callback(callback)
    trainer.add_callback(watcher)
    trainer.train()
    assert len(watcher.errors) == 2 and max(watcher.errors) < 1e-6
    assert [r["step"] for r in callback.rows if "realised" in r] == [1, 2]


def test_sampling_the_probe_cannot_represent_is_still_refused(tmp_path, tiny_model_dir):
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir, top_k=5)
    with pytest.raises(ConfigError, match="GRPOConfig.top_k=5 is not supported"):
        EntropyProbeCallback(trainer, every=1, predict="trainer_step")
    with pytest.raises(ConfigError, match="predict must be one of probe_U, trainer_step"):
        EntropyProbeCallback(trainer, every=1, predict="next")

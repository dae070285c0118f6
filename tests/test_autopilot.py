"""EntropyAutopilot in a real GRPOTrainer run: the step taken is the predicted one (lr × m plus the entropy term,
against the parameters torch really ends at), the scheduler's lr is put back, the rows carry the controller's
own error, its state survives a resume; and what the prediction cannot represent is refused in one line."""

from __future__ import annotations

import dataclasses
import itertools
import json
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback

from entropy_experiments.errors import ConfigError
from entropy_experiments.integrations.live_state import untouched
from entropy_experiments.integrations.representable import check_optimizer, check_representable, step_agrees
from entropy_experiments.integrations.trainer_step import check_trainer_step

pytestmark = pytest.mark.xdist_group("trl_callback")
AFTER_STEP = ("realised", "realised_se", "first_order_residual", "first_order_residual_se")


class Remeasured(TrainerCallback):
    """Added after the autopilot: each step's row as `check_trainer_step` makes it when E is scored again at the
    parameters really reached (no measurement from before the step)."""

    def __init__(self, pilot):
        self.pilot, self.pending, self.rows = pilot, None, []

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.pending = self.pilot.pending

    def on_step_end(self, args, state, control, **kwargs):
        policy = self.pilot.policy
        with untouched(policy.trainable.model):
            self.rows.append(check_trainer_step(self.pilot.config, policy,
                                                dataclasses.replace(self.pending, measured=None)))


class HalvesTheLr(TrainerCallback):
    """Another callback, after the autopilot, that halves every group's lr right before the step."""

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        for group in optimizer.param_groups:
            group["lr"] *= 0.5


def _trainer(out, model_dir, steps=3, **kw):
    from entropy_experiments.testing.trl_run import tiny_grpo_trainer

    return tiny_grpo_trainer(out, steps=steps, model_dir=model_dir, learning_rate=1e-2, max_completion_length=6,
                             max_grad_norm=0.1, weight_decay=0.05, **kw)


PILOT = {"target": 10.0, "B_E": 6, "seed": 7, "budget": 0.0, "z": 0.0, "max_term": 3.0}  # far above: it acts every step


@pytest.mark.e2e
def test_the_autopilot_steers_the_real_step_and_survives_a_resume(tmp_path, tiny_model_dir):
    pytest.importorskip("trl")
    from entropy_experiments.integrations.autopilot import STATE_KEY, EntropyAutopilot
    from tests.test_trainer_step_trl import StepWatcher

    plain = _trainer(tmp_path / "plain", tiny_model_dir, save_strategy="no")
    plain.train()
    trainer = _trainer(tmp_path / "steered", tiny_model_dir)
    pilot = EntropyAutopilot(trainer, **PILOT)
    watcher = StepWatcher(trainer, pilot)
    again = Remeasured(pilot)
    for callback in (pilot, watcher, again):
        trainer.add_callback(callback)
    trainer.train()
    rows = [r for r in pilot.rows if "realised" in r]
    print([(r["lr_multiplier"], r["entropy_term"], r["steering"], r["limit"]) for r in rows], watcher.errors)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(watcher.errors) < 1e-6            # the step taken is the prediction at (m, κ), term included
    assert all(r["step_ok"] and r["step_error"] < 1e-6 for r in rows)
    for row, scored_again in zip(rows, again.rows, strict=True):  # measured before the step: E scored after it
        assert row["realised_before_step"] and not scored_again["realised_before_step"]
        assert (row["measured_change"], row["measured_change_se"]) == (row["realised"], row["realised_se"])
        for key in AFTER_STEP:
            assert row[key] == pytest.approx(scored_again[key], rel=1e-4, abs=1e-7), key
    assert any(r["entropy_term"] > 0 for r in rows[1:])  # from step 2 on, a term direction exists
    assert rows[0]["entropy_term"] == 0.0 and rows[0]["controller_error"] is None
    for previous, row in itertools.pairwise(rows):  # the previous decision graded on this step's fresh E
        assert row["controller_error"] == pytest.approx(row["H"] - previous["H_target"])
    scheduler = [h["learning_rate"] for h in plain.state.log_history if "learning_rate" in h]
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert logged == scheduler                    # the trainer's log: the scheduler's lr
    assert [set(lrs) for lrs in watcher.lrs_after] == [{lr} for lr in scheduler]  # put back in every group
    for row, lr in zip(rows, scheduler):
        assert row["lr"] == pytest.approx(lr * row["lr_multiplier"], rel=1e-6)
        assert 0.1 <= row["lr_multiplier"] <= 1.0 and row["H_target"] == 10.0
    saved = json.loads((tmp_path / "steered" / "checkpoint-2" / "trainer_state.json").read_text())[
        "stateful_callbacks"][STATE_KEY]
    assert saved["multiplier"] == rows[1]["lr_multiplier"] and len(saved["track"]) == 5
    resumed = _trainer(tmp_path / "steered", tiny_model_dir)
    again = EntropyAutopilot(resumed, **PILOT)
    resumed.add_callback(again)
    resumed.train(resume_from_checkpoint=str(tmp_path / "steered" / "checkpoint-2"))
    step3 = next(r for r in again.rows if "realised" in r)
    assert step3["step"] == 3 and step3["controller_error"] is not None  # the filter and the aim came back
    assert rows[1]["lr_multiplier"] / 1.25 - 1e-12 <= step3["lr_multiplier"] <= rows[1]["lr_multiplier"] * 1.25 + 1e-12


@pytest.mark.e2e
def test_a_step_taken_other_than_decided_is_flagged_and_measured_again(tmp_path, tiny_model_dir):
    pytest.importorskip("trl")
    from entropy_experiments.integrations.autopilot import EntropyAutopilot

    trainer = _trainer(tmp_path, tiny_model_dir, steps=2, save_strategy="no")
    pilot = EntropyAutopilot(trainer, **PILOT)
    again = Remeasured(pilot)
    for callback in (pilot, HalvesTheLr(), again):
        trainer.add_callback(callback)
    trainer.train()
    rows = [r for r in pilot.rows if "realised" in r]
    assert len(rows) == 2 and len(again.rows) == 2
    for row, scored_again in zip(rows, again.rows, strict=True):
        assert not row["step_ok"] and not row["realised_before_step"]
        assert any("differs from the predicted AdamW step" in w for w in row["warnings"])
        for key in AFTER_STEP:  # the realised change of the step really taken, not of the one decided
            assert row[key] == pytest.approx(scored_again[key], rel=1e-9, abs=1e-12), key
        assert row["realised"] != pytest.approx(row["measured_change"], rel=1e-3)


def test_a_misspelt_option_is_one_line_naming_the_closest(tmp_path, tiny_model_dir):
    pytest.importorskip("trl")
    from entropy_experiments.integrations.autopilot import EntropyAutopilot
    from entropy_experiments.integrations.trl_callback import EntropyProbeCallback

    trainer = _trainer(tmp_path, tiny_model_dir, steps=1)
    with pytest.raises(ConfigError, match=r"unknown option 'B_e' \(did you mean 'B_E'\?\)"):
        EntropyProbeCallback(trainer, every=1, B_e=16)
    with pytest.raises(ConfigError, match=r"unknown option 'max_terms' \(did you mean 'max_term'\?\)"):
        EntropyAutopilot(trainer, max_terms=2.0)


def _args(**kw):
    return SimpleNamespace(**{"fp16": False, "deepspeed": None, "fsdp": "", "optim": "adamw_torch", **kw})


@pytest.mark.parametrize("args, message", [
    (_args(fp16=True), r"GRPOConfig.fp16=True is not supported: .* still scaled by the loss scaler"),
    (_args(optim="adafactor"), r"GRPOConfig.optim='adafactor' is not supported"),
])
def test_what_the_prediction_cannot_represent_is_refused_in_one_line(args, message):
    with pytest.raises(ConfigError, match=message) as info:
        check_representable(SimpleNamespace(args=args, optimizer=None))
    assert "\n" not in str(info.value)


def test_the_optimizer_is_checked_by_type_under_accelerates_wrapper():
    p = [torch.nn.Parameter(torch.zeros(2))]
    wrapped = SimpleNamespace(optimizer=torch.optim.AdamW(p))  # accelerate's AcceleratedOptimizer holds .optimizer
    check_optimizer(wrapped)
    check_optimizer(torch.optim.Adam(p))
    check_optimizer(torch.optim.Adam(p, weight_decay=0.1, decoupled_weight_decay=True))
    with pytest.raises(ConfigError, match="torch.optim.Adam with weight_decay=0.1 .L2"):
        check_optimizer(torch.optim.Adam(p, weight_decay=0.1))
    with pytest.raises(ConfigError, match="the optimizer is torch.optim.sgd.SGD"):
        check_optimizer(SimpleNamespace(optimizer=torch.optim.SGD(p, lr=0.1)))


def test_a_real_trainer_with_another_optimizer_is_refused(tmp_path, tiny_model_dir):
    pytest.importorskip("trl")
    from entropy_experiments.integrations.autopilot import EntropyAutopilot

    trainer = _trainer(tmp_path, tiny_model_dir, steps=1, optim="sgd")
    with pytest.raises(ConfigError, match="GRPOConfig.optim='sgd' is not supported"):
        EntropyAutopilot(trainer)


def test_a_step_far_from_the_prediction_is_flagged():
    assert step_agrees(1e-8, largest_step=1e-3, largest_param=0.5)
    assert not step_agrees(1e-4, largest_step=1e-3, largest_param=0.5)

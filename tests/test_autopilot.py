"""EntropyAutopilot: its rule (pure: deadband, bounds, rate limit, drop limit, targets) and a real GRPOTrainer run
(the step taken is the predicted step × m, the scheduler's lr is put back, its state survives a resume)."""

from __future__ import annotations

import json
import math

import pytest

from entropy_experiments.errors import ConfigError
from entropy_experiments.integrations.autopilot_rule import AutopilotRule, decide, target_of

RULE = AutopilotRule(min_multiplier=0.2, max_multiplier=3.0, max_drop=0.05, deadband_z=1.0, max_rate=1.5, gain=1.0)


def _decide(rule=RULE, **kw):
    values = {"predicted": 0.01, "se": 0.001, "H": 1.0, "H_target": 1.0, "previous": 1.0, **kw}
    return decide(rule, **values)


def test_on_target_the_multiplier_is_the_ratio_of_wanted_to_predicted_change():
    d = _decide(predicted=0.01, se=0.001, H=1.0, H_target=1.012)
    assert d.multiplier == pytest.approx(1.2) and d.wanted == pytest.approx(0.012) and d.reason == "target"


def test_within_the_deadband_the_multiplier_stays():
    # at m_prev = 1.1 the prediction 0.011 ± 0.0011 already reaches the wanted 0.0115
    d = _decide(predicted=0.01, se=0.001, H=1.0, H_target=1.0115, previous=1.1)
    assert d.multiplier == 1.1 and d.reason == "deadband"
    # just outside it, the rule moves
    d = _decide(predicted=0.01, se=0.001, H=1.0, H_target=1.0125, previous=1.1)
    assert d.multiplier == pytest.approx(1.25) and d.reason == "target"


def test_a_gap_within_the_entropys_own_noise_asks_for_no_change():
    # Ĥ = 1.0 ± 0.03, target 1.05: only the gap beyond z·SE_Ĥ is wanted (0.02 at z = 1, 0 at z = 2)
    d = _decide(predicted=0.01, se=0.001, H=1.0, H_target=1.05, H_se=0.03)
    assert d.wanted == pytest.approx(0.02) and d.multiplier == pytest.approx(1.5) and d.reason == "target+rate"
    d = _decide(AutopilotRule(deadband_z=2.0), predicted=-0.01, se=0.001, H=1.05, H_target=1.0, H_se=0.03)
    assert d.wanted == 0.0 and d.multiplier == pytest.approx(1 / 1.5) and d.reason == "target+rate"
    # SE_Ĥ = 0: the gap as it is
    assert _decide(H=1.0, H_target=1.05).wanted == pytest.approx(0.05)


def test_a_prediction_within_its_noise_gives_no_signal():
    d = _decide(predicted=0.0005, se=0.001, H=1.0, H_target=1.5, previous=0.8)
    assert d.multiplier == 0.8 and d.reason == "no_signal"


def test_the_rate_limit_and_the_bounds():
    up = _decide(predicted=0.001, se=1e-5, H=1.0, H_target=1.04, previous=1.0)   # wants m = 40
    assert up.multiplier == pytest.approx(1.5) and up.reason == "target+rate"
    top = _decide(predicted=0.001, se=1e-5, H=1.0, H_target=1.04, previous=2.5)  # rate allows 3.75, bounds 3
    assert top.multiplier == pytest.approx(3.0) and top.reason == "target+rate+bounds"
    wrong_way = _decide(predicted=-0.01, se=1e-4, H=1.0, H_target=1.01, previous=0.25)  # m < 0 wanted
    assert wrong_way.multiplier == pytest.approx(0.2) and wrong_way.reason == "target+rate+bounds"
    for previous in (0.2, 0.5, 1.0, 2.0, 3.0):
        for predicted in (-0.3, -0.01, 1e-6, 0.02, 0.4):
            for H_target in (0.0, 0.9, 1.0, 1.1, 5.0):
                d = _decide(predicted=predicted, se=0.002, H_target=H_target, previous=previous)
                assert RULE.min_multiplier <= d.multiplier <= RULE.max_multiplier
                assert previous / 1.5 - 1e-12 <= d.multiplier <= previous * 1.5 + 1e-12 or "bounds" in d.reason


def test_the_drop_limit():
    # the target asks for a fall of 0.2: the wanted change is capped at −0.05 → m = 0.05 / 0.1
    d = _decide(predicted=-0.1, se=0.001, H=1.2, H_target=1.0, previous=0.6)
    assert d.wanted == pytest.approx(-0.05) and d.multiplier == pytest.approx(0.5)
    # within the deadband at m_prev, but m_prev·δH falls more than max_drop: lowered
    d = _decide(predicted=-0.04, se=0.02, H=1.0, H_target=0.95, previous=1.5)
    assert d.multiplier == pytest.approx(1.25) and d.reason == "deadband+drop_limit"
    # the rate limit wins over the drop limit, and the reason says so
    d = _decide(predicted=-0.4, se=0.001, H=1.0, H_target=1.0, previous=1.0)
    assert d.multiplier == pytest.approx(1 / 1.5) and d.reason == "target+rate+drop_limit_exceeded"
    assert _decide(AutopilotRule(max_drop=None), predicted=-0.4, se=0.001, H=1.2, H_target=1.0).wanted == \
        pytest.approx(-0.2)


def test_targets():
    assert target_of(1.5)(7, 2.0) == 1.5
    assert target_of("initial")(7, 2.0) == 2.0
    assert target_of(lambda step: 3.0 - 0.1 * step)(5, 2.0) == pytest.approx(2.5)
    for bad in ("start", -1.0, math.nan, True, None):
        with pytest.raises(ConfigError, match="target must be"):
            target_of(bad)


@pytest.mark.parametrize("options, message", [
    ({"min_multiplier": 0.0}, "min_multiplier"), ({"max_multiplier": 0.5}, "max_multiplier"),
    ({"max_drop": -0.1}, "max_drop"), ({"deadband_z": -1}, "deadband_z"), ({"max_rate": 0.9}, "max_rate"),
    ({"gain": 0.0}, "gain"),
])
def test_bad_settings_are_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        AutopilotRule(**options).check()


# ------------------------------------------------------------------ in a real GRPOTrainer run
def _trainer(out, model_dir, steps=3, **kw):
    from entropy_experiments.testing.trl_run import tiny_grpo_trainer

    return tiny_grpo_trainer(out, steps=steps, model_dir=model_dir, learning_rate=1e-2, max_completion_length=6,
                             max_grad_norm=0.1, weight_decay=0.05, **kw)


@pytest.mark.e2e
def test_the_autopilot_steers_the_real_step_and_survives_a_resume(tmp_path, tiny_model_dir):
    pytest.importorskip("trl")
    from entropy_experiments.integrations.autopilot import STATE_KEY, EntropyAutopilot
    from tests.test_trainer_step_trl import StepWatcher

    plain = _trainer(tmp_path / "plain", tiny_model_dir, save_strategy="no")
    plain.train()
    trainer = _trainer(tmp_path / "steered", tiny_model_dir)
    pilot = EntropyAutopilot(trainer, target=10.0, B_E=6, seed=7, max_rate=1.5, max_multiplier=2.0)
    watcher = StepWatcher(trainer, pilot)
    trainer.add_callback(pilot)
    trainer.add_callback(watcher)
    trainer.train()
    rows = [r for r in pilot.rows if "realised" in r]
    print([(r["lr_multiplier"], r["autopilot"], r["lr"]) for r in rows], watcher.errors)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(watcher.errors) < 1e-6            # the step taken is the prediction × m
    scheduler = [h["learning_rate"] for h in plain.state.log_history if "learning_rate" in h]
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert logged == scheduler                    # the trainer's log: the scheduler's lr
    assert [set(lrs) for lrs in watcher.lrs_after] == [{lr} for lr in scheduler]  # put back in every group
    for row, lr in zip(rows, scheduler):
        assert row["lr"] == pytest.approx(lr * row["lr_multiplier"], rel=1e-6)
        assert 0.1 <= row["lr_multiplier"] <= 2.0 and row["H_target"] == 10.0
    # the multiplier is in each checkpoint's trainer_state.json and a resumed run starts from it
    saved = json.loads((tmp_path / "steered" / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"][STATE_KEY]["multiplier"] == rows[1]["lr_multiplier"]
    resumed = _trainer(tmp_path / "steered", tiny_model_dir)
    again = EntropyAutopilot(resumed, target=10.0, B_E=6, seed=7, max_rate=1.5, max_multiplier=2.0)
    resumed.add_callback(again)
    resumed.train(resume_from_checkpoint=str(tmp_path / "steered" / "checkpoint-2"))
    step3 = next(r for r in again.rows if "realised" in r)
    assert step3["step"] == 3 and again.initial_H == pilot.initial_H
    # the rate limit moved from the restored multiplier (not from 1)
    assert rows[1]["lr_multiplier"] / 1.5 - 1e-12 <= step3["lr_multiplier"] <= rows[1]["lr_multiplier"] * 1.5 + 1e-12
    print("resumed step 3:", step3["lr_multiplier"], step3["autopilot"], "original:", rows[2]["lr_multiplier"])

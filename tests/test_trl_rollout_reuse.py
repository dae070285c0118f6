"""EntropyProbeCallback beside TRL's own logging, its refusals, and rollout reuse (num_iterations > 1).

A real trl.GRPOTrainer (tiny model, CPU) with a researcher's settings: loss_type dapo, beta 0.04,
num_iterations 2, gradient_accumulation_steps 2, scale_rewards batch, epsilon_high 0.28 — trained twice from
the same seed, without and with the callback (every = 1).

- log_history with the callback is the run's without it, entry by entry (timings aside), plus the callback's
  own `entropy_probe/` entries at the probed steps;
- the steps the callback probes are those at which TRL generated rollouts (recorded by the reward function
  from the `trainer_state` TRL passes it), the others are skipped with a note;
- `entropy-probe run` refuses a checkpoint whose next step reuses rollouts, and `entropy-probe sweep` measures
  only Ĥ there and marks the reuse steps in sweep.json and its summary;
- every refusal names the setting (cispo, sapo, steps_per_generation beside num_iterations, a setting the
  probe's config refuses), never pydantic's trailing link or a look-alike loss name.
"""

from __future__ import annotations

import json

import pytest
import torch
import yaml

pytest.importorskip("trl")

from entropy_experiments import cli
from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError
from entropy_experiments.integrations.trl_callback import LOG_FILE, PREFIX, EntropyProbeCallback
from entropy_experiments.testing.trl_run import count_vowels_reward, tiny_grpo_trainer
from tests.probe_helpers import SHORT_PROMPTS, write_prompts
from tests.run_helpers import logging_restored

pytestmark = pytest.mark.xdist_group("trl_callback")
STEPS = 4
RESEARCHER = {"loss_type": "dapo", "beta": 0.04, "num_iterations": 2, "gradient_accumulation_steps": 2,
              "scale_rewards": "batch", "epsilon_high": 0.28}
TIMINGS = {"step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def _train(out, model_dir, with_callback: bool):
    generated_at: list[int] = []  # the global_step at each of TRL's generations (not the probe's reward calls)

    def reward(prompts, completions, trainer_state=None, **kwargs):
        if trainer_state is not None:
            generated_at.append(trainer_state.global_step)
        return count_vowels_reward(prompts, completions)

    trainer = tiny_grpo_trainer(out, steps=STEPS, model_dir=model_dir, learning_rate=2e-2, max_completion_length=6,
                                reward_funcs=reward, **RESEARCHER)
    callback = EntropyProbeCallback(trainer, every=1, B_E=6, B_U=2, seed=7) if with_callback else None
    if callback is not None:
        trainer.add_callback(callback)
    trainer.train()
    model = trainer.accelerator.unwrap_model(trainer.model)
    params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return trainer, callback, params, generated_at


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir):
    base = tmp_path_factory.mktemp("trl_reuse")
    return _train(base / "plain", tiny_model_dir, False), _train(base / "probed", tiny_model_dir, True), base


def _without_timings(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k not in TIMINGS}


@pytest.mark.e2e
def test_log_history_is_the_trainers_entry_by_entry_plus_the_probes(runs):
    (plain, _, plain_params, _), (probed, callback, probed_params, _), _ = runs
    for name in plain_params:  # the callback leaves training bit-identical under num_iterations 2 as well
        assert torch.equal(plain_params[name], probed_params[name]), name
    history = probed.state.log_history
    own = [h for h in history if any(k.startswith(PREFIX) for k in h)]
    trainers = [h for h in history if not any(k.startswith(PREFIX) for k in h)]
    assert len(trainers) == len(plain.state.log_history)
    for theirs, ours in zip(plain.state.log_history, trainers, strict=True):
        assert _without_timings(theirs) == _without_timings(ours)
    logged = [h for h in trainers if "loss" in h]
    assert [h["step"] for h in logged] == list(range(1, STEPS + 1))  # every step's loss, the last one too
    assert all({"grad_norm", "learning_rate"} <= h.keys() for h in logged)
    assert any(h["loss"] != 0 for h in logged)  # the KL term and the reuse steps' ratios make it non-zero
    rows = [r for r in callback.rows if "delta_h1" in r]
    assert [h["step"] for h in own] == [r["step"] for r in rows]
    for entry, row in zip(own, rows, strict=True):
        assert set(entry) <= {"step", "epoch"} | {PREFIX + k for k in row}
        assert entry[PREFIX + "delta_h1"] == row["delta_h1"] and entry[PREFIX + "realised"] == row["realised"]
        # beside the trainer's entry of the same step, which comes after it
        assert history.index(entry) + 1 == history.index(next(h for h in trainers if h["step"] == entry["step"]))


@pytest.mark.e2e
def test_num_iterations_2_probes_the_steps_with_fresh_rollouts_only(runs):
    (_, _, _, generated_at), (_, _, _, _), base = runs
    fresh = [step + 1 for step in generated_at]  # TRL generated before these optimizer steps
    assert fresh == [1, 3]
    lines = [json.loads(x) for x in (base / "probed" / LOG_FILE).read_text().splitlines()]
    assert [r["step"] for r in lines if "delta_h1" in r] == fresh
    skipped = [r for r in lines if "skipped" in r]
    assert [r["step"] for r in skipped] == [s for s in range(1, STEPS + 1) if s not in fresh]
    assert skipped[0]["skipped"].startswith("step 2 reuses the rollouts generated for step 1 (num_iterations = 2: ")
    for row in lines:
        if "delta_h1" in row:
            assert row["se"] > 0 and row["delta_theta_norm"] > 0 and not row.get("error")


def _probe_config(run_dir, data, checkpoint: str, **objective) -> dict:
    return {"seed": 5, "checkpoint": {"checkpoint_path": str(run_dir / checkpoint), "device_map": "cpu"},
            "batch_config": {"dataset_name": "jsonl", "dataset_path": str(data), "B_E": 4, "B_U": 2, "G": 2},
            "generation": {"max_new_tokens": 6, "gen_batch_size": 8, "tf_batch_size": 8},
            "reward": {"name": "entropy_experiments.testing.trl_run:count_vowels_reward"},
            "objective": {"trainer": "trl", "num_iterations": 2, **objective},
            "importance": {"eta_list": [1.0e-3]}, "second_order": {"enabled": False},
            "output": {"plot": False}}


@pytest.mark.e2e
def test_run_refuses_a_checkpoint_whose_next_step_reuses_rollouts(runs, tmp_path, capsys):
    (_, _, _, _), (_, _, _, _), base = runs
    data = write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump(_probe_config(base / "probed", data, "checkpoint-3")))
    with logging_restored():
        code = cli.main(["run", "--config", str(path), "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2
    assert ("objective.num_iterations = 2: the step after " in err and "checkpoint-3 (global_step 3) cannot be "
            "probed: step 4 reuses the rollouts generated for step 3 (num_iterations = 2: off-policy" in err
            and "(here 2 or 4)" in err), err


@pytest.mark.e2e
def test_sweep_measures_only_the_entropy_before_reuse_steps_and_marks_them(runs, tmp_path, capsys):
    (_, _, _, generated_at), (_, _, _, _), base = runs
    data = write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)
    config = config_from_dict(_probe_config(base / "plain", data, "checkpoint-1", micro_batches=2))
    from entropy_experiments.sweep import run_sweep

    with logging_restored():
        doc = run_sweep(config, base / "plain", out=str(tmp_path / "sweep"))
    summary = capsys.readouterr().out
    reuse = [s for s in range(1, STEPS + 1) if s - 1 not in generated_at]  # TRL's own record: steps 2 and 4
    assert doc["num_iterations"] == 2
    by_step = {r["step"]: r for r in doc["rows"]}
    for step in (1, 3):  # the step after checkpoint-1 / -3 reuses rollouts: Ĥ only, the reason names the key
        assert by_step[step]["kind"] == "entropy_only" and by_step[step]["next_step_reuses_rollouts"]
        assert by_step[step]["no_prediction"].startswith("objective.num_iterations = 2: the step after checkpoint-")
        # its next step is not probed, but it has the schedule's lr (not 0.0, which would say the schedule ended)
        assert by_step[step]["no_step"] == "reuses_rollouts" and by_step[step]["lr"] > 0
    assert by_step[1]["lr"] > by_step[2]["lr"] > by_step[3]["lr"]  # the linear schedule's, step by step
    assert by_step[2]["kind"] == "probe" and by_step[2]["deltaH1"] is not None
    assert not by_step[2]["next_step_reuses_rollouts"]
    marks = {(r["from_step"], r["to_step"]): r["rollout_reuse_steps"] for r in doc["realised"]}
    assert marks == {(a, a + 1): [a + 1] if a + 1 in reuse else [] for a in range(1, STEPS)}
    assert "Ĥ only (reuse step)" in summary and "reuse: step 2" in summary and "reuse: step 4" in summary
    saved = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert [r["rollout_reuse_steps"] for r in saved["realised"]] == [[2], [], [4]]


@pytest.mark.parametrize("loss_type", ["cispo", "sapo"])
def test_loss_types_the_probe_does_not_mirror_are_named(loss_type, tmp_path, tiny_model_dir):
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir, **{**RESEARCHER, "loss_type": loss_type})
    with pytest.raises(ConfigError) as info:
        EntropyProbeCallback(trainer, every=1)
    message = str(info.value)
    assert message.startswith(f"EntropyProbeCallback: GRPOConfig.loss_type: TRL's loss_type '{loss_type}' is not "
                              "supported by the probe; supported: ")
    assert "dapo" in message and "did you mean" not in message and "pydantic" not in message
    with pytest.raises(ConfigError, match=f"objective.loss_type: TRL's loss_type '{loss_type}' is not supported"):
        config_from_dict({"objective": {"loss_type": loss_type}})


def test_settings_beside_num_iterations_the_probe_cannot_mirror_are_named(tmp_path, tiny_model_dir):
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir,
                                **{**RESEARCHER, "steps_per_generation": 4})
    with pytest.raises(ConfigError, match=r"GRPOConfig\.steps_per_generation=4 is not supported \(≠ "
                                          r"gradient_accumulation_steps=2: .*num_iterations"):
        EntropyProbeCallback(trainer, every=1)
    trainer = tiny_grpo_trainer(tmp_path, steps=1, model_dir=tiny_model_dir,
                                **{**RESEARCHER, "off_policy_mask_threshold": 0.5})
    with pytest.raises(ConfigError) as info:
        EntropyProbeCallback(trainer, every=1)
    assert str(info.value) == ("EntropyProbeCallback: the trainer's settings cannot be probed: "
                               "objective.off_policy_mask_threshold: off-policy sequence masks need old log-probs "
                               "the probe does not have, got 0.5")


def test_num_iterations_is_a_config_key_of_at_least_one():
    assert config_from_dict({"objective": {"num_iterations": 2}}).objective.num_iterations == 2
    with pytest.raises(ConfigError, match=r"objective\.num_iterations: must be >= 1, got 0"):
        config_from_dict({"objective": {"num_iterations": 0}})

"""The probe on a checkpoint written by a real TRL GRPOTrainer run, as a user runs it.

- `checkpoint_path` alone (the `checkpoint-N/` directory): layout, base model, optimizer and the next
  step's lr are found; `objective.trainer: trl` gives TRL's loss; without it a loud warning;
- checkpoint-2 (end of a linear schedule, saved lr 0.0) is a one-line error naming learning_rate;
- v from that checkpoint equals the displacement of a real torch AdamW step (the optimizer rebuilt by
  torch from the saved optimizer.pt, clipping at TRL's max_grad_norm) per unit lr.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml

from entropy_experiments import cli
from entropy_experiments.config import config_from_dict
from entropy_experiments.estimators.step_directions import step_direction
from entropy_experiments.probe import recipe
from tests.probe_helpers import SHORT_PROMPTS, load_probe, write_prompts
from tests.run_helpers import logging_restored

pytestmark = pytest.mark.e2e  # runs whole probes (scripts/test.sh -m "not e2e" skips them)

pytest.importorskip("trl")


@pytest.fixture(scope="module")
def grpo_run(tmp_path_factory):
    from entropy_experiments.testing.trl_run import run_tiny_grpo

    out = tmp_path_factory.mktemp("grpo")
    run_tiny_grpo(out / "run", steps=2)
    return out / "run"


def _config(grpo_run, tmp_path, checkpoint="checkpoint-1", **objective) -> dict:
    data = write_prompts(tmp_path / "prompts.jsonl", SHORT_PROMPTS)
    return {
        "seed": 5,
        "checkpoint": {"checkpoint_path": str(grpo_run / checkpoint), "device_map": "cpu"},
        "batch_config": {"dataset_name": "jsonl", "dataset_path": str(data), "B_E": 4, "B_U": 2, "G": 2},
        "generation": {"max_new_tokens": 8, "gen_batch_size": 8, "tf_batch_size": 8},
        # TRL's own reward signature f(prompts, completions, **kw), used as it is
        "reward": {"name": "entropy_experiments.testing.trl_run:count_vowels_reward"},
        "objective": objective,
        "importance": {"eta_list": [1.0e-3]},
        "output": {"plot": False},
    }


def _run_cli(config: dict, tmp_path, capsys) -> tuple[int, dict | None, str]:
    path = tmp_path / "probe.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "run"
    with logging_restored():
        code = cli.main(["run", "--config", str(path), "--out", str(out)])
    err = capsys.readouterr().err
    results = json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else None
    return code, results, err


def test_probe_runs_on_grpo_checkpoint_with_checkpoint_path_alone(grpo_run, tmp_path, capsys):
    code, results, err = _run_cli(_config(grpo_run, tmp_path, trainer="trl"), tmp_path, capsys)
    assert code == 0, err
    assert results["checkpoint"]["layout"] == "trainer"
    assert results["learning_rate"] == pytest.approx(5e-4)  # the lr of step 2, as saved after step 1
    objective = results["update"]["objective"]
    assert (objective["loss_type"], objective["scale_rewards"], objective["max_grad_norm"]) == ("dapo", "group", 1.0)
    assert results["deltaH1"] != 0 and results["se"]["total"] > 0
    assert not any("OBJECTIVE NOT SET" in w for w in results["warnings"])


def test_trainer_checkpoint_without_objective_warns_loudly(grpo_run, tmp_path, capsys):
    code, results, err = _run_cli(_config(grpo_run, tmp_path), tmp_path, capsys)
    assert code == 0, err
    assert "OBJECTIVE NOT SET" in err
    assert any("OBJECTIVE NOT SET" in w for w in results["warnings"])
    assert results["update"]["objective"]["loss_type"] == "dr_grpo_per_prompt"


def test_end_of_schedule_checkpoint_is_a_learning_rate_error(grpo_run, tmp_path, capsys):
    code, results, err = _run_cli(_config(grpo_run, tmp_path, checkpoint="checkpoint-2", trainer="trl"),
                                  tmp_path, capsys)
    assert code == 2 and results is None
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "learning_rate" in lines[0], err


def test_v_is_the_real_adamw_step_of_the_grpo_checkpoint(grpo_run, tmp_path):
    probe, _ = load_probe(config_from_dict(_config(grpo_run, tmp_path, trainer="trl")))
    _, U, _ = probe.sample(B_E=1, B_U=2, G=2)
    grads = recipe.update_gradients(probe.config, probe.policy, U, [list(range(U.num_prompts))]).total
    v, info = step_direction(probe.config.step_options(), probe.policy, grads)
    assert info["norm"] > 0

    # Independent reference: torch's own AdamW, built from the saved optimizer.pt by torch itself
    # (TRL's ids follow the PeftModel's trainable named_parameters order), one real clipped step.
    named = [(n, p) for n, p in probe.model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    saved = torch.load(grpo_run / "checkpoint-1" / "optimizer.pt", weights_only=True)
    saved = copy.deepcopy(saved)
    saved["param_groups"] = [g for g in saved["param_groups"] if g["params"]]
    for g in saved["param_groups"]:
        g["fused"] = None  # the fused kernel is not on every CPU build; the maths is the same
    before = {n: p.detach().clone() for n, p in named}
    opt = torch.optim.AdamW(params, lr=1.0)
    opt.load_state_dict(saved)
    eta = 1e-2
    for group in opt.param_groups:
        group["lr"] = eta
    for n, p in named:
        p.grad = grads[n].clone()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    try:
        for n, p in named:
            step = (p.detach() - before[n]) / eta
            assert torch.allclose(step, v[n], rtol=1e-4, atol=1e-4 * v[n].abs().max().item()), n
    finally:
        with torch.no_grad():
            for n, p in named:
                p.copy_(before[n])


def test_dr_grpo_length_constant_differing_from_max_new_tokens_warns(grpo_run, tmp_path):
    """An L_const set to TRL's default (512) against the probe's max_new_tokens (8): a loud, recorded warning;
    left unset under trainer trl it follows max_new_tokens (TRL's max_completion_length is its generation length)."""
    differs = _config(grpo_run, tmp_path, trainer="trl", loss_type="dr_grpo", max_completion_length=512)
    _, warnings = load_probe(config_from_dict(differs))
    assert any("objective.max_completion_length is 512" in w for w in warnings), warnings
    for same in (_config(grpo_run, tmp_path, trainer="trl", loss_type="dr_grpo", max_completion_length=8),
                 _config(grpo_run, tmp_path, trainer="trl", loss_type="dr_grpo")):
        _, warnings = load_probe(config_from_dict(same))
        assert not any("max_completion_length" in w for w in warnings)

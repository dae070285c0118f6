"""Rough edges a TRL user met in `entropy-probe run` / `sweep`, one test (or a few) per edge."""

from __future__ import annotations

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.estimators import objectives
from entropy_experiments.report.summary import render_summary
from tests.report_helpers import fake_results

# ---- a. the resolved objective: printed, and TRL's max_completion_length follows the generation length -----------

def test_trl_max_completion_length_follows_max_new_tokens():
    """trainer trl, max_completion_length unset: L_const = generation.max_new_tokens (TRL generates that many)."""
    for loss_type in (None, "dr_grpo"):
        config = config_from_dict({"objective": {"trainer": "trl", "loss_type": loss_type},
                                   "generation": {"max_new_tokens": 24}})
        assert config.objective_options().max_completion_length == 24
    explicit = config_from_dict({"objective": {"trainer": "trl", "max_completion_length": 30},
                                 "generation": {"max_new_tokens": 24}})
    assert explicit.objective_options().max_completion_length == 30
    # no trainer, a loss that does not read it: left unset, as before
    assert config_from_dict({"objective": {"loss_type": "grpo"}}).objective_options().max_completion_length is None


def test_trl_dr_grpo_normaliser_uses_the_generation_length():
    """dr_grpo's weight is 1/(B·G·L_const): with L_const from max_new_tokens (24), not TRL's 512."""
    config = config_from_dict({"objective": {"trainer": "trl", "loss_type": "dr_grpo"},
                               "generation": {"max_new_tokens": 24}})
    lengths = torch.tensor([[3, 24], [7, 11]])
    w = objectives.token_weights(lengths, config.objective_options())
    assert torch.equal(w, torch.full((2, 2), 1.0 / (4 * 24), dtype=torch.float64))
    assert not any("max_completion_length" in m for m in config.objective_warnings("trainer"))


def test_summary_prints_the_resolved_objective():
    options = config_from_dict({"objective": {"trainer": "trl", "loss_type": "dr_grpo", "kl_coef": 0.04},
                                "generation": {"max_new_tokens": 24}}).objective_options()
    results = fake_results()
    results["update"]["objective"] = options.to_dict()
    text = render_summary(results)
    # the objective row and the lines it wraps onto, whitespace collapsed
    row, inside = [], False
    for text_line in text.splitlines():
        inside = text_line.strip().startswith("objective") or (inside and text_line[:20].strip() == "")
        row += [text_line] if inside else []
    line = " ".join(" ".join(row).split())
    for part in ("dr_grpo (trainer trl)", "advantages group (ε 0.0001)", "β 0.04 (k3)", "entropy_coef 0",
                 "max_grad_norm 1", "max_completion_length 24", "micro_batches 1"):
        assert part in line, (part, line)


# ---- b. every ratio in the summary reads measured / predicted -------------------------------------------------

def test_summary_ratios_all_read_measured_over_predicted():
    """The η table's ΔH/δH₁(η) and the predictors table show the same pair the same way (not 0.711 and 1.406)."""
    results = fake_results()
    lr, row = results["learning_rate"], next(e for e in results["true"] if e["eta"] == 1e-6)
    measured = row["deltaH_true"] * lr / row["eta"]  # ΔH at the smallest positive η, scaled to the lr
    predicted = results["deltaH1"]
    results["predictors"] = {"adamw_step": {"delta_h1": predicted, "se": 2.5e-5, "se_E": 1.5e-5, "se_U": 2e-5,
                                            "measured_over_predicted": measured / predicted}}
    text = render_summary(results)
    assert f"{measured / predicted:.3f}" == "1.010"
    eta_row = next(line for line in text.splitlines() if line.strip().startswith("1e-06"))
    pred_row = next(line for line in text.splitlines() if line.strip().startswith("adamw_step"))
    assert "1.010" in eta_row and "1.010" in pred_row and f"{predicted / measured:.3f}" not in pred_row
    header = text.split("Measured ΔH(η) by SNIS on E")[1].splitlines()[:5]
    words = " ".join(header).split()
    assert "ΔH/δH₁(η)" in words and "measured/" in words and "predicted" in words  # the η table's header
    assert "measured/predicted" in text  # the predictors table's column and the linearity ratios
    assert "ratio " not in text  # no unlabelled ratio left


# ---- c. a module:function reward in the working directory is imported from there, as the docs say ----------------

def test_reward_module_in_the_working_directory_is_imported_from_there(tmp_path, monkeypatch):
    import sys

    import pytest

    from entropy_experiments.data.rewards import get_reward
    from entropy_experiments.errors import RewardError

    (tmp_path / "my_rewards_rough_edge.py").write_text("def fn(prompt, responses, example):\n    return [0.0]\n")
    monkeypatch.chdir(tmp_path.parent)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path), str(tmp_path.parent))])
    # elsewhere: one line saying where it was looked for and what to do
    with pytest.raises(RewardError) as info:
        get_reward("my_rewards_rough_edge:fn")
    message = str(info.value)
    assert message.startswith("reward 'my_rewards_rough_edge:fn': cannot import module 'my_rewards_rough_edge' "
                              "(ModuleNotFoundError: No module named 'my_rewards_rough_edge')")
    assert f"nor in the working directory {tmp_path.parent}" in message and "PYTHONPATH" in message
    assert "\n" not in message
    # run from the directory that holds it (as README.md and docs/user-guide.md say): it resolves
    monkeypatch.chdir(tmp_path)
    assert get_reward("my_rewards_rough_edge:fn")("p", ["r"], None) == [0.0]
    assert sys.path[-1] == str(tmp_path)  # appended, after every installed package


def test_working_directory_never_shadows_an_installed_module(tmp_path, monkeypatch):
    """A `colorsys.py` beside the config does not replace the standard library's, even after a reward was imported
    from the working directory: it is searched only for names found nowhere else."""
    import sys

    import pytest

    from entropy_experiments.data.rewards import get_reward
    from entropy_experiments.errors import RewardError

    (tmp_path / "my_rewards_shadow_check.py").write_text("def fn(prompt, responses, example):\n    return [1.0]\n")
    (tmp_path / "colorsys.py").write_text("def fn(prompt, responses, example):\n    return [1.0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "colorsys", raising=False)
    assert get_reward("my_rewards_shadow_check:fn")("p", ["r"], None) == [1.0]
    with pytest.raises(RewardError, match=r"'colorsys' has no attribute 'fn'"):
        get_reward("colorsys:fn")


def test_reward_module_whose_own_import_fails_gets_no_path_hint(tmp_path, monkeypatch):
    """A module that IS found but imports a missing package: the error is that package's, no PYTHONPATH advice."""
    import pytest

    from entropy_experiments.data.rewards import get_reward
    from entropy_experiments.errors import RewardError

    (tmp_path / "needs_missing_dep_rough_edge.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as info:
        get_reward("needs_missing_dep_rough_edge:fn")
    assert "No module named 'no_such_dependency_xyz'" in str(info.value) and "PYTHONPATH" not in str(info.value)


# ---- d. k̂ n/a is explained ------------------------------------------------------------------------------

def _results_with_n(n: int, logws: dict[float, list[float]]) -> dict:
    """fake_results whose ΔH rows carry the real diagnostics of the given log-weights (N = n sequences)."""
    from entropy_experiments.estimators.snis import importance_diagnostics

    results = fake_results()
    results["counts"]["B_E"] = n
    results["true"] = [{**results["true"][0], "eta": eta, **importance_diagnostics(lw)} for eta, lw in logws.items()]
    return results


def test_khat_na_says_it_needs_25_sequences():
    import numpy as np

    rng = np.random.default_rng(0)
    small = _results_with_n(24, {1e-5: list(rng.normal(0, 0.3, 24))})
    assert small["true"][0]["psis_khat"] != small["true"][0]["psis_khat"]  # NaN: psis_khat's own rule at N = 24
    text = render_summary(small)
    assert "k̂ n/a: PSIS k̂ fits a Pareto tail" in text and "N ≥ 25 E sequences; this run has N = 24" in text
    enough = _results_with_n(25, {1e-5: list(rng.normal(0, 0.3, 25))})
    assert enough["true"][0]["psis_khat"] == enough["true"][0]["psis_khat"]  # defined from N = 25 on
    assert "k̂ n/a" not in render_summary(enough)


def test_khat_na_from_zero_weights_is_named():
    import numpy as np

    lw = [0.0] * 5 + [-np.inf] * 35  # N = 40, M = 8: only 5 non-zero weights
    text = render_summary(_results_with_n(40, {1e-4: lw}))
    assert "k̂ n/a at η=0.0001: only 5 non-zero weights, the fit needs more than M = 8" in " ".join(text.split())


# ---- e / f. the run directory: no partial/ left by a completed run; a run that failed before computing ------
# ---- anything does not block the corrected config -------------------------------------------------------

def test_failed_run_with_nothing_computed_is_taken_over_by_a_new_config(tmp_path):
    import pytest

    from entropy_experiments.errors import OutputError
    from entropy_experiments.report.run_dir import RunDirectory

    run = RunDirectory.prepare(tmp_path, "seed: 1\n", "aaaa", overwrite=False, resume=False)
    (tmp_path / "probe.log").write_text("error: data set not found\n")
    run.mark_status("failed")
    again = RunDirectory.prepare(tmp_path, "seed: 2\n", "bbbb", overwrite=False, resume=False)
    assert again.read_meta()["config_hash"] == "bbbb" and again.read_meta()["status"] == "running"
    assert (tmp_path / "config.yaml").read_text() == "seed: 2\n" and not (tmp_path / "probe.log").exists()
    # --resume still needs the config the run was started with
    again.mark_status("failed")
    with pytest.raises(OutputError, match="holds a different config"):
        RunDirectory.prepare(tmp_path, "seed: 3\n", "cccc", overwrite=False, resume=True)


def test_failed_run_that_saved_samples_or_a_running_one_still_needs_overwrite(tmp_path):
    import pytest

    from entropy_experiments.errors import OutputError
    from entropy_experiments.report.run_dir import GenerationChunkStore, RunDirectory

    chunk = RunDirectory.prepare(tmp_path / "chunk", "seed: 1\n", "aaaa", overwrite=False, resume=False)
    GenerationChunkStore(chunk).open({"seed": 1})[1](0, [[1, 2]])
    chunk.mark_status("failed")
    batch = RunDirectory.prepare(tmp_path / "batch", "seed: 1\n", "aaaa", overwrite=False, resume=False)
    batch.save_batch("E", {"x": torch.ones(1)})
    batch.mark_status("failed")
    running = RunDirectory.prepare(tmp_path / "running", "seed: 1\n", "aaaa", overwrite=False, resume=False)
    complete = RunDirectory.prepare(tmp_path / "complete", "seed: 1\n", "aaaa", overwrite=False, resume=False)
    complete.mark_status("complete")
    for run in (chunk, batch, running, complete):
        with pytest.raises(OutputError, match="holds a different config"):
            RunDirectory.prepare(run.path, "seed: 2\n", "bbbb", overwrite=False, resume=False)
    assert chunk.has_partial_chunks() and batch.load_batch("E") is not None


def test_clear_partial_removes_the_folder(tmp_path):
    from entropy_experiments.report.run_dir import GenerationChunkStore, RunDirectory

    run = RunDirectory.prepare(tmp_path, "seed: 1\n", "aaaa", overwrite=False, resume=False)
    store = GenerationChunkStore(run)
    store.open({"seed": 1})[1](0, [[1, 2]])
    store.clear()  # the batches are saved whole: the chunks and their folder go
    assert not (tmp_path / "partial").exists()
    run.save_partial("older_state", {"x": 1})
    run.clear_partial()
    assert not (tmp_path / "partial").exists()
    run.record_meta("sampling_warnings", ["w"])
    resumed = RunDirectory.prepare(tmp_path, "seed: 1\n", "aaaa", overwrite=False, resume=True)
    assert resumed.read_meta()["sampling_warnings"] == ["w"]  # kept for the resumed run's results.json
    fresh = RunDirectory.prepare(tmp_path, "seed: 1\n", "aaaa", overwrite=False, resume=False)
    assert "sampling_warnings" not in fresh.read_meta()


@pytest.mark.e2e
def test_tiny_run_failed_config_then_corrected_config_completes_without_partial(tmp_path, tiny_model_dir, capsys):
    """A real run: a data-set error leaves a failed directory the corrected config reuses (no --overwrite); the
    completed run keeps no partial/ and prints its objective."""
    import json

    import yaml

    from entropy_experiments import cli
    from tests.run_helpers import logging_restored, make_run_setup

    config_path, config = make_run_setup(tmp_path / "setup", tiny_model_dir)
    bad = dict(config, batch_config={**config["batch_config"], "dataset_path": str(tmp_path / "missing.jsonl")})
    bad_path = tmp_path / "bad.yaml"
    bad_path.write_text(yaml.safe_dump(bad, allow_unicode=True))
    out = tmp_path / "run"
    with logging_restored():
        assert cli.main(["run", "--config", str(bad_path), "--out", str(out)]) == 2
        assert "missing.jsonl" in capsys.readouterr().err
        assert json.loads((out / "run_meta.json").read_text())["status"] == "failed"
        assert cli.main(["run", "--config", str(config_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert json.loads((out / "run_meta.json").read_text())["status"] == "complete"
    assert not (out / "partial").exists()
    assert (out / "E_batch.pt").is_file() and (out / "results.json").is_file()
    assert "objective" in printed and "max_completion_length" in printed


# ---- h. which optional phases ran and their seconds -----------------------------------------------------

def test_summary_states_the_optional_phases_and_their_seconds():
    timing = {"load": 3.0, "sample": 10.0, "delta_h1_total": 20.0, "error_bars": 4.0,
              "delta_h": 6.0, "second_order": 32.0, "predictors": 32.0, "total": 100.0}
    text = " ".join(render_summary(fake_results(timing=timing)).split())
    assert ("optional phases ran: variance 4.0 s (4 %), importance 6.0 s (6 %), second_order 32.0 s (32 %), "
            "predictors 32.0 s (32 %) (set <phase>.enabled: false to skip one)") in text
    del timing["second_order"], timing["predictors"]
    text = " ".join(render_summary(fake_results(timing=timing)).split())
    assert "ran: variance 4.0 s (4 %), importance 6.0 s (6 %) (set" in text and "; off: second_order, predictors" in text


# ---- i. no claim of agreement when the ratio is far from 1 -------------------------------------------------

def _with_residual(ratio: float, z: float) -> str:
    """The summary of a run whose η = 1e-5 row has ΔH = ratio·δH₁(η) and a paired residual with that z."""
    results = fake_results()
    for entry in results["true"]:
        predicted = entry["eta"] * results["x_hat_dot_v"]
        entry["deltaH_true"] = ratio * predicted
        value = entry["deltaH_true"] - predicted
        entry["residual"] = {"value": value, "se": abs(value / z), "z": z}
    return render_summary(results)


def _row(text: str, eta: str) -> str:
    return next(line for line in text.splitlines() if line.strip().startswith(f"{eta} "))


def test_far_ratio_with_small_z_is_too_noisy_not_agreement():
    row = _row(_with_residual(2.35, 0.99), "1e-05")  # the user's case: ΔH/δH₁ = 2.35, z +0.99
    assert "2.350" in row and "+0.99 too noisy" in row
    assert "consistent" not in row and "holds" not in row


def test_consistent_only_with_small_z_and_an_informative_interval():
    # ratio 1.1 with z 0.5: SE = 0.2·|δH₁(η)|, 1.96·SE = 0.39·|δH₁(η)| ≤ 0.5·|δH₁(η)|
    assert "+0.50 consistent" in _row(_with_residual(1.1, 0.5), "1e-05")
    # ratio 1.1 with z 0.15: SE = 0.67·|δH₁(η)|: the interval could not have shown a 50 % miss
    assert "+0.15 too noisy" in _row(_with_residual(1.1, 0.15), "1e-05")
    assert "+3.00 off" in _row(_with_residual(1.3, 3.0), "1e-05")
    assert "'consistent': |z| < 2 and the 95 % interval" in " ".join(_with_residual(1.1, 0.5).split())


# ---- j. an interrupted --dryrun does not suggest --resume ------------------------------------------------

@pytest.mark.e2e
def test_interrupted_dryrun_says_there_is_nothing_to_resume(monkeypatch, capsys):
    """The interrupt reaches cli.main as a real SIGINT would (lifecycle.RunInterrupted raised inside the run)."""
    import signal

    from entropy_experiments import cli
    from entropy_experiments.config import packaged_config_path
    from entropy_experiments.probe.lifecycle import RunInterrupted
    from tests.run_helpers import logging_restored

    calls = []

    def interrupted(config, **kwargs):
        calls.append(kwargs)
        raise RunInterrupted(signal.SIGINT)

    monkeypatch.setattr(cli, "run_probe", interrupted)
    with logging_restored():
        assert cli.main(["run", "--config", str(packaged_config_path("default")), "--dryrun"]) == 128 + signal.SIGINT
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err == "interrupted by SIGINT; a dry run writes nothing, so there is nothing to resume: start it again"
        assert "--resume" not in err
        assert cli.main(["run", "--config", str(packaged_config_path("default"))]) == 128 + signal.SIGINT
        assert capsys.readouterr().err.strip().splitlines()[-1] == \
            "interrupted by SIGINT; finish a run with --resume RUN_DIR"
    assert [c["dryrun"] for c in calls] == [True, False]

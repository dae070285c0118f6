"""What a TRL user rerunning the probe read wrong: report.html's header, its ratio convention, the token view's
direct-part label with the split of δH₁, and the shared prompt template shown once. Read from the page's DOM with
the stdlib HTML parser (always runs), next to the headless-Chromium tests of tests/test_report_html.py."""

from __future__ import annotations

import html.parser

import pytest

from entropy_experiments.estimators.predictors import with_ratios
from entropy_experiments.report.html_report import render_html_report
from entropy_experiments.report.summary import render_summary
from tests.report_helpers import fake_results

TEMPLATE = ("<|im_start|>system\nYou are a careful maths tutor. Think step by step.<|im_end|>\n<|im_start|>user\n",
            "<|im_end|>\n<|im_start|>assistant\n")
QUESTIONS = ["What is 2 + 2?", "Name a prime above 10.", "What is 7 * 6?"]


class Dom(html.parser.HTMLParser):
    """The text of every element with an id (nested text included), and all the page's text."""

    def __init__(self):
        super().__init__()
        self.open: list[tuple[str, str | None]] = []
        self.by_id: dict[str, list[str]] = {}
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        ident = dict(attrs).get("id")
        if tag not in ("input", "br", "hr", "meta"):
            self.open.append((tag, ident))
        if ident:
            self.by_id.setdefault(ident, [])

    def handle_endtag(self, tag):
        while self.open:
            if self.open.pop()[0] == tag:
                break

    def handle_data(self, data):
        self.text.append(data)
        for _, ident in self.open:
            if ident:
                self.by_id[ident].append(data)

    def of(self, ident: str) -> str:
        return "".join(self.by_id[ident])


def _page(**changes) -> tuple[dict, Dom]:
    n = 4
    tokens = {"sequence": [0] * n, "position": list(range(n)), "token_id": list(range(n)),
              "token": ["The", " answer", " is", " 4"], "H": [0.5, 0.4, 0.3, 0.2], "dH": [1e-6, -2e-6, 3e-6, -4e-6]}
    results = fake_results(**changes)
    att = {"U_groups": None, "E_tokens": {"tokens": n, "sum_dH": -2e-6, "normalizer": 4, "direct_only": -5e-7,
                                          "top_shares": []}}
    results["attribution"] = att
    results["update"]["objective"] = {"loss_type": "dapo", "trainer": "trl 1.16", "scale_rewards": "batch",
                                      "advantage_eps": 1e-4, "kl_coef": 0.04, "kl_estimator": "k3",
                                      "entropy_coef": 0.0, "max_grad_norm": 1.0, "max_completion_length": 64,
                                      "micro_batches": 2}
    prompts = [TEMPLATE[0] + q + TEMPLATE[1] for q in QUESTIONS]
    page = render_html_report(results, tokens, {"prompts": prompts[:1], "num_responses_per_prompt": 1},
                              {"prompts": prompts})
    dom = Dom()
    dom.feed(page)
    return results, dom


def test_the_header_names_checkpoint_objective_sizes_and_the_console_verdict():
    results, dom = _page()
    assert dom.of("header-checkpoint") == "runs/step_40"
    objective = dom.of("header-objective")
    assert "dapo" in objective and "β 0.04" in objective and "advantages batch" in objective
    sizes = dom.of("header-sizes")
    assert "B_E 64" in sizes and "B_U 8" in sizes and "G 4" in sizes and "4380 tokens" in sizes
    verdict = dom.of("header-verdict")
    # the same words as the console summary's head: at the smallest positive η (1e-6) measured/predicted 1.01
    assert "at η=1e-06: measured/predicted 1.010" in verdict
    console = render_summary(results)
    assert verdict.split(", first order")[0] in console


def test_the_token_view_says_it_shows_the_direct_part_and_splits_delta_h1():
    results, dom = _page()
    note = dom.of("direct-part-note")
    assert "direct part" in note and "score-function part" in note
    delta_h1 = results["deltaH1"]
    assert f"δH₁ = {delta_h1:.4g}" in note and "Σ dH / D -5e-07" in note
    assert f"score-function part {delta_h1 - -5e-7:.4g}" in note
    assert "colour by lr·D_v H_t, the direct part" in "".join(dom.text)


def test_the_shared_template_is_shown_once_and_rows_show_their_question():
    _, dom = _page()
    text = "".join(dom.text)
    assert text.count("You are a careful maths tutor") == 1
    assert "You are a careful maths tutor" in dom.of("template")
    for q in QUESTIONS[:1]:
        assert q in text


def test_every_ratio_reads_measured_over_predicted():
    measured = {"eta": 1e-6, "deltaH_scaled": -1.2e-4, "se": 1e-5}
    entry = with_ratios({"adamw_step": {"delta_h1": -1.0e-4}}, measured)["adamw_step"]
    assert entry["measured_over_predicted"] == pytest.approx(1.2)
    assert "ratio_to_measured" not in entry  # the inverse is not written beside it
    results, dom = _page(predictors={"adamw_step": entry})
    console = render_summary(results)
    assert "measured/predicted" in console and "1.200" in console
    assert "1.200" in "".join(dom.text) and "ratio to measured" not in "".join(dom.text)
    assert "0.833" not in "".join(dom.text)


def test_a_training_run_given_as_the_checkpoint_names_its_checkpoints(tmp_path):
    from entropy_experiments.checkpoint.layout import resolve_checkpoint
    from entropy_experiments.errors import CheckpointError

    for step in (2, 4, 10, 6):
        (tmp_path / f"checkpoint-{step}").mkdir()
        (tmp_path / f"checkpoint-{step}" / "adapter_config.json").write_text("{}")
    (tmp_path / "runs").mkdir()  # TensorBoard logs beside them
    with pytest.raises(CheckpointError) as err:
        resolve_checkpoint(str(tmp_path), None, None)
    message = str(err.value)
    assert "\n" not in message and err.value.exit_code == 2
    assert "is a training run" in message and "checkpoint-4, checkpoint-6, checkpoint-10" in message
    assert "checkpoint-2" not in message and "entropy-probe sweep" in message
    assert "set checkpoint.adapter_path" not in message


def test_an_empty_directory_still_asks_for_the_adapter(tmp_path):
    from entropy_experiments.checkpoint.layout import resolve_checkpoint
    from entropy_experiments.errors import CheckpointError

    with pytest.raises(CheckpointError, match="no adapter found"):
        resolve_checkpoint(str(tmp_path), None, None)


def test_grpo_clip_range_and_num_iterations_are_accepted_and_recorded():
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.report.run_lines import objective_lines

    cfg = config_from_dict({"objective": {"trainer": "trl", "loss_type": "dapo", "epsilon_high": 0.28,
                                          "num_iterations": 2, "kl_coef": 0.04}})
    recorded = cfg.objective_options().to_dict()  # results.json update.objective
    assert recorded["epsilon_high"] == 0.28 and recorded["epsilon"] is None and recorded["num_iterations"] == 2
    line = " · ".join(objective_lines(recorded))
    assert "num_iterations 2" in line
    assert "ε default / ε_high 0.28 (no effect on the first on-policy step: ratio = 1)" in line
    plain = " · ".join(objective_lines(config_from_dict({}).objective_options().to_dict()))
    assert "num_iterations 1" in plain and "ε_high" not in plain
    # the default config's hash is unchanged by the new keys (a run directory made before them still resumes)
    assert config_from_dict({}).config_hash() == config_from_dict({"objective": {"epsilon": None}}).config_hash()
    assert config_from_dict({}).config_hash() != config_from_dict({"objective": {"epsilon": 0.2}}).config_hash()


def test_a_real_trl_log_of_rollout_reuse_warns_when_num_iterations_is_left_at_1(tmp_path):
    """TRL 1.16 with num_iterations = 2 and logging every step: every other training entry has no generation metrics."""
    import json

    pytest.importorskip("trl")
    from entropy_experiments.checkpoint.trainer_log import logged_rollout_reuse, rollout_reuse_warnings
    from entropy_experiments.testing.trl_run import run_tiny_grpo

    state = run_tiny_grpo(tmp_path / "run", steps=4, num_iterations=2) / "trainer_state.json"
    assert logged_rollout_reuse(state) == (4, 2)
    (message,) = rollout_reuse_warnings(state, 1)
    assert "2 of 4 logged training steps have no generation metrics" in message
    assert "num_iterations ≈ 2" in message and "objective.num_iterations is 1" in message
    assert rollout_reuse_warnings(state, 2) == []  # set as the run had it: nothing to say
    history = json.loads(state.read_text())
    for row in history["log_history"]:  # a run that generated at every step
        row.setdefault("reward", 1.0)
    fresh = tmp_path / "fresh.json"
    fresh.write_text(json.dumps(history))
    assert logged_rollout_reuse(fresh) is None and rollout_reuse_warnings(fresh, 1) == []


def test_threads_follow_the_flag_then_omp_num_threads_then_the_free_cores():
    from entropy_experiments.threads import choose_threads

    assert choose_threads(3, "8", cores=16, load=0.0).threads == 3          # --threads wins
    assert choose_threads(None, "2", cores=16, load=15.0).threads == 2      # OMP_NUM_THREADS respected
    busy = choose_threads(None, None, cores=16, load=14.2)                  # another process on 14 cores
    assert busy.threads == 2 and "load average 14.2" in busy.reason
    assert choose_threads(None, None, cores=2, load=7.0).threads == 1       # never below 1
    assert choose_threads(None, None, cores=8, load=0.1).threads == 8       # idle: every core
    assert choose_threads(None, "abc", cores=4, load=0.0).threads == 4      # a malformed value is not a count


@pytest.mark.parametrize("omp", [None, "1"])
def test_the_cli_sets_torch_threads_with_omp_num_threads_set_and_unset(omp):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if omp is not None:
        env["OMP_NUM_THREADS"] = omp
    code = ("import torch; from entropy_experiments.threads import apply_threads, choose_threads, usable_cores; "
            "import os; c = apply_threads(None); print(c.threads, torch.get_num_threads(), usable_cores())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    chosen, torch_threads, cores = map(int, out.stdout.split())
    assert chosen == torch_threads
    if omp is not None:
        assert chosen == 1
    else:
        assert 1 <= chosen <= cores


def test_threads_flag_is_refused_when_not_positive(capsys):
    from entropy_experiments import cli

    assert cli.main(["run", "--threads", "0"]) == 2
    assert "--threads must be a positive integer" in capsys.readouterr().err


def test_the_bitsandbytes_kernels_notice_is_dropped_and_its_other_messages_kept(caplog):
    import logging

    from entropy_experiments.library_noise import (
        BNB_CPU_LOGGER,
        BNB_KERNELS_NOTICE,
        quiet_bitsandbytes_kernels_notice,
    )

    quiet_bitsandbytes_kernels_notice()
    quiet_bitsandbytes_kernels_notice()  # idempotent
    logger = logging.getLogger(BNB_CPU_LOGGER)
    with caplog.at_level(logging.INFO):
        logger.warning("%s: No module named 'kernels'. Please make sure you already `pip install kernels`",
                       BNB_KERNELS_NOTICE)
        logger.warning("another bitsandbytes warning")
    assert [r.getMessage() for r in caplog.records if r.name == BNB_CPU_LOGGER] == ["another bitsandbytes warning"]


def test_importing_bitsandbytes_after_the_cli_logging_prints_no_kernels_line():
    import subprocess
    import sys

    pytest.importorskip("bitsandbytes")
    code = ("from entropy_experiments.cli import setup_logging; setup_logging(); import bitsandbytes")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "kernels-community" not in out.stderr and "pip install kernels" not in out.stderr


def test_use_bias_correction_kl_left_at_the_trainers_default_raises_no_warning():
    from entropy_experiments.config import config_from_dict

    for beta in (0.0, 0.04):
        cfg = config_from_dict({"objective": {"trainer": "trl", "kl_coef": beta}})
        assert not [w for w in cfg.objective_warnings("trainer") if "use_bias_correction_kl" in w]
    assert config_from_dict({"objective": {"trainer": "trl", "kl_coef": 0.04}}).objective_options().weights_kl


def _sweep_doc() -> dict:
    base = {"H_se": 0.01, "se_total": None, "deltaH_true": None, "residual_z": None, "kind": "entropy_only",
            "deltaH1": None, "lr": 5e-6}
    rows = [{**base, "checkpoint": "checkpoint-1", "step": 1, "H": 0.70, "no_step": "reuses_rollouts",
             "next_step_reuses_rollouts": True},
            {**base, "checkpoint": "checkpoint-3", "step": 3, "H": 0.66, "lr": 0.0, "no_step": "schedule_ended",
             "next_step_reuses_rollouts": True}]
    realised = [{"from_step": 1, "to_step": 3, "dH_realised": -0.03, "se": 0.01, "method": "importance",
                 "n_changed": 5, "n_common_draws": 8, "ess_frac": 0.8, "psis_khat": 0.2, "paired_diagnostic": {},
                 "dH_predicted": None, "se_predicted": None, "se_batch": None, "z": None,
                 "displacement": {"steps_spanned": 2, "value": -0.02, "se": 0.005, "second_order": None,
                                  "cos_with_probe_step": None, "probe_step_norm_ratio": None},
                 "u_noise": None, "first_order": None, "with_second_order": None}]
    return {"n_checkpoints": 2, "units": "nats/token", "rows": rows, "realised": realised, "calibration": {},
            "decomposition": {}}


def test_sweep_summary_names_why_a_row_has_only_h_and_explains_k(capsys):
    from entropy_experiments.sweep.summary import print_sweep_summary

    print_sweep_summary(_sweep_doc())
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip().startswith("checkpoint-")}
    assert "Ĥ only (reuse step)" in lines["checkpoint-1"] and "5e-06" in lines["checkpoint-1"]
    assert "Ĥ only (schedule ended)" in lines["checkpoint-3"] and "reuse" not in lines["checkpoint-3"]
    assert "K: training steps the interval spans" in out


def test_no_step_kind_reads_the_reasons_the_sweep_writes():
    from entropy_experiments.checkpoint.rollouts import reuse_refusal
    from entropy_experiments.sweep.rows import no_step_kind

    assert no_step_kind(reuse_refusal("checkpoint-3", 3, 2)) == "reuses_rollouts"
    ended = ("the saved lr is 0.0 (trainer_state.json step 4 of max_steps 4: a schedule that ended): no next step "
             "follows this checkpoint, so δH₁ would be 0 by construction; only its entropy is measured")
    assert no_step_kind(ended) == "schedule_ended"


def test_trajectory_legend_names_the_importance_estimate_and_the_left_panel_says_why(monkeypatch, tmp_path):
    pytest.importorskip("matplotlib")
    from entropy_experiments.sweep import plots

    figures = []
    monkeypatch.setattr(plots, "save_png", lambda fig, path: figures.append(fig) or path)
    plots.plot_trajectory(_sweep_doc(), tmp_path / "trajectory.png")
    (fig,) = figures
    left, right = fig.axes[:2]
    legend = [t.get_text() for t in right.get_legend().get_texts()]
    assert any("importance estimate" in t for t in legend)
    assert not any(t.startswith("realised H(to) − H(from)") for t in legend)
    notes = " ".join(t.get_text() for t in left.texts)
    assert "own E" in notes and "same draws" in notes

"""`entropy-probe` end to end, in process: run, --resume, --overwrite, --dryrun, report, bad inputs.

Everything runs on the tiny random Qwen2 (conftest `tiny_model_dir`) with a checkpoint made by
`entropy-probe make-checkpoint` (one Dr-GRPO step), at B_E 4, B_U 2, G 2 and 8 new tokens. The one
`slow` test runs `entropy-probe demo` on the embedded SmolLM2 at tiny sizes.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from entropy_experiments import cli
from entropy_experiments.report.results_schema import SCHEMA_VERSION, validate_results_schema
from entropy_experiments.report.summary import render_summary
from tests.independent_checks import lr_times_snis_slope
from tests.probe_helpers import SHORT_PROMPTS, write_prompts
from tests.run_helpers import base_config as make_base_config
from tests.run_helpers import logging_restored

# Costly module fixtures: one worker runs this whole file (scripts/test.sh distributes by xdist_group).
pytestmark = [pytest.mark.xdist_group("test_cli_e2e"), pytest.mark.e2e]

RUN_FILES = ("config.yaml", "results.json", "E_batch.pt", "U_batch.pt", "update_vector.safetensors",
             "per_sequence.jsonl", "delta_h_vs_eta.png", "probe.log")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True, scope="module")
def _restore_logging_after_module():
    """Module-scoped fixtures below call cli.main before any function-scoped fixture runs."""
    with logging_restored():
        yield


@pytest.fixture(autouse=True)
def _restore_logging():
    with logging_restored():
        yield


def _main(argv: list[str]) -> tuple[int, str]:
    """cli.main(argv) with its stdout captured (for fixtures, which cannot use capsys)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = cli.main(argv)
    return code, buffer.getvalue()


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error:")]


def _summary_line(text: str, label: str) -> str:
    lines = [line for line in text.splitlines() if line.lstrip().startswith(label)]
    assert len(lines) == 1, f"expected one {label!r} line in:\n{text}"
    return lines[0]


def _numbers(res: dict) -> dict:
    """The numbers a resumed run must reproduce exactly (timings and the environment excluded)."""
    return {"deltaH1": res["deltaH1"], "x_hat_dot_v": res["x_hat_dot_v"], "learning_rate": res["learning_rate"],
            "se": res["se"], "H_orig": res["H_orig"], "update_norm": res["update"]["norm"],
            "true": [(t["eta"], t["deltaH_true"], t["se"], t["H_upd"], t["ess"]) for t in res["true"]]}


# ------------------------------------------------------------------------------------------ fixtures

@pytest.fixture(scope="module")
def base_config(tiny_model_dir, tmp_path_factory) -> dict:
    """The config dict shared by every run here (the checkpoint path is added by `config_file`)."""
    data = write_prompts(tmp_path_factory.mktemp("cli_data") / "prompts.jsonl", SHORT_PROMPTS)
    return make_base_config(tiny_model_dir, data, output={"plot": True})


@pytest.fixture(scope="module")
def tiny_checkpoint(base_config, tmp_path_factory) -> Path:
    """A real adapter + AdamW state from `entropy-probe make-checkpoint --steps 1` on the tiny model."""
    folder = tmp_path_factory.mktemp("cli_ckpt")
    cfg = folder / "make_ckpt.yaml"
    cfg.write_text(yaml.safe_dump(base_config, allow_unicode=True))
    out = folder / "ckpt"
    code, _ = _main(["make-checkpoint", "--out", str(out), "--steps", "1", "--config", str(cfg)])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def config_file(base_config, tiny_checkpoint, tmp_path_factory) -> Path:
    config = {**base_config, "checkpoint": {**base_config["checkpoint"], "checkpoint_path": str(tiny_checkpoint)}}
    path = tmp_path_factory.mktemp("cli_cfg") / "probe.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return path


@pytest.fixture(scope="module")
def first_run(config_file, tmp_path_factory) -> tuple[Path, str]:
    """(run directory, printed summary) of `entropy-probe run --config F --out D`. Tests that change
    the directory work on a copy (`run_copy`)."""
    out = tmp_path_factory.mktemp("cli_runs") / "run1"
    code, stdout = _main(["run", "--config", str(config_file), "--out", str(out)])
    assert code == 0
    return out, stdout


@pytest.fixture
def run_copy(first_run, tmp_path) -> Path:
    return Path(shutil.copytree(first_run[0], tmp_path / "run_copy"))


def _results(run_dir: Path) -> dict:
    return json.loads((run_dir / "results.json").read_text(encoding="utf-8"))



# ------------------------------------------------------------------------------------------ run

def test_checkpoint_from_make_checkpoint(tiny_checkpoint):
    assert (tiny_checkpoint / "model" / "adapter_config.json").is_file()
    assert (tiny_checkpoint / "optimizer.pt").is_file()
    meta = json.loads((tiny_checkpoint / "checkpoint.json").read_text())
    assert meta["step"] == 1


def test_run_writes_every_output(first_run, tiny_model_dir):
    out, stdout = first_run
    for name in RUN_FILES:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")], "temp files left behind"
    assert json.loads((out / "run_meta.json").read_text())["status"] == "complete"

    res = _results(out)
    validate_results_schema(res)
    assert math.isfinite(res["deltaH1"]) and math.isfinite(res["x_hat_dot_v"])
    assert res["deltaH1"] == pytest.approx(lr_times_snis_slope(res), abs=4 * res["se"]["E"])
    assert res["schema_version"] == SCHEMA_VERSION and "bars_dot" not in res  # the current names only
    assert [t["eta"] for t in res["true"] if t["eta"] > 0] == [1.0e-4, 1.0e-3]
    assert res["counts"]["B_E"] == 4 and res["counts"]["B_U"] == 2 and res["counts"]["G"] == 2

    # config.yaml is the resolved config: the values we gave, and the defaults for the rest.
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["batch_config"]["B_E"] == 4 and resolved["generation"]["max_new_tokens"] == 8
    assert resolved["checkpoint"]["base_model"] == str(tiny_model_dir)
    assert "variance" in resolved and "precision" in resolved

    # update_vector.safetensors: v keyed by exactly the model's trainable parameter names, shapes included.
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(resolved["checkpoint"]["checkpoint_path"] + "/model"),
                                      is_trainable=True)
    trainable = {n: tuple(p.shape) for n, p in model.named_parameters() if p.requires_grad}
    with safe_open(str(out / "update_vector.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_tensor(k).shape) for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    assert trainable and saved == trainable
    assert meta["direction"] == res["update"]["direction"]

    E = torch.load(out / "E_batch.pt", weights_only=True)
    U = torch.load(out / "U_batch.pt", weights_only=True)
    assert isinstance(E, dict) and isinstance(U, dict)
    rows = [json.loads(line) for line in (out / "per_sequence.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all("h" in row and "T" in row for row in rows)
    assert (out / "delta_h_vs_eta.png").read_bytes().startswith(PNG_MAGIC)
    assert "run directory" in (out / "probe.log").read_text()
    # the summary printed at the end of the run names the same δH₁
    assert f"{res['deltaH1']:+.4g}" in _summary_line(stdout, "δH₁")


def test_resume_reproduces_the_numbers(first_run, run_copy, config_file):
    before = _results(run_copy)
    batches = {name: (run_copy / name).read_bytes() for name in ("E_batch.pt", "U_batch.pt")}
    code, _ = _main(["run", "--config", str(config_file), "--resume", str(run_copy)])
    assert code == 0
    after = _results(run_copy)
    validate_results_schema(after)
    assert _numbers(after) == _numbers(before)
    assert after["config_hash"] == before["config_hash"]
    # the saved batches were reused, not re-sampled and re-written
    assert {name: (run_copy / name).read_bytes() for name in batches} == batches
    assert "resuming" in (run_copy / "probe.log").read_text()


def test_resume_alone_uses_the_saved_config(first_run, run_copy):
    before = _results(run_copy)
    code, _ = _main(["run", "--resume", str(run_copy)])
    assert code == 0
    assert _numbers(_results(run_copy)) == _numbers(before)


def test_run_without_config_or_resume_is_one_line_error(capsys):
    assert cli.main(["run"]) == 2
    lines = _error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "--config" in lines[0]


def test_resume_with_out_naming_another_dir_is_refused(first_run, config_file, tmp_path, capsys):
    code = cli.main(["run", "--config", str(config_file), "--resume", str(first_run[0]),
                     "--out", str(tmp_path / "elsewhere")])
    err = capsys.readouterr().err
    assert code == 2
    assert len(_error_lines(err)) == 1 and "--resume" in _error_lines(err)[0]
    assert not (tmp_path / "elsewhere").exists()


def test_different_config_needs_overwrite(run_copy, config_file, capsys):
    original = _results(run_copy)
    argv = ["run", "--config", str(config_file), "--out", str(run_copy), "--set", "seed=11"]
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: ")
    assert str(run_copy) in captured.err and "--overwrite" in captured.err
    assert _results(run_copy) == original, "a refused run must not touch the directory"

    code = cli.main([*argv, "--overwrite"])
    capsys.readouterr()
    assert code == 0
    replaced = _results(run_copy)
    validate_results_schema(replaced)
    assert replaced["config_hash"] != original["config_hash"]
    assert yaml.safe_load((run_copy / "config.yaml").read_text())["seed"] == 11
    assert json.loads((run_copy / "run_meta.json").read_text())["status"] == "complete"


def test_dryrun_prints_summary_and_writes_nothing(config_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code = cli.main(["run", "--config", str(config_file), "--out", "dry", "--dryrun"])
    captured = capsys.readouterr()
    assert code == 0
    assert "δH₁" in captured.out and "Measured ΔH(η)" in captured.out
    assert not (tmp_path / "dry").exists() and not (tmp_path / "runs").exists()
    assert list(tmp_path.iterdir()) == []


def test_report_rerenders_summary_and_plot(first_run, run_copy, capsys):
    res = _results(run_copy)
    (run_copy / "delta_h_vs_eta.png").unlink()
    code = cli.main(["report", str(run_copy)])
    out = capsys.readouterr().out
    assert code == 0
    line = _summary_line(out, "δH₁")
    assert f"{res['deltaH1']:+.4g}" in line
    assert line == _summary_line(first_run[1], "δH₁")
    assert out == render_summary(res)
    assert (run_copy / "delta_h_vs_eta.png").read_bytes().startswith(PNG_MAGIC)


# ------------------------------------------------------------------------------------------ bad inputs

def _bad_config(tmp_path: Path, config_file: Path) -> Path:
    config = yaml.safe_load(config_file.read_text())
    config["batch_config"]["B_EE"] = 4
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return path


@pytest.mark.parametrize("case", ["unknown_key", "missing_file", "bad_value", "report_no_results"])
def test_bad_inputs_are_one_line_exit_2(case, config_file, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if case == "unknown_key":
        argv = ["run", "--config", str(_bad_config(tmp_path, config_file)), "--out", "o"]
        expected = ["unknown key 'batch_config.B_EE'", "did you mean 'batch_config.B_E'"]
    elif case == "missing_file":
        missing = tmp_path / "nowhere" / "probe.yaml"
        argv = ["run", "--config", str(missing), "--out", "o"]
        expected = [str(missing), "not found"]
    elif case == "bad_value":
        argv = ["run", "--config", str(config_file), "--out", "o", "--set", "batch_config.B_E=0"]
        expected = ["batch_config.B_E", ">= 1"]
    else:
        argv = ["report", str(tmp_path / "no_run")]
        expected = [str(tmp_path / "no_run"), "no results file"]
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.count("\n") == 1 and captured.err.startswith("error: "), captured.err
    for text in expected:
        assert text in captured.err, (text, captured.err)
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (tmp_path / "o").exists() and not (tmp_path / "runs").exists()


# ------------------------------------------------------------------------------------------ the demo

@pytest.mark.slow
def test_demo_on_embedded_smollm2(tmp_path, monkeypatch):
    """`entropy-probe demo` at tiny sizes: a fresh 1-step demo checkpoint in tmp_path (the converted
    SmolLM2 itself stays in the shared cache), then the probe into --out."""
    from entropy_experiments.make_checkpoint import trained as training

    monkeypatch.setattr(training, "demo_checkpoint_dir", lambda steps: tmp_path / f"demo_checkpoint_{steps}steps")
    ckpt = tmp_path / "demo_checkpoint_1steps"  # one cache directory per step count: --steps 1 never reuses 2
    out = tmp_path / "demo_run"
    code, stdout = _main(["demo", "--out", str(out), "--steps", "1",
                          "--set", "batch_config.B_E=2", "--set", "batch_config.B_U=2",
                          "--set", "batch_config.G=2", "--set", "generation.max_new_tokens=4",
                          "--set", "importance.eta_list=[1e-5]"])
    assert code == 0
    assert json.loads((ckpt / "checkpoint.json").read_text())["step"] == 1
    res = _results(out)
    validate_results_schema(res)
    assert isinstance(res["deltaH1"], float) and math.isfinite(res["deltaH1"])
    assert res["counts"]["B_E"] == 2
    assert "δH₁" in stdout

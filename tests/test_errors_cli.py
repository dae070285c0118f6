"""Every row of docs/errors.md that a user meets through `entropy-probe run`: exit code 2, exactly one
stderr line `error: ...` naming the key / path / value, no traceback, and nothing half-written (no
results.json, batch files or temp files in the run directory).

A representative set (SUBPROCESS_CASES) runs `python -m entropy_experiments.cli` as a real subprocess;
the other rows go through `cli.main` in process with the same assertions (a subprocess costs 5-20 s of
imports on two cores). ENTROPY_ERRORS_ALL_SUBPROCESS=1 runs every row as a subprocess.
Unit tests of the same messages live next to their modules (see docs/errors.md for the map).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from tests.probe_helpers import SHORT_PROMPTS
from tests.run_helpers import make_run_setup, run_cli


@pytest.fixture(scope="module")
def setup(tiny_model_dir, tmp_path_factory) -> tuple[Path, dict]:
    return make_run_setup(tmp_path_factory.mktemp("errors_cli"), tiny_model_dir)


class _Payload:
    """Unpickling this would create `marker` (it must never run)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _write_config(tmp: Path, config: dict, name: str = "c.yaml") -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return path


def _with(config: dict, section: str, **values) -> dict:
    new = json.loads(json.dumps(config))
    new.setdefault(section, {}).update(values)
    return new


def case_args(case: str, tmp: Path, config: dict, config_file: Path) -> tuple[list[str], list[str]]:
    """(argv after `entropy-probe`, substrings the one error line must contain)."""
    run = ["run", "--out", str(tmp / "out")]
    ckpt = Path(config["checkpoint"]["checkpoint_path"])
    if case == "config_missing":
        return [*run, "--config", str(tmp / "nope.yaml")], ["config file not found", "nope.yaml"]
    if case == "config_not_yaml":
        (tmp / "bad.yaml").write_text("batch_config:\n  B_E: [1, 2\n")
        return [*run, "--config", str(tmp / "bad.yaml")], ["bad.yaml", "not valid YAML", "line "]
    if case == "config_unknown_key":
        return ([*run, "--config", str(config_file), "--set", "generation.top_pp=0.9"],
                ["unknown key 'generation.top_pp'", "did you mean 'generation.top_p'"])
    if case == "config_wrong_type":
        return [*run, "--config", str(config_file), "--set", "batch_config.B_E=abc"], \
            ["batch_config.B_E: expected an integer, got 'abc'"]
    if case == "config_out_of_range":
        return [*run, "--config", str(config_file), "--set", "generation.temperature=0"], \
            ["generation.temperature: must be > 0, got 0"]
    if case == "config_eta_zero":
        return [*run, "--config", str(config_file), "--set", "importance.eta_list=[1e-5, 0]"], \
            ["importance.eta_list: η must be non-zero"]
    if case == "config_alias_conflict":
        bad = _with(config, "sampling", use_sequence_processor=True)
        bad = _with(bad, "probe_rework", use_sequence_processor_sampling=False)
        return [*run, "--config", str(_write_config(tmp, bad))], \
            ["conflicts", "sampling.use_sequence_processor", "probe_rework.use_sequence_processor_sampling"]
    if case == "adapter_missing":
        bad = _with(config, "checkpoint", checkpoint_path=None, adapter_path=str(tmp / "no_adapter"),
                    optimizer_path=str(ckpt / "optimizer.pt"))
        return [*run, "--config", str(_write_config(tmp, bad))], [str(tmp / "no_adapter")]
    if case == "adapter_not_peft":
        (tmp / "empty_adapter").mkdir()
        bad = _with(config, "checkpoint", checkpoint_path=None, adapter_path=str(tmp / "empty_adapter"),
                    optimizer_path=str(ckpt / "optimizer.pt"))
        return [*run, "--config", str(_write_config(tmp, bad))], ["not a PEFT adapter", "empty_adapter"]
    if case == "base_model_unknown_offline":
        bad = _with(config, "checkpoint", base_model="no-such-org/not-a-model-0000")
        return [*run, "--config", str(_write_config(tmp, bad))], \
            ["base model 'no-such-org/not-a-model-0000' is not a local directory"]
    if case == "remote_code_needed":
        remote = tmp / "remote_model"
        remote.mkdir()
        (remote / "config.json").write_text(json.dumps({
            "model_type": "my_custom_llm",
            "auto_map": {"AutoConfig": "configuration_my.MyConfig", "AutoModelForCausalLM": "modeling_my.MyModel"}}))
        bad = _with(config, "checkpoint", base_model=str(remote))
        return [*run, "--config", str(_write_config(tmp, bad))], ["checkpoint.trust_remote_code: true"]
    if case == "optimizer_missing":
        bad = _with(config, "checkpoint", optimizer_path=str(tmp / "none" / "optimizer.pt"))
        return [*run, "--config", str(_write_config(tmp, bad))], [str(tmp / "none" / "optimizer.pt"), "not found"]
    if case == "optimizer_malicious_pickle":
        evil = tmp / "evil.pt"
        torch.save({"state": {}, "param_groups": [{"params": []}], "x": _Payload(str(tmp / "pwned"))}, evil)
        bad = _with(config, "checkpoint", optimizer_path=str(evil))
        return [*run, "--config", str(_write_config(tmp, bad))], [f"refused to unpickle {evil}"]
    if case == "optimizer_wrong_count":
        copy = tmp / "ckpt"
        shutil.copytree(ckpt, copy)
        state = torch.load(copy / "optimizer.pt", weights_only=True)
        state["param_groups"][0]["params"] = state["param_groups"][0]["params"][:-1]
        state["state"].pop(max(state["state"]))
        torch.save(state, copy / "optimizer.pt")
        bad = _with(config, "checkpoint", checkpoint_path=str(copy))
        for key in ("adapter_path", "optimizer_path"):
            bad["checkpoint"].pop(key, None)
        return [*run, "--config", str(_write_config(tmp, bad))], [str(copy / "optimizer.pt")]
    if case == "dataset_unknown":
        return [*run, "--config", str(config_file), "--set", "batch_config.dataset_name=jsnl"], \
            ["unknown data set 'jsnl'", "did you mean 'jsonl'"]
    if case == "dataset_path_missing":
        return [*run, "--config", str(config_file), "--set", f"batch_config.dataset_path={tmp / 'no.jsonl'}"], \
            [str(tmp / "no.jsonl")]
    if case == "jsonl_malformed":
        data = tmp / "bad.jsonl"
        data.write_text(json.dumps({"question": "q", "answer": "1"}) + "\n{not json\n")
        return [*run, "--config", str(config_file), "--set", f"batch_config.dataset_path={data}"], [f"{data}:2:"]
    if case == "split_empty":
        (tmp / "empty.jsonl").write_text("")
        return [*run, "--config", str(config_file), "--set", f"batch_config.dataset_path={tmp / 'empty.jsonl'}"], \
            ["split 'train' is empty"]
    if case == "B_U_larger_than_pool":
        return [*run, "--config", str(config_file), "--set", "batch_config.B_U=20",
                "--set", "variance.u_groups=null"], \
            [f"batch_config.B_U=20 is larger than the prompt pool ({len(SHORT_PROMPTS)} prompts)"]
    if case == "reward_unknown":
        return [*run, "--config", str(config_file), "--set", "reward.name=tag_prf"], \
            ["unknown reward 'tag_prf'", "did you mean 'tag_pref'"]
    if case == "reward_import_fails":
        return [*run, "--config", str(config_file), "--set", "reward.name=tests.no_such_module:f"], \
            ["tests.no_such_module"]
    if case == "reward_wrong_length":
        return [*run, "--config", str(config_file), "--set", "reward.name=tests.reward_plugins:one_short"], \
            ["returned 1 values for 2 responses"]
    if case == "reward_non_finite":
        return [*run, "--config", str(config_file), "--set", "reward.name=tests.reward_plugins:nan_at_one"], \
            ["value at index 1 is not finite: nan"]
    if case == "cuda_without_gpu":
        if torch.cuda.is_available():
            pytest.skip("a GPU is present")
        return [*run, "--config", str(config_file), "--set", "checkpoint.device_map=cuda"], \
            ["checkpoint.device_map: 'cuda' requested but no CUDA device is available"]
    if case == "prompt_too_long":
        return [*run, "--config", str(config_file), "--set", "generation.max_prompt_tokens=2"], \
            ["more than generation.max_prompt_tokens=2", "prompt_overflow: truncate"]
    if case == "out_dir_other_config":
        out = tmp / "out"
        out.mkdir()
        (out / "config.yaml").write_text("seed: 1\n")
        (out / "run_meta.json").write_text(json.dumps({"config_hash": "other", "status": "complete"}))
        return [*run, "--config", str(config_file)], ["holds a different config", "--overwrite"]
    if case == "resume_other_schema":  # a run killed under schema version 1 (its run_meta.json has no version)
        out = tmp / "out"
        out.mkdir()
        shutil.copy(config_file, out / "config.yaml")
        (out / "run_meta.json").write_text(json.dumps({"config_hash": "h", "created": "c", "status": "failed"}))
        return ["run", "--resume", str(out)], ["--resume", "written by schema version 1", "writes version 2",
                                                 "start a fresh output directory"]
    if case == "out_dir_unwritable":
        (tmp / "file").write_text("x")
        return ["run", "--out", str(tmp / "file" / "run"), "--config", str(config_file)], [str(tmp / "file")]
    raise AssertionError(case)


CASES = ["config_missing", "config_not_yaml", "config_unknown_key", "config_wrong_type", "config_out_of_range",
         "config_eta_zero", "config_alias_conflict", "adapter_missing", "adapter_not_peft",
         "base_model_unknown_offline", "remote_code_needed", "optimizer_missing", "optimizer_malicious_pickle",
         "optimizer_wrong_count", "dataset_unknown", "dataset_path_missing", "jsonl_malformed", "split_empty",
         "B_U_larger_than_pool", "reward_unknown", "reward_import_fails", "reward_wrong_length",
         "reward_non_finite", "cuda_without_gpu", "prompt_too_long", "out_dir_other_config", "out_dir_unwritable",
         "resume_other_schema"]


SUBPROCESS_CASES = {"config_unknown_key", "optimizer_malicious_pickle"}  # one config-stage, one load-stage error
ALL_SUBPROCESS = os.environ.get("ENTROPY_ERRORS_ALL_SUBPROCESS") == "1"


def _in_process(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """cli.main(argv) with stdout / stderr captured and the logging set-up it changes restored."""
    from entropy_experiments import cli

    names = ("entropy_experiments", "transformers", "peft", "accelerate")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level, logging.getLogger(n).propagate)
             for n in names}
    out, err = io.StringIO(), io.StringIO()
    old_cwd = Path.cwd()
    try:
        os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = cli.main(argv)
    finally:
        os.chdir(old_cwd)
        for n, (handlers, level, propagate) in saved.items():
            logger = logging.getLogger(n)
            logger.handlers[:], logger.level, logger.propagate = handlers, level, propagate
    return subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())


@pytest.mark.e2e
@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_clean_line_and_exit_2(case, setup, tmp_path):
    config_file, config = setup
    argv, expected = case_args(case, tmp_path, config, config_file)
    if ALL_SUBPROCESS or case in SUBPROCESS_CASES:
        proc = run_cli(argv, cwd=tmp_path)
    else:
        proc = _in_process(argv, tmp_path)
    lines = proc.stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(errors) == 1 and lines[-1] == errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for text in expected:
        assert text in errors[0], (text, errors[0])
    assert not (tmp_path / "pwned").exists(), "the pickle payload ran"
    out = tmp_path / "out"
    if out.is_dir():  # an error after the run directory was prepared: marked failed, nothing half-written
        assert not {"results.json", "E_batch.pt", "U_batch.pt"} & {p.name for p in out.iterdir()}
        assert not [p for p in out.rglob("*.tmp")]
        meta = json.loads((out / "run_meta.json").read_text())
        assert meta["status"] in ("failed", "complete") and (case != "out_dir_other_config") == (
            meta["status"] == "failed")


def test_the_payload_really_runs_code_under_plain_pickle(tmp_path):
    """Control for optimizer_malicious_pickle: the same payload does run code when unpickled naively."""
    pickle.loads(pickle.dumps(_Payload(str(tmp_path / "ran")))).close()
    assert (tmp_path / "ran").exists()

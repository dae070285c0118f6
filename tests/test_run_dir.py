"""The run directory: atomic writes, prepare (new, refuse, overwrite, resume), batches, update vector,
partial state, per-sequence rows and the log (entropy_experiments.report.run_dir)."""

from __future__ import annotations

import json
import logging
import os

import numpy as np
import pytest
import torch

from entropy_experiments import io_utils
from entropy_experiments.errors import ConfigError, OutputError
from entropy_experiments.report.results_schema import SCHEMA_VERSION
from entropy_experiments.report.run_dir import GenerationChunkStore, RunDirectory
from tests.report_helpers import fake_results, no_temp_files

# ---- atomic writes --------------------------------------------------------------------------

def test_atomic_write_keeps_old_file_when_replace_fails(tmp_path, monkeypatch):
    run = RunDirectory(tmp_path)
    target = run.write_results(fake_results(config_hash="old"))
    old = target.read_text()

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OutputError, match=r"cannot write .*results\.json: No space left on device"):
        run.write_results(fake_results(config_hash="new"))
    assert target.read_text() == old
    assert no_temp_files(tmp_path)


def test_atomic_write_keeps_old_file_when_killed_mid_write(tmp_path):
    """A writer interrupted half way (KeyboardInterrupt ≈ a kill signal) never reaches the final name."""
    target = RunDirectory(tmp_path).save_batch("E", {"x": torch.arange(3)})
    assert target == tmp_path / "E_batch.pt"
    before = target.read_bytes()

    def half_then_die(f):
        f.write(b"PARTIAL")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        io_utils.atomic_write(target, half_then_die)
    assert target.read_bytes() == before
    assert torch.equal(torch.load(target, weights_only=True)["x"], torch.arange(3))
    assert no_temp_files(tmp_path)


def test_atomic_write_file_permissions_follow_umask(tmp_path):
    RunDirectory(tmp_path).write_config("x")
    target = tmp_path / "config.yaml"
    assert target.stat().st_mode & 0o777 == 0o666 & ~io_utils.UMASK



# ---- prepare: new, refuse, overwrite, resume ----------------------------------------------------

def test_prepare_creates_parents_and_writes_config_and_meta(tmp_path):
    run = RunDirectory.prepare(tmp_path / "a" / "b", "seed: 1\n", "h1", overwrite=False, resume=False)
    assert (run.path / "config.yaml").read_text() == "seed: 1\n"
    meta = json.loads((run.path / "run_meta.json").read_text())
    assert meta["config_hash"] == "h1" and meta["status"] == "running" and meta["created"]
    run.mark_status("complete")
    assert run.read_meta()["status"] == "complete"
    with pytest.raises(ValueError, match="run status"):
        run.mark_status("done")


def test_prepare_refuses_a_different_config(tmp_path):
    RunDirectory.prepare(tmp_path, "seed: 1\n", "aaaa", overwrite=False, resume=False)
    for resume in (False, True):
        with pytest.raises(OutputError) as info:
            RunDirectory.prepare(tmp_path, "seed: 2\n", "bbbb", overwrite=False, resume=resume)
        message = str(info.value)
        assert "\n" not in message and str(tmp_path) in message
        assert "hash aaaa ≠ bbbb" in message and "--overwrite" in message
    assert (tmp_path / "config.yaml").read_text() == "seed: 1\n"


def test_prepare_refuses_foreign_config_yaml_without_meta(tmp_path):
    (tmp_path / "config.yaml").write_text("someone: else\n")
    with pytest.raises(OutputError, match="hash unknown ≠ h1"):
        RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)


def test_overwrite_clears_only_run_files(tmp_path):
    run = RunDirectory.prepare(tmp_path, "seed: 1\n", "aaaa", overwrite=False, resume=False)
    run.save_batch("E", {"x": torch.ones(2)})
    run.save_partial("x_hat", {"x_hat_dot_v": 1.0})
    run.write_results(fake_results())
    (tmp_path / ".results.json.abc123.tmp").write_text("stale temp of a killed write")
    (tmp_path / "notes.txt").write_text("the user's own notes")

    run = RunDirectory.prepare(tmp_path, "seed: 2\n", "bbbb", overwrite=True, resume=False)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.yaml", "notes.txt", "run_meta.json"]
    assert (tmp_path / "config.yaml").read_text() == "seed: 2\n"
    assert run.read_meta()["config_hash"] == "bbbb"
    assert run.load_batch("E") is None and not run.has_partial("x_hat")


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "thesis.tex").write_text("precious")
    with pytest.raises(OutputError, match="not a run directory"):
        RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=True, resume=False)
    assert (tmp_path / "thesis.tex").read_text() == "precious"
    # Without --overwrite nothing is deleted, so writing a run beside other files is allowed.
    RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    assert (tmp_path / "thesis.tex").exists()


def test_resume_same_config_keeps_batches_and_partials(tmp_path):
    run = RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    created = run.read_meta()["created"]
    run.save_batch("E", {"sequences": torch.arange(6).reshape(1, 2, 3)})
    run.save_partial("U_grads", {"g": torch.ones(3)})
    run.mark_status("failed")

    resumed = RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=True)
    assert torch.equal(resumed.load_batch("E")["sequences"], torch.arange(6).reshape(1, 2, 3))
    assert torch.equal(resumed.load_partial("U_grads")["g"], torch.ones(3))
    meta = resumed.read_meta()
    assert meta == {"config_hash": "h1", "created": created, "status": "running", "schema_version": SCHEMA_VERSION}


@pytest.mark.parametrize("version", [None, 1, 3])
def test_resume_of_a_directory_of_another_schema_version_is_refused(tmp_path, version):
    """--resume of a run or sweep directory written under another schema version (no key: version 1) is one
    ConfigError line naming both versions; nothing in the directory is touched."""
    from entropy_experiments.config import ProbeConfig
    from entropy_experiments.sweep.sweep_dir import META_FILE, SWEEP_KIND, SweepDirectory

    stamp = {} if version is None else {"schema_version": version}
    run_meta = {"config_hash": "h1", "created": "c", "status": "failed", **stamp}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "run_meta.json").write_text(json.dumps(run_meta))
    sweep_meta = {"kind": SWEEP_KIND, "config_hash": "h", "checkpoints_dir": str(tmp_path), "every": 1, **stamp}
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / META_FILE).write_text(json.dumps(sweep_meta))
    expected = (f"was written by schema version {version or 1}, this entropy-probe writes version {SCHEMA_VERSION}; "
                "start a fresh output directory")
    for prepare in (lambda: RunDirectory.prepare(tmp_path / "run", "seed: 1\n", "h1", overwrite=False, resume=True),
                    lambda: SweepDirectory.prepare(tmp_path / "sweep", ProbeConfig(), tmp_path, 1, resume=True)):
        with pytest.raises(ConfigError, match=expected) as info:
            prepare()
        assert "\n" not in str(info.value) and info.value.exit_code == 2
    assert json.loads((tmp_path / "run" / "run_meta.json").read_text()) == run_meta
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run_meta.json"]


def test_resume_hint_only_when_samples_are_saved(tmp_path):
    run = RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    assert run.resume_hint() is None
    run.save_batch("E", {"sequences": torch.zeros(1, 1, 1)})
    assert run.resume_hint() is None  # E alone: --resume cannot reuse it whole
    _, save_chunk = GenerationChunkStore(run).open({"seed": 1})
    save_chunk(0, [[1, 2]])
    assert run.resume_hint() == (f"run marked failed; the samples generated so far are kept in {tmp_path}: "
                                 f"after fixing the cause, finish it with: entropy-probe run --resume {tmp_path}")
    GenerationChunkStore(run).clear()
    assert run.resume_hint() is None
    run.save_batch("U", {"sequences": torch.zeros(1, 1, 1)})
    assert run.resume_hint() is not None


def test_rerun_same_config_without_resume_drops_stale_state(tmp_path):
    """A fresh run must not leave an older run's partial state for a later --resume to mix in."""
    run = RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    run.save_batch("E", {"x": torch.ones(1)})
    run.save_partial("x_hat", {"v": torch.ones(1)})
    again = RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    assert again.load_batch("E") is None and not again.has_partial("x_hat")


def test_resume_needs_an_existing_run_and_excludes_overwrite(tmp_path):
    with pytest.raises(OutputError, match="nothing to resume"):
        RunDirectory.prepare(tmp_path / "new", "seed: 1\n", "h1", overwrite=False, resume=True)
    with pytest.raises(OutputError, match="exclude each other"):
        RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=True, resume=True)


def test_unwritable_location_is_one_line_output_error(tmp_path):
    # A path under a regular file fails for root as well (chmod tricks do not).
    blocker = tmp_path / "somefile"
    blocker.write_text("x")
    with pytest.raises(OutputError) as info:
        RunDirectory.prepare(blocker / "sub", "seed: 1\n", "h1", overwrite=False, resume=False)
    message = str(info.value)
    assert "\n" not in message and str(blocker / "sub") in message and "Not a directory" in message
    with pytest.raises(OutputError, match="is not a directory"):
        RunDirectory.prepare(blocker, "seed: 1\n", "h1", overwrite=False, resume=False)


# ---- batches, update vector, partial state, per-sequence rows, log ---------------------------------

def test_batch_round_trip_with_weights_only(tmp_path):
    run = RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    batch = {
        "sequences": torch.randint(0, 300, (3, 2, 7)), "attention_masks": torch.ones(3, 2, 7, dtype=torch.long),
        "prompt_lens": [4, 4, 4], "gen_lens": [[3, 2], [1, 3], [3, 3]], "advantages": torch.randn(3, 2),
        "rewards": [[1.0, 0.0], [0.5, 0.5], [0.0, 0.0]], "max_lengths": [3, 3, 3], "prompt_ids": [17, 2, 9],
        "num_prompts": 3, "num_responses_per_prompt": 2,
        "prompts": ["Q1 <think>", "Q2 <think>", "Q3 <think>"], "responses_text": [["a", "b"], ["c", "d"], ["é", ""]],
    }
    path = run.save_batch("U", batch)
    assert path.name == "U_batch.pt"
    for loaded in (run.load_batch("U"), torch.load(path, weights_only=True)):
        assert loaded.keys() == batch.keys()
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(loaded[key], value)
            else:
                assert loaded[key] == value
    assert run.load_batch("E") is None
    with pytest.raises(ValueError, match="batch name"):
        run.save_batch("X", batch)


def test_corrupt_batch_is_output_error(tmp_path):
    run = RunDirectory(tmp_path)
    (tmp_path / "E_batch.pt").write_bytes(b"not a torch file")
    with pytest.raises(OutputError, match="E_batch.pt"):
        run.load_batch("E")


def test_update_vector_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_file

    run = RunDirectory(tmp_path)
    v = {"base_model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.randn(4, 64),
         "base_model.model.layers.0.self_attn.q_proj.lora_B.default.weight": torch.randn(64, 4).t().t()}
    path = run.save_update_vector(v, {"direction": "adamw_step", "learning_rate": 1e-5, "clipped": False})
    loaded = load_file(path)
    assert loaded.keys() == v.keys() and all(torch.equal(loaded[k], v[k]) for k in v)
    tensors, meta = run.load_update_vector()
    assert all(torch.equal(tensors[k], v[k]) for k in v)
    assert meta["direction"] == "adamw_step" and json.loads(meta["learning_rate"]) == 1e-5
    assert meta["clipped"] == "false"


def test_partial_state_names_cannot_escape(tmp_path):
    run = RunDirectory(tmp_path)
    assert run.load_partial("missing") is None and not run.has_partial("missing")
    for bad in ("../evil", "a/b", ""):
        with pytest.raises(ValueError, match="partial state name"):
            run.save_partial(bad, {})


def test_per_sequence_jsonl_is_strict(tmp_path):
    run = RunDirectory(tmp_path)
    rows = [{"i": 0, "h": 3.5, "T": 7, "logw": float("-inf")}, {"i": 1, "h": np.float32(2.25), "T": 4, "logw": 0.1}]
    text = run.write_per_sequence(rows).read_text()
    parsed = [json.loads(line) for line in text.splitlines()]
    assert parsed == [{"i": 0, "h": 3.5, "T": 7, "logw": None}, {"i": 1, "h": 2.25, "T": 4, "logw": 0.1}]


def test_log_handler_writes_time_and_level(tmp_path):
    run = RunDirectory(tmp_path)
    logger = logging.getLogger("entropy_experiments.test_results")
    logger.setLevel(logging.INFO)
    handler = run.attach_log_handler(logger)
    try:
        logger.warning("ESS collapsed at eta=%g", 1e-4)
    finally:
        logger.removeHandler(handler)
        handler.close()
    line = run.log_path.read_text().strip()
    assert line.endswith("WARNING entropy_experiments.test_results: ESS collapsed at eta=0.0001")
    assert line[:4].isdigit()  # asctime first

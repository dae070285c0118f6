"""Run directory, atomic writes, strict results.json, summary table and plot (entropy_experiments.results)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from entropy_experiments import results as R
from entropy_experiments.errors import OutputError


def fake_results(**changes) -> dict:
    """A results dict shaped like a real per_token run on the embedded model (numbers are made up but consistent)."""
    lr, bars_dot = 1e-5, -12.3456
    true = []
    for eta, ratio, khat in [(-1e-5, 0.98, 0.12), (1e-6, 1.01, 0.05), (1e-5, 0.97, 0.21), (1e-4, 0.71, 0.93)]:
        true.append({
            "eta": eta, "deltaH_true": eta * bars_dot * ratio, "H_upd": 0.6123 + eta * bars_dot * ratio,
            "ess": 60.0 * (1 - khat / 2), "ess_frac": 0.9375 * (1 - khat / 2), "psis_khat": khat,
            "khat_threshold": 0.7, "logw": {"min": -0.31, "median": 0.002, "max": 0.27},
            "zero_weight_count": 2 if eta == 1e-4 else 0, "se": abs(eta * bars_dot) * 0.1,
        })
    res = {
        "deltaH1": lr * bars_dot, "bars_dot": bars_dot, "learning_rate": lr,
        "se": {"E": 1.5e-5, "U": 2.0e-5, "total": 2.5e-5},
        "H_orig": {"per_token": 0.61234, "per_sequence": 41.876},
        "true": true,
        "linearity": {"slope_through_origin": -9.1234, "loglog_slope": 1.043,
                      "symmetric_slopes": [{"eta": 1e-5, "slope": -12.05}]},
        "counts": {"B_E": 64, "unique_E_prompts": 61, "B_U": 8, "G": 4, "E_tokens": 4380, "U_tokens": 2210,
                   "zero_advantage_prompts": 3},
        "update": {"direction": "adamw_step", "norm": 153.2, "grad_norm": 0.8765, "clipped": False,
                   "hyperparameters": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}},
        "timing": {"sampling": 12.5, "x_hat": 3.1, "snis": 4.4, "total": 20.0},
        "environment": {"versions": {"torch": torch.__version__}, "device": "cpu",
                        "dtypes": {"runtime": "float32"}, "seeds": {"seed": 42}},
        "config_hash": "0123456789abcdef", "normalize": "per_token",
        "warnings": ["k̂ > 0.7 at η=0.0001: ΔH(η) is unreliable there"],
        "checkpoint": "runs/step_40",
    }
    res.update(changes)
    return res


def _no_temp_files(directory: Path) -> bool:
    return not [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


# ---- atomic writes --------------------------------------------------------------------------

def test_atomic_write_keeps_old_file_when_replace_fails(tmp_path, monkeypatch):
    target = tmp_path / "results.json"
    R.atomic_write_text(target, "old")

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(OutputError, match=r"cannot write .*results\.json: No space left on device"):
        R.atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert _no_temp_files(tmp_path)


def test_atomic_write_keeps_old_file_when_killed_mid_write(tmp_path):
    """A writer interrupted half way (KeyboardInterrupt ≈ a kill signal) never reaches the final name."""
    target = tmp_path / "E_batch.pt"
    R.atomic_torch_save({"x": torch.arange(3)}, target)
    before = target.read_bytes()

    def half_then_die(f):
        f.write(b"PARTIAL")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        R._atomic_write(target, half_then_die)
    assert target.read_bytes() == before
    assert torch.equal(torch.load(target, weights_only=True)["x"], torch.arange(3))
    assert _no_temp_files(tmp_path)


def test_atomic_write_file_permissions_follow_umask(tmp_path):
    target = tmp_path / "a.txt"
    R.atomic_write_text(target, "x")
    assert target.stat().st_mode & 0o777 == 0o666 & ~R._UMASK


# ---- prepare: new, refuse, overwrite, resume ----------------------------------------------------

def test_prepare_creates_parents_and_writes_config_and_meta(tmp_path):
    run = R.RunDirectory.prepare(tmp_path / "a" / "b", "seed: 1\n", "h1", overwrite=False, resume=False)
    assert (run.path / "config.yaml").read_text() == "seed: 1\n"
    meta = json.loads((run.path / "run_meta.json").read_text())
    assert meta["config_hash"] == "h1" and meta["status"] == "running" and meta["created"]
    run.mark_status("complete")
    assert run.read_meta()["status"] == "complete"
    with pytest.raises(ValueError, match="run status"):
        run.mark_status("done")


def test_prepare_refuses_a_different_config(tmp_path):
    R.RunDirectory.prepare(tmp_path, "seed: 1\n", "aaaa", overwrite=False, resume=False)
    for resume in (False, True):
        with pytest.raises(OutputError) as info:
            R.RunDirectory.prepare(tmp_path, "seed: 2\n", "bbbb", overwrite=False, resume=resume)
        message = str(info.value)
        assert "\n" not in message and str(tmp_path) in message
        assert "hash aaaa ≠ bbbb" in message and "--overwrite" in message
    assert (tmp_path / "config.yaml").read_text() == "seed: 1\n"


def test_prepare_refuses_foreign_config_yaml_without_meta(tmp_path):
    (tmp_path / "config.yaml").write_text("someone: else\n")
    with pytest.raises(OutputError, match="hash unknown ≠ h1"):
        R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)


def test_overwrite_clears_only_run_files(tmp_path):
    run = R.RunDirectory.prepare(tmp_path, "seed: 1\n", "aaaa", overwrite=False, resume=False)
    run.save_batch("E", {"x": torch.ones(2)})
    run.save_partial("x_hat", {"bars_dot": 1.0})
    run.write_results(fake_results())
    (tmp_path / ".results.json.abc123.tmp").write_text("stale temp of a killed write")
    (tmp_path / "notes.txt").write_text("the user's own notes")

    run = R.RunDirectory.prepare(tmp_path, "seed: 2\n", "bbbb", overwrite=True, resume=False)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["config.yaml", "notes.txt", "run_meta.json"]
    assert (tmp_path / "config.yaml").read_text() == "seed: 2\n"
    assert run.read_meta()["config_hash"] == "bbbb"
    assert run.load_batch("E") is None and not run.has_partial("x_hat")


def test_overwrite_refuses_a_directory_that_is_not_a_run(tmp_path):
    (tmp_path / "thesis.tex").write_text("precious")
    with pytest.raises(OutputError, match="not a run directory"):
        R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=True, resume=False)
    assert (tmp_path / "thesis.tex").read_text() == "precious"
    # Without --overwrite nothing is deleted, so writing a run beside other files is allowed.
    R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    assert (tmp_path / "thesis.tex").exists()


def test_resume_same_config_keeps_batches_and_partials(tmp_path):
    run = R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    created = run.read_meta()["created"]
    run.save_batch("E", {"sequences": torch.arange(6).reshape(1, 2, 3)})
    run.save_partial("U_grads", {"g": torch.ones(3)})
    run.mark_status("failed")

    resumed = R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=True)
    assert torch.equal(resumed.load_batch("E")["sequences"], torch.arange(6).reshape(1, 2, 3))
    assert torch.equal(resumed.load_partial("U_grads")["g"], torch.ones(3))
    meta = resumed.read_meta()
    assert meta == {"config_hash": "h1", "created": created, "status": "running"}


def test_resume_hint_only_when_samples_are_saved(tmp_path):
    run = R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    assert run.resume_hint() is None
    run.save_batch("E", {"sequences": torch.zeros(1, 1, 1)})
    assert run.resume_hint() is None  # E alone: --resume cannot reuse it whole
    _, save_chunk = R.GenerationChunkStore(run).open({"seed": 1})
    save_chunk(0, [[1, 2]])
    assert run.resume_hint() == (f"run marked failed; the samples generated so far are kept in {tmp_path}: "
                                 f"after fixing the cause, finish it with: entropy-probe run --resume {tmp_path}")
    R.GenerationChunkStore(run).clear()
    assert run.resume_hint() is None
    run.save_batch("U", {"sequences": torch.zeros(1, 1, 1)})
    assert run.resume_hint() is not None


def test_rerun_same_config_without_resume_drops_stale_state(tmp_path):
    """A fresh run must not leave an older run's partial state for a later --resume to mix in."""
    run = R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    run.save_batch("E", {"x": torch.ones(1)})
    run.save_partial("x_hat", {"v": torch.ones(1)})
    again = R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
    assert again.load_batch("E") is None and not again.has_partial("x_hat")


def test_resume_needs_an_existing_run_and_excludes_overwrite(tmp_path):
    with pytest.raises(OutputError, match="nothing to resume"):
        R.RunDirectory.prepare(tmp_path / "new", "seed: 1\n", "h1", overwrite=False, resume=True)
    with pytest.raises(OutputError, match="exclude each other"):
        R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=True, resume=True)


def test_unwritable_location_is_one_line_output_error(tmp_path):
    # A path under a regular file fails for root as well (chmod tricks do not).
    blocker = tmp_path / "somefile"
    blocker.write_text("x")
    with pytest.raises(OutputError) as info:
        R.RunDirectory.prepare(blocker / "sub", "seed: 1\n", "h1", overwrite=False, resume=False)
    message = str(info.value)
    assert "\n" not in message and str(blocker / "sub") in message and "Not a directory" in message
    with pytest.raises(OutputError, match="is not a directory"):
        R.RunDirectory.prepare(blocker, "seed: 1\n", "h1", overwrite=False, resume=False)


# ---- batches, update vector, partial state, per-sequence rows, log ---------------------------------

def test_batch_round_trip_with_weights_only(tmp_path):
    run = R.RunDirectory.prepare(tmp_path, "seed: 1\n", "h1", overwrite=False, resume=False)
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
    run = R.RunDirectory(tmp_path)
    (tmp_path / "E_batch.pt").write_bytes(b"not a torch file")
    with pytest.raises(OutputError, match="E_batch.pt"):
        run.load_batch("E")


def test_update_vector_safetensors_round_trip(tmp_path):
    from safetensors.torch import load_file

    run = R.RunDirectory(tmp_path)
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
    run = R.RunDirectory(tmp_path)
    assert run.load_partial("missing") is None and not run.has_partial("missing")
    for bad in ("../evil", "a/b", ""):
        with pytest.raises(ValueError, match="partial state name"):
            run.save_partial(bad, {})


def test_per_sequence_jsonl_is_strict(tmp_path):
    run = R.RunDirectory(tmp_path)
    rows = [{"i": 0, "h": 3.5, "T": 7, "logw": float("-inf")}, {"i": 1, "h": np.float32(2.25), "T": 4, "logw": 0.1}]
    text = run.write_per_sequence(rows).read_text()
    parsed = [json.loads(line) for line in text.splitlines()]
    assert parsed == [{"i": 0, "h": 3.5, "T": 7, "logw": None}, {"i": 1, "h": 2.25, "T": 4, "logw": 0.1}]


def test_log_handler_writes_time_and_level(tmp_path):
    run = R.RunDirectory(tmp_path)
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


# ---- results.json ---------------------------------------------------------------------------

def test_results_json_is_strict_and_round_trips(tmp_path):
    res = fake_results()
    res["true"][3]["psis_khat"] = float("nan")
    res["linearity"]["loglog_slope"] = np.float64("inf")
    res["update"]["norm"] = torch.tensor(153.25)
    run = R.RunDirectory(tmp_path)
    path = run.write_results(res)

    def no_constants(name):
        raise AssertionError(f"non-standard JSON constant {name}")

    loaded = json.loads(path.read_text(), parse_constant=no_constants)
    assert loaded["true"][3]["psis_khat"] is None and loaded["linearity"]["loglog_slope"] is None
    assert loaded["update"]["norm"] == 153.25
    assert loaded["deltaH1"] == res["deltaH1"] and loaded["true"][0]["eta"] == -1e-5
    assert R.load_results(tmp_path) == loaded == R.load_results(path)
    assert path.read_text().startswith('{\n  "deltaH1"')  # indent 2


def test_validate_results_schema_names_first_missing_key():
    R.validate_results_schema(fake_results())
    res = fake_results()
    del res["true"][1]["logw"]["median"]
    with pytest.raises(ValueError, match=r"'true\[1\]\.logw\.median'"):
        R.validate_results_schema(res)
    res = fake_results()
    del res["counts"]["zero_advantage_prompts"]
    with pytest.raises(ValueError, match="'counts.zero_advantage_prompts'"):
        R.validate_results_schema(res)
    with pytest.raises(ValueError, match="normalize"):
        R.validate_results_schema(fake_results(normalize="per_char"))
    with pytest.raises(ValueError, match="'config_hash'"):
        R.RunDirectory("unused").write_results({k: v for k, v in fake_results().items() if k != "config_hash"})


def test_load_results_missing_file_names_the_path(tmp_path):
    with pytest.raises(OutputError) as info:
        R.load_results(tmp_path)
    assert str(tmp_path / "results.json") in str(info.value)
    (tmp_path / "results.json").write_text("{ broken")
    with pytest.raises(OutputError, match="not valid JSON"):
        R.load_results(tmp_path)


# ---- summary and plot -------------------------------------------------------------------------

def test_summary_contains_the_numbers():
    from rich.cells import cell_len

    text = R.render_summary(fake_results())
    # Literal strings written by hand from fake_results (not via the module's formatter).
    for expected in ("0.6123 nats/token", "41.8760 nats/seq",
                     "-0.0001235 ± 2.5e-05", "SE_E 1.5e-05", "SE_U 2e-05",   # δH₁ = 1e-5 × -12.3456
                     "1e-05",                                                 # learning rate
                     "-12.35",                                                # bars_dot
                     "-0.0008765 ± 0.00012",                                  # ΔH at η = 1e-4 (ratio 0.71)
                     "0.93 ✗", "0.710", "0.980",                              # k̂ flag, ratios to δH₁(η)
                     "-9.123", "ratio 0.739", "1.043", "-12.05",              # linearity
                     "runs/step_40", "k̂ > 0.7 at η=0.0001"):
        assert expected in text, expected
    assert text.count("✗") == 1  # only η = 1e-4 has k̂ above its threshold
    assert max(cell_len(line) for line in text.splitlines()) <= 110
    assert "\x1b[" not in text  # no colour codes


def test_summary_notes_when_khat_rests_on_few_tail_draws():
    from entropy_experiments.stats import psis_tail_size

    assert [psis_tail_size(n) for n in (24, 25, 32, 225, 226, 10_000)] == [4, 5, 6, 45, 45, 300]
    text = R.render_summary(fake_results())  # N = ess / ess_frac = 64 → M = 12 tail draws
    assert "M = 12 largest of N = 64 weights" in text and "prior worth 10 draws" in text
    big = fake_results()
    for entry in big["true"]:
        entry["ess"] = entry["ess_frac"] * 1000  # N = 1000 → M = 94: the fit is the data's
    assert "largest of N" not in R.render_summary(big)


def test_summary_tolerates_nulls():
    res = json.loads(R.dumps_strict(fake_results(deltaH1=float("nan"), bars_dot=0.0)))
    text = R.render_summary(res)
    assert "n/a" in text


def test_plot_is_a_png(tmp_path):
    res = fake_results()
    res["true"][1]["deltaH_true"] = float("nan")  # a missing point must not break the plot
    path = R.plot_delta_h(res, tmp_path / "delta_h_vs_eta.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1024
    assert _no_temp_files(tmp_path)
    # Linear x (narrow η span), per-sequence units, no points at all.
    narrow = fake_results(normalize="per_sequence", true=fake_results()["true"][2:3])
    assert R.plot_delta_h(narrow, tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
    assert R.plot_delta_h(fake_results(true=[]), tmp_path / "c.png").stat().st_size > 1024


def _not_measured() -> dict:
    """fake_results as a run with importance.enabled: false writes it (after the strict-JSON round trip)."""
    res = fake_results(true=[], linearity={"slope_through_origin": float("nan"), "loglog_slope": float("nan"),
                                           "symmetric_slopes": []})
    return json.loads(R.dumps_strict(res))


def test_summary_without_delta_h_rows_says_not_measured():
    res = _not_measured()
    R.validate_results_schema(res)
    text = R.render_summary(res)
    assert "ΔH(η) not measured (importance.enabled: false)" in text
    assert "-0.0001235 ± 2.5e-05" in text and "k̂ > 0.7 at η=0.0001" in text  # δH₁ and the warnings stay
    assert "Measured ΔH(η)" not in text and "Linearity" not in text and "slope" not in text
    full = R.render_summary(fake_results())
    assert "not measured" not in full and "Measured ΔH(η)" in full and "Linearity of ΔH in η" in full


def test_plot_without_delta_h_rows_draws_the_prediction_only(tmp_path, monkeypatch):
    from matplotlib.axes import Axes

    drawn = []

    def recording(method):
        real = getattr(Axes, method)
        return lambda self, *args, **kwargs: drawn.append(method) or real(self, *args, **kwargs)

    for method in ("plot", "fill_between", "errorbar", "text"):
        monkeypatch.setattr(Axes, method, recording(method))
    path = R.plot_delta_h(_not_measured(), tmp_path / "p.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert drawn == ["plot", "fill_between"]  # the δH₁ line and its band; no points, no "no finite ΔH" text
    drawn.clear()
    R.plot_delta_h(fake_results(), tmp_path / "q.png")
    assert drawn == ["plot", "fill_between", "errorbar", "errorbar"]

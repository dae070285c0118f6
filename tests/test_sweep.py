"""`entropy-probe sweep` against independent references.

One real run on the enumerable toy model (3 checkpoints, each after a real AdamW step; the last saved with
lr 0.0 as at the end of a linear schedule) is swept once; then
- every checkpoint's Ĥ lies within 4 SE of its exact entropy (enumeration of every response), and every
  realised change H(to) − H(from) within 4 of its paired SE of the exact difference;
- the entropy-only checkpoint draws E exactly as the probe does, and says why it has no δH₁;
- sweep.json's calibration equals the one computed by a small implementation of its own (sweep_reference.py);
- loading a checkpoint onto the already-loaded model gives the fresh load's weights and optimizer exactly;
- a sweep killed (SIGKILL) in its second checkpoint (batches saved) and resumed writes the same sweep.json;
- bad input is one line and exit code 2.
The statistics alone (synthetic data) are tested in tests/test_sweep_stats.py.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from entropy_experiments import cli
from entropy_experiments.checkpoint.layout import resolve_checkpoint
from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import CheckpointError, ConfigError, OutputError
from entropy_experiments.estimators.entropy_proxies import PROXIES
from entropy_experiments.sweep import run_sweep
from entropy_experiments.sweep.discovery import find_checkpoints, select_every
from entropy_experiments.testing.tiny_model import build_toy_enumerable_dir
from tests.hooked_cli import HOLD_ENV, HOLD_FILE_ENV, hooked_command
from tests.run_helpers import logging_restored, subprocess_env
from tests.sweep_helpers import exact_entropy, load_checkpoint_model, train_run
from tests.sweep_reference import assert_close, jackknife, ref_calibration

# Costly module fixtures: one worker runs this whole file (scripts/test.sh distributes by xdist_group).
pytestmark = pytest.mark.xdist_group("test_sweep")


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory) -> Path:
    return build_toy_enumerable_dir(tmp_path_factory.mktemp("sweep_toy"))


@pytest.fixture(scope="module")
def trained(toy_dir, tmp_path_factory) -> tuple[Path, dict, Path]:
    """(checkpoints dir with step_1..step_3, probe config dict, config file)."""
    folder = tmp_path_factory.mktemp("sweep_run")
    # second order on: the decomposition's ½·D²_Δθ H (with_second_order) is measured only then
    run, config = train_run(folder, toy_dir, steps=3, end_with_lr_zero=True, second_order={"enabled": True})
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return run, config, path


@pytest.fixture(scope="module")
def swept(trained, tmp_path_factory) -> tuple[Path, dict]:
    """(sweep directory, sweep.json) of an uninterrupted sweep, one thread (as the killed subprocess)."""
    run, config, _ = trained
    out = tmp_path_factory.mktemp("sweep_ref") / "sweep"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        doc = run_sweep(config_from_dict(config), run, out=str(out))
    finally:
        torch.set_num_threads(n)
    assert json.loads((out / "sweep.json").read_text()) == json.loads(json.dumps(doc))
    return out, doc


# ---------------------------------------------------------------------------------- exactness
@pytest.mark.e2e
def test_entropies_and_realised_changes_match_enumeration(swept, trained, toy_dir):
    _, doc = swept
    run, _, _ = trained
    exact = {}
    for row in doc["rows"]:
        model, tokenizer = load_checkpoint_model(toy_dir, run / row["checkpoint"])
        exact[row["step"]] = exact_entropy(model, tokenizer)
        assert abs(row["H"] - exact[row["step"]]) < 4 * row["H_se"], (row["checkpoint"], row["H"], row["H_se"])
        assert row["H_se"] < 0.02
    assert [r["step"] for r in doc["rows"]] == [1, 2, 3]
    assert max(exact.values()) - min(exact.values()) > 2 * max(r["H_se"] for r in doc["rows"]) / 2
    assert len(doc["realised"]) == 2
    for real in doc["realised"]:
        diff = exact[real["to_step"]] - exact[real["from_step"]]
        assert abs(real["dH_realised"] - diff) < 4 * real["se"], (real, diff)
        assert real["se"] < 0.5 * abs(diff), "the check must be sharp enough to mean something"
        assert real["n_paired_units"] == doc["rows"][0]["n_units"] and real["n_unpaired_units"] == 0


@pytest.mark.e2e
def test_rows_read_the_run_directories(swept):
    out, doc = swept
    for row in doc["rows"][:2]:
        res = json.loads((out / row["run_dir"] / "results.json").read_text())
        assert row["kind"] == "probe" and row["lr"] == res["learning_rate"] == pytest.approx(2e-2)
        assert row["H"] == pytest.approx(res["H_orig"]["per_token"], rel=1e-9)
        assert row["deltaH1"] == res["deltaH1"] and row["se_total"] == res["se"]["total"]
        true = min((r for r in res["true"] if r["eta"] > 0), key=lambda r: r["eta"])  # the sweep's: smallest +η
        assert row["deltaH_true"]["scaled"] == pytest.approx(true["deltaH_true"] * res["learning_rate"] / true["eta"])
        assert row["residual_z"] == true["residual"]["z"]
        assert set(row["predictors"]) == set(res.get("predictors") or {"adamw_step": 0})
        assert row["predictors"]["adamw_step"]["z_own"] == row["residual_z"]
        paired = {n: e["residual"]["z"] for n, e in res["predictors"].items() if e.get("residual")}
        assert {"sgd_same_norm", "direct_only"} <= set(paired)  # each its own one jackknife with ΔH
        for name, z in paired.items():
            assert row["predictors"][name]["z_own"] == z and row["predictors"][name]["z_own_paired"], name
    first = doc["realised"][0]
    assert first["dH_predicted"] == doc["rows"][0]["deltaH1"] and first["se_predicted"] == doc["rows"][0]["se_total"]
    se = math.sqrt(first["se"] ** 2 + first["se_predicted"] ** 2 + doc["rows"][0]["se_U"] ** 2)
    assert first["z"] == pytest.approx((first["dH_realised"] - first["dH_predicted"]) / se)
    assert (out / "trajectory.png").stat().st_size > 0 and (out / "calibration.png").stat().st_size > 0
    assert (out / "predictors.png").stat().st_size > 0


@pytest.mark.e2e
def test_lr_zero_checkpoint_is_measured_for_entropy_only(swept, trained):
    out, doc = swept
    last = doc["rows"][-1]
    assert last["kind"] == "entropy_only" and last["deltaH1"] is None and last["predictors"] == {}
    assert "saved lr is 0.0" in last["no_prediction"]
    assert doc["realised"][-1]["dH_realised"] is not None and doc["realised"][-1]["dH_predicted"] is not None
    # E at the entropy-only checkpoint: the same prompt draws as every probed checkpoint's E ...
    E_probe = torch.load(out / "runs/step_2/E_batch.pt", weights_only=True)
    E_only = torch.load(out / "runs/step_3/E_batch.pt", weights_only=True)
    assert E_only["prompt_ids"] == E_probe["prompt_ids"]
    # ... and drawn exactly as the probe draws it: the entropy-only path at step_2 reproduces step_2's E.
    from entropy_experiments.sweep.entropy_only import measure_entropy_only
    from entropy_experiments.sweep.policies import SweepPolicies
    from entropy_experiments.sweep.runner import checkpoint_config

    run, config, _ = trained
    ck = find_checkpoints(run)[1]
    cfg = checkpoint_config(config_from_dict(config), ck)
    loaded = SweepPolicies().policy_for(cfg, ck)
    measure_entropy_only(cfg, loaded.policy, out.parent / "step_2_entropy_only", "test", resume=False)
    E_again = torch.load(out.parent / "step_2_entropy_only/E_batch.pt", weights_only=True)
    assert torch.equal(E_again["sequences"], E_probe["sequences"])


# ---------------------------------------------------------------------------------- calibration
@pytest.mark.e2e
def test_sweep_calibration_matches_an_independent_implementation(swept):
    _, doc = swept
    assert {"adamw_step"} <= set(doc["calibration"])
    assert_close(doc["calibration"], ref_calibration(doc, scale_free=set(PROXIES)), "calibration")
    assert set(PROXIES) <= set(doc["calibration"])  # the scale-free entropy proxies are scored too
    # the realised z of every predictor, recomputed
    for real in doc["realised"]:
        row = next(r for r in doc["rows"] if r["step"] == real["from_step"])
        for name, p in real["predictors"].items():
            if name == "displacement":  # its z is the first-order residual's: test_first_order_residual_...
                assert p["z"] == real["first_order"]["z"] and p["dH_predicted"] == real["displacement"]["value"]
                continue
            if name in PROXIES:  # no SE, no z: scored by the leave-one-out scale (test_sweep_stats.py)
                assert p["z"] is None
                continue
            se = math.sqrt(real["se"] ** 2 + row["predictors"][name]["se"] ** 2 + row["se_U"] ** 2)
            assert p["z"] == pytest.approx((real["dH_realised"] - row["predictors"][name]["delta_h1"]) / se)


# ---------------------------------------------------------------------------------- loading
@pytest.mark.e2e
def test_swapped_checkpoint_equals_a_fresh_load(trained):
    from entropy_experiments.sweep.policies import SweepPolicies
    from entropy_experiments.sweep.runner import checkpoint_config

    run, config, _ = trained
    cks = find_checkpoints(run)
    policies = SweepPolicies()
    base = config_from_dict(config)
    policies.policy_for(checkpoint_config(base, cks[0]), cks[0])
    swapped = policies.policy_for(checkpoint_config(base, cks[1]), cks[1])
    fresh = SweepPolicies().policy_for(checkpoint_config(base, cks[1]), cks[1])
    mine, ref = swapped.policy.trainable.model.state_dict(), fresh.policy.trainable.model.state_dict()
    assert mine.keys() == ref.keys()
    assert all(torch.equal(mine[k], ref[k]) for k in ref)
    assert any("lora_B" in k and mine[k].abs().sum() > 0 for k in ref)
    opt_a, opt_b = swapped.policy.optimizer.state_dict(), fresh.policy.optimizer.state_dict()
    assert opt_a["param_groups"] == opt_b["param_groups"]
    for i, st in opt_b["state"].items():
        assert all(torch.equal(st[k], opt_a["state"][i][k]) for k in st)
    assert swapped.policy.checkpoint_info == fresh.policy.checkpoint_info
    # another LoRA configuration cannot be swapped in
    other = run.parent / "other_lora" / "step_9"
    shutil.copytree(cks[0].path, other)
    cfg_file = other / "model" / "adapter_config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), "lora_alpha": 3}))
    ck_other = find_checkpoints(other.parent)[0]
    with pytest.raises(CheckpointError, match="lora_alpha"):
        policies.policy_for(checkpoint_config(base, ck_other), ck_other)


# ---------------------------------------------------------------------------------- kill and resume
@pytest.mark.e2e
def test_resume_after_a_kill_gives_identical_sweep_json(swept, trained, tmp_path):
    run, _, config_file = trained
    out, marker = tmp_path / "sweep", tmp_path / "held"
    env = subprocess_env(**{HOLD_ENV: "batches_saved:2", HOLD_FILE_ENV: str(marker)})
    proc = subprocess.Popen(hooked_command("sweep", "--config", str(config_file), "--checkpoints", str(run),
                                        "--out", str(out)), cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not marker.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"sweep never reached the hold point:\n{proc.communicate()[1][-3000:]}")
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert not (out / "sweep.json").exists()
    assert json.loads((out / "runs/step_1/run_meta.json").read_text())["status"] == "complete"
    assert json.loads((out / "runs/step_2/run_meta.json").read_text())["status"] == "running"

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with logging_restored():
            assert cli.main(["sweep", "--resume", str(out)]) == 0
    finally:
        torch.set_num_threads(n)
    assert json.loads((out / "sweep.json").read_text()) == json.loads(json.dumps(swept[1]))
    log = (out / "sweep.log").read_text()
    assert "step_1 (step 1) finished earlier: kept" in log and "saved E and U batches" in log


# ---------------------------------------------------------------------------------- discovery and errors
def _fake_checkpoint(path: Path, *, trainer_step: int | None = None, own: bool = False) -> Path:
    adapter = path / "model" if own else path
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (path / "optimizer.pt").write_bytes(b"")
    if trainer_step is not None:
        (path / "trainer_state.json").write_text(json.dumps({"global_step": trainer_step, "max_steps": 20}))
    return path


def test_discovery_orders_by_step_and_reads_each_layout(tmp_path):
    for n in (10, 2, 9):
        _fake_checkpoint(tmp_path / f"checkpoint-{n}", trainer_step=n)
    _fake_checkpoint(tmp_path / "step_5", own=True)
    (tmp_path / "logs").mkdir()
    found = find_checkpoints(tmp_path)
    assert [(c.name, c.step) for c in found] == [("checkpoint-2", 2), ("step_5", 5), ("checkpoint-9", 9),
                                                 ("checkpoint-10", 10)]
    assert found[0].step_source == "trainer_state.json global_step" and found[1].step_source == "directory name"
    assert found[0].files.layout == "trainer" and found[1].files.layout == "own"
    assert [c.step for c in select_every(found, 3)] == [2, 10]
    assert [c.step for c in select_every(found, 2)] == [2, 9, 10]
    assert resolve_checkpoint(str(found[1].path), None, None).adapter_dir == tmp_path / "step_5" / "model"
    _fake_checkpoint(tmp_path / "step_9", own=True)
    with pytest.raises(CheckpointError, match="both step 9"):
        find_checkpoints(tmp_path)


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["empty", "not_a_checkpoint", "no_optimizer", "resume_other_config",
                                  "resume_not_a_sweep", "out_not_empty", "every_zero"])
def test_bad_input_is_one_line_and_exit_2(case, swept, trained, tmp_path, capsys):
    run, config, config_file = trained
    ckdir, expect = tmp_path / "ckpts", []
    ckdir.mkdir()
    args = ["sweep", "--config", str(config_file), "--checkpoints", str(ckdir), "--out", str(tmp_path / "o")]
    if case == "empty":
        expect = ["no checkpoints found in", str(ckdir)]
    elif case == "not_a_checkpoint":
        (ckdir / "checkpoint-3").mkdir()
        expect = ["unreadable checkpoint", str(ckdir / "checkpoint-3"), "adapter_config.json"]
    elif case == "no_optimizer":
        shutil.copytree(run / "step_1", ckdir / "step_1")
        (ckdir / "step_1" / "optimizer.pt").unlink()
        expect = ["unreadable checkpoint", "optimizer"]
    elif case == "resume_other_config":
        other = tmp_path / "other.yaml"
        other.write_text(yaml.safe_dump({**config, "seed": 99}))
        args = ["sweep", "--config", str(other), "--resume", str(swept[0])]
        expect = ["--resume", str(swept[0]), "config_hash"]
    elif case == "resume_not_a_sweep":
        args = ["sweep", "--resume", str(ckdir)]
        expect = ["nothing to resume", str(ckdir)]
    elif case == "out_not_empty":
        args = ["sweep", "--config", str(config_file), "--checkpoints", str(run), "--out", str(swept[0])]
        expect = [str(swept[0]), "not empty", "--resume"]
    elif case == "every_zero":
        args = ["sweep", "--config", str(config_file), "--checkpoints", str(run), "--every", "0"]
        expect = ["--every 0"]
    with logging_restored():
        code = cli.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert all(s in err[0] for s in expect), (err[0], expect)


@pytest.mark.e2e
def test_every_must_match_on_resume_and_config_errors_name_the_value(swept, trained):
    run, config, _ = trained
    with pytest.raises(ConfigError, match="--every 0"):
        select_every(find_checkpoints(run), 0)
    with pytest.raises(OutputError, match="that sweep has every 1, this one 2"):
        run_sweep(config_from_dict(config), run, resume=str(swept[0]), every=2)


# ---------------------------------------------------------------------------------- the step the run took
def _per_sequence(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / "per_sequence.jsonl").read_text().splitlines() if line.strip()]


def _importance_change(interval: dict, without=None) -> float:
    """The realised change written out from intervals/<from>__<to>.json: (forward + reverse)/2 of the SNIS
    changes, the unit `without` removed from both batches."""
    def side(s):
        keep = [i for i, u in enumerate(s["units"]) if u != without]
        lw = np.array(s["logw"])[keep]
        w = np.exp(lw - lw.max())
        h_own, h_other, T = (np.array(s[k])[keep] for k in ("h_own", "h_other", "T"))
        return np.sum(w * h_other) / np.sum(w * T), np.sum(h_own) / np.sum(T)

    (f_other, f_own), (r_other, r_own) = side(interval["forward"]), side(interval["reverse"])
    return 0.5 * ((f_other - f_own) + (r_own - r_other))


@pytest.mark.e2e
def test_first_order_residual_is_one_jackknife_over_both_batches(swept):
    """realised − δH_Δθ and its SE against a delete-one jackknife written out over the units (draw:prompt) of
    BOTH batches: deleting a unit removes it from the realised change (the importance estimate, both batches at
    once) and from δH_Δθ = (A − Ĥ·B)/ΣT at once; the paired difference's residual (`paired_diagnostic`) the
    same way with Ĥ(to) − Ĥ(from)."""
    out, doc = swept
    real = doc["realised"][0]
    assert real["displacement"]["steps_spanned"] == 1 and "one step" in real["displacement"]["span"]
    rows_from = _per_sequence(out / "runs" / real["from_checkpoint"])
    rows_to = _per_sequence(out / "runs" / real["to_checkpoint"])
    interval = json.loads((out / "intervals" / f"{real['from_checkpoint']}__{real['to_checkpoint']}.json").read_text())

    def key(r):
        return f"{r['prompt_index']}:{r['prompt_id']}"

    units = sorted({key(r) for r in rows_from} | {key(r) for r in rows_to})
    assert units == sorted(set(interval["forward"]["units"]) | set(interval["reverse"]["units"]))

    def displacement(without=None):
        f = [r for r in rows_from if key(r) != without]
        h_f, T_f = sum(r["h"] for r in f), sum(r["T"] for r in f)
        A, B = sum(r["displacement"]["a"] for r in f), sum(r["displacement"]["r"] for r in f)
        return (A - h_f / T_f * B) / T_f

    def paired_residual(without=None):
        f = [r for r in rows_from if key(r) != without]
        t = [r for r in rows_to if key(r) != without]
        h_f, T_f = sum(r["h"] for r in f), sum(r["T"] for r in f)
        return sum(r["h"] for r in t) / sum(r["T"] for r in t) - h_f / T_f - displacement(without)

    def residual(without=None):
        return _importance_change(interval, without) - displacement(without)

    first = real["first_order"]
    assert real["method"] == first["method"] == "importance"
    assert first["residual"] == pytest.approx(residual(), rel=1e-9, abs=1e-12)
    # its two parts, each against its written-out reference (the residual is not re-derived from them)
    assert real["dH_realised"] == pytest.approx(_importance_change(interval), rel=1e-9, abs=1e-12)
    assert real["displacement"]["value"] == pytest.approx(displacement(), rel=1e-3, abs=1e-6)
    assert first["se"] == pytest.approx(jackknife([residual(u) for u in units]), rel=1e-9)
    assert first["z"] == pytest.approx(first["residual"] / first["se"])
    assert doc["realised"][0]["predictors"]["displacement"]["z"] == first["z"]
    paired = first["paired_diagnostic"]
    assert paired["residual"] == pytest.approx(paired_residual(), rel=1e-9, abs=1e-12)
    assert real["paired_diagnostic"]["value"] == pytest.approx(paired_residual() + displacement(), rel=1e-9, abs=1e-12)
    assert paired["se"] == pytest.approx(jackknife([paired_residual(u) for u in units]), rel=1e-9)
    assert paired["z"] == pytest.approx(paired["residual"] / paired["se"])
    def curvature(without=None):
        """½·D²_Δθ of the SNIS estimate on E_N, written out from the per-sequence s, s2, dh, d2h along Δθ."""
        f = [r for r in rows_from if key(r) != without]
        h, T = np.array([r["h"] for r in f]), np.array([r["T"] for r in f])
        s, s2, dh, d2h = (np.array([r["displacement"][k] for r in f]) for k in ("s", "s2", "dh", "d2h"))
        N, D, N1, D1 = h.sum(), T.sum(), (s * h + dh).sum(), (s * T).sum()
        N2, D2 = ((s2 + s ** 2) * h + 2 * s * dh + d2h).sum(), ((s2 + s ** 2) * T).sum()
        return 0.5 * ((N2 * D - N * D2) / D ** 2 - 2 * D1 * (N1 * D - N * D1) / D ** 3)

    second = real["with_second_order"]
    assert second["residual"] == pytest.approx(residual() - curvature(), rel=1e-9, abs=1e-12)
    assert second["se"] == pytest.approx(jackknife([residual(u) - curvature(u) for u in units]), rel=1e-9)
    assert second["se"] > 0 and second["z"] == pytest.approx(second["residual"] / second["se"])
    assert second["paired_diagnostic"]["residual"] == pytest.approx(paired_residual() - curvature(), rel=1e-9,
                                                                    abs=1e-12)
    # the joint SE is not the two SEs added in quadrature: the realised change and δH_Δθ share E_N
    assert first["se"] != pytest.approx(math.hypot(real["se"], real["displacement"]["se"]), rel=1e-3)
    assert paired["se"] != pytest.approx(math.hypot(real["paired_diagnostic"]["se"], real["displacement"]["se"]),
                                         rel=1e-3)
    noise = real["u_noise"]
    row = doc["rows"][0]
    assert noise["trainer_batch_sequences"] == noise["probe_U_sequences"] == 32  # make_checkpoint: B_U·G = 8·4
    assert noise["se"] == pytest.approx(math.sqrt(2 * row["se_U"] ** 2 + noise["se_E"] ** 2))
    # the probe's own step lr·X̂·v against δH_Δθ, both from per-sequence pieces on E_N (a, r along v; along Δθ)
    h_f, T_f = sum(r["h"] for r in rows_from), sum(r["T"] for r in rows_from)
    A = sum(row["lr"] * r["a"] - r["displacement"]["a"] for r in rows_from)
    B = sum(row["lr"] * r["r"] - r["displacement"]["r"] for r in rows_from)
    assert noise["value"] == pytest.approx((A - h_f / T_f * B) / T_f, rel=1e-9, abs=1e-12)
    assert doc["decomposition"]["first_order"]["n"] == len(doc["realised"])

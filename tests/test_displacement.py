"""The `displacement` predictor δH_Δθ = X̂·(θ_next − θ) (docs/maths.md §9) against independent references.

On the enumerable toy model, with checkpoints from real AdamW steps (`make_checkpoint`):
- δH_Δθ within 4 SE_E of the exact D_Δθ H (central difference of the enumerated entropy along Δθ);
- its per-sequence pieces sum to X̂·Δθ (1e-4);
- when Δθ is one real AdamW step (torch's own) taken on the probe's own U from the saved state, δH_Δθ equals
  δH₁ = lr·X̂·v on the same E (1e-5);
- ½·D²_Δθ H against half the exact second difference of the enumerated entropy along Δθ (4 SE);
- Δθ = 0 is reported as such; a next checkpoint with another rank, other target modules or another base model,
  or none at all, is one line (exit 2 through the CLI).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch

from entropy_experiments import cli
from entropy_experiments.checkpoint.displacement import displacement_to
from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import CheckpointError
from entropy_experiments.estimators.delta_h import real_optimizer_step
from entropy_experiments.probe.recipe import run as probe_run
from entropy_experiments.probe.recipe import update_phase
from entropy_experiments.testing.tiny_model import build_toy_enumerable_dir
from tests.run_helpers import logging_restored
from tests.sweep_helpers import MAX_NEW, train_run
from tests.test_probe import _enumerated, _shifted

pytestmark = [pytest.mark.xdist_group("test_displacement"), pytest.mark.e2e]


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
    """(toy model dir, checkpoints dir with step_1, step_2 from real AdamW steps, the probe config dict)."""
    folder = tmp_path_factory.mktemp("displacement")
    toy = build_toy_enumerable_dir(folder / "toy")
    run, config = train_run(folder, toy, steps=2, lr=5e-2)
    config["batch_config"]["B_E"] = 2000
    config["importance"] = {"enabled": False}
    return toy, run, config


def _config(config: dict, checkpoint: Path, next_checkpoint) -> dict:
    out = copy.deepcopy(config)
    out["checkpoint"]["checkpoint_path"] = str(checkpoint)
    out["predictors"] = {"enabled": True, "next_checkpoint": None if next_checkpoint is None else str(next_checkpoint)}
    out["second_order"] = {"enabled": True}  # ½·D²_Δθ H is measured only with second order on
    return out


@pytest.fixture(scope="module")
def probed(toy_run):
    """The probe at step_1 with next_checkpoint step_2: (outcome, E, U)."""
    _, run, config = toy_run
    captured = {}
    outcome = probe_run(config_from_dict(_config(config, run / "step_1", run / "step_2")),
                        on_batches=lambda E, U: captured.update(E=E, U=U))
    return outcome, captured["E"], captured["U"]


def _exact_along(model, delta: dict, tokenizer, steps: list[float]) -> list[float]:
    """The exact per-token entropy H(θ + s·Δθ) for each s (enumeration of every response, float64)."""
    model64 = copy.deepcopy(model).double()
    params = {n: p.detach() for n, p in model64.named_parameters()}
    assert set(delta) <= set(params)
    out = []
    for s in steps:
        _, qh, qT, _, _ = _enumerated(model64, _shifted(params, delta, s), tokenizer, MAX_NEW)
        out.append(qh / qT)
    return out


def test_displacement_against_the_exact_derivatives(probed, toy_run):
    outcome, _, _ = probed
    entry = outcome.results["predictors"]["displacement"]
    policy = outcome.policy
    delta = {n: t.clone() for n, t in policy.displacement.items()}
    assert next(iter(outcome.results["predictors"])) == "displacement"
    assert entry["zero_displacement"] is False and entry["delta_theta_norm"] > 0
    # Δθ is what the two checkpoints hold: step_2's adapter minus step_1's, tensor by tensor
    eps = 1e-3
    lo, mid, hi = _exact_along(policy.trainable.model, delta, policy.tokenizer, [-eps, 0.0, eps])
    first = (hi - lo) / (2 * eps)
    second = (hi - 2 * mid + lo) / eps ** 2
    print(f"\nδH_Δθ {entry['delta_h1']:.4g} ± {entry['se_E']:.2g}, exact D_Δθ H {first:.4g}; "
          f"½D² {entry['second_order']['value']:.3g} ± {entry['second_order']['se']:.2g}, exact {0.5 * second:.3g}")
    assert abs(entry["delta_h1"] - first) < 4 * entry["se_E"]
    assert entry["se_E"] < 0.25 * abs(first), "the test must be sharp enough to mean something"
    assert entry["from_pieces"] == pytest.approx(entry["delta_h1"], rel=1e-4)
    half = entry["second_order"]
    assert abs(half["value"] - 0.5 * second) < 4 * half["se"]
    assert half["se"] < 0.5 * abs(0.5 * second), "the second-order check must be sharp enough to mean something"
    # the per-sequence columns the sweep reads
    rows = outcome.per_sequence_rows
    assert all(set(r["displacement"]) == {"a", "r", "s", "s2", "dh", "d2h"} for r in rows)
    assert -1 <= entry["cos_with_probe_step"] <= 1 and entry["probe_step_norm_ratio"] > 0


def test_one_adamw_step_on_the_probes_own_u_gives_delta_h1(probed, toy_run, tmp_path):
    """Δθ = torch's AdamW step with lr from the saved state on the probe's own U gradient ⇒ X̂·Δθ = lr·X̂·v."""
    outcome, E, U = probed
    _, run, config = toy_run
    cfg = config_from_dict(_config(config, run / "step_1", None))
    policy = outcome.policy
    grads = update_phase(cfg, policy, U, None).gradients
    lr, t = outcome.results["learning_rate"], policy.trainable
    stepped = tmp_path / "one_step"
    shutil.copytree(run / "step_1", stepped)
    with real_optimizer_step(policy.optimizer, list(zip(t.names, t.params)), grads.total, lr,
                             cfg.objective_options().max_grad_norm):
        t.model.save_pretrained(str(stepped / "model"))
    again = probe_run(config_from_dict(_config(config, run / "step_1", stepped)), policy=policy,
                      batches=(E, U)).results
    entry = again["predictors"]["displacement"]
    assert again["deltaH1"] != 0
    assert entry["delta_h1"] == pytest.approx(again["deltaH1"], rel=1e-5)
    assert entry["cos_with_probe_step"] == pytest.approx(1.0, abs=1e-6)
    assert entry["probe_step_norm_ratio"] == pytest.approx(1.0, rel=1e-5)


def test_an_unchanged_adapter_is_reported_as_zero_displacement(probed, toy_run):
    outcome, E, U = probed
    _, run, config = toy_run
    res = probe_run(config_from_dict(_config(config, run / "step_1", run / "step_1")), policy=outcome.policy,
                    batches=(E, U)).results
    entry = res["predictors"]["displacement"]
    assert entry["zero_displacement"] is True and entry["delta_h1"] == 0.0 and entry["delta_theta_norm"] == 0.0
    assert any("Δθ = 0" in w for w in res["warnings"])


def test_second_order_switch_turns_off_the_displacement_second_order_pass(probed, toy_run, monkeypatch):
    """second_order.enabled: false skips ½·D²_Δθ H (a second-order pass over E) as it skips d2 along v."""
    from entropy_experiments.probe import beyond

    outcome, E, U = probed
    _, run, config = toy_run
    assert outcome.results["predictors"]["displacement"]["second_order"] is not None  # on by default
    assert "s2" in outcome.per_sequence_rows[0]["displacement"]
    calls = []
    real = beyond.second_order_sums
    monkeypatch.setattr(beyond, "second_order_sums", lambda *a, **k: calls.append(1) or real(*a, **k))
    off = _config(config, run / "step_1", run / "step_2")
    off["second_order"] = {"enabled": False}
    again = probe_run(config_from_dict(off), policy=outcome.policy, batches=(E, U))
    entry = again.results["predictors"]["displacement"]
    assert calls == [] and entry["second_order"] is None and again.results["second_order"] is None
    assert "s2" not in again.per_sequence_rows[0]["displacement"] and "a" in again.per_sequence_rows[0]["displacement"]
    assert entry["delta_h1"] == pytest.approx(outcome.results["predictors"]["displacement"]["delta_h1"], rel=1e-6)


def _edited_adapter(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    path = dst / "model" / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("case", ["rank", "target_modules", "base_model", "missing"])
def test_adapter_mismatches_are_one_line(case, probed, toy_run, tmp_path):
    outcome, _, _ = probed
    _, run, _ = toy_run
    t = outcome.policy.trainable
    before = [p.detach().clone() for p in t.params]
    if case == "rank":
        nxt, expect = _edited_adapter(run / "step_2", tmp_path / "r", r=2), ["r = 2"]
    elif case == "target_modules":
        nxt, expect = _edited_adapter(run / "step_2", tmp_path / "tm", target_modules=["q_proj"]), ["target_modules"]
    elif case == "base_model":
        other = build_toy_enumerable_dir(tmp_path / "other_toy", seed=1)
        nxt, expect = _edited_adapter(run / "step_2", tmp_path / "bm", base_model_name_or_path=str(other)), \
            ["base model", str(other)]
    else:
        nxt, expect = tmp_path / "nowhere", ["not found", str(tmp_path / "nowhere")]
    with pytest.raises(CheckpointError) as info:
        displacement_to(t.model, nxt, list(t.names), list(t.params))
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"predictors.next_checkpoint {nxt}")
    assert all(s in message for s in expect), (message, expect)
    assert all(torch.equal(p.detach(), b) for p, b in zip(t.params, before)), "the probed weights must stay"


def test_missing_next_checkpoint_through_the_cli_is_exit_2(toy_run, tmp_path, capsys):
    _, run, config = toy_run
    cfg = _config(config, run / "step_1", tmp_path / "nowhere")
    cfg["batch_config"]["B_E"] = 8
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(cfg))
    with logging_restored():
        code = cli.main(["run", "--config", str(path), "--out", str(tmp_path / "out")])
    err = [line for line in capsys.readouterr().err.splitlines() if "next_checkpoint" in line or "rror" in line]
    assert code == 2 and len(err) == 1 and err[0].startswith("error: predictors.next_checkpoint"), err
    assert "not found" in err[0]

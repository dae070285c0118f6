"""The competing predictors (README "Competing predictors") against independent computations.

- no_momentum / sgd_same_norm: their directions written out in the test from the optimizer's saved state and
  g; with x_mode full_return each prediction lr·X̂·v' equals the η → 0 slope of the SNIS estimate along v'
  on the same E (the docs/maths.md §3 identity), measured by re-scoring E at θ ± εv';
- direct_only: lr·X_H·v against a central difference of Σ_i h_i(θ ± εv) on the SAME sequences, its SE_E
  against a jackknife written in the test over those finite-difference pieces;
- the hook pieces along every direction against forward-mode (jvp) pieces, through whole runs;
- measured_over_predicted against the results' own ΔH rows;
- on the enumerable model: each prediction against the exact derivative of the exact entropy.
"""

from __future__ import annotations

import copy
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from entropy_experiments.estimators import delta_h as isamp
from entropy_experiments.estimators.predictors import zero_second_moment_caveat
from entropy_experiments.estimators.sequence_scores import score_sequences
from entropy_experiments.estimators.update_direction import named_norm
from tests.probe_helpers import SHORT_PROMPTS, ProbeSetup, make_probe, write_prompts
from tests.test_probe import (  # noqa: F401  (fixtures)
    TOY_PROMPTS,
    _enumerate_responses,
    _enumerated,
    _run,
    _shifted,
    _update_direction,
    toy_dir,
    toy_prompts_file,
)

DIRECTION_NAMES = ("no_momentum", "sgd_same_norm")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl", SHORT_PROMPTS)



def _directions_by_hand(probe, U) -> tuple[dict, dict[str, dict]]:
    """(g, {name: v'}) with v' written out from the optimizer's saved state, independently of predictors.py."""
    g, v, _ = _update_direction(probe, U)
    group = probe.optimizer.param_groups[0]
    beta2, eps = group["betas"][1], group["eps"]
    v_p = {}
    for name, p in zip(probe.policy.trainable.names, probe.policy.trainable.params):
        st = probe.optimizer.state[p]
        t = int(st["step"])
        v_p[name] = -g[name].double() / ((st["exp_avg_sq"].double() / (1 - beta2 ** t)).sqrt() + eps)
    scale = named_norm(v) / named_norm(g)
    v_s = {n: -g[n].double() * scale for n in g}
    return g, {"no_momentum": v_p, "sgd_same_norm": v_s, "v": v}


def _snis_slope(probe, E, direction: dict, eps: float) -> float:
    out = isamp.measure_delta_h(probe.engine, E, {n: t.float() for n, t in direction.items()}, [-eps, eps],
                                normalize=probe.config.estimator.normalize)
    lo, hi = (row["deltaH_true"] for row in out.rows)
    return (hi - lo) / (2 * eps)


@pytest.mark.e2e
@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_direction_predictors_equal_the_snis_slope_along_their_direction(tiny_model_dir, prompts_file, normalize):
    probe = make_probe(tiny_model_dir, prompts_file, {
        "estimator": {"normalize": normalize, "x_mode": "full_return"}, "importance": {"eta_list": [1e-3]}})
    results, E, U, _ = _run(probe)
    lr = results["learning_rate"]
    _, dirs = _directions_by_hand(probe, U)
    for name in DIRECTION_NAMES:
        entry = results["predictors"][name]
        slope = _snis_slope(probe, E, dirs[name], 0.03 / named_norm(dirs[name]))  # steps of length 0.03 in θ
        assert entry["delta_h1"] != 0
        assert abs(entry["delta_h1"] / lr - slope) <= 2e-3 * abs(slope), (name, entry, slope)
        assert entry["from_pieces"] == pytest.approx(entry["delta_h1"], rel=1e-4)
        assert 0 < entry["se_E"] and 0 < entry["se_U"] and entry["se"] == pytest.approx(
            math.hypot(entry["se_E"], entry["se_U"]))
    main = results["predictors"]["adamw_step"]
    assert main["delta_h1"] == results["deltaH1"] and main["se"] == pytest.approx(results["se"]["total"])
    # the measured reference: ΔH at the smallest positive η, scaled to lr
    row = min((r for r in results["true"] if r["eta"] > 0), key=lambda r: r["eta"])
    measured = row["deltaH_true"] * lr / row["eta"]
    for entry in results["predictors"].values():
        if entry.get("scale_free"):  # the entropy proxies: no lr, no ratio (tests/test_entropy_proxies.py)
            assert entry["measured_over_predicted"] is None
            continue
        assert entry["measured_over_predicted"] == pytest.approx(measured / entry["delta_h1"], rel=1e-12)


def _jackknife_ratio(num: np.ndarray, den: np.ndarray) -> float:
    """Delete-one jackknife SE of Σnum/Σden, written out (independent of estimators/jackknife.py)."""
    n = len(num)
    reps = np.array([(num.sum() - num[i]) / (den.sum() - den[i]) for i in range(n)])
    return float(np.sqrt((n - 1) / n * ((reps - reps.mean()) ** 2).sum()))


@pytest.mark.e2e
@pytest.mark.parametrize("directional", ["backward_hooks", "jvp"])
def test_direct_only_against_finite_differences_of_the_entropies(tiny_model_dir, prompts_file, directional):
    probe = make_probe(tiny_model_dir, prompts_file, {"batch_config": {"B_E": 12},
                                                      "variance": {"directional": directional},
                                                      "importance": {"enabled": False}})
    results, E, _, v = _run(probe)
    entry, lr = results["predictors"]["direct_only"], results["learning_rate"]
    sp, eps = probe.engine, 3e-4
    h_plus = score_sequences(sp, E, params_override=sp.build_params_override(v, eps)).seq_entropies.numpy()
    h_minus = score_sequences(sp, E, params_override=sp.build_params_override(v, -eps)).seq_entropies.numpy()
    d = (h_plus - h_minus) / (2 * eps)                       # D_v h_i by finite differences, sequence by sequence
    T = np.array([len(x) for x in score_sequences(sp, E).token_logqs], dtype=float)
    # Σ_i d_i cancels between sequences (|Σd| ≈ Σ|d|/10 here): compare on the scale of the terms
    assert abs(entry["delta_h1"] - lr * d.sum() / T.sum()) <= 2e-3 * lr * np.abs(d).sum() / T.sum()
    assert entry["se_E"] == pytest.approx(lr * _jackknife_ratio(d, T), rel=1e-2)
    assert entry["from_pieces"] == pytest.approx(entry["delta_h1"], rel=1e-4)
    assert entry["se_U"] > 0 and entry["measured_over_predicted"] is None  # importance off: nothing to compare with


@pytest.mark.e2e
def test_hook_pieces_equal_jvp_pieces_for_every_predictor(tiny_model_dir, prompts_file):
    by_method = {}
    for directional in ("backward_hooks", "jvp"):
        probe = make_probe(tiny_model_dir, prompts_file, {"variance": {"directional": directional},
                                                          "importance": {"enabled": False}})
        by_method[directional] = _run(probe)[0]["predictors"]
    for name, hooks in by_method["backward_hooks"].items():
        jvp = by_method["jvp"][name]
        keys = ("delta_h1",) if hooks.get("scale_free") else ("delta_h1", "se_E", "se_U", "from_pieces")
        for key in keys:  # the scale-free proxies (U's tokens only) have no SE and no pieces
            assert hooks[key] == pytest.approx(jvp[key], rel=1e-4), (name, key, hooks[key], jvp[key])


@pytest.mark.e2e
def test_predictors_off_and_variance_off(tiny_model_dir, prompts_file):
    off = _run(make_probe(tiny_model_dir, prompts_file, {"predictors": {"enabled": False}}))[0]
    assert off["predictors"] is None and "predictors" not in off["timing"]
    no_bars = _run(make_probe(tiny_model_dir, prompts_file, {"variance": {"enabled": False}}))[0]["predictors"]
    for entry in no_bars.values():
        assert math.isfinite(entry["delta_h1"])
        assert entry["se"] is None if entry.get("scale_free") else math.isnan(entry["se"])  # proxies: no SE


@pytest.mark.e2e
def test_predictors_on_the_enumerable_model(toy_dir, toy_prompts_file):  # noqa: F811
    """Each prediction/lr against the exact derivative along its direction of the exact entropy (enumeration);
    direct_only against the exact E_q[Σ_k D_v H_k] / E_q[T] (per-token entropies differentiated at fixed y)."""
    max_new = 3
    probe = make_probe(toy_dir, toy_prompts_file, {
        "seed": 3, "batch_config": {"B_E": 3000, "B_U": 8, "G": 4},
        "generation": {"max_new_tokens": max_new, "gen_batch_size": 1024, "tf_batch_size": 1024},
        "estimator": {"microbatch_size": 1024}, "importance": {"eta_list": [2e-2], "symmetric": False},
        "second_order": {"enabled": False}})
    results, _, U, _ = _run(probe)
    lr = results["learning_rate"]
    _, dirs = _directions_by_hand(probe, U)
    model64 = copy.deepcopy(probe.model).double()
    params = {n: p.detach() for n, p in model64.named_parameters()}
    eps = 1e-4
    at = {}  # (direction name, s) → the enumeration at θ + s·v

    def enum(name, s):
        if (name, s) not in at:
            at[name, s] = _enumerated(model64, _shifted(params, dirs[name], s), probe.tokenizer, max_new)
        return at[name, s]

    for name in DIRECTION_NAMES:
        (_, h_lo, t_lo, _, _), (_, h_hi, t_hi, _, _) = enum(name, -eps), enum(name, eps)
        entry, exact = results["predictors"][name], (h_hi / t_hi - h_lo / t_lo) / (2 * eps)
        print(f"\n{name}: {entry['delta_h1'] / lr:.4g} ± {entry['se_E'] / lr:.2g}, exact {exact:.4g}")
        assert abs(entry["delta_h1"] / lr - exact) < 4 * entry["se_E"] / lr, (name, entry, exact)
        assert entry["se_E"] < 0.5 * abs(entry["delta_h1"]), "the test must be sharp enough to mean something"
    # the direct part: Σ_y q_θ(y) Σ_k ∂_η H_k(y; θ + ηv) / Σ_y q_θ(y) T(y) — the per-token entropies
    # differentiated at fixed sequences (central difference), weighted by the probabilities at θ
    q0, _, _, _, lengths = enum("v", 0.0)
    dh = (enum("v", eps)[3] - enum("v", -eps)[3]) / (2 * eps)
    exact = float((q0 * dh).sum() / (q0 * lengths).sum())
    entry = results["predictors"]["direct_only"]
    print(f"direct_only: {entry['delta_h1'] / lr:.4g} ± {entry['se_E'] / lr:.2g}, exact {exact:.4g}")
    assert abs(entry["delta_h1"] / lr - exact) < 4 * entry["se_E"] / lr, (entry, exact)


@pytest.mark.e2e
def test_no_momentum_is_unavailable_on_a_fresh_optimizer_state(tiny_model_dir, prompts_file):
    probe = make_probe(tiny_model_dir, prompts_file, {"importance": {"enabled": False}})
    fresh = torch.optim.AdamW([p for p in probe.model.parameters() if p.requires_grad], lr=1e-3)
    probe = ProbeSetup(probe.config, replace(probe.policy, optimizer=fresh))
    predictors = _run(probe)[0]["predictors"]
    assert predictors["no_momentum"]["delta_h1"] is None
    assert "step ≥ 1" in predictors["no_momentum"]["unavailable"]
    assert math.isfinite(predictors["sgd_same_norm"]["delta_h1"]) and predictors["sgd_same_norm"]["se"] > 0


def test_zero_second_moment_caveat_counts_the_entries_that_divide_by_eps():
    g = {"a": torch.tensor([1.0, 0.0, 2.0]), "b": torch.tensor([[3.0, 4.0]])}
    s = {"a": torch.tensor([0.0, 0.0, 1e-3]), "b": torch.tensor([[0.0, 0.0]])}
    caveat = zero_second_moment_caveat(g, s)  # a[0], b[0,0], b[0,1]: s = 0 and g ≠ 0; a[1] has g = 0
    assert caveat.startswith("3 of 5 trainable entries")
    assert zero_second_moment_caveat(g, {"a": torch.ones(3), "b": torch.ones(1, 2)}) is None


@pytest.mark.e2e
def test_no_momentum_warns_where_the_saved_second_moment_is_zero(tiny_model_dir, prompts_file):
    probe = make_probe(tiny_model_dir, prompts_file, {"importance": {"enabled": False}})
    params = [p for group in probe.optimizer.param_groups for p in group["params"]]
    probe.optimizer.state[params[0]]["exp_avg_sq"].zero_()  # as LoRA B's after a first step with g = 0 there
    predictors = _run(probe)[0]["predictors"]
    total = sum(p.numel() for p in params)
    assert predictors["no_momentum"]["warning"].startswith(f"{params[0].numel()} of {total} trainable entries")
    assert "warning" not in predictors["sgd_same_norm"]
    assert math.isfinite(predictors["no_momentum"]["delta_h1"])


@pytest.mark.e2e
def test_no_momentum_residual_is_paired_with_delta_h_on_the_same_e(tiny_model_dir, prompts_file):
    """no_momentum against ΔH(η₊)·lr/η₊ on one fixed E: the residual is the difference of the two numbers the run
    reports (the prediction from its pieces), and its one jackknife over E is narrower than √(SE_E² + SE(ΔH)²),
    the two E errors added as if independent, because both come from the same E."""
    probe = make_probe(tiny_model_dir, prompts_file, {"batch_config": {"B_E": 32}, "importance": {"eta_list": [5e-4]}})
    results = _run(probe)[0]
    lr, entry = results["learning_rate"], results["predictors"]["no_momentum"]
    row = min((r for r in results["true"] if r["eta"] > 0), key=lambda r: r["eta"])
    measured, se_measured = row["deltaH_true"] * lr / row["eta"], row["se"] * lr / row["eta"]
    paired, unpaired = entry["residual"], math.hypot(entry["se_E"], se_measured)
    print(f"\nno_momentum residual {paired['value']:+.3g}: paired SE {paired['se']:.3g}, unpaired {unpaired:.3g}")
    assert paired["eta"] == row["eta"] and lr != row["eta"]  # (so that a residual left at unit lr shows)
    assert paired["value"] == pytest.approx(measured - entry["from_pieces"], rel=1e-6, abs=1e-12)
    assert paired["z"] == pytest.approx(paired["value"] / paired["se"])
    assert 0 < paired["se"] < unpaired
    for name in ("sgd_same_norm", "direct_only"):  # the other predictors with pieces along their direction
        other = results["predictors"][name]
        assert 0 < other["residual"]["se"] < math.hypot(other["se_E"], se_measured), name

"""What-if (probe/what_if.py, estimators/what_if.py): other objectives' δH₁ on the same E and U as the run.

- each variant's δH₁ equals a separate run of the probe with that objective on the same E and U;
- its paired SE equals a delete-one jackknife of the difference written out here (E units, then U groups);
- the solved entropy coefficient: δH₁ at it is the target (a real U backward there), and a scan brackets it;
- on the enumerable toy: its interval brackets the exact root of the enumerated δH₁(c), found by scanning c;
- bad --what-if / --solve input: one line, exit code 2.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators.what_if import find_root
from entropy_experiments.probe import recipe
from entropy_experiments.probe.what_if import (
    WhatIfRequest,
    parse_request,
    variant_config,
    what_if_hook,
    what_if_text,
)
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts

VARIANTS = (("objective.entropy_coef", 0.05), ("objective.loss_type", "grpo"),
            ("objective.top_entropy_quantile", 0.5))


@pytest.fixture(scope="module")
def run(tiny_model_dir, tmp_path_factory, one_torch_thread):
    """One probe run with the what-if of VARIANTS and a solve, its E and U, and the set-up."""
    data = write_prompts(tmp_path_factory.mktemp("what_if") / "p.jsonl", SHORT_PROMPTS)
    setup = make_probe(tiny_model_dir, data, {"batch_config": {"B_E": 6, "B_U": 4, "G": 2},
                                              "objective": {"trainer": "trl"},
                                              "importance": {"enabled": False}, "variance": {"u_groups": 4}})
    batches = {}
    request = WhatIfRequest(VARIANTS, "objective.entropy_coef", 0.0)
    out = setup.run(on_batches=lambda E, U: batches.update(E=E, U=U), after_estimates=what_if_hook(request))
    return setup, out.results, (batches["E"], batches["U"])


def separate(setup, config, batches) -> dict:
    return recipe.run(config, policy=setup.policy, batches=batches).results


def test_each_variant_equals_a_separate_run(run):
    setup, results, batches = run
    base = results["what_if_baseline"]
    assert base["deltaH1"] == pytest.approx(results["deltaH1"], rel=1e-10)
    assert base["se_U"] == pytest.approx(results["se"]["U"], rel=1e-8)
    assert base["se_E"] == pytest.approx(results["se"]["E"], rel=1e-5)  # jvp pieces vs the run's own pass
    for entry, (key, value) in zip(results["what_if"], VARIANTS):
        assert (entry["key"], entry["value"]) == (key, value)
        own = separate(setup, variant_config(setup.config, key, value), batches)
        assert entry["deltaH1"] == pytest.approx(own["deltaH1"], rel=1e-10), key
        assert entry["se_U"] == pytest.approx(own["se"]["U"], rel=1e-8), key
        assert entry["se_E"] == pytest.approx(own["se"]["E"], rel=1e-5), key
        assert entry["diff"] == pytest.approx(own["deltaH1"] - results["deltaH1"], rel=1e-8, abs=1e-14)
        assert entry["deltaH1"] != pytest.approx(results["deltaH1"], rel=1e-6), key  # the variant changes v
    assert "What-if" in what_if_text(results) and "paired" in what_if_text(results)


def brute_force_paired_se(setup, results, batches, key, value) -> tuple[float, float]:
    """(SE_E, SE_U) of δH₁(variant) − δH₁(baseline) by deleting each E prompt / U group and recomputing both."""
    E, U = batches
    base_cfg, var_cfg = setup.config, variant_config(setup.config, key, value)
    pol = setup.policy
    groups = [[0], [1], [2], [3]]
    res = recipe.delta_h1_phase(base_cfg, pol, E, U, u_groups=groups, per_sequence_pieces=True)
    lr = res.learning_rate
    g_base = recipe.update_gradients(base_cfg, pol, U, groups)
    g_var = recipe.update_gradients(var_cfg, pol, U, groups)
    from entropy_experiments.estimators.step_directions import probe_step
    from entropy_experiments.estimators.update_direction import leave_one_out_gradients, named_dot

    def loo_values(cfg, grads):
        return [lr * named_dot(res.X_hat, probe_step(cfg.step_options(), pol, g))
                for g in leave_one_out_gradients(grads.groups, grads.group_sizes, grads.leave_one_out_scales)]

    d_u = np.subtract(loo_values(var_cfg, g_var), loo_values(base_cfg, g_base))
    se_u = math.sqrt((len(d_u) - 1) / len(d_u) * np.sum((d_u - d_u.mean()) ** 2))
    # E side: drop each prompt of E and recompute both δH₁ from their pieces along their own v
    v_base = probe_step(base_cfg.step_options(), pol, g_base.total)
    v_var = probe_step(var_cfg.step_options(), pol, g_var.total)
    s = res.scores
    from entropy_experiments.estimators.surrogate import directional_pieces
    pieces = {}
    for name, v in (("base", v_base), ("var", v_var)):
        sc = recipe.score_E(base_cfg, pol, E, v)
        pieces[name] = [x.double().numpy() for x in directional_pieces(sc.d_logq, sc.d_entropy, res.coefficients)]
    h, T = s.seq_entropies.double().numpy(), s.lengths.double().numpy()
    units = np.asarray(s.unit_of_sequence)

    def dh(name, keep):
        a, r = pieces[name][0][keep], pieces[name][1][keep]
        H = h[keep].sum() / T[keep].sum()
        return lr * (a.sum() - H * r.sum()) / T[keep].sum()

    reps = np.array([dh("var", units != u) - dh("base", units != u) for u in np.unique(units)])
    se_e = math.sqrt((len(reps) - 1) / len(reps) * np.sum((reps - reps.mean()) ** 2))
    return se_e, se_u


def test_paired_se_matches_brute_force_jackknife(run):
    setup, results, batches = run
    assert setup.config.estimator.normalize == "per_token"
    for entry, (key, value) in zip(results["what_if"], VARIANTS[:2]):
        se_e, se_u = brute_force_paired_se(setup, results, batches, key, value)
        assert entry["diff_se_E"] == pytest.approx(se_e, rel=1e-6), key
        assert entry["diff_se_U"] == pytest.approx(se_u, rel=1e-8), key
        assert entry["diff_se"] == pytest.approx(math.hypot(se_e, se_u), rel=1e-6)
        # pairing matters: the paired SE is not the unpaired √(SE₀² + SE₁²)
        base = results["what_if_baseline"]
        assert entry["diff_se"] != pytest.approx(math.hypot(base["se"], entry["se"]), rel=1e-3)


def test_solved_entropy_coef_reaches_the_target(run):
    setup, results, batches = run
    solved = results["solve"]
    c = solved["value"]
    assert c is not None and solved["target"] == 0.0
    own = separate(setup, variant_config(setup.config, "objective.entropy_coef", c), batches)
    scale = abs(results["deltaH1"])
    assert abs(own["deltaH1"]) < 1e-4 * scale  # a real run at the solved coefficient: δH₁ ≈ 0 (fp32 gradients)
    assert solved["interpolation_error"] < 1e-4 * scale and solved["deltaH1"] == pytest.approx(own["deltaH1"],
                                                                                            rel=1e-8, abs=1e-14)
    lo, hi = solved["interval"]  # here SE ≫ |δH₁| everywhere: the band never leaves 0, both ends unbounded
    assert (lo is None or lo < c) and (hi is None or hi > c) and solved["level"] == 0.95
    assert solved["se"] > abs(results["deltaH1"]) or lo is not None
    # a scan of real runs brackets the root: δH₁ changes sign between the scan points around c
    below = separate(setup, variant_config(setup.config, "objective.entropy_coef", 0.5 * c), batches)["deltaH1"]
    above = separate(setup, variant_config(setup.config, "objective.entropy_coef", 1.5 * c), batches)["deltaH1"]
    assert below * above < 0


def test_find_root_on_a_monotone_nonlinear_function():
    f = lambda c: math.tanh(3.0 * (c - 0.37)) + 0.1
    root = find_root(f, 0.0, 0.0, 1e-3)
    assert root == pytest.approx(0.37 + math.atanh(-0.1) / 3.0, abs=1e-10)
    assert find_root(lambda c: 1.0 + c * c, 0.0, 0.0, 1e-3) is None


@pytest.mark.parametrize(("specs", "solve", "target", "needle"), [
    (["objective.entropy_coef"], None, None, "--what-if expects objective.<key>=<value>"),
    (["estimator.microbatch_size=4"], None, None, "--what-if estimator.microbatch_size: not an objective key"),
    (["objective.nonsense=1"], None, None, "--what-if objective.nonsense: unknown key 'objective.nonsense' (valid keys: "),
    (["objective.top_entropy_quantile=1.5"], None, None, "--what-if objective.top_entropy_quantile=1.5"),
    (["objective.loss_type=nonsense"], None, None, "--what-if objective.loss_type='nonsense'"),
    ([], "objective.loss_type", None, "--solve objective.loss_type: not a scalar coefficient"),
    ([], "objective.top_entropy_quantile", None, "--solve objective.top_entropy_quantile"),
    ([], None, 0.1, "--solve-target needs --solve"),
])
def test_bad_what_if_input_is_one_config_error(specs, solve, target, needle):
    config = config_from_dict({})
    with pytest.raises(ConfigError) as info:
        parse_request(config, specs, solve, target)
    assert str(info.value).startswith(needle) and "\n" not in str(info.value)


def test_cli_bad_what_if_exits_2(tmp_path, capsys):
    from entropy_experiments.cli import main
    from tests.run_helpers import logging_restored

    cfg = tmp_path / "c.yaml"
    cfg.write_text("seed: 1\n")
    with logging_restored():
        code = main(["run", "--config", str(cfg), "--what-if", "objective.bogus=1", "--out", str(tmp_path / "r")])
    # the log lines before it (the CPU threads chosen) are INFO; the error is one line, no traceback
    err = [line for line in capsys.readouterr().err.strip().splitlines() if " INFO " not in line]
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: --what-if objective.bogus: unknown key 'objective.bogus' (valid keys: trainer, ")
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("key", ["objective.entropy_coeff", "entropy_coef", "objective.loss_typ"])
def test_misspelt_what_if_key_gets_the_did_you_mean_of_set(key):
    """--what-if names a misspelt key in the words --set uses for it (config/messages.py), "did you mean" included."""
    from entropy_experiments.config.loading import load_config

    with pytest.raises(ConfigError) as by_set:
        load_config(None, [f"{key}=0.1"])
    with pytest.raises(ConfigError) as by_what_if:
        parse_request(config_from_dict({}), [f"{key}=0.1"], None, None)
    assert "did you mean 'objective." in str(by_set.value)
    assert str(by_what_if.value) == f"--what-if {key}: {by_set.value}"


@pytest.mark.e2e
def test_cli_what_if_on_reused_samples_matches_a_reanalysis(tiny_model_dir, tmp_path, capsys):
    """`run --reuse-samples A --what-if objective.loss_type=dapo` gives the δH₁ of `run --reuse-samples A` with
    that objective, and prints the table."""
    import json

    import yaml

    from entropy_experiments.cli import main
    from tests.run_helpers import logging_restored, make_run_setup

    light = {"importance": {"enabled": False}, "second_order": {"enabled": False}, "predictors": {"enabled": False},
             "variance": {"u_groups": 2}}
    config_path, config = make_run_setup(tmp_path / "setup", tiny_model_dir, **light)
    source, what, dapo = tmp_path / "source", tmp_path / "what", tmp_path / "dapo"
    config["objective"] = {"loss_type": "dapo"}
    (tmp_path / "dapo.yaml").write_text(yaml.safe_dump(config))
    with logging_restored():
        assert main(["run", "--config", str(config_path), "--out", str(source)]) == 0
        assert main(["run", "--config", str(config_path), "--reuse-samples", str(source), "--out", str(what),
                     "--what-if", "objective.loss_type=dapo", "--what-if", "objective.entropy_coef=0.01"]) == 0
        printed = capsys.readouterr().out
        assert main(["run", "--config", str(tmp_path / "dapo.yaml"), "--reuse-samples", str(source),
                     "--out", str(dapo)]) == 0
        assert main(["report", str(what)]) == 0
        reprinted = capsys.readouterr().out
    got = json.loads((what / "results.json").read_text())
    other = json.loads((dapo / "results.json").read_text())
    assert got["what_if"][0]["deltaH1"] == pytest.approx(other["deltaH1"], rel=1e-10)
    assert got["what_if"][0]["se_U"] == pytest.approx(other["se"]["U"], rel=1e-8)
    assert got["solve"] is None and got["what_if_baseline"]["deltaH1"] == pytest.approx(got["deltaH1"], rel=1e-10)
    assert "What-if (same E and U):" in printed and "objective.loss_type=dapo" in printed
    table = printed[printed.index("What-if (same E and U):"):].splitlines()[:4]
    assert all(line in reprinted for line in table)  # `entropy-probe report` prints the same table from results.json


# ------------------------------------------------------------------ the solve against an exact scan (enumeration)
@pytest.mark.e2e
def test_solved_coefficient_brackets_the_exact_root_on_the_enumerable_model(tmp_path, one_torch_thread):
    """On the 4-token toy (every response enumerable): the exact δH₁(c) = lr·D_{v(c)}H, with v(c) the AdamW step
    of a real U backward of the objective at entropy_coef c and D_vH the central difference of the enumerated
    entropy in float64, is scanned in c until it changes sign and bisected to its root; the interval the probe
    gives for its solved coefficient at its 95 % level brackets that root (seed 3, 8 U groups: solved −0.122 in
    [−0.472, 0.013], exact root −0.126; the width is mostly SE_U with 7 degrees of freedom, which the scan on the
    same U lacks; the coverage over seeds is tests/test_what_if_intervals.py's)."""
    import copy

    from entropy_experiments.estimators.step_directions import probe_step
    from entropy_experiments.testing.tiny_model import build_toy_enumerable_dir
    from tests.test_probe import TOY_PROMPTS, _exact_entropy, _shifted

    max_new = 3
    setup = make_probe(build_toy_enumerable_dir(tmp_path / "toy"), write_prompts(tmp_path / "toy.jsonl", TOY_PROMPTS),
                       {"seed": 3, "batch_config": {"B_E": 3000, "B_U": 8, "G": 4},
                        "generation": {"max_new_tokens": max_new, "gen_batch_size": 1024, "tf_batch_size": 1024},
                        "estimator": {"microbatch_size": 1024}, "importance": {"enabled": False},
                        "variance": {"u_groups": 8}})
    batches = {}
    out = setup.run(on_batches=lambda E, U: batches.update(E=E, U=U),
                    after_estimates=what_if_hook(WhatIfRequest((), "objective.entropy_coef", 0.0)))
    solved, lr = out.results["solve"], out.results["learning_rate"]
    model64 = copy.deepcopy(setup.model).double()
    params = {n: p.detach() for n, p in model64.named_parameters()}
    U = batches["U"]

    def exact(c: float) -> float:
        config = variant_config(setup.config, "objective.entropy_coef", c)
        g = recipe.update_gradients(config, setup.policy, U, [list(range(U.num_prompts))]).total
        v = probe_step(config.step_options(), setup.policy, g)
        H = lambda s: _exact_entropy(model64, _shifted(params, v, s), setup.tokenizer, TOY_PROMPTS, 1.0,
                                     "per_token", max_new)
        return lr * (H(1e-5) - H(-1e-5)) / 2e-5

    f0, scan = exact(0.0), [c * 1e-3 * 2 ** k for k in range(16) for c in (1, -1)]
    c_far = next(c for c in scan if exact(c) * f0 < 0)  # the first scan point past the root
    a, f_a, b = 0.0, f0, c_far
    for _ in range(30):  # bisect the exact δH₁ between 0 and the scan point to its root
        mid = 0.5 * (a + b)
        f_mid = exact(mid)
        a, f_a, b = (mid, f_mid, b) if f_mid * f_a > 0 else (a, f_a, mid)
    root = 0.5 * (a + b)
    lo, hi = solved["interval"]
    print(f"\nsolved {solved['value']:.5g} in [{lo}, {hi}], exact root {root:.5g} (δH₁(0) = {f0:.3g}, "
          f"SE at the root {solved['se']:.2g})")
    assert lo is not None and hi is not None and lo <= root <= hi, (solved, root)
    assert solved["interval_note"] is None and all(end["settled"] for end in solved["ends"])


def test_what_if_passes_are_the_ones_the_user_guide_prices(tiny_model_dir, tmp_path, one_torch_thread, monkeypatch):
    """docs/user-guide.md prices a what-if in passes: one E pass along the run's own direction, then per variant one U
    backward and one E pass, and for --solve three U backwards and one E pass. Counted on the recipe's own passes."""
    data = write_prompts(tmp_path / "p.jsonl", SHORT_PROMPTS)
    setup = make_probe(tiny_model_dir, data, {"batch_config": {"B_E": 4, "B_U": 2, "G": 2},
                                              "importance": {"enabled": False}, "second_order": {"enabled": False}})
    counts = {"U": 0, "E": 0}
    u_pass, e_pass = recipe.update_gradients, recipe.score_E

    def counted(kind, fn):
        def call(*args, **kwargs):
            counts[kind] += 1
            return fn(*args, **kwargs)
        return call

    def what_if_counted(*args):
        monkeypatch.setattr(recipe, "update_gradients", counted("U", u_pass))
        monkeypatch.setattr(recipe, "score_E", counted("E", e_pass))
        return hook(*args)

    hook = what_if_hook(WhatIfRequest(VARIANTS[:2], "objective.entropy_coef", 0.0))
    results = setup.run(after_estimates=what_if_counted).results
    assert results["solve"]["value"] is not None  # the solve found its root, so it checked it with one E pass
    assert counts == {"U": 2 + 3, "E": 1 + 2 + 1}

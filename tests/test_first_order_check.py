"""ΔH that can see first order, on the enumerable toy model against its exact entropy (float64 enumeration).

- the finite-difference second order's ±η passes are rows of results.json `true`: ΔH(±η) equals the exact change
  H(θ ± η·v) − H(θ) within 4 of its SEs, and the symmetric slope carries its paired residual against X̂·v;
- the rounding floor F estimated from those passes (estimators/rounding_floor.py): a ΔH forced under 5 F (η = 1e−9)
  is warned, the ±η rows are not;
- the second order's window diagnostics η·SD(s_i) and ESS/N against the same quantities computed here from the
  per-sequence log-weights of results.json's per_sequence rows;
- importance.eta_over_lr: η = k·lr; an old config's hash does not change with the key at its default.
"""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest

from entropy_experiments.config import config_from_dict
from entropy_experiments.errors import ConfigError
from entropy_experiments.estimators.rounding_floor import floor_passes
from entropy_experiments.probe import recipe
from tests.probe_helpers import make_probe
from tests.test_probe import TOY_PROMPTS, _exact_entropy, _shifted, toy_dir, toy_prompts_file  # noqa: F401

MAX_NEW = 3
TINY_ETA = 1e-9


@pytest.fixture(scope="module")
def toy_run(toy_dir, toy_prompts_file):  # noqa: F811
    probe = make_probe(toy_dir, toy_prompts_file, {
        "seed": 5, "batch_config": {"B_E": 512, "B_U": 8, "G": 4},
        "generation": {"max_new_tokens": MAX_NEW, "gen_batch_size": 512, "tf_batch_size": 512},
        "estimator": {"microbatch_size": 512}, "predictors": {"enabled": False},
        "importance": {"eta_list": [1e-5, TINY_ETA], "symmetric": False}, "output": {"token_attribution": False}})
    outcome = probe.run()
    model64 = copy.deepcopy(probe.model).double()
    params = {n: p.detach() for n, p in model64.named_parameters()}

    def exact(s: float) -> float:
        return _exact_entropy(model64, _shifted(params, outcome.update_vector, s), probe.tokenizer, TOY_PROMPTS, 1.0,
                              "per_token", MAX_NEW)
    return probe, outcome, exact


@pytest.mark.e2e
def test_second_order_passes_are_true_rows_equal_to_the_exact_change(toy_run):
    probe, outcome, exact = toy_run
    results = outcome.results
    eta = probe.config.second_order.eta_list[0]
    rows = {r["eta"]: r for r in results["true"]}
    assert {eta, -eta} <= set(rows), sorted(rows)
    H0 = exact(0.0)
    for e in (eta, -eta):
        row, change = rows[e], exact(e) - H0
        print(f"\nΔH({e:+g}) = {row['deltaH_true']:+.4e} ± {row['se']:.2e}, exact {change:+.4e}, "
              f"residual z {row['residual']['z']:+.2f}")
        assert abs(row["deltaH_true"] - change) < 4 * row["se"], (row, change)
        assert row["se"] < 0.5 * abs(change), "the test must be sharp enough to mean something"
        assert np.isfinite(row["residual"]["z"])
    slope = next(s for s in results["linearity"]["symmetric_slopes"] if s["eta"] == eta)
    exact_slope = (exact(eta) - exact(-eta)) / (2 * eta)
    residual = slope["residual"]
    # D_v H from the pieces is X̂·v to the consistency check's 1e-4 (docs/maths.md §6)
    assert residual["value"] == pytest.approx(slope["slope"] - results["x_hat_dot_v"],
                                              abs=1e-4 * abs(results["x_hat_dot_v"]))
    assert abs(slope["slope"] - exact_slope) < 4 * residual["se"], (slope, exact_slope)
    # ΔH(±η) − (±η·X̂·v + ½η²·d2) = ±η·(slope − X̂·v): the second-order residual is the slope's
    d2 = results["second_order"]["d2"]
    for e in (eta, -eta):
        assert rows[e]["deltaH_true"] - e * results["x_hat_dot_v"] - 0.5 * e ** 2 * d2 == pytest.approx(
            e * (slope["slope"] - results["x_hat_dot_v"]), rel=1e-6, abs=1e-12)


@pytest.mark.e2e
def test_rounding_floor_warns_where_delta_h_is_forced_under_it(toy_run):
    probe, outcome, _ = toy_run
    results = outcome.results
    floor = results["rounding_floor"]
    eta = probe.config.second_order.eta_list[0]
    assert (floor["eta"], floor["pair_eta"]) == (1e-5, eta)
    rows = {r["eta"]: r for r in results["true"]}
    print(f"\nF = {floor['value']:.2e}; |ΔH(1e-9)| = {abs(rows[TINY_ETA]['deltaH_true']):.2e}, "
          f"|ΔH(1e-5)| = {abs(rows[1e-5]['deltaH_true']):.2e}, |ΔH(1e-3)| = {abs(rows[eta]['deltaH_true']):.2e}")
    assert 0 < floor["value"] < 1e-3 * abs(rows[eta]["deltaH_true"])
    warned = [w for w in results["warnings"] if "rounding floor" in w]
    assert any(f"ΔH(η={TINY_ETA:g})" in w for w in warned), results["warnings"]
    assert not any(f"ΔH(η={e:g})" in w for w in warned for e in (eta, -eta)), warned


@pytest.mark.e2e
def test_window_diagnostics_of_the_reported_pair(toy_run):
    _, outcome, _ = toy_run
    so = outcome.results["second_order"]
    eta = so["eta"]
    row = so["per_eta"][-1]
    logw = {e: np.array([r["logw"][f"{e:g}"] for r in outcome.per_sequence_rows]) for e in (eta, -eta)}
    spread = np.std((logw[eta] - logw[-eta]) / 2)
    assert row["eta_sd_s"] == pytest.approx(spread, rel=1e-9)
    for sign, key in ((1, "ess_frac_plus"), (-1, "ess_frac_minus")):
        w = np.exp(logw[sign * eta] - logw[sign * eta].max())
        assert row[key] == pytest.approx(w.sum() ** 2 / (w ** 2).sum() / w.size, rel=1e-9)
    assert so["bias_estimate"] is None and "bias_bound" not in so  # one η: nothing to compare
    assert (so.get("window_warning") is None) == (row["eta_sd_s"] <= 0.5 and min(row["ess_frac_plus"],
                                                                                 row["ess_frac_minus"]) >= 0.75)


def test_floor_passes():
    assert floor_passes([1e-5, -1e-3, 1e-3]) == (1e-5, 1e-3)
    assert floor_passes([1e-5, 1e-9, -1e-3, 1e-3]) == (1e-5, 1e-3)  # the largest small η
    assert floor_passes([-1e-3, 1e-3]) is None and floor_passes([1e-5, 2e-4, -2e-4]) == (1e-5, 2e-4)
    assert floor_passes([5e-4, 1e-3, -1e-3]) is None


def test_eta_over_lr_and_the_config_hash():
    base = {"checkpoint": {"base_model": "unused"}}
    plain = config_from_dict(base)
    assert plain.config_hash() == config_from_dict({**base, "importance": {"eta_over_lr": None}}).config_hash()
    relative = config_from_dict({**base, "importance": {"eta_over_lr": [1.0, 0.1]}})
    assert relative.config_hash() != plain.config_hash()
    policy = types.SimpleNamespace(optimizer=types.SimpleNamespace(param_groups=[{"lr": 2e-4, "params": [0]}]))
    assert recipe.with_absolute_etas(relative, policy).importance.eta_list == pytest.approx([2e-4, 2e-5])
    assert recipe.with_absolute_etas(plain, policy) is plain
    for bad, message in (([0.0], "eta_over_lr: η must be non-zero"), ([float("inf")], r"eta_over_lr\[0\]: must be a finite")):
        with pytest.raises(ConfigError, match=message):
            config_from_dict({**base, "importance": {"eta_over_lr": bad}})

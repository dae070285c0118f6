"""The sweep's statistics against references that share no code with them: the jackknife of Ĥ and of a paired
difference against written-out delete-one loops, Pearson / Spearman / average ranks against scipy, the bootstrap
intervals and every calibration metric against the plain-Python implementation in tests/sweep_reference.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from entropy_experiments.sweep.calibration import calibration
from entropy_experiments.sweep.stats import (
    bootstrap_ci,
    entropy_with_se,
    paired_difference,
    pearson,
    rank_average,
    spearman,
)
from tests.sweep_reference import assert_close, jackknife, ref_bootstrap, ref_calibration, ref_pearson


def test_calibration_on_many_rows_matches_an_independent_implementation():
    """n = 12 synthetic checkpoints (a sweep of two probed checkpoints leaves r undefined): every metric,
    the bootstrap intervals included, against the implementation above."""
    rng = np.random.default_rng(5)
    truth = rng.normal(0, 1e-2, 12)
    rows, realised = [], []
    for i, t in enumerate(truth):
        preds = {"adamw_step": {"delta_h1": float(t + rng.normal(0, 3e-3)), "z_own": float(rng.normal())},
                 "sgd_same_norm": {"delta_h1": float(round(t * 300) / 300), "z_own": None},
                 "displacement": {"delta_h1": float(t + rng.normal(0, 2e-3)), "z_own": None}}
        rows.append({"predictors": preds, "deltaH_true": {"scaled": float(t), "se_scaled": 4e-3 if i % 3 else None}})
        realised.append({"dH_realised": float(t + rng.normal(0, 5e-3)), "se": float(rng.uniform(1e-3, 8e-3)),
                         "predictors": {k: {"dH_predicted": v["delta_h1"], "z": float(rng.normal(0, 1.5))}
                                        for k, v in preds.items()}})
    doc = {"rows": rows, "realised": realised}
    mine = calibration(rows, realised)
    assert_close(mine, ref_calibration(doc))
    assert next(iter(mine)) == "displacement"
    assert 0 < mine["displacement"]["realised"]["n_resolved"] < 12
    assert 0.5 < mine["adamw_step"]["own"]["pearson"]["r"] < 1.0
    lo, hi = mine["adamw_step"]["own"]["pearson"]["ci95"]
    assert lo < mine["adamw_step"]["own"]["pearson"]["r"] < hi


def test_correlations_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(1)
    x = rng.normal(size=40)
    y = 0.5 * x + rng.normal(size=40)
    ties = np.round(x * 2) / 2  # many ties
    assert pearson(x, y) == pytest.approx(stats.pearsonr(x, y)[0], rel=1e-12)
    assert spearman(ties, y) == pytest.approx(stats.spearmanr(ties, y)[0], rel=1e-12)
    assert np.array_equal(rank_average(ties), stats.rankdata(ties))
    assert math.isnan(pearson([1.0, 2.0], [3.0, 1.0])) and math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    lo, hi = bootstrap_ci(x, y, pearson)
    ref = ref_bootstrap(list(x), list(y), lambda a, b: ref_pearson(a, b))
    assert (lo, hi) == pytest.approx(tuple(ref), rel=1e-12)


def test_entropy_and_paired_difference_against_written_outjackknife():
    rng = np.random.default_rng(2)
    n = 30
    units_a = [f"{i}:{i % 7}" for i in range(n)]
    units_b = [f"{i}:{i % 7}" for i in range(3, n + 3)]  # 27 paired units, 3 on each side alone
    h_a, T_a = rng.uniform(0, 3, n), rng.integers(1, 6, n).astype(float)
    h_b, T_b = h_a + rng.normal(0, 0.1, n), T_a.copy()
    est = entropy_with_se(h_a, T_a, units_a)
    assert est.value == pytest.approx(h_a.sum() / T_a.sum())
    assert est.se == pytest.approx(jackknife([(h_a.sum() - h_a[i]) / (T_a.sum() - T_a[i]) for i in range(n)]))
    diff = paired_difference(h_a, T_a, units_a, h_b, T_b, units_b)
    a = {u: (h, t) for u, h, t in zip(units_a, h_a, T_a)}
    b = {u: (h, t) for u, h, t in zip(units_b, h_b, T_b)}
    universe = sorted(set(a) | set(b))

    def stat(keep):
        ha, ta = sum(a[u][0] for u in keep if u in a), sum(a[u][1] for u in keep if u in a)
        hb, tb = sum(b[u][0] for u in keep if u in b), sum(b[u][1] for u in keep if u in b)
        return hb / tb - ha / ta

    assert diff.value == pytest.approx(stat(universe))
    assert diff.se == pytest.approx(jackknife([stat([u for u in universe if u != d]) for d in universe]))
    assert (diff.n_paired, diff.n_from_only, diff.n_to_only) == (27, 3, 3)
    # fully paired, the SE of the difference is far below the two SEs in quadrature (the correlation counts)
    both = paired_difference(h_a, T_a, units_a, h_b, T_b, units_a)
    se_b = entropy_with_se(h_b, T_b, units_a).se
    assert both.n_paired == n and both.se < 0.2 * math.hypot(est.se, se_b)

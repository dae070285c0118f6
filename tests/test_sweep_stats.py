"""The sweep's statistics against references that share no code with them: the jackknife of Ĥ and of a paired
difference against written-out delete-one loops, Pearson / Spearman / average ranks against scipy, the bootstrap
intervals and every calibration metric against the plain-Python implementation in tests/sweep_reference.py."""

from __future__ import annotations

import math

import numpy as np
import pytest

from entropy_experiments.estimators.jackknife import entropy_with_se
from entropy_experiments.sweep.calibration import calibration
from entropy_experiments.sweep.rows import interval_prediction
from entropy_experiments.sweep.stats import (
    bootstrap_ci,
    fitted_scale,
    loo_scale_z,
    paired_difference,
    pearson,
    rank_average,
    rms,
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
                 "displacement": {"delta_h1": float(t + rng.normal(0, 2e-3)), "z_own": None},
                 "cui_npg": {"delta_h1": float(40 * t + rng.normal(0, 0.1)), "z_own": None}}  # scale-free
        rows.append({"predictors": preds, "lr": 1e-3 * (1 + i % 4),
                     "deltaH_true": {"scaled": float(t), "se_scaled": 4e-3 if i % 3 else None}})
        realised.append({"dH_realised": float(t + rng.normal(0, 5e-3)), "se": float(rng.uniform(1e-3, 8e-3)),
                         "predictors": {k: {"dH_predicted": v["delta_h1"],
                                            "z": None if k == "cui_npg" else float(rng.normal(0, 1.5))}
                                        for k, v in preds.items()}})
    doc = {"rows": rows, "realised": realised}
    mine = calibration(rows, realised)
    assert_close(mine, ref_calibration(doc, scale_free={"cui_npg"}))
    loo = mine["cui_npg"]["realised"]["loo_scale"]
    assert mine["cui_npg"]["realised"]["coverage"]["n"] == 0 and loo["n"] == 12  # no z of its own; 12 LOO z
    assert 0 < loo["scale"] < 0.05 and loo["rms_z"] > 0
    assert "loo_scale" not in mine["adamw_step"]["own"] and mine["adamw_step"]["own"]["rms_z"] > 0
    assert next(iter(mine)) == "displacement"
    assert 0 < mine["displacement"]["realised"]["n_resolved"] < 12
    assert 0.5 < mine["adamw_step"]["own"]["pearson"]["r"] < 1.0
    lo, hi = mine["adamw_step"]["own"]["pearson"]["ci95"]
    assert lo < mine["adamw_step"]["own"]["pearson"]["r"] < hi


def test_loo_scale_against_a_brute_force_loop():
    """The scale fitted without each pair (closed form of min Σ (y − c·x)²/se²) is checked
    against numpy's lstsq on the weighted rows, refitted in a loop; pairs without a usable SE give NaN."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=9)
    y = 0.02 * x + rng.normal(0, 5e-3, size=9)
    se = rng.uniform(2e-3, 6e-3, size=9)
    se[4] = np.nan
    z = loo_scale_z(x, y, se)
    for i in range(9):
        keep = [j for j in range(9) if j != i and np.isfinite(se[j])]
        c = np.linalg.lstsq((x[keep] / se[keep])[:, None], y[keep] / se[keep], rcond=None)[0][0]
        if i == 4:
            assert math.isnan(z[i])
        else:
            assert z[i] == pytest.approx((c * x[i] - y[i]) / se[i], rel=1e-10)
    ok = np.isfinite(se)
    c_all = np.linalg.lstsq((x[ok] / se[ok])[:, None], y[ok] / se[ok], rcond=None)[0][0]
    assert fitted_scale(x, y, se) == pytest.approx(c_all, rel=1e-12)
    assert rms([3.0, 4.0, float("nan")]) == pytest.approx(math.sqrt(12.5))


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


def test_interval_residuals_and_u_noise_against_written_out_jackknives():
    """Synthetic batches (some draws in one batch only, one unit of two sequences): the second-order residual's SE
    against a delete-one loop over the union of units with the SNIS second derivative written out, and the U-noise
    variance over K = 3 steps with a trainer batch half the probe's U."""
    from entropy_experiments.estimators.displacement import (
        BatchColumns,
        DisplacementPieces,
        interval_residuals,
        u_noise,
    )
    from entropy_experiments.estimators.realised_change import paired_change_replicates

    rng = np.random.default_rng(3)
    n = 30
    keys_f = [f"{i}:p" for i in range(n)]
    keys_f[1] = keys_f[0]  # one unit of two sequences
    keys_t = [f"{i}:p" for i in range(2, n + 3)]
    T_f, T_t = rng.integers(1, 9, n).astype(float), rng.integers(1, 9, n + 1).astype(float)
    h_f, h_t = T_f * rng.uniform(0.5, 1.5, n), T_t * rng.uniform(0.5, 1.5, n + 1)
    a, r, s, s2, dh, d2h = (rng.normal(size=n) for _ in range(6))
    a_v, r_v = rng.normal(size=n), rng.normal(size=n)
    frm = BatchColumns(h_f, T_f, keys_f)
    pieces = DisplacementPieces(a, r, (s, s2, dh, d2h), a_v, r_v)
    out = interval_residuals(frm, pieces, paired_change_replicates(h_f, T_f, keys_f, h_t, T_t, keys_t), "per_token")

    def stat(drop=None):
        f = [i for i in range(n) if keys_f[i] != drop]
        t = [i for i in range(n + 1) if keys_t[i] != drop]
        hf, df, ht, dt = h_f[f].sum(), T_f[f].sum(), h_t[t].sum(), T_t[t].sum()
        H = hf / df
        first = ht / dt - H - (a[f].sum() - H * r[f].sum()) / df
        N1, D1 = (s * h_f + dh)[f].sum(), (s * T_f)[f].sum()
        N2 = ((s2 + s ** 2) * h_f + 2 * s * dh + d2h)[f].sum()
        D2 = ((s2 + s ** 2) * T_f)[f].sum()
        d2 = (N2 * df - hf * D2) / df ** 2 - 2 * D1 * (N1 * df - hf * D1) / df ** 3
        return first, first - 0.5 * d2

    units = sorted(set(keys_f) | set(keys_t))
    assert out["first_order"].value == pytest.approx(stat()[0], rel=1e-12)
    assert out["second_order"].value == pytest.approx(stat()[1], rel=1e-12)
    assert out["first_order"].se == pytest.approx(jackknife([stat(u)[0] for u in units]), rel=1e-10)
    assert out["second_order"].se == pytest.approx(jackknife([stat(u)[1] for u in units]), rel=1e-10)

    lr, steps, se_U = 0.01, 3, 0.002
    noise = u_noise(frm, pieces, step_lr=lr, steps=steps, se_U=se_U, u_batch_ratio=2.0)
    A, B = steps * lr * a_v - a, steps * lr * r_v - r

    def diff(drop=None):
        f = [i for i in range(n) if keys_f[i] != drop]
        H = h_f[f].sum() / T_f[f].sum()
        return (A[f].sum() - H * B[f].sum()) / T_f[f].sum()

    se_E = jackknife([diff(u) for u in sorted(set(keys_f))])
    assert noise["value"] == pytest.approx(diff(), rel=1e-12) and noise["se_E"] == pytest.approx(se_E, rel=1e-10)
    assert noise["se"] == pytest.approx(math.sqrt((9 + 3 * 2.0) * se_U ** 2 + se_E ** 2), rel=1e-12)
    assert noise["z"] == pytest.approx(noise["value"] / noise["se"])


def test_independent_residuals_against_written_out_jackknives():
    """The fallback residual Ĥ(to) − [Ĥ(from) + δH_Δθ + ½·D²]: the bracket's SE a delete-one loop over E_N's
    units, Ĥ(to)'s over E_{N'}'s, added in quadrature (the batches taken as independent)."""
    from entropy_experiments.estimators.displacement import (
        BatchColumns,
        DisplacementPieces,
        independent_residuals,
    )

    rng = np.random.default_rng(5)
    n = 25
    keys_f, keys_t = [f"{i // 2}:p" for i in range(n)], [f"{i}:q" for i in range(n + 4)]
    T_f, T_t = rng.integers(1, 9, n).astype(float), rng.integers(1, 9, n + 4).astype(float)
    h_f, h_t = T_f * rng.uniform(0.5, 1.5, n), T_t * rng.uniform(0.5, 1.5, n + 4)
    a, r, s, s2, dh, d2h = (rng.normal(size=n) for _ in range(6))
    out = independent_residuals(BatchColumns(h_f, T_f, keys_f), DisplacementPieces(a, r, (s, s2, dh, d2h)),
                                BatchColumns(h_t, T_t, keys_t), "per_token")

    def bracket(drop=None):
        f = [i for i in range(n) if keys_f[i] != drop]
        hf, df = h_f[f].sum(), T_f[f].sum()
        H = hf / df
        first = (a[f].sum() - H * r[f].sum()) / df
        N1, D1 = (s * h_f + dh)[f].sum(), (s * T_f)[f].sum()
        N2, D2 = ((s2 + s ** 2) * h_f + 2 * s * dh + d2h)[f].sum(), ((s2 + s ** 2) * T_f)[f].sum()
        d2 = (N2 * df - hf * D2) / df ** 2 - 2 * D1 * (N1 * df - hf * D1) / df ** 3
        return H + first, H + first + 0.5 * d2

    def h_to(drop=None):
        t = [i for i in range(n + 4) if keys_t[i] != drop]
        return h_t[t].sum() / T_t[t].sum()

    se_to = jackknife([h_to(u) for u in sorted(set(keys_t))])
    for j, key in enumerate(("first_order", "second_order")):
        se_from = jackknife([bracket(u)[j] for u in sorted(set(keys_f))])
        assert out[key].value == pytest.approx(h_to() - bracket()[j], rel=1e-12)
        assert out[key].se == pytest.approx(math.hypot(se_to, se_from), rel=1e-10)



def test_a_proxy_scale_is_the_same_under_a_constant_and_a_decaying_lr():
    """A synthetic sweep whose entropy changes are c·lr·proxy exactly (one interval spans two steps at the `from`
    lr): with the lr multiplied in before the fit, the proxy's scale is c under a constant lr and under a
    linear decay alike, and the correlation is exact; without it the decaying schedule would need another c."""
    rng = np.random.default_rng(11)
    proxy, c, n = rng.normal(0, 1, 10), 3.0, 10
    scales = {}
    for schedule, lrs in (("constant", [1e-2] * n), ("linear", [1e-2 * (1 - i / n) for i in range(n)])):
        rows = [{"step": i, "lr": lr, "se_U": None,
                 "predictors": {"cui_npg": {"delta_h1": float(x), "se": None, "z_own": None}},
                 "deltaH_true": {"scaled": c * lr * float(x), "se_scaled": 1e-4}} for i, (x, lr) in
                enumerate(zip(proxy, lrs))]
        realised = []
        for a, steps in zip(rows, [1] * (n - 1) + [2]):
            want = c * steps * a["lr"] * a["predictors"]["cui_npg"]["delta_h1"]
            realised.append({"dH_realised": want, "se": 1e-4, "predictors": interval_prediction(a, steps)})
        cal = calibration(rows, realised)["cui_npg"]
        for vs in ("own", "realised"):
            scales[schedule, vs] = cal[vs]["loo_scale"]["scale"]
            assert cal[vs]["pearson"]["r"] == pytest.approx(1.0, abs=1e-12)
            assert cal[vs]["loo_scale"]["coverage"] == 1.0 and cal[vs]["predicted_as"].startswith(("lr", "Σ lr"))
    for key, scale in scales.items():
        assert scale == pytest.approx(c, rel=1e-9), key

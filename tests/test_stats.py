"""Statistics cores against direct numpy, brute-force loops and known distributions."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats as sps

from entropy_experiments.estimators.jackknife import (
    Estimate,
    delta_h1_per_sequence,
    delta_h1_per_token,
    delta_h1_slope,
    jackknife_estimate,
    jackknife_ratio_se,
    jackknife_replicates,
    jackknife_se,
    sum_by_unit,
)
from entropy_experiments.estimators.snis import (
    ess,
    importance_diagnostics,
    khat_threshold,
    linearity_fit,
    logw_summary,
    psis_khat,
    snis_delta_h,
    snis_entropy,
    zero_weight_count,
)


def _batch(n: int = 40, seed: int = 0):
    rng = np.random.default_rng(seed)
    T = rng.integers(3, 30, size=n).astype(float)
    h = T * rng.uniform(0.5, 2.0, size=n)
    h_new = h + rng.normal(0, 0.1, size=n)
    logw = rng.normal(0, 0.3, size=n)
    return logw, h_new, h, T


# ------------------------------------------------------------------------- SNIS and weights


def test_snis_with_zero_logw_is_plain_ratio():
    _, h_new, _, T = _batch()
    zeros = np.zeros_like(T)
    assert snis_entropy(zeros, h_new, T, normalize="per_token") == pytest.approx(
        h_new.sum() / T.sum(), rel=1e-14
    )
    assert snis_entropy(zeros, h_new, T, normalize="per_sequence") == pytest.approx(h_new.mean(), rel=1e-14)


def test_snis_matches_direct_numpy_and_is_shift_invariant():
    logw, h_new, _, T = _batch(seed=1)
    w = np.exp(logw)
    assert snis_entropy(logw, h_new, T, normalize="per_token") == pytest.approx(
        (w @ h_new) / (w @ T), rel=1e-13
    )
    assert snis_entropy(logw, h_new, T, normalize="per_sequence") == pytest.approx(
        (w @ h_new) / w.sum(), rel=1e-13
    )
    # exp(logw) would overflow here; the max-shift keeps it exact.
    shifted = snis_entropy(logw + 1000.0, h_new, T, normalize="per_token")
    assert shifted == pytest.approx((w @ h_new) / (w @ T), rel=1e-12)
    # torch tensors are accepted too
    assert snis_entropy(torch.tensor(logw), torch.tensor(h_new), torch.tensor(T), normalize="per_token") == (
        pytest.approx(shifted, rel=1e-12)
    )


def test_minus_inf_weights_drop_out_and_nan_is_refused():
    logw, h_new, _, T = _batch(seed=2)
    logw[[3, 7]] = -np.inf
    keep = np.isfinite(logw)
    w = np.exp(logw[keep])
    assert snis_entropy(logw, h_new, T, normalize="per_token") == pytest.approx(
        (w @ h_new[keep]) / (w @ T[keep]), rel=1e-13
    )
    assert zero_weight_count(logw) == 2
    summary = logw_summary(logw)
    assert summary == {"min": logw[keep].min(), "median": np.median(logw[keep]), "max": logw[keep].max()}
    all_zero = np.full(5, -np.inf)
    assert math.isnan(snis_entropy(all_zero, h_new[:5], T[:5], normalize="per_token"))
    assert ess(all_zero) == 0.0
    with pytest.raises(ValueError, match="entry 1"):
        snis_entropy([0.0, np.nan], [1.0, 1.0], [1.0, 1.0], normalize="per_token")
    with pytest.raises(ValueError, match="normalize"):
        snis_entropy([0.0], [1.0], [1.0], normalize="per_tok")


def test_ess_bounds_and_extremes():
    rng = np.random.default_rng(3)
    for _ in range(5):
        logw = rng.normal(0, 2.0, size=50)
        w = np.exp(logw)
        e = ess(logw)
        assert 1.0 <= e <= 50.0
        assert e == pytest.approx(w.sum() ** 2 / (w @ w), rel=1e-12)
    assert ess(np.zeros(50)) == pytest.approx(50.0)
    assert ess(np.r_[0.0, np.full(49, -200.0)]) == pytest.approx(1.0, abs=1e-12)


@pytest.mark.parametrize("k_true", [0.3, 0.6, 0.9])
def test_psis_khat_recovers_pareto_tail_shape(k_true):
    """Weights from a generalized Pareto with shape k: k̂ estimates k (M = 3√N ≈ 949 tail draws)."""
    w = sps.genpareto.rvs(c=k_true, size=100_000, random_state=np.random.default_rng(int(k_true * 10)))
    assert psis_khat(np.log(w)) == pytest.approx(k_true, abs=0.12)


def test_psis_khat_light_tail_and_undefined_cases():
    # Log-normal weights with a small σ have a light tail: k̂ well below 0.5.
    lw = np.random.default_rng(4).normal(0, 0.1, size=2000)
    assert psis_khat(lw) < 0.3
    # Invariant to a constant shift of the log-weights (self-normalisation).
    assert psis_khat(lw + 50.0) == pytest.approx(psis_khat(lw), abs=1e-9)
    assert math.isnan(psis_khat(np.zeros(100)))  # η = 0: every weight equal
    assert math.isnan(psis_khat(np.zeros(10)))  # too few draws for a tail fit
    mostly_zero = np.full(100, -np.inf)
    mostly_zero[:10] = lw[:10]
    assert math.isnan(psis_khat(mostly_zero))  # zero weights inside the fitted tail
    some_zero = lw[:100].copy()
    some_zero[:10] = -np.inf
    assert math.isfinite(psis_khat(some_zero))


def test_khat_threshold():
    assert khat_threshold(100) == pytest.approx(0.5)
    assert khat_threshold(10**6) == 0.7
    assert math.isnan(khat_threshold(1))


def test_importance_diagnostics_keys():
    logw, *_ = _batch(n=200, seed=5)
    logw[0] = -np.inf
    d = importance_diagnostics(logw)
    assert set(d) == {"ess", "ess_frac", "zero_weight_count", "psis_khat", "khat_threshold", "logw"}
    assert d["ess_frac"] == pytest.approx(d["ess"] / 200)
    assert d["zero_weight_count"] == 1
    assert math.isfinite(d["psis_khat"])


# ------------------------------------------------------------------------- jackknife


def test_jackknife_se_of_mean_is_std_over_sqrt_n():
    x = np.random.default_rng(6).normal(size=37)
    n = x.size
    replicates = np.array([np.delete(x, i).mean() for i in range(n)])
    expected = x.std(ddof=1) / math.sqrt(n)
    assert jackknife_se(replicates) == pytest.approx(expected, rel=1e-12)
    assert delta_h1_per_sequence(x).se == pytest.approx(expected, rel=1e-12)
    assert delta_h1_per_sequence(x).value == pytest.approx(x.mean(), rel=1e-14)
    assert math.isnan(jackknife_se([1.0]))


def _brute_force_se(columns, stat):
    """Recompute the statistic n times from the raw per-unit data with unit i deleted."""
    n = len(columns[0])
    reps = np.array([stat(*[np.delete(c, i) for c in columns]) for i in range(n)])
    return math.sqrt((n - 1) / n * np.sum((reps - reps.mean()) ** 2))


def test_jackknife_estimate_vs_brute_force_ratio():
    rng = np.random.default_rng(7)
    num, den = rng.normal(1, 0.5, size=25), rng.uniform(1, 3, size=25)
    expected = _brute_force_se([num, den], lambda a, b: a.sum() / b.sum())
    assert jackknife_ratio_se(num, den) == pytest.approx(expected, rel=1e-10)
    # The general form with an arbitrary function of the column sums.

    def fn(s):
        return float(np.log(s[0] ** 2 + 1.0) / s[1])

    stats = np.stack([num, den], axis=1)
    assert jackknife_estimate(stats, fn).se == pytest.approx(
        _brute_force_se([num, den], lambda a, b: np.log(a.sum() ** 2 + 1.0) / b.sum()), rel=1e-10
    )
    assert jackknife_replicates(stats, fn).shape == (25,)


def test_delta_h1_per_token_value_and_se_vs_brute_force():
    rng = np.random.default_rng(8)
    n = 30
    T = rng.integers(2, 40, size=n).astype(float)
    h = T * rng.uniform(0.3, 1.5, size=n)
    a, r = rng.normal(0, 3, size=n), rng.normal(0, 10, size=n)

    def stat(a, r, h, T):  # Ĥ is recomputed from the kept sequences
        return (a.sum() - h.sum() / T.sum() * r.sum()) / T.sum()

    est = delta_h1_per_token(a, r, h, T)
    assert isinstance(est, Estimate)
    assert est.value == pytest.approx(stat(a, r, h, T), rel=1e-13)
    assert est.se == pytest.approx(_brute_force_se([a, r, h, T], stat), rel=1e-10)
    assert delta_h1_slope(a, r, h, T, normalize="per_token") == est
    assert delta_h1_slope(a, r, h, T, normalize="per_sequence") == delta_h1_per_sequence(a)


def test_units_group_sequences():
    """With G > 1 the unit is the prompt: grouping = summing its sequences' rows first."""
    rng = np.random.default_rng(9)
    n_prompts, g = 12, 3
    units = np.repeat(np.arange(n_prompts), g)
    T = rng.integers(2, 20, size=n_prompts * g).astype(float)
    h = T * rng.uniform(0.5, 1.0, size=T.size)
    a, r = rng.normal(size=T.size), rng.normal(size=T.size)
    pre = [x.reshape(n_prompts, g).sum(axis=1) for x in (a, r, h, T)]
    grouped = delta_h1_per_token(a, r, h, T, units=units)
    assert grouped.value == pytest.approx(delta_h1_per_token(*pre).value, rel=1e-13)
    assert grouped.se == pytest.approx(delta_h1_per_token(*pre).se, rel=1e-12)
    # per_sequence keeps the per-SEQUENCE mean when grouped
    assert delta_h1_per_sequence(a, units=units).value == pytest.approx(a.mean(), rel=1e-13)
    # units in shuffled order give the same answer
    perm = rng.permutation(T.size)
    shuffled = delta_h1_per_token(a[perm], r[perm], h[perm], T[perm], units=units[perm])
    assert shuffled.se == pytest.approx(grouped.se, rel=1e-12)
    assert sum_by_unit([a], units).shape == (n_prompts, 1)


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_snis_delta_h_value_and_se_vs_brute_force(normalize):
    logw, h_new, h, T = _batch(n=35, seed=10)
    logw[4] = -np.inf

    def stat(lw, hn, hh, t):
        w = np.exp(lw)
        d = t if normalize == "per_token" else np.ones_like(t)
        return (w @ hn) / (w @ d) - hh.sum() / d.sum()

    est = snis_delta_h(logw, h_new, h, T, normalize=normalize)
    assert est.value == pytest.approx(stat(logw, h_new, h, T), rel=1e-12)
    assert est.value == pytest.approx(
        snis_entropy(logw, h_new, T, normalize=normalize)
        - (h.sum() / T.sum() if normalize == "per_token" else h.mean()),
        rel=1e-12,
    )
    assert est.se == pytest.approx(_brute_force_se([logw, h_new, h, T], stat), rel=1e-9)


# ------------------------------------------------------------------------- linearity


def test_linearity_fit_exact_linear():
    etas = [-1e-3, -1e-4, 0.0, 1e-4, 1e-3, 1e-2]
    fit = linearity_fit(etas, [-2.5 * e for e in etas])
    assert fit["slope_through_origin"] == pytest.approx(-2.5, rel=1e-12)
    assert fit["loglog_slope"] == pytest.approx(1.0, rel=1e-10)
    assert fit["symmetric_slopes"] == [
        {"eta": 1e-4, "slope": pytest.approx(-2.5, rel=1e-10)},
        {"eta": 1e-3, "slope": pytest.approx(-2.5, rel=1e-10)},
    ]


def test_linearity_fit_quadratic():
    etas = np.array([-1e-2, -1e-3, 1e-3, 1e-2])
    c, d = 3.0, 50.0
    fit = linearity_fit(etas, c * etas + d * etas**2)
    # Symmetric slopes cancel the curvature exactly; with ±η pairs so does the through-origin fit.
    for item in fit["symmetric_slopes"]:
        assert item["slope"] == pytest.approx(c, rel=1e-10)
    assert fit["slope_through_origin"] == pytest.approx(c, rel=1e-10)
    # One-sided etas: the through-origin slope picks up d Ση³/Ση².
    pos = etas[etas > 0]
    one_sided = linearity_fit(pos, c * pos + d * pos**2)
    assert one_sided["slope_through_origin"] == pytest.approx(
        c + d * (pos**3).sum() / (pos**2).sum(), rel=1e-10
    )
    assert one_sided["symmetric_slopes"] == []
    assert linearity_fit(pos, d * pos**2)["loglog_slope"] == pytest.approx(2.0, rel=1e-10)


def test_linearity_fit_degenerate_cases():
    assert math.isnan(linearity_fit([1e-3], [0.1])["loglog_slope"])  # one point
    assert math.isnan(linearity_fit([1e-3, 1e-2], [0.1, 0.0])["loglog_slope"])  # |ΔH| = 0
    fit = linearity_fit([1e-3, 1e-2, -1e-3], [0.1, float("nan"), -0.1])  # NaN ΔH dropped
    assert fit["slope_through_origin"] == pytest.approx(100.0)
    assert math.isnan(fit["loglog_slope"])

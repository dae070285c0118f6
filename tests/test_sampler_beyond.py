"""The sampler correction beyond first order (docs/maths.md §12) on per-sequence arrays: every weighted
estimate against a brute-force weighted computation with its delete-one jackknife written out unit by unit;
s ≡ 1 gives the unweighted numbers exactly; None is the unweighted code path."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from entropy_experiments.estimators.jackknife import se_E
from entropy_experiments.estimators.paired import paired_residual
from entropy_experiments.estimators.realised_change import CrossScored, importance_realised_change
from entropy_experiments.estimators.second_difference import finite_difference_report, second_difference
from entropy_experiments.estimators.second_order import second_derivative
from entropy_experiments.estimators.snis import snis_delta_h
from entropy_experiments.estimators.surrogate import entropy_estimate

N, G = 60, 3
UNITS = [i // G for i in range(N)]


def _data(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    T = rng.integers(1, 9, N).astype(float)
    return {"T": T, "h": rng.uniform(0.2, 1.5, N) * T, "h_new": rng.uniform(0.2, 1.5, N) * T,
            "logw": rng.normal(0, 0.3, N), "logw_minus": rng.normal(0, 0.3, N), "h_minus": rng.uniform(0.2, 1.5, N) * T,
            "a": rng.normal(0, 1, N), "r": rng.normal(0, 1, N), "s": np.exp(rng.normal(0, 0.4, N)),
            "sc": rng.normal(0, 1, N), "s2": rng.normal(0, 1, N), "dh": rng.normal(0, 1, N), "d2h": rng.normal(0, 1, N)}


def _brute_jackknife(fn, units=UNITS) -> tuple[float, float]:
    """(fn(all sequences), delete-one jackknife SE): fn takes a boolean mask of the sequences kept."""
    units = np.asarray(units)
    value = fn(np.ones(len(units), bool))
    reps = np.array([fn(units != u) for u in np.unique(units)])
    n = reps.size
    return value, math.sqrt((n - 1) / n * ((reps - reps.mean()) ** 2).sum())


def _d(x, normalize):
    return x["T"] if normalize == "per_token" else np.ones(N)


def _H(weights, h, d, m):
    return (weights[m] * h[m]).sum() / (weights[m] * d[m]).sum()


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_weighted_snis_delta_h_against_brute_force(normalize):
    x = _data()
    d, s, w = _d(x, normalize), x["s"], np.exp(x["logw"])

    def fn(m):
        return _H(s * w, x["h_new"], d, m) - _H(s, x["h"], d, m)

    value, se = _brute_jackknife(fn)
    est = snis_delta_h(x["logw"], x["h_new"], x["h"], x["T"], normalize=normalize, units=UNITS, sampler_weights=s)
    assert est.value == pytest.approx(value, rel=1e-12) and est.se == pytest.approx(se, rel=1e-10)
    # the weights matter here: the unweighted estimate is another number
    assert abs(snis_delta_h(x["logw"], x["h_new"], x["h"], x["T"], normalize=normalize, units=UNITS).value
               - value) > 10 * abs(value) * 1e-6
    assert entropy_estimate(np.asarray(x["h"]), np.asarray(x["T"], dtype=float), normalize, np.asarray(s)) == pytest.approx(
        _H(s, x["h"], d, np.ones(N, bool)), rel=1e-13)


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_unit_weights_give_the_unweighted_numbers_exactly(normalize):
    x = _data(1)
    ones = np.ones(N)
    args = (x["logw"], x["h_new"], x["h"], x["T"])
    assert snis_delta_h(*args, normalize=normalize, units=UNITS, sampler_weights=ones) == snis_delta_h(
        *args, normalize=normalize, units=UNITS)
    res_args = (*args, x["a"], x["r"], 0.1)
    assert paired_residual(*res_args, normalize=normalize, units=UNITS, sampler_weights=ones) == paired_residual(
        *res_args, normalize=normalize, units=UNITS)
    so = (x["sc"], x["s2"], x["dh"], x["d2h"], x["h"], x["T"])
    assert second_derivative(*so, normalize=normalize, units=UNITS, sampler_weights=ones) == second_derivative(
        *so, normalize=normalize, units=UNITS)
    sd = (x["logw"], x["h_new"], x["logw_minus"], x["h_minus"], x["h"], x["T"], 0.1)
    assert second_difference(*sd, normalize=normalize, units=UNITS, sampler_weights=ones) == second_difference(
        *sd, normalize=normalize, units=UNITS)
    t = [torch.tensor(x[k]) for k in ("a", "r", "h", "T")]
    assert se_E(*t, UNITS, normalize=normalize, learning_rate=0.5, sampler_weights=ones) == se_E(
        *t, UNITS, normalize=normalize, learning_rate=0.5)


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_weighted_paired_residual_and_se_E_against_brute_force(normalize):
    x = _data(2)
    d, s, w, eta, lr = _d(x, normalize), x["s"], np.exp(x["logw"]), 0.05, 0.3

    def slope(m):  # D_v H = (Σ s a − Ĥ Σ s r) / Σ s d
        return ((s[m] * x["a"][m]).sum() - _H(s, x["h"], d, m) * (s[m] * x["r"][m]).sum()) / (s[m] * d[m]).sum()

    def residual(m):
        return _H(s * w, x["h_new"], d, m) - _H(s, x["h"], d, m) - eta * slope(m)

    value, se = _brute_jackknife(residual)
    est = paired_residual(x["logw"], x["h_new"], x["h"], x["T"], x["a"], x["r"], eta, normalize=normalize,
                          units=UNITS, sampler_weights=s)
    assert est.value == pytest.approx(value, rel=1e-10) and est.se == pytest.approx(se, rel=1e-9)

    value, se = _brute_jackknife(lambda m: lr * slope(m))
    got = se_E(*(torch.tensor(x[k]) for k in ("a", "r", "h", "T")), UNITS, normalize=normalize, learning_rate=lr,
               sampler_weights=torch.tensor(s))
    assert got[0] == pytest.approx(value, rel=1e-10) and got[1] == pytest.approx(se, rel=1e-9)


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_weighted_second_derivative_against_a_numerical_second_derivative(normalize):
    """d2 with the sampler weights = d²/dη² of Σ s e^{L(η)} h(η) / Σ s e^{L(η)} d (L, h quadratic in η with the
    given first and second derivatives), by a central difference; the SE by the jackknife written out."""
    x = _data(3)
    d, s = _d(x, normalize), x["s"]

    def H_eta(eta, m):
        w = s * np.exp(x["sc"] * eta + 0.5 * x["s2"] * eta ** 2)
        return _H(w, x["h"] + x["dh"] * eta + 0.5 * x["d2h"] * eta ** 2, d, m)

    def exact_d2(m):  # the quadratic-in-η pieces make the 4th difference small; step 1e-3 in float64
        e = 1e-3
        return (H_eta(e, m) - 2 * H_eta(0.0, m) + H_eta(-e, m)) / e ** 2

    value, se = _brute_jackknife(exact_d2)
    est = second_derivative(x["sc"], x["s2"], x["dh"], x["d2h"], x["h"], x["T"], normalize=normalize, units=UNITS,
                            sampler_weights=s)
    assert est.value == pytest.approx(value, rel=1e-5, abs=1e-6) and est.se == pytest.approx(se, rel=1e-4)


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_weighted_second_difference_against_brute_force(normalize):
    x = _data(4)
    d, s, eta = _d(x, normalize), x["s"], 0.1
    wp, wm = np.exp(x["logw"]), np.exp(x["logw_minus"])

    def fn(m):
        return (_H(s * wp, x["h_new"], d, m) + _H(s * wm, x["h_minus"], d, m) - 2 * _H(s, x["h"], d, m)) / eta ** 2

    value, se = _brute_jackknife(fn)
    est = second_difference(x["logw"], x["h_new"], x["logw_minus"], x["h_minus"], x["h"], x["T"], eta,
                            normalize=normalize, units=UNITS, sampler_weights=s)
    assert est.value == pytest.approx(value, rel=1e-10) and est.se == pytest.approx(se, rel=1e-9)
    per_eta = {eta: {"logw": x["logw"], "h_new": x["h_new"]}, -eta: {"logw": x["logw_minus"], "h_new": x["h_minus"]}}
    report = finite_difference_report(per_eta, x["h"], x["T"], normalize=normalize, units=UNITS, sampler_weights=s)
    assert report["d2"] == est.value and report["se"] == est.se


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_weighted_realised_change_against_brute_force(normalize):
    """Both directions of the sweep's realised change with each batch's own sampler weights: forward
    Σ s w h'/Σ s w d − Σ s h/Σ s d on E_N, reverse the same on E_N' signed N → N', averaged; one jackknife over
    the units of both batches (a unit removed from both at once)."""
    f, r = _data(5), _data(6)
    keys = [f"{u}:p" for u in UNITS]
    df, dr = _d(f, normalize), _d(r, normalize)

    def fn(m_f, m_r):
        fwd = _H(f["s"] * np.exp(f["logw"]), f["h_new"], df, m_f) - _H(f["s"], f["h"], df, m_f)
        rev = _H(r["s"], r["h"], dr, m_r) - _H(r["s"] * np.exp(r["logw"]), r["h_new"], dr, m_r)
        return 0.5 * (fwd + rev)

    units = np.asarray(keys)
    value = fn(np.ones(N, bool), np.ones(N, bool))
    reps = np.array([fn(units != u, units != u) for u in np.unique(units)])
    se = math.sqrt((reps.size - 1) / reps.size * ((reps - reps.mean()) ** 2).sum())
    sides = [CrossScored(x["logw"], x["h"], x["h_new"], x["T"], keys, sampler_weights=x["s"]) for x in (f, r)]
    est = importance_realised_change(*sides, normalize=normalize)
    assert est.value == pytest.approx(value, rel=1e-10) and est.se == pytest.approx(se, rel=1e-9)
    plain = [CrossScored(x["logw"], x["h"], x["h_new"], x["T"], keys) for x in (f, r)]
    ones = [CrossScored(x["logw"], x["h"], x["h_new"], x["T"], keys, sampler_weights=np.ones(N)) for x in (f, r)]
    assert importance_realised_change(*ones, normalize=normalize) == importance_realised_change(
        *plain, normalize=normalize)

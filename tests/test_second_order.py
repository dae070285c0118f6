"""The second-order coefficient d2 = D²_v H (estimators/second_order.py, policy.score.jvp(order=2)).

- the formula against central differences of the SNIS estimate itself, on per-sequence log-weights and
  entropies that are exact quadratics in η (so the reference needs no model);
- its jackknife SE against a written-out delete-one loop whose replicates are finite differences;
- forward-over-forward mode on a tiny model against a central difference of first-order forward mode.
The exact comparison on the enumerable toy model is in tests/test_probe.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from entropy_experiments.estimators.second_order import (
    second_derivative,
    second_order_report,
    snis_derivatives,
)
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts


def _synthetic(seed: int, N: int = 30):
    rng = np.random.default_rng(seed)
    T = rng.integers(2, 9, N).astype(float)
    h = rng.uniform(0.5, 2.0, N) * T
    return {"s": rng.normal(0, 1, N), "s2": rng.normal(0, 1, N), "dh": rng.normal(0, 0.3, N),
            "d2h": rng.normal(0, 0.3, N), "h": h, "T": T}


def _snis(x: dict, eta: float, normalize: str, keep=None) -> float:
    keep = np.ones(len(x["T"]), dtype=bool) if keep is None else keep
    L = x["s"] * eta + 0.5 * x["s2"] * eta ** 2
    h_eta = x["h"] + x["dh"] * eta + 0.5 * x["d2h"] * eta ** 2
    d = x["T"] if normalize == "per_token" else np.ones_like(x["T"])
    w = np.exp(L[keep])
    return float((w * h_eta[keep]).sum() / (w * d[keep]).sum())


def _second_difference(x: dict, normalize: str, keep=None, eps: float = 1e-4) -> float:
    return (_snis(x, eps, normalize, keep) - 2 * _snis(x, 0.0, normalize, keep) + _snis(x, -eps, normalize, keep)) / eps ** 2


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_formula_matches_central_differences_of_the_snis_estimate(normalize):
    x = _synthetic(0)
    d = x["T"] if normalize == "per_token" else np.ones_like(x["T"])
    curv = x["s2"] + x["s"] ** 2
    sums = np.array([x["h"].sum(), d.sum(), (x["s"] * x["h"] + x["dh"]).sum(), (x["s"] * d).sum(),
                     (curv * x["h"] + 2 * x["s"] * x["dh"] + x["d2h"]).sum(), (curv * d).sum()])
    first, second = snis_derivatives(sums)
    eps = 1e-4
    assert first == pytest.approx((_snis(x, eps, normalize) - _snis(x, -eps, normalize)) / (2 * eps), rel=1e-6)
    assert second == pytest.approx(_second_difference(x, normalize), rel=1e-4)


@pytest.mark.parametrize("grouped", [False, True])
def test_jackknife_se_matches_a_written_out_loop_of_finite_differences(grouped):
    x = _synthetic(1)
    N = len(x["T"])
    units = [i // 3 for i in range(N)] if grouped else list(range(N))
    est = second_derivative(x["s"], x["s2"], x["dh"], x["d2h"], x["h"], x["T"], normalize="per_token", units=units)
    ids = sorted(set(units))
    reps = np.array([_second_difference(x, "per_token", np.array([u != i for u in units])) for i in ids])
    n = len(ids)
    se = math.sqrt((n - 1) / n * ((reps - reps.mean()) ** 2).sum())
    assert est.value == pytest.approx(_second_difference(x, "per_token"), rel=1e-4)
    assert est.se == pytest.approx(se, rel=1e-3)


def test_report_gives_eta_star_and_the_second_order_prediction():
    from entropy_experiments.estimators.jackknife import Estimate

    report = second_order_report(Estimate(-4.0, 1.0), x_hat_dot_v=2.0, etas=[0.1, -0.1], method="m")
    assert report["eta_star"] == pytest.approx(0.1)  # ½·η²·4 = 0.1·η·2 at η = 0.1
    assert report["predictions"] == pytest.approx({"0.1": 0.2 - 0.02, "-0.1": -0.2 - 0.02})
    assert second_order_report(Estimate(0.0, 1.0), 2.0, [], "m")["eta_star"] is None


def test_forward_over_forward_matches_a_central_difference_of_forward_mode(tiny_model_dir, tmp_path):
    probe = make_probe(tiny_model_dir, write_prompts(tmp_path / "p.jsonl", SHORT_PROMPTS),
                       {"batch_config": {"B_E": 4, "B_U": 2, "G": 2}})
    sp = probe.engine
    E, _ = probe.sample(B_E=4, B_U=2, G=2)[:2]
    seqs = E
    named = {n: p for n, p in probe.model.named_parameters() if p.requires_grad}
    gen = torch.Generator().manual_seed(0)
    v = {n: torch.randn(p.shape, generator=gen) * 0.5 for n, p in named.items()}
    second = [r for row in sp.teacher_force_directional(seqs, v, order=2) for r in row]
    eps = 2e-3

    def first_at(shift: float) -> list[dict]:
        with torch.no_grad():
            for n, p in named.items():
                p.add_(shift * v[n])
        try:
            return [r for row in sp.teacher_force_directional(seqs, v) for r in row]
        finally:
            with torch.no_grad():
                for n, p in named.items():
                    p.sub_(shift * v[n])

    plus, minus = first_at(eps), first_at(-eps)
    for key in ("logq", "rb_entropy"):
        exact = torch.cat([r[f"d2_{key}"] for r in second])
        fd = torch.cat([(p[f"d_{key}"] - m[f"d_{key}"]) / (2 * eps) for p, m in zip(plus, minus)])
        assert exact.abs().max() > 0
        assert torch.allclose(exact, fd, rtol=2e-2, atol=2e-2 * float(exact.abs().max())), key
    first = [r for row in sp.teacher_force_directional(seqs, v) for r in row]
    for a, b in zip(first, second):  # order 2 returns the same order-0 and order-1 values
        # fp32 forwards, two AD paths: agreement to fp32 rounding of the largest term (an entry near 0 can
        # differ by ~1e-4 absolute when others are ~15)
        scale = float(a["d_logq"].abs().max())
        assert torch.allclose(a["d_logq"], b["d_logq"], rtol=1e-4, atol=1e-5 * scale)

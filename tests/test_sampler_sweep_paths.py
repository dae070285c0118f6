"""The sweep's remaining E-side statistics under the sampler correction's weights s (docs/maths.md §12): the
checkpoint's Ĥ, the `independent_batches` realised change, the `paired_diagnostic`, the decomposition's
residuals ρ₁ (against the independent and the paired realised change) and `u_noise` — each against a
brute-force weighted computation with the delete-one jackknife written out unit by unit; without
`sampler_log_weight` (s None) and with s ≡ 1 they are the unweighted numbers, bit for bit."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from entropy_experiments.estimators.displacement import (
    BatchColumns,
    DisplacementPieces,
    independent_residuals,
    interval_residuals,
    u_noise,
)
from entropy_experiments.estimators.jackknife import entropy_with_se
from entropy_experiments.estimators.realised_change import paired_change_replicates
from entropy_experiments.sweep.realised import interval_realised_change
from entropy_experiments.sweep.rows import CheckpointRun


def jackknife(stat, units: list[str]) -> tuple[float, float]:
    """stat(kept units) over all units, and its delete-one jackknife SE (brute force)."""
    every = sorted(set(units))
    reps = np.array([stat(set(every) - {u}) for u in every])
    n = len(reps)
    return stat(set(every)), math.sqrt((n - 1) / n * ((reps - reps.mean()) ** 2).sum())


def batch(seed: int, n_units: int, per_unit: int, weighted: bool, shift: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    n = n_units * per_unit
    slots = [shift + i // per_unit for i in range(n)]
    T = rng.integers(3, 12, n).astype(float)
    return {"h": T * rng.uniform(1, 3, n), "T": T, "slots": slots, "prompts": [s % 4 for s in slots],
            "a": rng.normal(size=n), "r": rng.normal(size=n), "a_v": rng.normal(size=n), "r_v": rng.normal(size=n),
            "log_s": rng.normal(0, 0.4, n) + 3.0 if weighted else None}


def run_of(b: dict, log_s) -> CheckpointRun:
    return CheckpointRun(Path("."), "probe", {}, b["h"], b["T"], b["slots"], b["prompts"], {}, log_s)


def keys(b: dict) -> list[str]:
    return [f"{s}:{p}" for s, p in zip(b["slots"], b["prompts"], strict=True)]


def weighted_entropy(b: dict, d: np.ndarray, kept: set[str]) -> float:
    s = np.exp(b["log_s"]) if b["log_s"] is not None else np.ones(len(d))
    m = np.array([k in kept for k in keys(b)])
    return float((s * b["h"])[m].sum() / (s * d)[m].sum())


def weighted_slope(b: dict, d: np.ndarray, kept: set[str], a: np.ndarray, r: np.ndarray) -> float:
    s = np.exp(b["log_s"]) if b["log_s"] is not None else np.ones(len(d))
    m = np.array([k in kept for k in keys(b)])
    D = (s * d)[m].sum()
    return float(((s * a)[m].sum() - weighted_entropy(b, d, kept) * (s * r)[m].sum()) / D)


@pytest.fixture(params=["per_token", "per_sequence"])
def normalize(request):
    return request.param


@pytest.fixture(params=[True, False], ids=["weighted", "unweighted"])
def pair(request):
    # 12 units in E_N, 12 in E_N', 9 of them common (the same draw and prompt)
    return batch(1, 12, 2, request.param), batch(2, 12, 2, request.param, shift=3)


def d_of(b: dict, normalize: str) -> np.ndarray:
    return b["T"] if normalize == "per_token" else np.ones_like(b["T"])


def test_checkpoint_entropy_and_independent_and_paired_realised_change(pair, normalize):
    a, b = pair
    run_a, run_b = run_of(a, a["log_s"]), run_of(b, b["log_s"])
    Ha = jackknife(lambda kept: weighted_entropy(a, d_of(a, normalize), kept), keys(a))
    Hb = jackknife(lambda kept: weighted_entropy(b, d_of(b, normalize), kept), keys(b))
    est = entropy_with_se(a["h"], d_of(a, normalize), keys(a), run_a.sampler_weights)
    assert (est.value, est.se) == pytest.approx(Ha, rel=1e-12)
    entry, _ = interval_realised_change(run_a, run_b, normalize, None, "a → b")
    assert entry["method"] == "independent_batches"
    assert entry["dH_realised"] == pytest.approx(Hb[0] - Ha[0], rel=1e-12)
    assert entry["se"] == pytest.approx(math.hypot(Ha[1], Hb[1]), rel=1e-12)
    paired = jackknife(lambda kept: weighted_entropy(b, d_of(b, normalize), kept)
                       - weighted_entropy(a, d_of(a, normalize), kept), keys(a) + keys(b))
    got = entry["paired_diagnostic"]
    assert (got["value"], got["se"]) == pytest.approx(paired, rel=1e-10)


def test_decomposition_residuals_and_u_noise(pair, normalize):
    a, b = pair
    da, db = d_of(a, normalize), d_of(b, normalize)
    sa, sb = (None if x["log_s"] is None else np.exp(x["log_s"] - x["log_s"].max()) for x in (a, b))
    frm, to = BatchColumns(a["h"], da, keys(a), sa), BatchColumns(b["h"], db, keys(b), sb)
    pieces = DisplacementPieces(a["a"], a["r"], None, a["a_v"], a["r_v"])
    slope = lambda kept: weighted_slope(a, da, kept, a["a"], a["r"])
    # independent: Ĥ(to) − [Ĥ(from) + δH_Δθ], the two jackknifes in quadrature
    Hb = jackknife(lambda kept: weighted_entropy(b, db, kept), keys(b))
    bracket = jackknife(lambda kept: weighted_entropy(a, da, kept) + slope(kept), keys(a))
    rho = independent_residuals(frm, pieces, to, normalize)["first_order"]
    assert (rho.value, rho.se) == pytest.approx((Hb[0] - bracket[0], math.hypot(Hb[1], bracket[1])), rel=1e-10)
    # paired: [Ĥ(to) − Ĥ(from)] − δH_Δθ, one jackknife over the union of units
    realised = paired_change_replicates(a["h"], da, keys(a), b["h"], db, keys(b), sa, sb)
    rho = interval_residuals(frm, pieces, realised, normalize)["first_order"]
    expected = jackknife(lambda kept: weighted_entropy(b, db, kept) - weighted_entropy(a, da, kept) - slope(kept),
                         keys(a) + keys(b))
    assert (rho.value, rho.se) == pytest.approx(expected, rel=1e-10)
    # u_noise: K·lr·X̂·v − δH_Δθ from the pieces on E_N
    K, lr = 3, 0.01
    out = u_noise(frm, pieces, step_lr=lr, steps=K, se_U=0.5, u_batch_ratio=1.0)
    diff = jackknife(lambda kept: weighted_slope(a, da, kept, K * lr * a["a_v"] - a["a"], K * lr * a["r_v"] - a["r"]),
                     keys(a))
    assert (out["value"], out["se_E"]) == pytest.approx(diff, rel=1e-10)


def test_unit_weights_and_no_weights_are_bit_identical(normalize):
    a, b = batch(3, 10, 2, False), batch(4, 10, 2, False, shift=2)
    da, db = d_of(a, normalize), d_of(b, normalize)
    ones = np.zeros(len(a["h"]))
    for log_s_a, log_s_b in ((None, None), (ones, np.zeros(len(b["h"])))):
        entry, _ = interval_realised_change(run_of(a, log_s_a), run_of(b, log_s_b), normalize, None, "x")
        if log_s_a is None:
            reference = entry
        else:
            assert entry == reference
    pieces = DisplacementPieces(a["a"], a["r"], None, a["a_v"], a["r_v"])
    plain = BatchColumns(a["h"], da, keys(a)), BatchColumns(b["h"], db, keys(b))
    unit = BatchColumns(a["h"], da, keys(a), np.ones(len(da))), BatchColumns(b["h"], db, keys(b), np.ones(len(db)))
    assert independent_residuals(*plain[:1], pieces, plain[1], normalize) == \
        independent_residuals(*unit[:1], pieces, unit[1], normalize)
    assert u_noise(plain[0], pieces, step_lr=0.1, steps=1, se_U=0.2, u_batch_ratio=1.0) == \
        u_noise(unit[0], pieces, step_lr=0.1, steps=1, se_U=0.2, u_batch_ratio=1.0)

"""The rounding floor of ΔH (estimators/rounding_floor.py, docs/maths.md §8) and the comparison that
tests/test_cuda.py runs between a CPU and a GPU, exercised here between two CPU runs that differ only in
reduction order (eager vs SDPA attention) on the same E and U:

* F against a brute-force Monte Carlo of ΔH under simulated per-token rounding (independent reference);
* the whole tiny probe (δH₁, SEs, ΔH(±η), second order by both methods, every predictor, the displacement
  predictor) agrees between the two runs within the derived tolerances, and a planted discrepancy of three
  tolerances is caught;
* at η = 1e−4 the floor alone is larger than the old fixed 1e−3 relative tolerance (why the GPU test failed).
"""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.estimators import snis
from entropy_experiments.estimators.rounding_floor import delta_h_rounding_floor, delta_h_tolerance
from entropy_experiments.make_checkpoint.trained import make_checkpoint
from entropy_experiments.probe import recipe
from entropy_experiments.probe.results import WarningLog
from tests.device_comparison import Z, differences, rounding_floor
from tests.run_helpers import make_run_setup


def test_the_floor_matches_a_monte_carlo_of_simulated_rounding():
    rng = np.random.default_rng(0)
    N = 40
    T = rng.integers(3, 30, N).astype(float)
    H_tok = [rng.uniform(0.5, 3.0, int(t)) for t in T]
    h = np.array([x.sum() for x in H_tok])
    sigma_h, sigma_l = 2e-6, 3e-6

    def rounded_delta_h() -> float:  # ΔH at η with the exact change 0: only the two scorings' rounding
        dh0 = np.array([rng.normal(0, sigma_h, int(t)).sum() for t in T])
        dh1 = np.array([rng.normal(0, sigma_h, int(t)).sum() for t in T])
        dl0 = np.array([rng.normal(0, sigma_l, int(t)).sum() for t in T])
        dl1 = np.array([rng.normal(0, sigma_l, int(t)).sum() for t in T])
        return snis.snis_delta_h(dl1 - dl0, h + dh1, h + dh0, T, normalize="per_token").value

    draws = np.array([rounded_delta_h() for _ in range(4000)])
    F = delta_h_rounding_floor(torch.tensor(h), torch.tensor(T), sigma_h ** 2, sigma_l ** 2)
    assert abs(draws.mean()) < 4 * F / math.sqrt(len(draws))
    assert draws.std() == pytest.approx(F, rel=0.05)


@pytest.fixture(scope="module")
def two_orders(tmp_path_factory, tiny_model_dir):
    """The tiny probe (second order, predictors, displacement) run twice on the same E and U: eager attention,
    then SDPA. Returns (config dict, eager results, SDPA results, F)."""
    folder = tmp_path_factory.mktemp("orders")
    _, d = make_run_setup(folder, tiny_model_dir, estimator={"microbatch_size": 4}, second_order={"enabled": True},
                          importance={"eta_list": [1.0e-4, 1.0e-3]})
    make_checkpoint(folder / "next", config_from_dict(d), steps=2)
    d["predictors"] = {"enabled": True, "next_checkpoint": str(folder / "next")}
    out = {}
    for method in ("jvp", "finite_difference"):
        d2 = copy.deepcopy(d)
        d2["second_order"]["method"] = method
        config, batches = config_from_dict(d2), {}
        eager = recipe.run(config, on_batches=lambda E, U, kept=batches: kept.update(E=E, U=U))
        twin = recipe.load_phase(config, recipe.process_context(config), WarningLog())
        twin.trainable.model.set_attn_implementation("sdpa")
        sdpa = recipe.run(config, policy=twin, batches=(batches["E"], batches["U"]))
        out[method] = (eager.results, sdpa.results, rounding_floor(eager.policy, batches["E"], config))
    return out


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["jvp", "finite_difference"])
def test_two_reduction_orders_agree_within_the_derived_tolerances(two_orders, method):
    a, b, F = two_orders[method]
    assert a["second_order"]["method"] == method and "displacement" in a["predictors"]
    assert any(x["deltaH_true"] != y["deltaH_true"] for x, y in zip(a["true"], b["true"]))  # the orders differ
    assert differences(a, b, F) == []


@pytest.mark.e2e
def test_a_planted_discrepancy_is_caught(two_orders):
    a, b, F = two_orders["jvp"]
    planted = copy.deepcopy(b)
    row = planted["true"][-1]
    row["deltaH_true"] += 3 * delta_h_tolerance(row["deltaH_true"], F, z=Z)
    assert [m for m in differences(a, planted, F) if m.startswith("ΔH")]
    planted = copy.deepcopy(b)
    planted["predictors"]["direct_only"]["delta_h1"] *= 1.01
    was, now = a["predictors"]["direct_only"]["delta_h1"], planted["predictors"]["direct_only"]["delta_h1"]
    assert differences(a, planted, F) == [f"predictors.direct_only.delta_h1: {was} vs {now}"]


@pytest.mark.e2e
def test_at_small_eta_the_floor_exceeds_a_fixed_relative_tolerance(two_orders):
    a, _, F = two_orders["jvp"]
    small = next(x for x in a["true"] if x["eta"] == 1.0e-4)
    assert math.sqrt(2) * F / abs(small["deltaH_true"]) > 1e-3

"""The autopilot's law on measured changes (`autopilot_rule.decide_measured`), against a known curved response.

The step's true entropy change here is m·(δ + κ·e) − c·m²·(1 + κ²/10): first order (δ, e) plus a curvature c that
first order misses, as AdamW's large steps have. `measure` returns the truth (plus a known SE), as the SNIS
measurement on E does before the step is taken. The law must land nearer the wanted change than the
first-order law, rest on one measurement where the untouched step stays within the budget, and never choose a
step measured worse than resting.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from entropy_experiments.errors import NumericsError
from entropy_experiments.integrations.autopilot_rule import (
    AutopilotRule,
    Estimate,
    decide,
    decide_measured,
    limited_multiplier,
)

RULE = AutopilotRule()


def _world(delta: float, e: float, c: float, se: float = 0.005):
    calls = []

    def truth(m: float, kappa: float) -> float:
        return m * (delta + kappa * e) - c * m * m * (1 + kappa * kappa / 10)

    def measure(m: float, kappa: float) -> Estimate:
        calls.append((m, kappa))
        return Estimate(truth(m, kappa), se)

    return truth, measure, calls


def test_a_curved_step_lands_nearer_the_wanted_change_than_first_order():
    # first order says the step keeps the entropy (δ = −0.01); the curvature drops it by 0.2
    truth, measure, calls = _world(delta=-0.01, e=0.15, c=0.2)
    gap, term = Estimate(0.0, 0.01), Estimate(0.15, 0.01)
    first_order = decide(RULE, step=Estimate(-0.01, 0.005), gap=gap, previous=1.0, term=term)
    assert first_order.steering.startswith("within the budget")  # first order sees nothing to do
    measured = decide_measured(RULE, gap=gap, previous=1.0, term=term, measure=measure)
    true_miss = abs(measured.wanted - truth(measured.multiplier, measured.term))
    assert measured.predicted == pytest.approx(truth(measured.multiplier, measured.term))
    assert true_miss < 0.5 * abs(measured.wanted - truth(first_order.multiplier, first_order.term))
    assert measured.term > 0 and calls[0] == (1.0, 0.0) and len(calls) <= 3


def test_within_the_budget_it_rests_on_one_measurement():
    truth, measure, calls = _world(delta=0.01, e=0.1, c=0.01)
    d = decide_measured(RULE, gap=Estimate(0.0, 0.01), previous=1.0, term=Estimate(0.1, 0.01), measure=measure)
    assert (d.multiplier, d.term) == (1.0, 0.0) and calls == [(1.0, 0.0)]
    assert d.predicted == truth(1.0, 0.0) and d.steering == "within the budget: no action"


def test_the_chosen_step_is_never_measured_worse_than_resting():
    rng = np.random.default_rng(3)
    for _ in range(500):
        truth, measure, calls = _world(delta=rng.normal(-0.05, 0.1), e=rng.uniform(-0.05, 0.2),
                                       c=rng.uniform(0, 0.3), se=rng.uniform(0.001, 0.05))
        previous = rng.uniform(0.3, 1.0)
        d = decide_measured(RULE, gap=Estimate(rng.normal(0, 0.2), 0.02), previous=previous,
                            term=Estimate(rng.uniform(0, 0.2), 0.01), measure=measure)
        resting = limited_multiplier(RULE, 1.0, previous)[0]
        if resting == 1.0 and len(calls) > 1:
            se = measure(1.0, 0.0).se
            assert (d.wanted - d.predicted) ** 2 <= (d.wanted - truth(1.0, 0.0)) ** 2 + 0.1 * se ** 2 + 1e-15
        assert RULE.min_multiplier <= d.multiplier <= RULE.max_multiplier and abs(d.term) <= RULE.max_term
        assert d.predicted_se is not None


def test_a_measurement_that_is_not_finite_is_an_error_not_a_rest():
    for bad in (Estimate(math.nan, 0.01), Estimate(-0.3, math.inf)):
        with pytest.raises(NumericsError, match="not finite"):
            decide_measured(RULE, gap=Estimate(0.0, 0.01), previous=1.0, term=None, measure=lambda m, k, bad=bad: bad)

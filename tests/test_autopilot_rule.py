"""The autopilot's control law (integrations/autopilot_rule.py) and its entropy filter (entropy_filter.py), pure.

The law is driven here by simulated predictions whose truth is known: pure noise at the target (it must rest),
a steady significant fall (it must act), and random inputs (the step it takes is never predicted worse than
the lr-only step). The filter is checked against generalised least squares over the whole history (the
independent reference: for a linear-Gaussian model the Kalman estimate IS that solution) and against fresh Ĥ
alone on simulated runs.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from entropy_experiments.errors import ConfigError
from entropy_experiments.integrations.autopilot_rule import (
    CLEAR,
    AutopilotRule,
    Estimate,
    decide,
    limited_multiplier,
    shrunk_ratio,
    significant,
    target_of,
)
from entropy_experiments.integrations.entropy_filter import after_step, first_track, observe

RULE = AutopilotRule()


def test_at_rest_the_law_does_nothing():
    d = decide(RULE, step=Estimate(-0.004, 0.01), gap=Estimate(0.003, 0.005), previous=1.0,
               term=Estimate(0.05, 0.01))
    assert (d.multiplier, d.term) == (1.0, 0.0) and d.steering == "within the budget: no action"
    # after an earlier cut, m returns toward 1 at the rate limit
    d = decide(RULE, step=Estimate(0.0, 0.01), gap=Estimate(0.0, 0.005), previous=0.3)
    assert d.multiplier == pytest.approx(0.3 * RULE.max_rate_clear) and d.term == 0.0
    assert d.steering == "within the budget: lr returning to 1" and d.limit == "rate limit"


@pytest.mark.parametrize("with_term", [True, False])
def test_pure_noise_at_the_target_leaves_m_near_1_and_pushes_nothing(with_term):
    """20 seeds × 50 decisions: δ, the gap and the term's effect are noise around 0, at SEs up to 2.5× the
    drift budget."""
    acting = pushes = 0
    for seed in range(20):
        rng = np.random.default_rng(seed)
        m = 1.0
        for _ in range(50):
            s = rng.uniform(0.005, 0.05)
            step = Estimate(rng.normal(0, s), s)
            gap = Estimate(rng.normal(0, 0.5 * s), 0.5 * s)
            term = Estimate(rng.normal(0, s), s) if with_term else None
            d = decide(RULE, step=step, gap=gap, previous=m, term=term)
            m = d.multiplier
            acting += d.term != 0.0 or not d.steering.startswith("within")
            pushes += d.term != 0.0
            assert 0.8 <= m <= 1.25, (seed, d)
    # of 1000 decisions: noise alone rarely crosses budget + 2 SD, and a push then needs a confirmed direction
    assert acting <= 25 and pushes <= 5


def _simulate_fall(term: Estimate | None, steps: int = 20) -> tuple[list, list]:
    """A run whose every step lowers the entropy by 0.1 ± 0.01; the gap follows the steps taken."""
    gap, m, gaps, decisions = 0.0, 1.0, [], []
    for _ in range(steps):
        d = decide(RULE, step=Estimate(-0.1, 0.01), gap=Estimate(gap, 0.01), previous=m, term=term)
        m = d.multiplier
        gap -= d.multiplier * (-0.1 + d.term * (term.value if term else 0.0))
        gaps.append(gap)
        decisions.append(d)
    return gaps, decisions


def test_a_steady_significant_fall_is_acted_on():
    gaps, decisions = _simulate_fall(Estimate(0.08, 0.005))
    assert all(d.term > 0 for d in decisions) and all(d.multiplier == 1.0 for d in decisions)  # the term alone
    assert max(abs(g) for g in gaps) < 0.03
    assert "entropy falling beyond the budget: entropy term" in decisions[0].steering
    lr_only, decisions = _simulate_fall(None)  # no term: the lr is lowered instead
    assert decisions[0].multiplier < 1 and decisions[-1].multiplier == RULE.min_multiplier
    assert decisions[0].steering.startswith("entropy falling beyond the budget: lr x")
    free = [0.1 * (k + 1) for k in range(20)]
    assert all(abs(g) < f for g, f in zip(lr_only[3:], free[3:]))


def test_the_chosen_step_is_never_predicted_worse_than_the_lr_only_step():
    rng = np.random.default_rng(7)
    for _ in range(2000):
        step = Estimate(rng.normal(0, 0.1), rng.uniform(0.001, 0.05))
        gap = Estimate(rng.normal(0, 0.2), rng.uniform(0.001, 0.05))
        term = Estimate(rng.normal(0.02, 0.05), rng.uniform(0.001, 0.05))  # often unconfirmed
        previous = rng.uniform(0.3, 1.0)
        chosen = decide(RULE, step=step, gap=gap, previous=previous, term=term)
        if chosen.steering.startswith("within"):
            continue
        # the lr-only step: the shrunk ratio from the resting m, within the rate limit and the bounds
        resting = limited_multiplier(RULE, 1.0, previous)[0]
        clear = significant(RULE, gap, gap.value - step.value, step.se, CLEAR * RULE.z)
        m = limited_multiplier(RULE, resting + shrunk_ratio(chosen.wanted - resting * step.value, step), previous,
                               clear)[0]
        # never predicted worse, beyond a tenth of the prediction's variance (closer than it can tell apart)
        error = (chosen.wanted - chosen.predicted) ** 2 + (chosen.term * term.se) ** 2
        assert error <= (chosen.wanted - m * step.value) ** 2 + 0.1 * step.se ** 2 + 1e-15
        assert RULE.min_multiplier <= chosen.multiplier <= RULE.max_multiplier
        assert abs(chosen.term) <= RULE.max_term
        fall = RULE.max_rate_clear if clear else RULE.max_rate
        assert previous / fall - 1e-12 <= chosen.multiplier <= previous * RULE.max_rate_clear + 1e-12 or \
            chosen.limit == "multiplier bound"


def test_an_unconfirmed_term_direction_is_not_used():
    d = decide(RULE, step=Estimate(-0.1, 0.01), gap=Estimate(0.1, 0.01), previous=1.0, term=Estimate(0.01, 0.02))
    assert d.term == 0.0 and "term direction unconfirmed" in d.limit and d.multiplier < 1.0


def test_the_term_lowers_a_rising_entropy_and_respects_its_bound():
    d = decide(RULE, step=Estimate(0.1, 0.005), gap=Estimate(-0.1, 0.01), previous=1.0, term=Estimate(0.05, 0.002))
    assert d.term < 0 and d.multiplier == 1.0 and d.steering.startswith("entropy rising")
    d = decide(RULE, step=Estimate(-0.3, 0.005), gap=Estimate(0.2, 0.01), previous=1.0, term=Estimate(0.01, 0.001))
    assert d.term == RULE.max_term and "term bound" in d.limit


def test_the_drop_limit_caps_the_wanted_fall():
    d = decide(RULE, step=Estimate(-0.02, 0.001), gap=Estimate(-0.5, 0.01), previous=1.0, term=Estimate(0.05, 0.002))
    assert d.wanted == pytest.approx(-RULE.max_drop) and d.predicted == pytest.approx(-RULE.max_drop, rel=1e-3)


def test_targets():
    assert target_of(1.5)(7, 2.0) == 1.5
    assert target_of("initial")(7, 2.0) == 2.0
    assert target_of(lambda step: 3.0 - 0.1 * step)(5, 2.0) == pytest.approx(2.5)
    for bad in ("start", -1.0, math.nan, True, None):
        with pytest.raises(ConfigError, match="target must be"):
            target_of(bad)


@pytest.mark.parametrize("options, message", [
    ({"min_multiplier": 0.0}, "min_multiplier"), ({"max_multiplier": 0.5}, "max_multiplier"),
    ({"max_drop": -0.1}, "max_drop"), ({"z": -1}, "z must"), ({"max_rate": 0.9}, "max_rate"),
    ({"gain": 0.0}, "gain"), ({"budget": math.inf}, "budget"), ({"max_term": -1.0}, "max_term"),
])
def test_bad_settings_are_one_line(options, message):
    with pytest.raises(ConfigError, match=message):
        AutopilotRule(**options).check()


# ------------------------------------------------------------------ the filter
def _gls(H_obs, H_se, r_obs, r_se):
    """h0 + D_t by generalised least squares over all observations (unknowns h0 and the increments)."""
    T = len(H_obs)
    rows, values, sigmas = [], [], []
    for t in range(T):  # Ĥ_t = h0 + Σ_{k<t} Δ_k
        rows.append([1.0] + [1.0 if k < t else 0.0 for k in range(T - 1)])
        values.append(H_obs[t])
        sigmas.append(H_se[t])
    for k in range(T - 1):  # r_k = Δ_k
        rows.append([0.0] + [1.0 if j == k else 0.0 for j in range(T - 1)])
        values.append(r_obs[k])
        sigmas.append(r_se[k])
    A = np.array(rows) / np.array(sigmas)[:, None]
    x = np.linalg.lstsq(A, np.array(values) / np.array(sigmas), rcond=None)[0]
    cov = np.linalg.inv(A.T @ A)
    return x[0] + x[1:].sum(), -x[1:].sum(), math.sqrt(cov[1:, 1:].sum())


def _run_filter(H_obs, H_se, r_obs, r_se):
    track = first_track(Estimate(H_obs[0], H_se[0]))
    for t in range(1, len(H_obs)):
        track = observe(after_step(track, Estimate(r_obs[t - 1], r_se[t - 1])), Estimate(H_obs[t], H_se[t]))
    return track


def test_the_filter_is_the_least_squares_estimate_of_the_whole_history():
    rng = np.random.default_rng(3)
    T = 9
    H_se, r_se = rng.uniform(0.05, 0.3, T), rng.uniform(0.005, 0.05, T - 1)
    H_obs, r_obs = rng.normal(1.0, 0.2, T), rng.normal(-0.05, 0.05, T - 1)
    track = _run_filter(H_obs, H_se, r_obs, r_se)
    H, gap_initial, gap_se = _gls(H_obs, H_se, r_obs, r_se)
    assert track.entropy.value == pytest.approx(H, abs=1e-10)
    assert track.gap_to(None).value == pytest.approx(gap_initial, abs=1e-12)
    assert track.gap_to(None).se == pytest.approx(gap_se, abs=1e-12)
    assert track.gap_to(1.2).value == pytest.approx(1.2 - H, abs=1e-10)


def test_the_filter_beats_fresh_entropy_alone_at_small_batches():
    """Simulated runs: a drifting true entropy, fresh Ĥ with SE 0.2 (a 16-sequence E), paired changes with SE
    0.02. The filtered estimate's error is far below Ĥ's."""
    rng = np.random.default_rng(11)
    raw, filtered = [], []
    for _ in range(200):
        truth = 1.0 + np.cumsum(np.r_[0.0, rng.normal(-0.05, 0.05, 19)])
        H_obs = truth + rng.normal(0, 0.2, 20)
        r_obs = np.diff(truth) + rng.normal(0, 0.02, 19)
        track = first_track(Estimate(H_obs[0], 0.2))
        for t in range(1, 20):
            track = observe(after_step(track, Estimate(r_obs[t - 1], 0.02)), Estimate(H_obs[t], 0.2))
            raw.append(H_obs[t] - truth[t])
            filtered.append(track.entropy.value - truth[t])
    rms_raw, rms_filtered = np.sqrt(np.mean(np.square(raw))), np.sqrt(np.mean(np.square(filtered)))
    assert rms_raw == pytest.approx(0.2, rel=0.05)
    assert rms_filtered < 0.5 * rms_raw

"""The sampler correction beyond first order on the enumerable toy model (docs/maths.md §12): E drawn by a
sampler at another temperature (tests/sampler_toy.py), the phases after δH₁ run with the weights
s = q_θ/q_s computed here from the public functions of estimators/sampler_correction.py. Corrected, ΔH(η), d2
(jvp and second difference) and the direct_only predictor agree with the exact enumerated values within 4 SE;
on the same batch without the weights ΔH(η) and d2 do not (direct_only, an expectation of per-token entropy
derivatives, moves little with this sampler: only the corrected value is asserted).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.estimators.sampler_correction import normalised_weights, sampler_log_weights
from entropy_experiments.probe import recipe
from entropy_experiments.probe.beyond import beyond_first_order_phase, second_order_phase
from entropy_experiments.probe.results import WarningLog
from tests.probe_helpers import make_probe
from tests.sampler_toy import draw_from_sampler
from tests.test_probe import (  # noqa: F401  (fixtures)
    TOY_PROMPTS,
    _enumerated,
    _exact_entropy,
    _run,
    _shifted,
    toy_dir,
    toy_prompts_file,
)

pytestmark = pytest.mark.e2e  # runs whole probes (scripts/test.sh -m "not e2e" skips them)

MAX_NEW, ETA, SAMPLER_TEMPERATURE = 3, 2e-2, 5.0


@pytest.fixture(scope="module")
def sampled(toy_dir, toy_prompts_file):  # noqa: F811
    """(probe, E drawn by the sampler, phases 1–3 on it, s, exact reference function of the toy model)."""
    probe = make_probe(toy_dir, toy_prompts_file, {
        "seed": 3, "batch_config": {"B_E": 3000, "B_U": 8, "G": 4},
        "generation": {"max_new_tokens": MAX_NEW, "gen_batch_size": 1024, "tf_batch_size": 1024},
        "estimator": {"microbatch_size": 1024}, "importance": {"eta_list": [ETA], "symmetric": True},
        "second_order": {"enabled": True, "method": "jvp"}, "variance": {"u_groups": 4}})
    _, E, _, _ = _run(probe)
    # U from a smaller set-up: its step v is one along which the sampler moves ΔH(η) by more than ΔH itself
    # (the uncorrected limit, enumerated under q_s, is asserted below), so the test can tell the two apart
    _, _, U, _ = _run(make_probe(toy_dir, toy_prompts_file, {
        "seed": 3, "batch_config": {"B_E": 64, "B_U": 8, "G": 4}, "generation": {"max_new_tokens": MAX_NEW},
        "importance": {"enabled": False}, "second_order": {"enabled": False}, "predictors": {"enabled": False}}))
    model64 = copy.deepcopy(probe.model).double()
    E_s = draw_from_sampler(E, model64, probe.tokenizer, temperature=SAMPLER_TEMPERATURE, max_new=MAX_NEW, seed=11)
    est = recipe.estimate_phase(probe.config, probe.policy, E_s, U, WarningLog())
    log_s = sampler_log_weights(est.delta_h1.scores.token_logqs, E_s.sampler_response_logqs())
    s = torch.tensor(normalised_weights(log_s))
    return probe, E_s, est, s, model64


def _with_weights(est, s):
    return dataclasses.replace(est.delta_h1, sampler_weights=s)


@pytest.fixture(scope="module")
def beyond_both(sampled):
    """{weighted: BeyondFirstOrder} with the sampler weights (True) and without them (False), same batch."""
    probe, E_s, est, s, _ = sampled
    return {weighted: beyond_first_order_phase(probe.config, probe.policy, E_s,
                                               _with_weights(est, s if weighted else None), est.error_bars)
            for weighted in (True, False)}


def _exact_H(sampled, v, eta: float) -> float:
    probe, _, _, _, model64 = sampled
    params = {n: p.detach() for n, p in model64.named_parameters()}
    return _exact_entropy(model64, _shifted(params, v, eta), probe.tokenizer, TOY_PROMPTS, 1.0, "per_token", MAX_NEW)


def _within(value: float, se: float, exact: float) -> bool:
    return abs(value - exact) < 4 * se


def test_sampler_is_far_enough_from_the_policy_to_matter(sampled):
    _, _, _, s, _ = sampled
    ess_frac = float(s.sum() ** 2 / (s ** 2).sum()) / len(s)
    print(f"\nsampler ESS/N {ess_frac:.3f}")
    assert 0.2 < ess_frac < 0.95


def test_delta_h_corrected_matches_enumeration_and_uncorrected_does_not(sampled, beyond_both):
    _, _, est, _, _ = sampled
    v = est.delta_h1.v
    for row_w, row_u in zip(beyond_both[True].truth.rows, beyond_both[False].truth.rows):
        exact = _exact_H(sampled, v, row_w["eta"]) - _exact_H(sampled, v, 0.0)
        print(f"\nη={row_w['eta']:+g}: corrected {row_w['deltaH_true']:.5g} ± {row_w['se']:.2g}, uncorrected "
              f"{row_u['deltaH_true']:.5g} ± {row_u['se']:.2g}, exact {exact:.5g}")
        assert _within(row_w["deltaH_true"], row_w["se"], exact), (row_w, exact)
        assert not _within(row_u["deltaH_true"], row_u["se"], exact), (row_u, exact)
        assert row_w["se"] < 0.4 * abs(exact), "the test must be sharp enough to mean something"
        # the row's diagnostics are the step's own weights w, the same with and without the sampler's s
        assert row_w["ess"] == row_u["ess"] and row_w["psis_khat"] == row_u["psis_khat"]
    assert beyond_both[True].truth.H_orig == pytest.approx(_exact_H(sampled, v, 0.0), abs=4e-3)


def test_second_order_corrected_matches_enumeration_and_uncorrected_does_not(sampled, beyond_both):
    probe, E_s, est, s, _ = sampled
    v, eps = est.delta_h1.v, 1e-2
    exact = (_exact_H(sampled, v, eps) - 2 * _exact_H(sampled, v, 0.0) + _exact_H(sampled, v, -eps)) / eps ** 2
    d = probe.config.to_dict()
    d["second_order"]["method"] = "finite_difference"
    fd_config = config_from_dict(d)
    for weighted in (True, False):
        so = beyond_both[weighted].second_order
        fd = second_order_phase(fd_config, probe.policy, E_s, _with_weights(est, s if weighted else None),
                                beyond_both[weighted].truth)
        print(f"\n{'corrected' if weighted else 'uncorrected'}: jvp d2 {so['d2']:.4g} ± {so['se']:.2g}, "
              f"second difference {fd['d2']:.4g} ± {fd['se']:.2g}, exact {exact:.4g}")
        for entry in (so, fd):
            assert _within(entry["d2"], entry["se"], exact) is weighted, (weighted, entry["method"], entry, exact)
    assert beyond_both[True].second_order["se"] < 0.5 * abs(exact), "the test must be sharp enough"


def test_direct_only_corrected_matches_enumeration(sampled, beyond_both):
    """direct_only = Σ_y q_θ(y) Σ_k D_v H_k(y) / Σ_y q_θ(y) T(y): with the weights, X_H = ∇Σ s H / Σ s T."""
    probe, _, est, _, model64 = sampled
    v, lr, eps = est.delta_h1.v, est.delta_h1.learning_rate, 1e-4
    params = {n: p.detach() for n, p in model64.named_parameters()}
    q0, _, _, _, lengths = _enumerated(model64, params, probe.tokenizer, MAX_NEW)
    dh = (_enumerated(model64, _shifted(params, v, eps), probe.tokenizer, MAX_NEW)[3]
          - _enumerated(model64, _shifted(params, v, -eps), probe.tokenizer, MAX_NEW)[3]) / (2 * eps)
    exact = float((q0 * dh).sum() / (q0 * lengths).sum())
    w, u = (beyond_both[k].predictors["direct_only"] for k in (True, False))
    print(f"\ndirect_only corrected {w['delta_h1'] / lr:.4g} ± {w['se_E'] / lr:.2g}, uncorrected "
          f"{u['delta_h1'] / lr:.4g} ± {u['se_E'] / lr:.2g}, exact {exact:.4g}")
    assert _within(w["delta_h1"] / lr, w["se_E"] / lr, exact), (w, exact)
    assert w["from_pieces"] == pytest.approx(w["delta_h1"], rel=1e-4)
    assert w["se_E"] < 0.5 * abs(w["delta_h1"]), "the test must be sharp enough to mean something"

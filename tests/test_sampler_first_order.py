"""The first-order E side under the sampler's correction (docs/maths.md §12): E drawn by a sampler q_s other than
the policy q_θ (the toy model at another temperature, or with a logit bias on EOS, tests/sampler_toy.py), every
E-side number weighted by s_i = q_θ(y_i)/q_s(y_i).

- exactness: the corrected Ĥ and δH₁/lr agree with brute-force enumeration within 4 SE (per_token and
  per_sequence, at another temperature and under an EOS bias); under the EOS bias the same batch without the
  correction is more than 4 SE off for both;
- a sampler equal to the policy gives weights ≈ 1 and the uncorrected numbers; no sampler log-probs: no weights;
- backward_hooks, jvp and two_pass agree under weights; two "ranks" with different weight scales (and rescaled
  weights) add up to one process;
- the per-sequence parts s_i·(a_i − Ĥ r_i)·lr/D add up to δH₁; the E-token dH add up to the weighted direct_only.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from entropy_experiments.estimators import entropy_gradient
from entropy_experiments.estimators.entropy_gradient import e_microbatches, finish_one_pass, one_pass_sums
from entropy_experiments.estimators.jackknife import jackknife_ratio_se
from entropy_experiments.estimators.sampler_correction import normalised_weights, sampler_log_weights
from entropy_experiments.probe import recipe
from tests.probe_helpers import make_probe
from tests.sampler_toy import draw_from_sampler, sampler_token_logqs, with_sampler_logqs
from tests.test_probe import TOY_PROMPTS, _exact_entropy, _shifted, toy_dir, toy_prompts_file  # noqa: F401

MAX_NEW = 3


def _toy_probe(toy_dir, toy_prompts_file, B_E: int, seed: int, **sections):  # noqa: F811
    config = {"seed": seed, "batch_config": {"B_E": B_E, "B_U": 8, "G": 4},
              "generation": {"max_new_tokens": MAX_NEW, "gen_batch_size": 1024, "tf_batch_size": 1024},
              "estimator": {"microbatch_size": 1024}, "importance": {"enabled": False}, "variance": {"u_groups": 4}}
    for key, values in sections.items():
        config.setdefault(key, {}).update(values)
    return make_probe(toy_dir, toy_prompts_file, config)


def _sampled(probe, B_E: int, tau_s: float, seed: int):
    """(E drawn by the sampler at temperature tau_s with its log-probs, U, the float64 model copy)."""
    E, U, _ = probe.sample(B_E=B_E, B_U=8, G=4)
    model64 = copy.deepcopy(probe.model).double()
    return draw_from_sampler(E, model64, probe.tokenizer, temperature=tau_s, max_new=MAX_NEW, seed=seed), U, model64


def _exact(probe, model64, v, normalize: str) -> tuple[float, float]:
    """(H(θ), dH(θ + εv)/dε at 0) by enumeration at the policy's temperature 1."""
    params = {n: p.detach() for n, p in model64.named_parameters()}

    def H(s):
        return _exact_entropy(model64, _shifted(params, v, s), probe.tokenizer, TOY_PROMPTS, 1.0, normalize, MAX_NEW)

    eps = 1e-5
    return H(0.0), (H(eps) - H(-eps)) / (2 * eps)


def _entropy_se(rows: list[dict], normalize: str) -> float:
    """Jackknife SE of the weighted Ĥ = Σ s h / Σ s d from per_sequence.jsonl's rows (one unit per sequence)."""
    log_w = np.array([row.get("sampler_log_weight", 0.0) for row in rows])
    s = np.exp(log_w - log_w.max())
    h = np.array([row["h"] for row in rows])
    d = np.array([row["T"] for row in rows], dtype=float) if normalize == "per_token" else np.ones(len(rows))
    return jackknife_ratio_se(s * h, s * d)


def _z_against_enumeration(probe, E_s, U, model64, normalize: str) -> tuple[dict, dict]:
    """(z, corrected results): z = (estimate − exact)/SE of Ĥ and δH₁/lr, with ("H", "slope") and without
    ("H_uncorrected", "slope_uncorrected") the sampler's correction, on the sampler-drawn E_s."""
    corrected = probe.run(batches=(E_s, U))
    uncorrected = probe.run(batches=(with_sampler_logqs(E_s, None), U))
    H_exact, slope_exact = _exact(probe, model64, corrected.update_vector, normalize)
    r, u = corrected.results, uncorrected.results
    lr = r["learning_rate"]
    se_slope, se_slope_u = r["se"]["E"] / lr, u["se"]["E"] / lr
    se_H, se_H_u = _entropy_se(corrected.per_sequence_rows, normalize), _entropy_se(uncorrected.per_sequence_rows,
                                                                                    normalize)
    z = {"H": (r["H_orig"][normalize] - H_exact) / se_H, "H_uncorrected": (u["H_orig"][normalize] - H_exact) / se_H_u,
         "slope": (r["x_hat_dot_v"] - slope_exact) / se_slope,
         "slope_uncorrected": (u["x_hat_dot_v"] - slope_exact) / se_slope_u}
    print(f"\n{normalize}: ESS/E {r['sampler']['correction']['ess_frac']:.3f}, z {z}")
    assert se_slope < 0.25 * abs(slope_exact), "the test must be sharp enough to mean something"
    assert r["sampler"]["correction"]["ess_frac"] < 0.99 and u["sampler"]["correction"] is None
    assert "sampler_log_weight" in corrected.per_sequence_rows[0]
    assert "sampler_log_weight" not in uncorrected.per_sequence_rows[0]
    return z, r


# A sampler that only changes the temperature: the corrected numbers are exact. On this toy the per-token
# quantities hardly feel the temperature (|bias| < 1 SE at B_E = 3000 for τ_s in [0.5, 4]) and the slope's bias
# stays near 2 SE, so only per_sequence Ĥ at τ_s = 3 is seen off without the correction; the EOS-bias test below
# is the one that shows every uncorrected number off.
@pytest.mark.e2e
@pytest.mark.parametrize("normalize,tau_s,uncorrected_off", [("per_token", 1.6, False), ("per_sequence", 3.0, True)])
def test_corrected_first_order_is_exact_at_another_temperature(toy_dir, toy_prompts_file, normalize,  # noqa: F811
                                                               tau_s, uncorrected_off):
    probe = _toy_probe(toy_dir, toy_prompts_file, 3000, 3, estimator={"normalize": normalize})
    E_s, U, model64 = _sampled(probe, 3000, tau_s, seed=11)
    z, _ = _z_against_enumeration(probe, E_s, U, model64, normalize)
    assert abs(z["H"]) < 4 and abs(z["slope"]) < 4, z
    if uncorrected_off:
        assert abs(z["H_uncorrected"]) > 5, z


# EOS made e^1.5 ≈ 4.5 times less likely inside the sampler only: longer responses, so the uncorrected Ĥ and δH₁
# move by many SE (seen at B_E = 3000: per_token z −8.4 and −10.7, per_sequence z 19.3 and 15.5) while ESS/E
# stays 0.64.
EOS_BIAS = -1.5


@pytest.mark.e2e
@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_corrected_first_order_is_exact_and_uncorrected_is_not(toy_dir, toy_prompts_file, normalize):  # noqa: F811
    probe = _toy_probe(toy_dir, toy_prompts_file, 3000, 3, estimator={"normalize": normalize})
    E, U, _ = probe.sample(B_E=3000, B_U=8, G=4)
    model64 = copy.deepcopy(probe.model).double()
    E_s = draw_from_sampler(E, model64, probe.tokenizer, temperature=1.0, max_new=MAX_NEW, seed=11,
                            logit_bias={probe.tokenizer.eos_token_id: EOS_BIAS})
    z, r = _z_against_enumeration(probe, E_s, U, model64, normalize)
    assert abs(z["H"]) < 4 and abs(z["slope"]) < 4, z
    assert abs(z["H_uncorrected"]) > 4 and abs(z["slope_uncorrected"]) > 4, z
    assert r["sampler"]["correction"]["ess_frac"] >= 0.5


@pytest.mark.e2e
def test_sampler_equal_to_policy_gives_unit_weights_and_the_uncorrected_numbers(toy_dir, toy_prompts_file):  # noqa: F811
    probe = _toy_probe(toy_dir, toy_prompts_file, 400, 4)
    E, U, _ = probe.sample(B_E=400, B_U=8, G=4)
    model64 = copy.deepcopy(probe.model).double()
    own = with_sampler_logqs(E, sampler_token_logqs(E, model64, temperature=1.0))
    plain = probe.run(batches=(E, U)).results
    weighted = probe.run(batches=(own, U))
    w = weighted.results
    log_w = np.array([row["sampler_log_weight"] for row in weighted.per_sequence_rows])
    assert np.abs(log_w).max() < 1e-4, np.abs(log_w).max()
    assert w["sampler"]["correction"]["ess_frac"] > 0.999999
    assert plain["sampler"]["correction"] is None
    for key in ("deltaH1", "x_hat_dot_v"):
        assert w[key] == pytest.approx(plain[key], rel=1e-4, abs=0), key
    assert w["se"]["E"] == pytest.approx(plain["se"]["E"], rel=1e-3)
    assert w["H_orig"]["per_token"] == pytest.approx(plain["H_orig"]["per_token"], rel=1e-6)


def test_without_sampler_log_probs_the_result_carries_no_weights(toy_dir, toy_prompts_file):  # noqa: F811
    probe = _toy_probe(toy_dir, toy_prompts_file, 64, 6)
    E, U, _ = probe.sample(B_E=64, B_U=8, G=4)
    for per_sequence_pieces in (True, False):
        res = recipe.delta_h1_phase(probe.config, probe.policy, E, U, per_sequence_pieces=per_sequence_pieces)
        assert res.sampler_weights is None and res.coefficients.weights is None


def _paths(probe, E, U):
    """{method: DeltaH1Result} for backward_hooks, jvp and two_pass on the same E and U."""
    out = {}
    for method, directional, pieces in (("backward_hooks", "auto", True), ("jvp", "jvp", True),
                                        ("two_pass", "auto", False)):
        config = probe.config.model_copy(update={"variance": probe.config.variance.model_copy(
            update={"directional": directional})})
        out[method] = recipe.delta_h1_phase(config, probe.policy, E, U, u_groups=[[0, 1, 2, 3], [4, 5, 6, 7]],
                                            per_sequence_pieces=pieces)
    return out


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_backward_hooks_jvp_and_two_pass_agree_under_weights(toy_dir, toy_prompts_file, normalize):  # noqa: F811
    probe = _toy_probe(toy_dir, toy_prompts_file, 96, 7, estimator={"normalize": normalize, "microbatch_size": 16})
    E_s, U, _ = _sampled(probe, 96, 0.7, seed=5)
    res = _paths(probe, E_s, U)
    hooks, jvp, two = res["backward_hooks"], res["jvp"], res["two_pass"]
    assert hooks.e_pass == "backward_hooks" and jvp.e_pass == "jvp" and two.e_pass == "two_pass" and two.pieces is None
    s = hooks.sampler_weights
    assert s is not None and s.mean().item() == pytest.approx(1.0) and s.std().item() > 0.05
    for other in (jvp, two):
        assert torch.allclose(other.sampler_weights, s, rtol=1e-5)
        assert other.coefficients.H_hat == pytest.approx(hooks.coefficients.H_hat, rel=1e-6)
        assert other.coefficients.D == pytest.approx(hooks.coefficients.D, rel=1e-6)
        assert other.delta_h1 == pytest.approx(hooks.delta_h1, rel=1e-4)
        for n in hooks.X_hat:
            scale = hooks.X_hat[n].abs().max().item()
            assert torch.allclose(other.X_hat[n], hooks.X_hat[n], rtol=1e-4, atol=1e-5 * scale), n
    for (a, r), (a_ref, r_ref) in [(hooks.pieces, jvp.pieces)]:
        assert torch.allclose(a, a_ref, rtol=1e-4, atol=1e-5 * a_ref.abs().max().item())
        assert torch.allclose(r, r_ref, rtol=1e-4, atol=1e-5 * max(r_ref.abs().max().item(), 1e-30))
    # the per-sequence parts lr·s_i·(a_i − Ĥ r_i)/D add up to δH₁ (what the attribution and SE_E rest on)
    for out in (hooks, jvp):
        a, r = out.pieces
        c = out.coefficients
        parts = out.learning_rate * s * (a - c.H_hat * r) / c.D
        assert float(parts.sum()) == pytest.approx(out.delta_h1, rel=1e-4)


def test_split_microbatches_with_their_own_weight_scales_add_up(toy_dir, toy_prompts_file, monkeypatch):  # noqa: F811
    """Two 'ranks' (halves of the microbatches) each keep their own weight scale c — rescaled whenever a microbatch
    has a larger weight (headroom 0), one of them moved to another scale — and are put on the largest c before
    adding up, as probe/parallel.py does: the same X̂ and pieces as one process."""
    probe = _toy_probe(toy_dir, toy_prompts_file, 96, 8, estimator={"microbatch_size": 16})
    E_s, U, _ = _sampled(probe, 96, 1.5, seed=6)
    config, policy = probe.config, probe.policy
    v = recipe.update_phase(config, policy, U, None).v
    options = config.entropy_options()
    mbs = e_microbatches(E_s.num_prompts, 1, options.microbatch_size)
    one = recipe.one_pass_phase(config, policy, E_s, {recipe.MAIN: v})
    monkeypatch.setattr(entropy_gradient, "LOG_WEIGHT_HEADROOM", 0.0)
    half = len(mbs) // 2
    parts = [one_pass_sums(policy.engine, policy.trainable, E_s, chunk, options, {recipe.MAIN: v},
                           agree_on_shift=lambda s: 3.0) for chunk in (mbs[:half], mbs[half:])]
    parts[1].rescale(parts[1].log_weight_shift + 2.5)  # a rank whose weights drifted to another scale
    assert parts[0].log_weight_shift != parts[1].log_weight_shift
    top = max(p.log_weight_shift for p in parts)
    for p in parts:
        p.rescale(top)
    total = parts[0]
    for p in parts[1:]:
        for mine, theirs in ((total.X_alpha, p.X_alpha), (total.X_beta, p.X_beta)):
            for n in mine:
                mine[n] += theirs[n]
        total.a[recipe.MAIN] += p.a[recipe.MAIN]
        total.r[recipe.MAIN] += p.r[recipe.MAIN]
        total.rows.update(p.rows)
    scores = one.scores
    X, coefs, pieces = finish_one_pass(total, scores, options, E_s.sampler_response_logqs())
    for n in X:
        assert torch.allclose(X[n], one.X_hat[n], rtol=1e-4, atol=1e-5 * one.X_hat[n].abs().max().item()), n
    a_ref = one.pieces[recipe.MAIN][0]
    assert torch.allclose(pieces[recipe.MAIN][0], a_ref, rtol=1e-4, atol=1e-5 * a_ref.abs().max().item())
    log_s = sampler_log_weights(scores.token_logqs, E_s.sampler_response_logqs())
    assert torch.allclose(coefs.weights, torch.from_numpy(normalised_weights(log_s)))


@pytest.mark.e2e
def test_e_token_attribution_is_weighted(toy_dir, toy_prompts_file):  # noqa: F811
    probe = _toy_probe(toy_dir, toy_prompts_file, 96, 9, variance={"directional": "jvp", "u_groups": 4})
    E_s, U, _ = _sampled(probe, 96, 1.5, seed=7)
    outcome = probe.run(batches=(E_s, U))
    summary = outcome.results["attribution"]["E_tokens"]
    scores = recipe.score_E(probe.config, probe.policy, E_s, outcome.update_vector)
    s = normalised_weights(sampler_log_weights(scores.token_logqs, E_s.sampler_response_logqs()))
    lr = outcome.results["learning_rate"]
    explicit = sum(w * lr * float(d.sum()) for w, d in zip(s, scores.d_entropy))
    D = float(sum(w * len(t) for w, t in zip(s, scores.token_logqs)))
    assert summary["sum_dH"] == pytest.approx(explicit, rel=1e-6)
    assert summary["direct_only"] == pytest.approx(explicit / D, rel=1e-6)
    assert summary["normalizer"] == pytest.approx(D, rel=1e-9)

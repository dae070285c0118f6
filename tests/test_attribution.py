"""Attribution (docs/attribution.md) against independent references.

- U groups: each influence against δH₁ − δH₁(without the group) recomputed from scratch: the trainer objective's
  gradient on U minus that group's prompts, its AdamW step from the loaded state and X̂ on the same E, all
  through a fresh `recipe.delta_h1_phase` (no leave-one-out shortcut);
- E tokens: on the enumerable model, each token's dH/lr against the central difference in float64 of that
  prefix's exact entropy along v, by the jvp and by the differences of the ΔH passes (the default's forward
  difference at 1e−5, the central one at 1e−4) within their measured errors; Σ dH / D against `direct_only`;
- the share of the top tokens against a sort written in the test.
"""

from __future__ import annotations

import copy
import math
import types

import numpy as np
import pytest
import torch

from entropy_experiments.data.batch import Batch
from entropy_experiments.estimators.attribution import top_share
from entropy_experiments.probe import recipe
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts
from tests.test_probe import _shifted, toy_dir, toy_prompts_file  # noqa: F401  (fixtures)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl", SHORT_PROMPTS)


def _outcome(probe):
    captured = {}
    outcome = probe.run(on_batches=lambda E, U: captured.update(E=E, U=U))
    return outcome, captured["E"], captured["U"]


def _delta_h1_from_scratch(probe, E: Batch, U: Batch) -> float:
    """δH₁ on (E, U) by the recipe's own phase, v rebuilt from U's gradient and the saved AdamW state."""
    return recipe.delta_h1_phase(probe.config, probe.policy, E, U).delta_h1


@pytest.mark.e2e
@pytest.mark.parametrize("u_groups", [None, 2])
def test_u_influence_is_delta_h1_minus_delta_h1_without_the_group(tiny_model_dir, prompts_file, u_groups):
    probe = make_probe(tiny_model_dir, prompts_file, {
        "batch_config": {"B_E": 8, "B_U": 4, "G": 2}, "importance": {"enabled": False},
        "second_order": {"enabled": False}, "predictors": {"enabled": False},
        "variance": {"u_groups": u_groups}, "objective": {"max_grad_norm": 1e9},
        "output": {"token_attribution": u_groups is not None}})
    outcome, E, U = _outcome(probe)
    att, dh1 = outcome.results["attribution"], outcome.results["deltaH1"]
    if u_groups is None:  # output.token_attribution off: no token attribution
        assert att["E_tokens"] is None and outcome.e_tokens is None
    else:  # on (the default), with the predictors off too
        assert att["E_tokens"] is not None
        assert len(outcome.e_tokens["dH"]) == sum(sum(int(T) for T in row) for row in E.gen_lens)
    rows = att["U_groups"]
    assert len(rows) == (u_groups or 4)
    assert [abs(r["influence"]) for r in rows] == sorted((abs(r["influence"]) for r in rows), reverse=True)
    assert abs(_delta_h1_from_scratch(probe, E, U) - dh1) <= 1e-5 * abs(dh1)
    for row in rows:
        keep = [p for p in range(U.num_prompts) if p not in row["prompt_index"]]
        without = _delta_h1_from_scratch(probe, E, U.subset(keep))
        assert abs(row["influence"] - (dh1 - without)) <= 1e-4 * abs(dh1), (row, dh1, without)
        assert row["rewards"] == [[float(r) for r in U.rewards[p]] for p in row["prompt_index"]]
        for p, adv in zip(row["prompt_index"], row["advantages"]):  # Dr-GRPO: r − mean_g r
            mean = sum(U.rewards[p]) / len(U.rewards[p])
            assert adv == pytest.approx([r - mean for r in U.rewards[p]], abs=1e-6)
    summary = att["U_summary"]
    assert summary["sum_influence"] == pytest.approx(sum(r["influence"] for r in rows), rel=1e-12)
    print(f"\nK={len(rows)}: Σ influence = {summary['sum_influence']:.4e}, δH₁ = {dh1:.4e}, "
          f"ratio {summary['sum_over_delta_h1']:.3g}")


def test_top_share_against_a_sort_in_the_test():
    rng = np.random.default_rng(0)
    dH = rng.standard_normal(1000) * rng.exponential(1.0, 1000)
    for fraction in (0.01, 0.1, 0.2):
        got = top_share(dH, fraction)
        k = math.ceil(fraction * dH.size)
        by_size = sorted(dH, key=abs, reverse=True)[:k]
        assert got["tokens"] == k
        assert got["share_of_sum"] == pytest.approx(sum(by_size) / dH.sum(), rel=1e-12)
        assert got["share_of_abs_sum"] == pytest.approx(sum(abs(x) for x in by_size) / np.abs(dH).sum(), rel=1e-12)
    assert top_share(np.zeros(0), 0.1)["share_of_sum"] is None
    assert top_share(np.array([5.0]), 0.01)["tokens"] == 1


def _true_float64(model):
    """`model` (a deep copy) computing in float64 throughout: transformers' RMSNorm and eager softmax round to fp32
    on the way (noise ~1e-7 that a finite difference divides by ε); sdpa on CPU and the RMSNorm below do not."""
    model = copy.deepcopy(model).double()
    for m in model.modules():
        if type(m).__name__.endswith("RMSNorm"):
            m.forward = types.MethodType(lambda self, x: self.weight * (
                x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)), m)
    model.set_attn_implementation("sdpa")
    return model.eval()


def _prefix_entropies(model64, params: dict, E: dict, n: int) -> torch.Tensor:
    """H_t of sequence n at every response position, float64, by one forward of the unpadded prompt + response."""
    G = E.num_responses_per_prompt
    b, g = divmod(n, G)
    row, mask = E.sequences[b, g], E.attention_masks[b, g].bool()
    start, T = int(E.prompt_lens[b]), int(E.gen_lens[b][g])
    ids = row[:start + T][mask[:start + T]]
    prompt_len = int(mask[:start].sum())
    logits = torch.func.functional_call(model64, params, (ids[None],))["logits"][0]
    logq = torch.log_softmax(logits[prompt_len - 1: prompt_len - 1 + T], -1)
    return -(logq.exp() * logq).sum(-1)


# (variance.directional, importance, the derivative expected, its tolerance relative to the largest |D_v H_t|)
TOKEN_CASES = [("auto", {"enabled": False}, ("jvp", None), 1e-4),       # no ΔH pass: the jvp pass
               ("jvp", {"enabled": False}, ("jvp", None), 1e-4),        # the jvp pieces' scores, reused
               ("auto", {"eta_list": [1e-5], "symmetric": False}, ("forward_difference", 1e-5), 5e-2),  # default
               ("auto", {"eta_list": [1e-5, 1e-4], "symmetric": True}, ("central_difference", 1e-4), 2e-3)]


@pytest.mark.e2e
@pytest.mark.parametrize(("directional", "importance", "method", "tolerance"), TOKEN_CASES)
def test_token_dH_is_the_exact_derivative_of_each_prefix_entropy(toy_dir, toy_prompts_file, directional,  # noqa: F811
                                                                 importance, method, tolerance):
    probe = make_probe(toy_dir, toy_prompts_file, {
        "seed": 3, "batch_config": {"B_E": 12, "B_U": 4, "G": 2},
        "generation": {"max_new_tokens": 4}, "importance": importance,
        "second_order": {"enabled": False}, "variance": {"directional": directional}})
    outcome, E, _ = _outcome(probe)
    res, cols = outcome.results, outcome.e_tokens
    lr, v = res["learning_rate"], outcome.update_vector
    assert res["e_pass"] == ("backward_hooks" if directional == "auto" else "jvp")
    summary = res["attribution"]["E_tokens"]
    assert (summary["dH_method"], summary["dH_eta"]) == method
    model64 = _true_float64(probe.model)
    params = {n: p.detach() for n, p in model64.named_parameters()}
    eps = 1e-5
    seq = np.asarray(cols["sequence"])
    errors, scale = [], 0.0
    for n in sorted(set(seq.tolist())):
        at = seq == n
        H0 = _prefix_entropies(model64, params, E, n).numpy()
        slope = ((_prefix_entropies(model64, _shifted(params, v, eps), E, n)
                  - _prefix_entropies(model64, _shifted(params, v, -eps), E, n)) / (2 * eps)).numpy()
        assert np.asarray(cols["position"])[at].tolist() == list(range(len(H0)))
        np.testing.assert_allclose(np.asarray(cols["H"])[at], H0, rtol=1e-5, atol=1e-6)
        # the probe's jvp runs through the fp32 model: agreement to fp32 rounding (measured ≤ 5e-5 relative); a
        # difference of the ΔH passes to its truncation and rounding (docs/attribution.md "How dH is computed")
        errors.append(np.abs(np.asarray(cols["dH"])[at] / lr - slope).max())
        scale = max(scale, np.abs(slope).max())
        if method[0] == "jvp":
            np.testing.assert_allclose(np.asarray(cols["dH"])[at] / lr, slope, rtol=1e-4,
                                       atol=1e-6 * np.abs(slope).max())
    print(f"\n{method}: largest error {max(errors) / scale:.2e} of the largest |D_v H_t|")
    assert max(errors) <= tolerance * scale
    assert np.abs(np.asarray(cols["dH"])).max() > 0
    # Σ_t dH_t / D is the direct_only predictor (a backward X_H·v: fp32 gradient buffers)
    direct = res["predictors"]["direct_only"]["delta_h1"]
    assert summary["tokens"] == len(seq) == res["counts"]["E_tokens"]
    assert summary["normalizer"] == len(seq)  # per_token: D = Σ T
    assert summary["direct_only"] == pytest.approx(direct, rel=max(1e-4, tolerance))
    top = summary["top"][0]
    assert abs(top["dH"]) == pytest.approx(np.abs(cols["dH"]).max(), rel=1e-12)
    assert top["token"] == probe.tokenizer.decode([top["token_id"]])


@pytest.mark.e2e
def test_u_influences_sum_to_zero_when_the_step_is_linear_in_g(tiny_model_dir, prompts_file):
    """v = −g (update_direction sgd) and the prompt-averaging Dr-GRPO loss over equal groups: influence_k =
    (c_k − mean_{j≠k} c_j)/K, so Σ_k influence_k = 0 — the sum is a measure of Adam's nonlinearity only."""
    probe = make_probe(tiny_model_dir, prompts_file, {
        "batch_config": {"B_E": 8, "B_U": 4, "G": 2}, "importance": {"enabled": False},
        "second_order": {"enabled": False}, "predictors": {"enabled": False},
        "estimator": {"update_direction": "sgd"}})
    att = _outcome(probe)[0].results["attribution"]
    influences = [r["influence"] for r in att["U_groups"]]
    assert max(abs(x) for x in influences) > 0
    assert abs(sum(influences)) <= 1e-4 * max(abs(x) for x in influences), influences

"""A token's dH within its stated error (docs/attribution.md "How dH is computed"), on the enumerable toy model.

With `importance.eta_list: [0.005]` (a forward difference there was 30 % off), each token's dH/lr against the
central difference in float64 of that prefix's exact entropy along v: within results.json's stated error
(`attribution.E_tokens.dH_error.max`), or the run warns. The default second order's ±1e−3 passes give the central
difference, the 0.005 pass its error estimate.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.probe_helpers import make_probe
from tests.test_attribution import _outcome, _prefix_entropies, _true_float64
from tests.test_probe import _shifted, toy_dir, toy_prompts_file  # noqa: F401


@pytest.mark.e2e
def test_every_token_within_its_stated_error_or_a_warning(toy_dir, toy_prompts_file):  # noqa: F811
    probe = make_probe(toy_dir, toy_prompts_file, {
        "seed": 3, "batch_config": {"B_E": 12, "B_U": 4, "G": 2}, "generation": {"max_new_tokens": 4},
        "importance": {"eta_list": [0.005], "symmetric": False}})
    outcome, E, _ = _outcome(probe)
    res, cols = outcome.results, outcome.e_tokens
    lr, v = res["learning_rate"], outcome.update_vector
    summary = res["attribution"]["E_tokens"]
    stated = summary["dH_error"]
    model64 = _true_float64(probe.model)
    params = {n: p.detach() for n, p in model64.named_parameters()}
    eps, seq = 1e-5, np.asarray(cols["sequence"])
    errors, scale = [], 0.0
    for n in sorted(set(seq.tolist())):
        at = seq == n
        slope = ((_prefix_entropies(model64, _shifted(params, v, eps), E, n)
                  - _prefix_entropies(model64, _shifted(params, v, -eps), E, n)) / (2 * eps)).numpy()
        errors.append(np.abs(np.asarray(cols["dH"])[at] - lr * slope).max())
        scale = max(scale, lr * np.abs(slope).max())
    worst = max(errors)
    warned = any(w.startswith("attribution: a token's dH") for w in res["warnings"])
    print(f"\n{summary['dH_method']} at {summary['dH_eta']}: largest error {worst:.3g} ({worst / scale:.2%} of the "
          f"largest |dH_t|), stated {stated}, warned {warned}")
    assert summary["dH_method"] != "forward_difference"  # 0.005 is past the forward difference's measured limit
    if stated["max"] is not None:
        assert stated["share_of_largest"] == pytest.approx(stated["max"] / np.abs(cols["dH"]).max())
    assert warned or worst <= stated["max"], (worst, stated)
    assert warned == ("warning" in stated)

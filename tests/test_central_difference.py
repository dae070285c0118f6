"""r_i by the central difference of the ±η passes (estimators/central_difference.py) against the exact pieces of
the second backward (`one_pass_sums` with the row hooks) on the tiny model, on the same E and U:

* X̂ and D_v L_X,i of ONE backward of L_X give X̂ (1e-5) and, with r_i, a_i = D·D_v L_X,i + Ĥ·r_i;
* with the exact r_i the lean a_i equal the exact ones (1e-6 of max |a|);
* with r_i by the central difference at η = 1e-4 (the tiny model's best η: truncation O(η²) above it, fp32
  rounding ∝ 1/η below), max |r_cd − r| ≤ 1 % of max |r| and SE_E moves by ≤ 1 % of itself — far below SE_E;
  δH₁ from the pieces does not depend on r at all (the Ĥ·r terms cancel in A − Ĥ·B).
"""

from __future__ import annotations

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.estimators.central_difference import central_difference_r, pieces_from_rows
from entropy_experiments.estimators.delta_h import score_at_eta
from entropy_experiments.estimators.entropy_gradient import (
    coefficients,
    e_microbatches,
    surrogate_gradient_rows,
)
from entropy_experiments.estimators.jackknife import se_E
from entropy_experiments.estimators.sequence_scores import score_sequences
from entropy_experiments.probe import recipe
from entropy_experiments.probe.results import WarningLog
from tests.run_helpers import make_run_setup

ETA = 1.0e-4


@pytest.fixture(scope="module")
def both(tmp_path_factory, tiny_model_dir):
    """(exact DeltaH1Result by one_pass_sums, lean X̂, D_v L_X rows, coefficients, scores, r_cd)."""
    _, d = make_run_setup(tmp_path_factory.mktemp("cd"), tiny_model_dir, estimator={"microbatch_size": 4},
                          batch_config={"B_E": 12})
    config = config_from_dict(d)
    policy = recipe.load_phase(config, recipe.SINGLE, WarningLog())
    samples = recipe.sample_phase(config, policy.engine)
    E = samples.E
    res = recipe.delta_h1_phase(config, policy, E, samples.U, per_sequence_pieces=True)
    assert res.e_pass == "backward_hooks"
    options = config.entropy_options()
    scores = score_sequences(policy.engine, E)
    coefs = coefficients(scores, options)
    X, rows = surrogate_gradient_rows(policy.engine, policy.trainable, E,
                                      e_microbatches(E.num_prompts, E.num_responses_per_prompt,
                                                     options.microbatch_size), coefs, {"v": res.v})
    plus, minus = (score_at_eta(policy.engine, E, res.v, s * ETA) for s in (1, -1))
    return res, X, rows["v"], coefs, scores, central_difference_r(plus.token_logqs, minus.token_logqs, coefs, ETA)


def test_one_backward_gives_x_hat_and_with_the_exact_r_the_exact_a(both):
    res, X, rows, coefs, _, _ = both
    for name, x in res.X_hat.items():
        assert torch.allclose(X[name].float(), x, rtol=1e-5, atol=1e-5 * float(x.abs().max()))
    a, r = res.pieces
    a_lean, _ = pieces_from_rows(rows, r, coefs)
    assert float((a_lean - a).abs().max()) <= 1e-6 * float(a.abs().max())


def test_central_difference_r_is_close_and_moves_se_e_far_less_than_se_e(both):
    res, _, rows, coefs, scores, r_cd = both
    a, r = res.pieces
    assert float((r_cd - r).abs().max()) <= 1e-2 * float(r.abs().max())
    args = (scores.seq_entropies, scores.lengths, scores.unit_of_sequence)
    exact = se_E(a, r, *args, normalize="per_token", learning_rate=res.learning_rate)
    lean = se_E(*pieces_from_rows(rows, r_cd, coefs), *args, normalize="per_token", learning_rate=res.learning_rate)
    assert lean[0] == pytest.approx(exact[0], rel=1e-5)
    assert abs(lean[1] - exact[1]) <= 1e-2 * exact[1]


def test_the_central_difference_needs_a_positive_eta(both):
    _, _, _, coefs, scores, _ = both
    with pytest.raises(ValueError, match="η > 0"):
        central_difference_r(scores.token_logqs, scores.token_logqs, coefs, 0.0)

"""The sampler correction's pure maths (estimators/sampler_correction.py) against direct computation."""

import numpy as np
import pytest
import torch

from entropy_experiments.estimators.sampler_correction import (
    correction_diagnostics,
    correction_warnings,
    normalised_weights,
    sampler_log_weights,
)


def test_log_weights_are_the_sequence_log_ratio():
    lq = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    ls = [torch.tensor([-1.5, -2.0]), torch.tensor([-0.25])]
    assert sampler_log_weights(lq, ls).tolist() == [0.5, -0.25]
    w = normalised_weights(np.array([0.5, -0.25]))
    assert w.sum() == pytest.approx(2.0, abs=1e-15)
    assert w[0] / w[1] == pytest.approx(np.exp(0.75), rel=1e-14)


def test_outside_the_policy_nucleus_is_weight_zero_and_bad_sampler_rows_raise():
    w = normalised_weights(sampler_log_weights([torch.tensor([-np.inf]), torch.tensor([-1.0])],
                                               [torch.tensor([-1.0]), torch.tensor([-1.0])]))
    assert w.tolist() == [0.0, 2.0]
    with pytest.raises(ValueError, match="not all finite"):
        sampler_log_weights([torch.tensor([-1.0])], [torch.tensor([-np.inf])])
    with pytest.raises(ValueError, match="2 scored tokens but 1"):
        sampler_log_weights([torch.tensor([-1.0, -1.0])], [torch.tensor([-1.0])])


def test_mean_token_kl_estimates_the_sampler_policy_kl():
    """Tokens drawn from a categorical q_s, scored under q_θ: the per-token estimate → KL(q_s ‖ q_θ)."""
    rng = np.random.default_rng(0)
    q_theta = np.array([0.5, 0.3, 0.15, 0.05])
    q_s = np.array([0.45, 0.33, 0.16, 0.06])
    draws = rng.choice(4, size=(4000, 5), p=q_s)
    lq = [torch.tensor(np.log(q_theta[row])) for row in draws]
    ls = [torch.tensor(np.log(q_s[row])) for row in draws]
    d = correction_diagnostics(lq, ls)
    exact = float(np.sum(q_s * np.log(q_s / q_theta)))
    per_token = np.log(q_s[draws]) - np.log(q_theta[draws])
    assert d["mean_token_kl"] == pytest.approx(exact, abs=4 * per_token.std() / np.sqrt(per_token.size))
    assert d["max_abs_dlogq"] == pytest.approx(np.abs(per_token).max())
    assert d["tokens"] == 20000 and 0.9 < d["ess_frac"] <= 1.0
    assert correction_warnings(d) == []
    assert "ESS/E" in correction_warnings({**d, "ess_frac": 0.5})[0]


def test_sequence_weights_are_none_without_sampler_log_probs_and_mean_one_with_them():
    from entropy_experiments.estimators.sampler_correction import sequence_weights

    lq = [torch.tensor([-1.0, -2.0]), torch.tensor([-0.5])]
    assert sequence_weights(lq, None) is None
    w = sequence_weights(lq, [torch.tensor([-1.5, -2.0]), torch.tensor([-0.25])])
    assert w.mean() == pytest.approx(1.0, abs=1e-15) and w[0] / w[1] == pytest.approx(np.exp(0.75), rel=1e-14)


def test_a_gathered_batch_reports_the_tokens_of_every_rank():
    """Batch.concat of per-rank batches: new tokens summed, wall seconds the longest part's."""
    from entropy_experiments.data.batch import Batch

    def part(tokens, seconds):
        seqs = torch.tensor([[[5, 1, 2]]])
        b = Batch(sequences=seqs, attention_masks=torch.ones_like(seqs), prompt_lens=[1], gen_lens=[[2]],
                  advantages=torch.zeros(1, 1), rewards=[[0.0]], prompt_ids=[0])
        b.generation = {"dtype": "fp32", "engine": "generate", "draws": "row_keyed", "new_tokens": tokens,
                        "seconds": seconds, "tokens_per_s": tokens / seconds}
        return b

    record = Batch.concat([part(10, 2.0), part(30, 4.0)], pad_id=0).generation
    assert record["new_tokens"] == 40 and record["seconds"] == 4.0 and record["tokens_per_s"] == 10.0
    assert record["parts"] == 2 and record["draws"] == "row_keyed"

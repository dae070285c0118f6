"""The sweep's realised change when each checkpoint's E was drawn by a sampler other than its policy (docs/maths.md
§12), on the enumerable toy policy of tests/realised_toy.py: the sampler is each checkpoint's policy at
temperature 3 (logits / 3), drawn with common random numbers as the sweep draws. With each batch's own weights
s = q_own/q_sampler (estimators/sampler_correction.py) under the step's w, the two-direction importance estimate
is calibrated against the exact entropy difference; without them it is not. Also: the interval file keeps s
from the batch's saved sampler log-probs (sweep/cross_scores.py) and reads it back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from entropy_experiments.estimators.realised_change import CrossScored, realised_change_entry
from entropy_experiments.estimators.sampler_correction import normalised_weights, sampler_log_weights
from tests.realised_toy import (
    INDEX,
    LENGTHS,
    MAX_Z,
    RMS_16,
    checkpoints,
    cross_scored,
    draw_E,
    exact_entropy,
    token_tables,
)

SEEDS, INTERVALS, N_DRAWS, LR, SAMPLER_TEMPERATURE = 8, 2, 3000, 1e-2, 3.0


def _tempered(theta):
    return tuple(x / SAMPLER_TEMPERATURE for x in theta)


def _token_logqs(E, theta) -> list[np.ndarray]:
    """Per sequence of E, the per-token log q under θ (its response's tokens only)."""
    with torch.no_grad():
        ell = token_tables(theta)[0].numpy()
    return [ell[c, INDEX[y], :int(LENGTHS[INDEX[y]])] for c, ys in zip(E.prompts, E.responses) for y in ys]


def _with_sampler(side: CrossScored, E, own) -> CrossScored:
    log_s = sampler_log_weights(_token_logqs(E, own), _token_logqs(E, _tempered(own)))
    return CrossScored(side.logw, side.h_own, side.h_other, side.T, side.units,
                       sampler_weights=normalised_weights(log_s))


@pytest.fixture(scope="module")
def intervals() -> list[dict]:
    out = []
    for seed in range(SEEDS):
        thetas = checkpoints(seed, INTERVALS, LR)
        exact = [exact_entropy(t) for t in thetas]
        Es = [draw_E(_tempered(t), N_DRAWS, 1000 + seed) for t in thetas]  # the sampler's draws, common seed
        for i in range(INTERVALS):
            fwd, rev = cross_scored(Es[i], thetas[i], thetas[i + 1]), cross_scored(Es[i + 1], thetas[i + 1], thetas[i])
            corrected = (_with_sampler(fwd, Es[i], thetas[i]), _with_sampler(rev, Es[i + 1], thetas[i + 1]))
            out.append({"exact": exact[i + 1] - exact[i],
                        "corrected": realised_change_entry(*corrected, normalize="per_token"),
                        "uncorrected": realised_change_entry(fwd, rev, normalize="per_token")})
    return out


def _z(intervals, key) -> np.ndarray:
    return np.array([(r[key]["value"] - r["exact"]) / r[key]["se"] for r in intervals])


def test_corrected_realised_change_is_calibrated_and_uncorrected_is_not(intervals):
    z, z_plain = _z(intervals, "corrected"), _z(intervals, "uncorrected")
    rms, rms_plain = float(np.sqrt(np.mean(z ** 2))), float(np.sqrt(np.mean(z_plain ** 2)))
    print(f"\nrms z corrected {rms:.2f}, uncorrected {rms_plain:.2f}")
    assert RMS_16[0] <= rms <= RMS_16[1], z
    assert np.abs(z).max() < MAX_Z, z
    # 16 calibrated z have rms > 2 with probability ≈ 1e-7 (χ²₁₆ > 64): the uncorrected estimate is off
    assert rms_plain > 2, z_plain
    # the entry's ESS/N stays the step's own (≈ 1 for these small steps), not the sampler's
    assert min(r["corrected"]["ess_frac"] for r in intervals) > 0.9
    assert [r["corrected"]["ess_frac"] for r in intervals] == [r["uncorrected"]["ess_frac"] for r in intervals]


def test_interval_file_keeps_the_sampler_weights_of_each_batch(tmp_path):
    """sweep/cross_scores: s from the batch's own scores and its saved sampler log-probs, written and read back
    (absent or null: no correction)."""
    import json
    from types import SimpleNamespace

    from entropy_experiments.sweep.cross_scores import read_cross_scores, sampler_weights_at_own

    own = SimpleNamespace(token_logqs=[torch.tensor([-0.5, -1.0], dtype=torch.float64), torch.tensor([-2.0], dtype=torch.float64)])
    E = SimpleNamespace(sampler_response_logqs=lambda: [torch.tensor([-0.7, -1.1], dtype=torch.float64),
                                                     torch.tensor([-1.5], dtype=torch.float64)])
    s = sampler_weights_at_own(own, E)
    raw = np.exp([0.3, -0.5])
    assert s == pytest.approx(list(raw / raw.mean()), rel=1e-12)
    assert sampler_weights_at_own(own, SimpleNamespace(sampler_response_logqs=lambda: None)) is None
    side = {"logw": [0.0, 0.1], "h_own": [1.0, 2.0], "h_other": [1.1, 2.1], "T": [2, 1], "units": ["0:a", "1:b"]}
    doc = {"n_changed": 0, "n_common_draws": 2, "forward": {**side, "sampler_weights": s}, "reverse": side}
    path = tmp_path / "a__b.json"
    path.write_text(json.dumps(doc))
    fwd, rev, _ = read_cross_scores(path)
    assert fwd.sampler_weights == s and rev.sampler_weights is None

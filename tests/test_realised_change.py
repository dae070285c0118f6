"""The realised change between checkpoints against the EXACT entropy difference, on an enumerable toy policy
(tests/realised_toy.py) whose checkpoints are one real torch AdamW step apart (lr 1e−3) and whose E batches are
drawn with common random numbers, as the sweep draws them: almost no response changes between checkpoints.

- the importance-weighted change (both directions, averaged; estimators/realised_change.py) is calibrated:
  over 8 seeds × 2 intervals, z = (estimate − exact)/SE has rms within [0.5, 1.6] (a calibrated z gives rms
  in [0.66, 1.34] 95 % of the time for 16 draws) and |z| < 3.5 for all;
- the old paired difference Ĥ(E_{N'}; θ_{N'}) − Ĥ(E_N; θ_N) (sweep/stats.paired_difference) fails the same
  test: its rms z is above 5 (it sees only the responses that changed, and few do);
- the jackknife of the averaged estimate equals a delete-one jackknife written out over the units.
"""

from __future__ import annotations

import numpy as np
import pytest

from entropy_experiments.estimators.realised_change import importance_realised_change, realised_change_entry
from entropy_experiments.sweep.stats import paired_difference
from tests.realised_toy import checkpoints, cross_scored, draw_E, exact_entropy, n_changed
from tests.sweep_reference import jackknife

SEEDS, INTERVALS, N_DRAWS, LR = 8, 2, 300, 1e-3


@pytest.fixture(scope="module")
def intervals() -> list[dict]:
    out = []
    for seed in range(SEEDS):
        thetas = checkpoints(seed, INTERVALS, LR)
        exact = [exact_entropy(t) for t in thetas]
        Es = [draw_E(t, N_DRAWS, 1000 + seed) for t in thetas]  # the same seed at every checkpoint
        for i in range(INTERVALS):
            fwd, rev = cross_scored(Es[i], thetas[i], thetas[i + 1]), cross_scored(Es[i + 1], thetas[i + 1], thetas[i])
            out.append({"exact": exact[i + 1] - exact[i], "fwd": fwd, "rev": rev,
                        "new": realised_change_entry(fwd, rev, normalize="per_token"),
                        "old": paired_difference(fwd.h_own, fwd.T, fwd.units, rev.h_own, rev.T, rev.units),
                        "n_changed": n_changed(Es[i], Es[i + 1])})
    return out


def _rms(z) -> float:
    return float(np.sqrt(np.mean(np.square(z))))


def test_importance_realised_change_is_calibrated_against_enumeration(intervals):
    assert np.mean([r["n_changed"] for r in intervals]) < 2, "the setup must be one where responses rarely change"
    z = [(r["new"]["value"] - r["exact"]) / r["new"]["se"] for r in intervals]
    assert 0.5 <= _rms(z) <= 1.6, z
    assert max(abs(v) for v in z) < 3.5, z
    assert min(r["new"]["ess_frac"] for r in intervals) > 0.99
    for side in ("forward", "reverse"):  # each direction alone is calibrated too
        zs = [(r["new"][side]["value"] - r["exact"]) / r["new"][side]["se"] for r in intervals]
        assert 0.5 <= _rms(zs) <= 1.6, (side, zs)


def test_the_old_paired_difference_fails_the_same_test(intervals):
    z = [(r["old"].value - r["exact"]) / r["old"].se for r in intervals]
    assert _rms(z) > 5, z


def test_averaged_jackknife_matches_a_written_out_one(intervals):
    fwd, rev = intervals[0]["fwd"], intervals[0]["rev"]
    units = sorted(set(fwd.units) | set(rev.units))

    def side(s, keep):
        m = np.array([u in keep for u in s.units])
        w = np.exp(s.logw[m] - s.logw[m].max())
        return np.sum(w * s.h_other[m]) / np.sum(w * s.T[m]), np.sum(s.h_own[m]) / np.sum(s.T[m])

    def averaged(keep):
        (fo, fs), (ro, rs) = side(fwd, keep), side(rev, keep)
        return 0.5 * ((fo - fs) + (rs - ro))

    est = importance_realised_change(fwd, rev, normalize="per_token")
    assert est.value == pytest.approx(averaged(set(units)), rel=1e-10)
    assert est.se == pytest.approx(jackknife([averaged(set(units) - {u}) for u in units]), rel=1e-8)

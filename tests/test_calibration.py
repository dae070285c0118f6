"""Calibration of the two error bars side by side, on the enumerable toy model of tests/test_probe.py.

- E side only: U (hence v) and θ fixed, E resampled over many seeds; the spread (std) of δH₁ = lr·X̂·v
  over the seeds must match the mean reported SE_E (delete-one jackknife over E units) within 1.3×.
- U side only: E (hence X̂) fixed, U resampled over many seeds; the spread of δH₁ = lr·X̂·v(U) must match
  the mean reported SE_U (grouped jackknife with v rebuilt through AdamW) within 1.3×.

The reference is the empirical spread over independent batches, which shares nothing with the
jackknife formulas. Each side runs through the recipe's phase functions / the jackknife directly (no full
probe runs): one sampling + one backward per seed. The ratios are printed (`pytest -s`) and carried in
the assertion messages. About 1 s per seed and side on two idle cores (~60 s in all; much more when
the cores are shared), hence `slow`.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from entropy_experiments.checkpoint.learning_rate import resolve_learning_rate
from entropy_experiments.data.datasets import load_examples
from entropy_experiments.data.rewards.weighted import RewardSet
from entropy_experiments.estimators import jackknife as cv
from entropy_experiments.estimators import update_direction as adam
from entropy_experiments.estimators.delta_h import measure_delta_h
from entropy_experiments.estimators.objective_gradient import split_into_groups
from entropy_experiments.estimators.paired import paired_residual
from entropy_experiments.estimators.step_directions import step_direction
from entropy_experiments.probe import recipe
from entropy_experiments.probe.sampling import BatchDraw, SamplingSpec, sample_batch
from entropy_experiments.testing.tiny_model import build_toy_enumerable_dir
from tests.probe_helpers import make_probe, write_prompts

# Costly module fixtures: one worker runs this whole file (scripts/test.sh distributes by xdist_group).
pytestmark = pytest.mark.xdist_group("test_calibration")

SEEDS = 32            # independent batches per side (relative SE of a std over 32 draws: ~13%)
BAND = 1.3
ETA = 0.02            # the paired-residual check's step: ESS/N stays > 0.8 on the toy model
B_E, B_U, G, K = 150, 8, 4, 8
# Every prompt of 1-3 words over the toy vocabulary: 39 prompts, so U's B_U distinct prompts are a
# small part of the pool and the prompt-to-prompt variance the U jackknife measures is really sampled.
POOL = [" ".join(w) for n in (1, 2, 3) for w in itertools.product("xab", repeat=n)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    folder = tmp_path_factory.mktemp("calibration")
    toy = build_toy_enumerable_dir(folder / "toy")
    data = write_prompts(folder / "pool.jsonl", POOL)
    probe = make_probe(toy, data, {
        "batch_config": {"B_E": B_E, "B_U": B_U, "G": G},
        "generation": {"max_new_tokens": 3, "gen_batch_size": 512, "tf_batch_size": 512},
        "estimator": {"microbatch_size": 512}, "variance": {"u_groups": K}})
    examples = load_examples("jsonl", "train", dataset_path=str(data))
    return probe, examples


def _E(probe, examples, seed: int) -> dict:
    rng = random.Random(seed)
    indices = [rng.randrange(len(examples)) for _ in range(B_E)]  # with replacement, one response each
    return sample_batch(SamplingSpec.choose(probe.engine), examples, BatchDraw(indices, 1, seed))


def _U(probe, examples, seed: int) -> dict:
    indices = random.Random(seed).sample(range(len(examples)), B_U)  # distinct prompts
    rewards = RewardSet.resolve([probe.config.reward.name])
    return sample_batch(SamplingSpec.choose(probe.engine), examples, BatchDraw(indices, G, seed, rewards))


def _ratio(values: list[float], ses: list[float], side: str) -> float:
    spread, reported = float(np.std(values, ddof=1)), float(np.mean(ses))
    ratio = spread / reported
    print(f"\ncalibration {side}: std over {len(values)} batches = {spread:.4e}, "
          f"mean SE = {reported:.4e}, ratio = {ratio:.3f}")
    return ratio


@pytest.fixture(scope="module")
def e_side_runs(setup):
    """U (hence v) and θ fixed; per E seed: δH₁, SE_E, and the paired residual ρ(η) ± SE at ETA."""
    probe, examples = setup
    config, policy = probe.config, probe.policy
    lr = resolve_learning_rate(config.learning_rate, policy.optimizer.param_groups).value
    U = _U(probe, examples, 999)
    v, _ = step_direction(config.step_options(), policy,
                          recipe.update_gradients(config, policy, U, [list(range(U.num_prompts))]).total)
    normalize = probe.config.estimator.normalize
    runs = []
    for seed in range(SEEDS):
        E = _E(probe, examples, 1000 + seed)
        surrogate = recipe.one_pass_phase(config, policy, E, {recipe.MAIN: v})
        scores = surrogate.scores
        a, r = surrogate.pieces[recipe.MAIN]
        _, se_e = cv.se_E(a, r, scores.seq_entropies, scores.lengths, scores.unit_of_sequence,
                          normalize=normalize, learning_rate=lr)
        truth = measure_delta_h(probe.engine, E, v, [ETA], normalize=normalize)
        per = truth.per_sequence[ETA]
        rho = paired_residual(per["logw"], per["h_new"], truth.h, truth.T, a.numpy(),
                              r.numpy(), ETA, normalize=normalize, units=scores.unit_of_sequence)
        runs.append({"delta_h1": lr * adam.named_dot(surrogate.X_hat, v), "se_E": se_e, "rho": rho.value, "rho_se": rho.se,
                     "ess_frac": truth.rows[0]["ess_frac"]})
    return runs


@pytest.mark.e2e
@pytest.mark.slow
def test_se_E_matches_the_spread_over_E_batches(e_side_runs):
    values, ses = [run["delta_h1"] for run in e_side_runs], [run["se_E"] for run in e_side_runs]
    assert np.all(np.isfinite(ses)) and min(ses) > 0
    ratio = _ratio(values, ses, "E")
    assert 1 / BAND <= ratio <= BAND, f"E-side spread / mean SE_E = {ratio:.3f}"


@pytest.mark.e2e
@pytest.mark.slow
def test_paired_residual_se_matches_the_spread_over_E_batches(e_side_runs):
    # ρ(η) = ΔH(η) − η·D_v H on the same E: the spread of ρ over independent E batches against its mean
    # paired jackknife SE (issue: within a factor 1.5).
    values, ses = [run["rho"] for run in e_side_runs], [run["rho_se"] for run in e_side_runs]
    assert min(run["ess_frac"] for run in e_side_runs) > 0.8, "η too large for a clean SNIS check"
    assert np.all(np.isfinite(ses)) and min(ses) > 0
    ratio = _ratio(values, ses, "residual")
    assert 1 / 1.5 <= ratio <= 1.5, f"residual spread / mean paired SE = {ratio:.3f}"


@pytest.mark.e2e
@pytest.mark.slow
def test_se_U_matches_the_spread_over_U_batches(setup):
    probe, examples = setup
    config, policy = probe.config, probe.policy
    lr = resolve_learning_rate(config.learning_rate, policy.optimizer.param_groups).value
    X = recipe.one_pass_phase(config, policy, _E(probe, examples, 2999), {}).X_hat
    groups = split_into_groups(B_U, K)
    values, ses = [], []
    for seed in range(SEEDS):
        grads = recipe.update_gradients(config, policy, _U(probe, examples, 3000 + seed), groups)
        v, _ = step_direction(config.step_options(), policy, grads.total)
        directions = cv.leave_one_group_out_directions(
            lambda g: step_direction(config.step_options(), policy, g)[0], grads)
        se_u, _ = cv.se_U(X, directions, learning_rate=lr)
        values.append(lr * adam.named_dot(X, v))
        ses.append(se_u)
    assert np.all(np.isfinite(ses)) and min(ses) > 0
    ratio = _ratio(values, ses, "U")
    assert 1 / BAND <= ratio <= BAND, f"U-side spread / mean SE_U = {ratio:.3f}"

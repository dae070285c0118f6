"""verl's covariance losses (policy_loss.loss_mode clip_cov / kl_cov) and the probe's objective, on the first
on-policy step (ℓ_old = ℓ), against the independent transcription of verl's code in tests/verl_reference.py.

- clip_cov: verl zeroes the gradient of a random subset of the covariance-band tokens; the probe's gradient is the
  EXPECTATION over that draw, checked here against the average of verl's gradient over every possible draw;
- kl_cov: its |ℓ − ℓ_old| penalty has no gradient on-policy, so verl's gradient is the vanilla one, which the
  probe uses; off-policy the penalty does act (the check is not vacuous).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.estimators import objectives
from tests.trl_reference import probe_loss, random_loss_batch
from tests.verl_reference import clip_cov_token_losses, kl_cov_token_losses, token_mean

B, G = 4, 4


def _verl_options(**keys):
    objective = {"trainer": "verl", "loss_type": "token-mean", **keys}
    return config_from_dict({"batch_config": {"B_U": B, "G": G}, "objective": objective}).objective_options()


def _token_advantages(rewards, mask):
    adv = objectives.advantages(rewards, "group", 1e-6).reshape(-1, 1)
    return adv.expand_as(mask) * mask


def _band(logps, adv, mask, size):
    """(lb, ub) around `size` tokens of the batch's covariance (a band verl's selection has in it)."""
    cov = (adv - (adv * mask).sum() / mask.sum()) * (logps.detach() - (logps.detach() * mask).sum() / mask.sum())
    values = cov[(mask > 0) & (cov > 0)].sort().values
    assert len(values) > size + 1
    return float(values[-size] + values[-size - 1]) / 2, float(values[-1]) + 1.0


@pytest.mark.parametrize("seed,size,ratio", [(3, 5, 0.03), (4, 6, 0.015), (5, 4, 0.1)])
def test_clip_cov_gradient_is_the_expectation_of_verls_draw(seed, size, ratio):
    logps, mask, rewards, lengths, _, _ = random_loss_batch(B=B, G=G, seed=seed)[0]
    adv = _token_advantages(rewards, mask)
    lb, ub = _band(logps, adv, mask, size)
    old = logps.detach()
    N = mask.sum()
    _, candidates, k = clip_cov_token_losses(old, logps, adv, mask, clip_cov_ratio=ratio, clip_cov_lb=lb,
                                             clip_cov_ub=ub)
    assert len(candidates) == size and k >= 1  # k ≥ size: every band token is dropped
    draws = []
    for chosen in itertools.combinations(range(size), min(k, size)):  # every subset verl's randperm can pick, equally likely
        perm = list(chosen) + [i for i in range(size) if i not in chosen]
        losses, _, _ = clip_cov_token_losses(old, logps, adv, mask, clip_cov_ratio=ratio, clip_cov_lb=lb,
                                             clip_cov_ub=ub, perm=perm)
        draws.append(torch.autograd.grad(token_mean(losses, mask, N), [logps])[0])
    expected = torch.stack(draws).mean(0)
    options = _verl_options(policy_loss="clip_cov", clip_cov_ratio=ratio, clip_cov_lb=lb, clip_cov_ub=ub)
    ours = torch.autograd.grad(probe_loss(logps, rewards, lengths, options), [logps])[0]
    scale = expected.abs().max()
    assert (ours - expected).abs().max() <= 1e-12 * scale
    vanilla = torch.autograd.grad(probe_loss(logps, rewards, lengths, _verl_options()), [logps])[0]
    assert (ours - vanilla).abs().max() > 1e-3 * scale  # the band's tokens lose weight


@pytest.mark.parametrize("seed,ratio", [(3, 0.05), (6, 0.2)])
def test_kl_cov_on_policy_is_the_vanilla_gradient(seed, ratio):
    logps, mask, rewards, lengths, _, _ = random_loss_batch(B=B, G=G, seed=seed)[0]
    adv = _token_advantages(rewards, mask)
    N = mask.sum()
    verl = token_mean(kl_cov_token_losses(logps.detach(), logps, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=1.0),
                      mask, N)
    theirs = torch.autograd.grad(verl, [logps])[0]
    options = _verl_options(policy_loss="kl_cov", kl_cov_ratio=ratio)
    assert not options.needs_token_statistics
    ours = torch.autograd.grad(probe_loss(logps, rewards, lengths, options), [logps])[0]
    assert (ours - theirs).abs().max() <= 1e-12 * theirs.abs().max()
    # off-policy (ℓ_old ≠ ℓ), the penalty's gradient is there: KL-Cov is vanilla only on the first on-policy step
    shifted = logps.detach() - 0.1
    off = token_mean(kl_cov_token_losses(shifted, logps, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=1.0), mask, N)
    plain = token_mean(kl_cov_token_losses(shifted, logps, adv, mask, kl_cov_ratio=ratio, ppo_kl_coef=0.0), mask, N)
    g_off, g_plain = (torch.autograd.grad(x, [logps])[0] for x in (off, plain))
    assert (g_off - g_plain).abs().max() > 1e-3 * g_plain.abs().max()


@pytest.mark.parametrize("objective,key", [
    ({"trainer": "trl", "policy_loss": "clip_cov"}, "objective.policy_loss"),
    ({"policy_loss": "kl_cov"}, "objective.policy_loss"),
    ({"trainer": "verl", "top_entropy_quantile": 0.2}, "objective.top_entropy_quantile"),
    ({"trainer": "verl", "use_adaptive_entropy": True}, "objective.use_adaptive_entropy"),
    ({"trainer": "verl", "policy_loss": "clip_cov", "clip_cov_ratio": 0}, "clip_cov_ratio")])
def test_entropy_controls_of_another_trainer_are_refused(objective, key):
    from entropy_experiments.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match=key):
        config_from_dict({"batch_config": {"B_U": B, "G": G}, "objective": objective}).objective_options()

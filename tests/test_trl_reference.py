"""The TRL reference harness (tests/trl_reference.py) against hand-written float64 formulas.

On-policy (ratio 1), TRL's loss for one generation batch of N rows cut into M micro-batches is
    Σ_it w_it (−A_i + β k3_it) − c Σ_it u_it H_it,   k3 = exp(ref − ℓ) − (ref − ℓ) − 1,
with per-token weights w (per loss_type, below) and u_it = m_it / (M · Σ_{chunk(i)} m); its gradient
is ∂/∂ℓ_it = w_it (−A_i + β (1 − exp(ref_it − ℓ_it) + b·k3_it)) and ∂/∂H_it = −c u_it, b = 1 with
use_bias_correction_kl (TRL's default: k3 × exp(ℓ − sg ℓ), value unchanged, gradient + k3), else 0. If the stand-in `self`
missed or mis-set anything `_compute_loss` reads, these comparisons would fail.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from tests.trl_reference import (
    LOSS_TYPES,
    trl_advantages,
    trl_loss,
    trl_loss_over_micro_batches,
)

N, T, L_MAX = 8, 6, 7
LENGTHS = [6, 3, 0, 5, 1, 6, 2, 4]  # one empty row: TRL clamps every denominator at 1


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    logp = (-3.0 * torch.rand(N, T, generator=g, dtype=torch.float64)).requires_grad_()
    ref = (logp.detach() + 0.3 * torch.randn(N, T, generator=g, dtype=torch.float64))
    ent = (2.0 * torch.rand(N, T, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(N, generator=g, dtype=torch.float64)
    return logp, mask, adv, ref, ent


def _chunk_token_counts(mask, rows, m):
    """Σ m over the micro-batch of each row, for rows taken in `rows` order and cut into m chunks."""
    counts = torch.empty(N, dtype=torch.float64)
    size = N // m
    for k in range(m):
        chunk = rows[k * size:(k + 1) * size]
        counts[chunk] = mask[chunk].sum()
    return counts.clamp(min=1.0)


def _hand_weights(loss_type, mask, m, rows):
    t_i = mask.sum(1, keepdim=True).clamp(min=1.0)
    chunk = _chunk_token_counts(mask, rows, m)[:, None]
    return {
        "grpo": mask / (t_i * N),
        "bnpo": mask / (chunk * m),
        "dr_grpo": mask / (N * L_MAX),
        "dapo": mask / mask.sum(),
        "luspo": mask / N,
    }[loss_type], mask / (chunk * m)


def _hand(loss_type, logp, mask, adv, ref, ent, *, beta, coef, m=1, rows=None, bias=True):
    """(value, ∂/∂ℓ, ∂/∂H) from the closed forms in the module docstring."""
    rows = torch.arange(N) if rows is None else rows
    w, u = _hand_weights(loss_type, mask, m, rows)
    lp = logp.detach()
    k3 = torch.exp(ref - lp) - (ref - lp) - 1.0
    value = (w * (-adv[:, None] + beta * k3)).sum() - coef * (u * ent.detach()).sum()
    grad_logp = w * (-adv[:, None] + beta * (1.0 - torch.exp(ref - lp) + (k3 if bias else 0.0)))
    return value, grad_logp, -coef * u


def _check(loss, logp, ent, expected, coef):
    value, grad_logp, grad_ent = expected
    g_logp, g_ent = torch.autograd.grad(loss, (logp, ent), allow_unused=True)
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss.detach(), value, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_logp, grad_logp, rtol=1e-12, atol=1e-15)
    if coef:
        torch.testing.assert_close(g_ent, grad_ent, rtol=1e-12, atol=1e-15)
    else:
        assert g_ent is None or not g_ent.any()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("coef", [0.0, 0.01])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_one_micro_batch_matches_hand_formula(loss_type, beta, coef, bias):
    logp, mask, adv, ref, ent = _batch()
    loss = trl_loss(logp, mask, adv, loss_type=loss_type, beta=beta, ref_per_token_logps=ref, entropies=ent,
                    entropy_coef=coef, max_completion_length=L_MAX, use_bias_correction_kl=bias)
    _check(loss, logp, ent, _hand(loss_type, logp, mask, adv, ref, ent, beta=beta, coef=coef, bias=bias), coef)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("m", [2, 4])
@pytest.mark.parametrize("coef", [0.0, 0.01])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_micro_batches_match_hand_formula(loss_type, beta, coef, m, bias):
    logp, mask, adv, ref, ent = _batch(seed=1)
    loss = trl_loss_over_micro_batches(logp, mask, adv, num_micro_batches=m, loss_type=loss_type, beta=beta,
                                       ref_per_token_logps=ref, entropies=ent, entropy_coef=coef,
                                       max_completion_length=L_MAX, use_bias_correction_kl=bias)
    expected = _hand(loss_type, logp, mask, adv, ref, ent, beta=beta, coef=coef, m=m, bias=bias)
    _check(loss, logp, ent, expected, coef)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_shuffled_split(loss_type):
    """A permuted split: only bnpo and the entropy bonus change, and both follow the chunks' token counts."""
    logp, mask, adv, ref, ent = _batch(seed=2)
    rows = torch.randperm(N, generator=torch.Generator().manual_seed(3))
    loss = trl_loss_over_micro_batches(logp, mask, adv, num_micro_batches=2, loss_type=loss_type, beta=0.04,
                                       ref_per_token_logps=ref, entropies=ent, entropy_coef=0.01, order=rows,
                                       max_completion_length=L_MAX)
    expected = _hand(loss_type, logp, mask, adv, ref, ent, beta=0.04, coef=0.01, m=2, rows=rows)
    _check(loss, logp, ent, expected, 0.01)


def test_bnpo_depends_on_the_split_and_the_others_do_not():
    logp, mask, adv, _, _ = _batch(seed=4)
    for loss_type in LOSS_TYPES:
        whole = trl_loss(logp, mask, adv, loss_type=loss_type, max_completion_length=L_MAX)
        split = trl_loss_over_micro_batches(logp, mask, adv, num_micro_batches=4, loss_type=loss_type,
                                            max_completion_length=L_MAX)
        assert torch.isclose(whole, split, rtol=1e-12).item() == (loss_type != "bnpo"), loss_type


def test_luspo_sequence_level_equals_token_level_on_policy():
    logp, mask, adv, ref, ent = _batch(seed=5)
    seq = trl_loss(logp, mask, adv, loss_type="luspo", importance_sampling_level="sequence")
    _check(seq, logp, ent, _hand("luspo", logp, mask, adv, ref, ent, beta=0.0, coef=0.0), 0.0)


def test_dapo_normalizer_with_steps_per_generation():
    """dapo divides by num_items_in_batch · GA / steps_per_generation (one process)."""
    logp, mask, adv, _, _ = _batch(seed=6)
    loss = trl_loss(logp, mask, adv, loss_type="dapo", gradient_accumulation_steps=2, steps_per_generation=4,
                    num_items_in_batch=torch.tensor(40))
    expected = -(adv[:, None] * mask).sum() / (40 * 2 / 4)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=1e-15)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        trl_loss(logp, mask, adv, loss_type="dapo", gradient_accumulation_steps=2)


def test_off_policy_ratio_is_clipped():
    """With old log-probs the ratio is exp(ℓ − ℓ_old) and TRL's −min(ρA, clip(ρ)A) applies (ε = 0.2)."""
    logp, mask, adv, _, _ = _batch(seed=7)
    old = logp.detach() + 0.5 * torch.randn(N, T, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    loss = trl_loss(logp, mask, adv, loss_type="grpo", old_per_token_logps=old)
    ratio = torch.exp(logp.detach() - old)
    per_token = -torch.minimum(ratio * adv[:, None], ratio.clamp(0.8, 1.2) * adv[:, None])
    w, _ = _hand_weights("grpo", mask, 1, torch.arange(N))
    torch.testing.assert_close(loss.detach(), (w * per_token).sum(), rtol=1e-12, atol=1e-15)


def test_metrics_are_logged():
    logp, mask, adv, ref, ent = _batch(seed=9)
    _, metrics = trl_loss(logp, mask, adv, loss_type="dapo", beta=0.04, ref_per_token_logps=ref, entropies=ent,
                          entropy_coef=0.01, return_metrics=True)
    assert metrics["entropy"][0] == pytest.approx(((ent * mask).sum() / mask.sum()).item(), rel=1e-12)
    assert metrics["clip_ratio/region_mean"] == [0.0] and metrics["entropy_coef"] == [0.01]
    assert len(metrics["kl"]) == 1 and len(metrics["policy_loss"]) == 1


def _hand_advantages(rewards, g, scale):
    grouped = rewards.view(-1, g)
    centred = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    if scale == "none":
        return centred
    std = grouped.std(1).repeat_interleave(g) if scale == "group" else rewards.std().expand_as(rewards)
    return centred / (std + 1e-4)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages(scale):
    rewards = torch.tensor([1.0, 3.0, 0.0, 2.0, 2.0, 2.0, 5.0, 1.0, 0.5], dtype=torch.float64)
    adv = trl_advantages(rewards, 3, scale)
    torch.testing.assert_close(adv, _hand_advantages(rewards, 3, scale), rtol=1e-12, atol=1e-15)
    assert not adv[3:6].any()  # a group of equal rewards has zero advantages in every variant

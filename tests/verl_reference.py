"""verl's covariance policy losses, transcribed independently in plain torch (verl is not installable here).

Transcribed from verl's `verl/trainer/ppo/core_algos.py`, functions `compute_policy_loss_clip_cov` and
`compute_policy_loss_kl_cov` (the registered policy losses "clip_cov" and "kl_cov", Cui et al. 2025, as in verl's
main branch as stored in the public code index: the version whose policy losses take `rollout_is_weights` and
`config.global_batch_info`), and
`agg_loss` in its "token-mean" mode with the global token count. Written from a reading of that source, not copied:

- both get one micro-batch's [N, T] tensors; A_t is the sequence's advantage on each of its tokens;
- clip_cov: ratio = exp(ℓ − ℓ_old); loss1 = −A·ratio, loss2 = −A·clamp(ratio, 1 − ε_low, 1 + ε_high); tokens where
  loss2 > loss1 ("clipped by origin") and padding get cov = −inf; otherwise cov = (A − masked mean A)·(ℓ − masked
  mean of detached ℓ); the candidates are the valid tokens with clip_cov_lb < cov < clip_cov_ub; k =
  max(int(clip_cov_ratio · Σ mask), 1); a `torch.randperm` of the candidates picks the first min(k, n) of them,
  whose correction factor becomes 0; the token loss is max(loss1, loss2)·corr;
- kl_cov: loss1 = −A·ratio, loss_kl = −A·ratio + ppo_kl_coef·|ℓ − ℓ_old|; cov over the valid tokens (detached,
  means over them); the top max(1, int(n · kl_cov_ratio)) tokens by cov take loss_kl instead of loss1;
- token-mean: Σ(loss · mask) / (the global token count), micro-batch losses summed over the step.
`perm` replaces verl's random permutation so that a test can enumerate every draw.
"""

from __future__ import annotations

import torch


def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def clip_cov_token_losses(old_logp, logp, adv, mask, *, clip_cov_ratio, clip_cov_lb, clip_cov_ub, eps_low=0.2,
                          eps_high=0.2, perm=None):
    """verl's Clip-Cov token losses [N, T] and the candidate (row, col) pairs (a draw: `perm` of the candidates)."""
    ratio = torch.exp(logp - old_logp)
    loss1 = -adv * ratio
    loss2 = -adv * torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
    clipped = (loss2 > loss1) & (mask > 0)
    cov = (adv - _masked_mean(adv, mask)) * (logp - _masked_mean(logp.detach(), mask))
    cov = cov.detach().clone()
    cov[mask == 0] = -torch.inf
    cov[clipped] = -torch.inf
    k = max(int(clip_cov_ratio * mask.sum().item()), 1)
    candidates = torch.nonzero((cov < clip_cov_ub) & (cov > clip_cov_lb) & (mask > 0))
    corr = torch.ones_like(adv)
    if len(candidates):
        order = torch.randperm(len(candidates)) if perm is None else torch.as_tensor(perm)
        chosen = candidates[order[:min(k, len(candidates))]]
        corr[chosen[:, 0], chosen[:, 1]] = 0
    return torch.maximum(loss1, loss2) * corr, candidates, k


def kl_cov_token_losses(old_logp, logp, adv, mask, *, kl_cov_ratio, ppo_kl_coef):
    """verl's KL-Cov token losses [N, T]."""
    ratio = torch.exp(logp - old_logp)
    loss1 = -adv * ratio
    loss_kl = -adv * ratio + ppo_kl_coef * (logp - old_logp).abs()
    valid = mask > 0
    flat_valid = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    a, ell = adv[valid].detach(), logp[valid].detach()
    cov = (a - a.mean()) * (ell - ell.mean())
    top = flat_valid[torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio)), largest=True).indices]
    rows, cols = top // adv.shape[1], top % adv.shape[1]
    losses = loss1.clone()
    losses[rows, cols] = loss_kl[rows, cols]
    return losses


def token_mean(losses, mask, global_tokens):
    """verl's agg_loss "token-mean" with the step's global token count."""
    return (losses * mask).sum() / global_tokens

"""Per-token weights of the trainers' entropy controls (docs/objectives.md "Entropy controls").

Each control multiplies a token's policy term (and, for TRL's mask, its entropy bonus) by a weight fixed before the
step (no graph); the weights depend on the whole trainer micro-batch's tokens, so they are formed from a no-grad pass
over U (`TokenStatistics`: every sequence's trainer entropies and log-probs) before the backward.

- TRL `top_entropy_quantile` q < 1 (grpo_trainer.py `get_high_entropy_mask`, trl 1.16.0): per micro-batch, the
  threshold is `torch.quantile` (linear interpolation) at 1 − q of the float32 entropies of its completion tokens;
  a token is kept when its float32 entropy ≥ that threshold (TRL compares its model's float32 entropies; a float64
  entropy against the float32 threshold would drop the token AT the threshold whenever its float32 rounding went
  up, i.e. by chance of the CPU's kernels). The policy term (not the KL) and the entropy bonus act on kept
  tokens only; the bonus is their token mean, the policy aggregation's normaliser still counts every token.
- verl `policy_loss.loss_mode: clip_cov` (core_algos.py `compute_policy_loss_clip_cov`): per micro-batch,
  cov_t = (A_t − mean A)(ℓ_t − mean ℓ) over its response tokens; of the tokens with clip_cov_lb < cov < clip_cov_ub,
  verl zeroes the gradient of k = max(⌊clip_cov_ratio · N_tokens⌋, 1) drawn uniformly without replacement
  (`torch.randperm`). The probe uses the EXPECTATION of that draw: each of the n band tokens keeps weight
  1 − min(k, n)/n. (On-policy the PPO clip is inactive, so no token is excluded from the band by clipping.)
- verl `kl_cov`: its penalty ppo_kl_coef·|ℓ − ℓ_old| has value 0 and gradient 0 at ℓ = ℓ_old (torch's d|x|/dx at 0
  is 0): on the first on-policy step KL-Cov's gradient is the plain policy gradient, so it needs no weights here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenStatistics:
    """Every U sequence's per-token trainer entropies and log-probs (no graph), flat in (prompt, response) order."""

    entropies: tuple[Tensor, ...]
    logps: tuple[Tensor, ...]


@dataclass(frozen=True)
class TokenWeights:
    """Per-sequence [T] multipliers of the policy term and of the entropy bonus (None: all ones), and the number of
    bonus tokens of each sequence's micro-batch (the token mean's count under a mask; None: unmasked)."""

    policy: tuple[Tensor, ...] | None
    entropy: tuple[Tensor, ...] | None
    entropy_counts: tuple[float, ...] | None


def micro_batch_slices(n_sequences: int, micro_batches: int) -> list[range]:
    """The `micro_batches` contiguous equal slices of the flat sequence order (objectives.micro_batch_token_counts)."""
    size = n_sequences // micro_batches
    return [range(m * size, (m + 1) * size) for m in range(micro_batches)]


def high_entropy_masks(entropies: tuple[Tensor, ...], micro_batches: int, quantile: float) -> list[Tensor]:
    """TRL's high-entropy token masks (float64 0/1, one [T] per sequence) for top_entropy_quantile `quantile`."""
    masks: list[Tensor] = []
    for rows in micro_batch_slices(len(entropies), micro_batches):
        values = [entropies[i].detach() for i in rows]
        pooled = torch.cat([v.reshape(-1) for v in values]).float()
        if pooled.numel() == 0:
            masks.extend(torch.zeros(v.shape, dtype=torch.float64) for v in values)
            continue
        threshold = torch.quantile(pooled, 1.0 - quantile)
        masks.extend((v.float() >= threshold).to(torch.float64).cpu() for v in values)
    return masks


def clip_cov_keep_weights(logps: tuple[Tensor, ...], advantages: list[float], micro_batches: int, *,
                          ratio: float, lower: float, upper: float) -> list[Tensor]:
    """E[verl's Clip-Cov gradient mask] per token (float64 [T] per sequence): 1 − min(k, n)/n on the n covariance-band
    tokens of each micro-batch, 1 elsewhere. advantages: one per sequence (A_t = A of its sequence)."""
    weights: list[Tensor] = []
    for rows in micro_batch_slices(len(logps), micro_batches):
        ell = [logps[i].detach().to(torch.float64).cpu().reshape(-1) for i in rows]
        adv = [torch.full_like(e, advantages[i]) for e, i in zip(ell, rows)]
        all_ell, all_adv = torch.cat(ell), torch.cat(adv)
        n_tokens = all_ell.numel()
        if n_tokens == 0:
            weights.extend(ell)
            continue
        cov = [(a - all_adv.mean()) * (e - all_ell.mean()) for a, e in zip(adv, ell)]
        band = [(c > lower) & (c < upper) for c in cov]
        n_band = int(sum(int(b.sum()) for b in band))
        k = max(int(ratio * n_tokens), 1)
        keep = 1.0 - min(k, n_band) / n_band if n_band else 1.0
        weights.extend(torch.where(b, torch.full_like(c, keep), torch.ones_like(c)) for b, c in zip(band, cov))
    return weights


def adaptive_entropy_coef(coef: float, last_entropy: float, target: float) -> float:
    """The coefficient TRL's adaptive entropy controller applies on the next step: the saved `entropy_coef` when the
    last window's entropy is at or below `entropy_target`, else 0 (grpo_trainer.py `_compute_loss`, trl 1.16.0)."""
    return float(coef) if float(last_entropy) <= float(target) else 0.0


def control_weights(advantages: list[float], stats: TokenStatistics | None, *, micro_batches: int, quantile: float,
                    clip_cov: tuple[float, float, float] | None) -> TokenWeights:
    """The entropy controls' per-token weights for the flat (prompt, response) sequences: TRL's mask for
    `quantile` < 1, verl's expected Clip-Cov weights for clip_cov = (ratio, lb, ub); neither: no weights."""
    if quantile >= 1.0 and clip_cov is None:
        return TokenWeights(None, None, None)
    if stats is None:
        raise ValueError("this objective's per-token weights need the U tokens' entropies and log-probs")
    if clip_cov is not None:
        ratio, lower, upper = clip_cov
        keep = clip_cov_keep_weights(stats.logps, advantages, micro_batches, ratio=ratio, lower=lower, upper=upper)
        return TokenWeights(tuple(keep), None, None)
    masks = high_entropy_masks(stats.entropies, micro_batches, quantile)
    slices = micro_batch_slices(len(masks), micro_batches)
    counts = [float(sum(float(masks[i].sum()) for i in rows)) for rows in slices]
    per_sequence = tuple(counts[m] for m, rows in enumerate(slices) for _ in rows)
    return TokenWeights(tuple(masks), tuple(masks), per_sequence)


POLICY_LOSSES = ("vanilla", "clip_cov", "kl_cov")


def control_refusal(trainer: str | None, quantile: float, policy_loss: str) -> str | None:
    """One line when the entropy controls are set for a trainer that does not have them, else None."""
    if not 0.0 <= quantile <= 1.0:
        return f"objective.top_entropy_quantile: must lie in [0, 1] (TRL's range), got {quantile!r}"
    if quantile < 1.0 and trainer != "trl":
        return (f"objective.top_entropy_quantile: {quantile!r} is TRL's high-entropy token mask, objective.trainer "
                f"is {trainer or 'null'}: set objective.trainer: trl (or leave the key at 1.0)")
    if policy_loss not in POLICY_LOSSES:
        return f"objective.policy_loss: expected one of {', '.join(POLICY_LOSSES)}, got {policy_loss!r}"
    if policy_loss != "vanilla" and trainer != "verl":
        return (f"objective.policy_loss: {policy_loss!r} is verl's policy_loss.loss_mode, objective.trainer is "
                f"{trainer or 'null'}: set objective.trainer: verl (or leave the key at vanilla)")
    return None

"""TRL's vLLM importance-sampling correction of the loss, for a U batch drawn by another sampler (docs/objectives.md).

When TRL generates with vLLM (`use_vllm`) and `vllm_importance_sampling_correction` is on (trl 1.16.0
grpo_trainer.py ≈ L2660–2707, formed once per generation batch, no graph), each completion token's policy loss
is multiplied by a ratio between the training policy's old log-probs ℓ_old (teacher-forced at θ) and the
sampler's own log-probs log q_s of the token (≈ L3146–3147; the KL term and the entropy bonus are not):

    d_t = ℓ_old,t − log q_s,t                 (a NaN sampler log-prob: d_t = 0)
    token_*:    ρ_t = exp(d_t);   sequence_*: ρ_t = exp(Σ_s d_s) for every token of the sequence
    *_truncate: ρ ← clamp(ρ, C_min, C_max);   *_mask: ρ ← 0 where ρ < C_min or ρ > C_max

with C_min = `vllm_importance_sampling_clip_min` (None: no lower bound) and C_max =
`vllm_importance_sampling_clip_max` (None: no upper bound; TRL's default 3.0). In the probe ℓ_old is the
objective's own trainer log-prob at θ, detached (TRL's `old_per_token_logps`), and log q_s is the U batch's
`sampler_logqs`; a batch sampled by the policy itself has none, and nothing is multiplied.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import ConfigError

MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
KEY = "objective.vllm_importance_sampling_correction"


@dataclass(frozen=True)
class VllmCorrection:
    """One TRL importance-sampling mode and its bounds (validated by `vllm_correction`)."""

    mode: str
    clip_min: float | None
    clip_max: float | None

    def ratios(self, old_logps: Tensor, sampler_logqs: Tensor) -> Tensor:
        """ρ_t of one response, [T] float64 without graph, from ℓ_old [T] (detached here) and log q_s [T]."""
        diff = torch.nan_to_num(old_logps.detach().double() - sampler_logqs.to(old_logps.device).double(), nan=0.0)
        if self.mode.startswith("sequence_"):
            diff = diff.sum().expand_as(diff)
        ratio = torch.exp(diff)
        if self.mode.endswith("_truncate"):
            return torch.clamp(ratio, min=self.clip_min, max=self.clip_max)
        low = -math.inf if self.clip_min is None else self.clip_min
        high = math.inf if self.clip_max is None else self.clip_max
        return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


def vllm_correction(trainer: str | None, enabled: bool, mode: str, clip_min: float | None,
                       clip_max: float | None) -> VllmCorrection | None:
    """The correction of `objective.vllm_importance_sampling_*` (None when off); ConfigError naming the key for a
    trainer without TRL's correction, an unknown mode, or bounds TRL's GRPOConfig refuses (grpo_config.py
    ≈ L1152–1171)."""
    if not enabled:
        return None
    if trainer != "trl":
        raise ConfigError(f"{KEY}: true mirrors TRL's vLLM importance-sampling correction and needs objective.trainer: "
                          f"trl, got trainer {trainer!r} (verl's rollout correction and OpenRLHF's tis / icepop are "
                          "not mirrored)")
    if mode not in MODES:
        raise ConfigError(f"objective.vllm_importance_sampling_mode: expected one of {', '.join(MODES)}, got {mode!r}")
    if clip_min is not None and clip_max is not None and clip_min >= clip_max:
        raise ConfigError(f"objective.vllm_importance_sampling_clip_min ({clip_min}) must be less than "
                          f"objective.vllm_importance_sampling_clip_max ({clip_max})")
    if mode.endswith("_truncate") and clip_min is None and clip_max is None:
        raise ConfigError(f"objective.vllm_importance_sampling_clip_max: mode {mode} needs "
                          "vllm_importance_sampling_clip_min or _clip_max set")
    return VllmCorrection(mode, clip_min, clip_max)

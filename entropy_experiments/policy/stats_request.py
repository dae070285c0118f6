"""`TokenStatsRequest`: what `sampling_policy.policy_token_stats` computes and how, in one frozen value."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TokenStatsRequest"]


@dataclass(frozen=True)
class TokenStatsRequest:
    """The rule and the arithmetic of `policy_token_stats`: q_θ's temperature and top_p; float64 maths (`fp64`,
    else the logits' own dtype); at most `chunk_size` rows and `chunk_elements` entries per chunk (None:
    `sampling_policy.CHUNK_ELEMENTS`); the DIAG_KEYS too (`diagnostics`, with the EOS id for eos_prob);
    `checkpoint` each chunk for backward passes; NaN/±inf checks of the scored rows (`check_finite`)."""

    temperature: float
    top_p: float
    fp64: bool = True
    chunk_size: int = 256
    chunk_elements: int | None = None
    diagnostics: bool = False
    eos_token_id: int | None = None
    checkpoint: bool = False
    check_finite: bool = True

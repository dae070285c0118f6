"""The sampler's correction (docs/maths.md §12): E drawn by a sampler q_s that is not the scored policy q_θ.

A fast sampler (bf16, another attention kernel or engine) draws each response y from its own q_s, close
to but not equal to the policy q_θ that every number is about. Each E-side estimate is then a
self-normalised importance-sampling estimate with per-sequence weights

    log s_i = Σ_k ℓ_ik − Σ_k ℓ^s_ik       (ℓ: fp32 teacher-forced log q_θ; ℓ^s: the sampler's own log q_s)

in float64; `normalised_weights` scales them to mean 1 (Σ s = N) so that a plain mean over sequences is
the special case s ≡ 1 — the sampler is the policy, and every estimator runs its unweighted code unchanged.

Pure float64 maths on per-sequence arrays; no model passes. Units: log-weights in nats; the per-token
KL in nats per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .jackknife import as_float64
from .snis import importance_diagnostics, weights_from_log

__all__ = [
    "ESS_FRACTION_FLOOR",
    "correction_diagnostics",
    "correction_warnings",
    "normalised_weights",
    "sampler_log_weights",
    "sequence_weights",
]

#: Below this ESS/E the correction costs more than a tenth of E's draws: results.json says so.
ESS_FRACTION_FLOOR = 0.9


def sampler_log_weights(token_logqs: Sequence[Any], sampler_token_logqs: Sequence[Any]) -> np.ndarray:
    """log s_i = Σ_k (ℓ_ik − ℓ^s_ik), float64 [N], from each sequence's per-token log q_θ and log q_s.

    −∞ when a token the sampler drew lies outside the policy's nucleus (q_θ = 0): that sequence gets
    weight 0. The sampler's log-probs must be finite (it drew the token)."""
    if len(token_logqs) != len(sampler_token_logqs):
        raise ValueError(f"{len(token_logqs)} scored sequences but {len(sampler_token_logqs)} sampler rows")
    out = np.empty(len(token_logqs), dtype=np.float64)
    for i, (lq, ls) in enumerate(zip(token_logqs, sampler_token_logqs, strict=True)):
        lq, ls = as_float64(lq), as_float64(ls)
        if lq.size != ls.size:
            raise ValueError(f"sequence {i}: {lq.size} scored tokens but {ls.size} sampler log-probs")
        if not np.isfinite(ls).all():
            raise ValueError(f"sequence {i}: the sampler's log-probabilities are not all finite")
        out[i] = lq.sum() - ls.sum()
    return out


def normalised_weights(log_w: Any) -> np.ndarray:
    """s_i / mean(s), float64 [N] (Σ s = N); ValueError when every weight is zero."""
    w = weights_from_log(log_w)
    total = w.sum()
    if not total > 0:
        raise ValueError("every sampler weight is zero: no E sequence is possible under the policy")
    return w * (w.size / total)


def sequence_weights(token_logqs: Sequence[Any], sampler_token_logqs: Sequence[Any] | None) -> np.ndarray | None:
    """s_i = q_θ(y_i)/q_s(y_i) scaled to mean 1 (float64 [N]) from each sequence's scored log q_θ and the sampler's
    log q_s; None when there are no sampler log-probs (the sampler is the policy: no weights)."""
    if sampler_token_logqs is None:
        return None
    return normalised_weights(sampler_log_weights(token_logqs, sampler_token_logqs))


def correction_diagnostics(token_logqs: Sequence[Any], sampler_token_logqs: Sequence[Any]) -> dict[str, Any]:
    """How far the sampler is from the policy on E, keyed as in results.json `sampler.correction`:
    the weight diagnostics of `snis.importance_diagnostics` (ess, ess_frac, psis_khat, khat_threshold,
    zero_weight_count, logw), `mean_token_kl` — Σ_ik (ℓ^s_ik − ℓ_ik) / Σ_i T_i, an unbiased estimate of
    the per-token KL(q_s ‖ q_θ) at the prefixes the sampler visited — and `max_abs_dlogq` over tokens."""
    log_w = sampler_log_weights(token_logqs, sampler_token_logqs)
    deltas = [as_float64(ls) - as_float64(lq) for lq, ls in zip(token_logqs, sampler_token_logqs, strict=True)]
    tokens = sum(d.size for d in deltas)
    finite = [d[np.isfinite(d)] for d in deltas]
    out = importance_diagnostics(log_w)
    out["mean_token_kl"] = float(sum(d.sum() for d in finite) / tokens) if tokens else float("nan")
    out["max_abs_dlogq"] = float(max((np.abs(d).max() for d in finite if d.size), default=0.0))
    out["tokens"] = int(tokens)
    return out


def correction_warnings(diagnostics: dict[str, Any], ess_floor: float = ESS_FRACTION_FLOOR) -> list[str]:
    """The lines results.json's warnings carry when the sampler is too far from the policy."""
    lines = []
    if diagnostics["ess_frac"] < ess_floor:
        lines.append(f"sampler correction: ESS/E = {diagnostics['ess_frac']:.3f} < {ess_floor} — the fast "
                     "sampler is far from the policy; every E-side error bar is wider for it "
                     "(generation.sampler_dtype: fp32 with sampler_engine: generate removes the correction)")
    khat, threshold = diagnostics["psis_khat"], diagnostics["khat_threshold"]
    if np.isfinite(khat) and khat > threshold:
        lines.append(f"sampler correction: PSIS k̂ = {khat:.2f} > {threshold:.2f} — the weights' tail is too "
                     "heavy for the corrected estimates to be trusted (generation.sampler_dtype: fp32, sampler_engine: generate)")
    return lines

"""The field's per-token entropy proxies as competing predictors (docs/maths.md §13): scale-free, no optimizer.

Each is computed on U, from every sampled response token t: its advantage A_t (the sequence's, as the trainer
objective forms it: objective.scale_rewards decides whether it is divided by a std), the policy's
log-probability ℓ_t = log π(y_t) of the sampled token, and the entropy H_t of the policy's next-token
distribution there (nats). Each models the update as a step of an unknown size η in LOGIT space, so it predicts
ΔH up to that size: the value below is the predicted per-token entropy change per unit η ("scale-free"; the
sweep fits the one scale it lacks, sweep/calibration.py). All in float64.

    cui_npg        −Cov_t(ℓ_t, A_t)                 natural policy gradient (Cui et al. 2025, arXiv 2505.22617)
    cui_vanilla    −Cov_t(ℓ_t, π_t·A_t)             vanilla policy gradient (the same paper)
    wang_s_star    −mean_t A_t·S*_t, S* = π_t(H_t + ℓ_t)   a logit step ε = η·A_t on the sampled token
                                                     (Wang et al. 2026, arXiv 2602.03392: ΔH ≈ −ε·S*)
    steer_omega    −mean_t Ω_t, Ω = (A_t/π_old,t)·π_t(1−π_t)(ℓ_t + H_t)   (STEER, arXiv 2510.10150)

Cov_t is the centred product over the batch's response tokens, mean_t[(x − x̄)(y − ȳ)] (verl's clip_cov /
kl_cov form); with `weights` (e.g. π over an enumerated vocabulary) every mean is the weighted one, which makes
Cov the exact Cov_{y∼π} of the papers' derivations. π_old = π here: U is drawn by the policy being probed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ..registry import registrar
from .sequence_scores import score_sequences

__all__ = ["PROXIES", "TokenTable", "centred_covariance", "cui_npg", "cui_vanilla", "proxy_entries",
           "s_star", "steer_omega", "steer_omega_tokens", "u_proxy_entries", "wang_s_star"]

UNITS = "nats per token per unit logit step (scale-free)"


@dataclass(frozen=True)
class TokenTable:
    """U's sampled response tokens, flat float64 [T]: advantage, log π of the sampled token, next-token entropy
    (nats), and optional weights of the means (None: every token counts once)."""

    advantage: np.ndarray
    logp: np.ndarray
    entropy: np.ndarray
    weights: np.ndarray | None = None

    @classmethod
    def of(cls, advantage, logp, entropy, weights=None) -> TokenTable:
        cols = [np.asarray(c, dtype=np.float64).reshape(-1) for c in (advantage, logp, entropy)]
        w = None if weights is None else np.asarray(weights, dtype=np.float64).reshape(-1)
        return cls(*cols, w)


def _mean(x: np.ndarray, w: np.ndarray | None) -> float:
    return float(np.mean(x)) if w is None else float(np.sum(w * x) / np.sum(w))


def centred_covariance(x: np.ndarray, y: np.ndarray, weights: np.ndarray | None = None) -> float:
    """mean[(x − x̄)(y − ȳ)] (weighted means with `weights`); NaN for no entries."""
    if x.size == 0:
        return float("nan")
    return _mean((x - _mean(x, weights)) * (y - _mean(y, weights)), weights)


def s_star(logp: np.ndarray, entropy: np.ndarray) -> np.ndarray:
    """Wang's S* = p_k·(H + log p_k) per token (nats)."""
    return np.exp(logp) * (entropy + logp)


def steer_omega_tokens(advantage: np.ndarray, logp: np.ndarray, entropy: np.ndarray,
                       logp_old: np.ndarray | None = None) -> np.ndarray:
    """STEER's Ω = (A/π_old)·π(1−π)·(ln π + H) per token (π_old = π when `logp_old` is None)."""
    p = np.exp(logp)
    p_old = p if logp_old is None else np.exp(logp_old)
    return advantage / p_old * p * (1.0 - p) * (logp + entropy)


ProxyFn = Callable[[TokenTable], float]
PROXIES: dict[str, ProxyFn] = {}
register_proxy: Callable[[str], Callable[[ProxyFn], ProxyFn]] = registrar(PROXIES, "entropy proxy")


@register_proxy("cui_npg")
def cui_npg(u: TokenTable) -> float:
    """−Cov(log π, A): ΔH per unit η of a natural-policy-gradient (logit z_y += η·A) step."""
    return -centred_covariance(u.logp, u.advantage, u.weights)


@register_proxy("cui_vanilla")
def cui_vanilla(u: TokenTable) -> float:
    """−Cov(log π, π·A): ΔH per unit η of a vanilla policy-gradient step in logit space."""
    return -centred_covariance(u.logp, np.exp(u.logp) * u.advantage, u.weights)


@register_proxy("wang_s_star")
def wang_s_star(u: TokenTable) -> float:
    """−mean A·S*: each sampled token's logit moved by ε = η·A (ΔH ≈ −ε·S*), averaged over the tokens."""
    return -_mean(u.advantage * s_star(u.logp, u.entropy), u.weights) if u.logp.size else float("nan")


@register_proxy("steer_omega")
def steer_omega(u: TokenTable) -> float:
    """−mean Ω over the tokens (π_old = π)."""
    if not u.logp.size:
        return float("nan")
    return -_mean(steer_omega_tokens(u.advantage, u.logp, u.entropy), u.weights)


def token_table(advantages: Sequence[float], token_logps: Sequence, token_entropies: Sequence) -> TokenTable:
    """The flat table of N sequences: sequence i's advantage repeated over its tokens, its ℓ and H."""
    lengths = [len(x) for x in token_logps]
    adv = np.repeat(np.asarray(advantages, dtype=np.float64).reshape(-1), lengths)
    cat = (lambda xs: np.concatenate([np.asarray(x, dtype=np.float64) for x in xs]) if xs else np.zeros(0))
    return TokenTable.of(adv, cat(token_logps), cat(token_entropies))


def proxy_entries(table: TokenTable) -> dict[str, dict]:
    """results.json `predictors` entries of every registered proxy: delta_h1 = the proxy's value (scale-free),
    no SE, `scale_free: true`, its units and the number of U tokens."""
    return {name: {"delta_h1": fn(table), "se": None, "se_E": None, "se_U": None, "from_pieces": None,
                   "measured_over_predicted": None, "scale_free": True, "units": UNITS,
                   "n_tokens": int(table.logp.size)} for name, fn in PROXIES.items()}


def u_proxy_entries(engine, U, advantages: Sequence[float]) -> dict[str, dict]:
    """One no-grad teacher-forcing pass over U at θ (ℓ and H per token), then `proxy_entries` with `advantages`,
    one per U sequence in batch order: the caller passes the trainer objective's A (objective.scale_rewards:
    r − mean_g r, or that over the group's or the batch's std + ε), the advantage the trainer's policy gradient
    multiplies, as verl's clip_cov does with its GRPO advantages."""
    scores = score_sequences(engine, U)
    return proxy_entries(token_table(list(advantages), scores.token_logqs, scores.token_entropies))

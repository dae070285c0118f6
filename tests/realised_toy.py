"""An enumerable toy policy for the realised change between checkpoints (tests/test_realised_change.py).

A prompt c ∈ {0..P−1} and up to L tokens from {0 (EOS), 1..V−1}: step 0's logits are A[c], step k ≥ 1's
B[k−1, previous token]. Every response of every prompt is enumerated, so the exact per-token entropy
H(θ) = Σ_c Σ_y q(y|c) h(y) / Σ_c Σ_y q(y|c) T(y) (prompts uniform; h = Σ_k H_k, the Rao–Blackwell entropy of
each step's distribution) is a finite sum in float64. Checkpoints are real torch AdamW steps on the exact
expected reward of a random per-response reward. E is drawn as the sweep draws it, with common random
numbers: draw b's prompt and the uniforms u_bgk of its responses are the same at every checkpoint, and a
token is the inverse CDF of the step's distribution at u — so a small step changes almost no response.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from entropy_experiments.estimators.realised_change import CrossScored

P, V, L, G = 4, 4, 3, 2


def all_responses() -> list[tuple[int, ...]]:
    """Every response: tokens 1..V−1 then EOS (0) before L tokens, or L tokens (the last may be anything)."""
    out = []
    for n in range(L - 1):
        out += [(*body, 0) for body in itertools.product(range(1, V), repeat=n)]
    out += [(*body, last) for body in itertools.product(range(1, V), repeat=L - 1) for last in range(V)]
    return out


RESPONSES = all_responses()


def _index_arrays() -> tuple[np.ndarray, ...]:
    """For every response i and step k (padded to L): the token, the previous token (step k ≥ 1), a mask."""
    tok = np.zeros((len(RESPONSES), L), dtype=int)
    mask = np.zeros((len(RESPONSES), L))
    for i, y in enumerate(RESPONSES):
        tok[i, :len(y)], mask[i, :len(y)] = y, 1.0
    prev = np.concatenate([np.zeros((len(RESPONSES), 1), dtype=int), tok[:, :-1]], axis=1)
    return tok, prev, mask


TOK, PREV, MASK = _index_arrays()
LENGTHS = MASK.sum(axis=1)


def step_log_probs(theta) -> tuple[torch.Tensor, torch.Tensor]:
    """log-softmax of step 0 per prompt [P, V] and of step k ≥ 1 per previous token [L−1, V, V]."""
    A, B = theta
    return torch.log_softmax(A, -1), torch.log_softmax(B, -1)


def token_tables(theta) -> tuple[torch.Tensor, torch.Tensor]:
    """(ℓ [P, R, L], H [P, R, L]) of every response R at every prompt, zero past a response's end."""
    LA, LB = step_log_probs(theta)
    HA, HB = -(LA.exp() * LA).sum(-1), -(LB.exp() * LB).sum(-1)
    tok, prev, mask = (torch.as_tensor(x) for x in (TOK, PREV, MASK))
    ell = torch.zeros(P, len(RESPONSES), L, dtype=torch.float64)
    ent = torch.zeros_like(ell)
    ell[:, :, 0], ent[:, :, 0] = LA[:, tok[:, 0]], HA[:, None].expand(P, len(RESPONSES))
    for k in range(1, L):
        ell[:, :, k] = LB[k - 1, prev[:, k], tok[:, k]][None].expand(P, -1)
        ent[:, :, k] = HB[k - 1, prev[:, k]][None].expand(P, -1)
    return ell * mask, ent * mask


def exact_entropy(theta) -> float:
    with torch.no_grad():
        ell, ent = token_tables(theta)
        q = ell.sum(-1).exp()
        return float((q * ent.sum(-1)).sum() / (q * torch.as_tensor(LENGTHS)).sum())


def checkpoints(seed: int, steps: int, lr: float, a_scale: float = 0.1,
                b_scale: float = 2.0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """θ_0 (A ~ a_scale·N(0, 1): a nearly uniform first token; B ~ b_scale·N(0, 1): later steps whose entropy
    depends on the branch taken) and `steps` real torch AdamW steps (lr, default betas, weight decay 0.01),
    step k on the exact expected reward E_c E_y R_k(c, y_0) of its own random reward of the FIRST token (a new
    batch per step): [θ_0, θ_1, …], detached copies. The step moves which branch a response takes; the
    per-token entropies along a fixed response barely move (the first step's entropy is near its maximum), so
    the change of H is carried by the responses that would change."""
    gen = torch.Generator().manual_seed(seed)
    A = (a_scale * torch.randn(P, V, generator=gen, dtype=torch.float64)).requires_grad_()
    B = (b_scale * torch.randn(L - 1, V, V, generator=gen, dtype=torch.float64)).requires_grad_()
    opt = torch.optim.AdamW([A, B], lr=lr)
    out = [(A.detach().clone(), B.detach().clone())]
    first = torch.as_tensor(TOK[:, 0])
    for _ in range(steps):
        reward = torch.rand(P, V, generator=gen, dtype=torch.float64)[:, first]
        opt.zero_grad()
        (-(reward * token_tables((A, B))[0].sum(-1).exp()).sum()).backward()
        opt.step()
        out.append((A.detach().clone(), B.detach().clone()))
    return out


@dataclass
class DrawnE:
    prompts: list[int]                       # per draw b
    responses: list[list[tuple[int, ...]]]   # [b][g]


def draw_E(theta, n_draws: int, seed: int) -> DrawnE:
    """E with common random numbers: the prompts [n] and uniforms [n, G, L] depend on the seed only, and a
    token is the inverse CDF of its step's distribution at its uniform."""
    with torch.no_grad():
        CA, CB = (np.cumsum(x.exp().numpy(), -1) for x in step_log_probs(theta))
    rng = np.random.default_rng(seed)
    prompts, u = rng.integers(P, size=n_draws), rng.random((n_draws, G, L))
    tokens = np.full((n_draws, G, L), -1)
    for k in range(L):
        cdf = CA[prompts][:, None, :].repeat(G, 1) if k == 0 else CB[k - 1, np.maximum(tokens[:, :, k - 1], 0)]
        drawn = np.minimum((u[:, :, k, None] >= cdf).sum(-1), V - 1)
        alive = np.ones((n_draws, G), dtype=bool) if k == 0 else tokens[:, :, k - 1] > 0
        tokens[:, :, k] = np.where(alive, drawn, -1)
    responses = [[tuple(int(t) for t in row if t >= 0) for row in draw] for draw in tokens]
    return DrawnE([int(c) for c in prompts], responses)


INDEX = {y: i for i, y in enumerate(RESPONSES)}

# Bounds on n z-scores of a calibrated estimator (z ~ N(0, 1)) that it breaks with negligible probability:
# rms within RMS_16 for 16 z: P(χ²₁₆ < 16·0.4²) = 6e-5, P(χ²₁₆ > 16·1.8²) = 1.2e-5; every |z| < MAX_Z: P(some
# |z| ≥ 4.5) = 1.1e-4 for 16 z, 2.7e-4 for 40 (scipy.stats.chi2 / norm). An overconfident estimate (rms z > 2)
# still breaks RMS_16.
RMS_16 = (0.4, 1.8)
MAX_Z = 4.5


def cross_scored(E: DrawnE, own, other) -> CrossScored:
    """E scored at its own policy and at the other: log w from per-token differences summed in float64."""
    with torch.no_grad():
        (ell, ent), (ell2, ent2) = token_tables(own), token_tables(other)
    c = np.array([c for c, ys in zip(E.prompts, E.responses) for _ in ys])
    i = np.array([INDEX[y] for ys in E.responses for y in ys])
    units = [f"{b}:{p}" for b, (p, ys) in enumerate(zip(E.prompts, E.responses)) for _ in ys]
    logw = (ell2.numpy()[c, i] - ell.numpy()[c, i]).sum(-1)
    return CrossScored(logw, ent.numpy()[c, i].sum(-1), ent2.numpy()[c, i].sum(-1), LENGTHS[i], units)


def n_changed(E_from: DrawnE, E_to: DrawnE) -> int:
    return sum(a != b for a, b in zip(E_from.responses, E_to.responses))


def displacement_pieces(E: DrawnE, theta, other) -> tuple[np.ndarray, np.ndarray]:
    """Per sequence of E (sampled at θ), the pieces of δH_Δθ along Δθ = other − θ (docs/maths.md §3, baseline
    none): a_i = Σ_k [D H_ik + G_ik·D ℓ_ik] with G_ik = Σ_{j>k} H_ij, r_i = Σ_k R_ik·D ℓ_ik with R_ik = T_i − k
    (tokens strictly after k); the directional derivatives D by forward-mode autograd (torch.func.jvp)."""
    delta = tuple(b - a for a, b in zip(theta, other, strict=True))
    (_, ent), (d_ell, d_ent) = torch.func.jvp(lambda A, B: token_tables((A, B)), tuple(theta), delta)
    c = np.array([c for c, ys in zip(E.prompts, E.responses) for _ in ys])
    i = np.array([INDEX[y] for ys in E.responses for y in ys])
    H, dH, dl = (x.detach().numpy()[c, i] for x in (ent, d_ent, d_ell))  # [N, L], zero past a response's end
    after = np.cumsum(H[:, ::-1], axis=1)[:, ::-1] - H                    # G_k: entropy strictly after k
    tokens_after = LENGTHS[i][:, None] - np.arange(1, L + 1)[None] * MASK[i]  # R_k = T − k (1-based), 0 past end
    return (dH + after * dl).sum(-1), (tokens_after * dl).sum(-1)


def exact_directional_derivative(theta, other) -> float:
    """D_Δθ H(θ) of the exact entropy along Δθ = other − θ (forward-mode autograd through the enumeration)."""
    delta = tuple(b - a for a, b in zip(theta, other, strict=True))

    def entropy(A, B):
        ell, ent = token_tables((A, B))
        q = ell.sum(-1).exp()
        return (q * ent.sum(-1)).sum() / (q * torch.as_tensor(LENGTHS)).sum()

    return float(torch.func.jvp(entropy, tuple(theta), delta)[1])

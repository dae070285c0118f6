"""The field's entropy proxies (estimators/entropy_proxies.py) against independent computations.

- on one softmax over a few tokens, enumerated: the Cui forms with π-weighted means equal the exact derivative
  (autograd) of the exact entropy along a natural (z += η·A) and a vanilla (z += η·∇_z E_π[A]) policy-gradient
  step in logit space; −S* equals the derivative along a step of the sampled token's logit alone;
- on random token tables: every proxy against a per-token loop written out here;
- through a probe run: results.json `predictors` carries them, scale-free, equal to a loop over U's own scores.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from entropy_experiments.estimators.entropy_proxies import (
    PROXIES,
    TokenTable,
    cui_npg,
    cui_vanilla,
    proxy_entries,
    token_table,
    wang_s_star,
)
from entropy_experiments.estimators.sequence_scores import score_sequences
from tests.probe_helpers import SHORT_PROMPTS, make_probe, write_prompts
from tests.test_probe import _run


def _entropy(z: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(z, -1)
    return -(logp.exp() * logp).sum()


def _slope(z: torch.Tensor, direction: torch.Tensor) -> float:
    """d/dη H(z + η·direction) at η = 0, by autograd."""
    eta = torch.zeros((), dtype=torch.float64, requires_grad=True)
    (grad,) = torch.autograd.grad(_entropy(z + eta * direction), eta)
    return float(grad)


def _enumerated(z: torch.Tensor, A: torch.Tensor) -> TokenTable:
    """Every token of the vocabulary, weighted by π: the exact expectations of the papers' derivations."""
    logp = torch.log_softmax(z, -1)
    H = float(_entropy(z))
    return TokenTable.of(A.numpy(), logp.numpy(), np.full(z.numel(), H), weights=logp.exp().numpy())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cui_forms_equal_the_exact_entropy_derivative_of_a_softmax_step(seed):
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(6, generator=gen, dtype=torch.float64) * 1.5
    pi = torch.softmax(z, -1)
    A = torch.randn(6, generator=gen, dtype=torch.float64)
    # natural PG for a tabular softmax: z_y += η·A(y)
    assert cui_npg(_enumerated(z, A)) == pytest.approx(_slope(z, A), rel=1e-10, abs=1e-14)
    # vanilla PG: z += η·∇_z Σ_y π(y)·A(y), with the advantage centred under π (E_π A = 0)
    A0 = A - (pi * A).sum()
    zz = z.clone().requires_grad_(True)
    (g,) = torch.autograd.grad((torch.softmax(zz, -1) * A0).sum(), zz)
    assert cui_vanilla(_enumerated(z, A0)) == pytest.approx(_slope(z, g), rel=1e-10, abs=1e-14)
    assert abs(_slope(z, g)) > 1e-4 and abs(_slope(z, A)) > 1e-4  # not a vacuous 0 = 0


def test_s_star_is_minus_the_entropy_derivative_along_the_sampled_logit():
    z = torch.tensor([1.3, -0.2, 0.4, 2.0, -1.1], dtype=torch.float64)
    logp, H = torch.log_softmax(z, -1), float(_entropy(z))
    for k in range(z.numel()):
        e_k = torch.zeros_like(z)
        e_k[k] = 1.0
        one = TokenTable.of([1.0], [float(logp[k])], [H])  # A = 1: ε = η
        assert wang_s_star(one) == pytest.approx(_slope(z, e_k), rel=1e-10, abs=1e-14)


@pytest.mark.parametrize("A", [1.0, -0.7])
def test_steer_sign_matches_the_exact_entropy_change(A):
    """−Ω·π_k = the exact derivative of H along z_k += A·∂(π_k/π_old)/∂z_k (= A·(1−π_k) at π_old = π): the
    sign ΔH ≈ −η·Ω, up to the positive factor π_k, for tokens on both sides of ln π + H = 0."""
    from entropy_experiments.estimators.entropy_proxies import steer_omega

    z = torch.tensor([1.3, -0.2, 0.4, 2.0, -1.1], dtype=torch.float64)
    logp, H = torch.log_softmax(z, -1), float(_entropy(z))
    signs = set()
    for k in range(z.numel()):
        p_k = float(logp[k].exp())
        step = torch.zeros_like(z)
        step[k] = A * (1.0 - p_k)
        slope = _slope(z, step)
        assert steer_omega(TokenTable.of([A], [float(logp[k])], [H])) * p_k == pytest.approx(slope, rel=1e-10,
                                                                                               abs=1e-14)
        signs.add(slope > 0)
    assert signs == {True, False}  # both signs occur: not one fixed sign


def _loop_cov(x: list[float], y: list[float]) -> float:
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    return sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / n


def _loop_proxies(A, logp, H) -> dict[str, float]:
    n = len(A)
    p = [math.exp(v) for v in logp]
    return {"cui_npg": -_loop_cov(list(logp), list(A)),
            "cui_vanilla": -_loop_cov(list(logp), [pi * a for pi, a in zip(p, A, strict=True)]),
            "wang_s_star": -sum(A[t] * p[t] * (H[t] + logp[t]) for t in range(n)) / n,
            "steer_omega": -sum(A[t] / p[t] * p[t] * (1 - p[t]) * (logp[t] + H[t]) for t in range(n)) / n}


@pytest.mark.parametrize("seed", [0, 1])
def test_proxies_equal_per_token_loops(seed):
    rng = np.random.default_rng(seed)
    n = 37
    A = rng.normal(size=n)
    logp = np.log(rng.uniform(0.01, 1.0, size=n))
    H = rng.uniform(0.0, 3.0, size=n)
    got = proxy_entries(TokenTable.of(A, logp, H))
    want = _loop_proxies(A.tolist(), logp.tolist(), H.tolist())
    assert set(got) == set(PROXIES) == set(want)
    for name, w in want.items():
        assert got[name]["delta_h1"] == pytest.approx(w, rel=1e-12), name
        assert got[name]["scale_free"] is True and got[name]["n_tokens"] == n and got[name]["se"] is None


def test_token_table_repeats_each_sequence_advantage_over_its_tokens():
    t = token_table([0.5, -1.0], [[-0.1, -0.2, -0.3], [-1.0]], [[1.0, 2.0, 3.0], [0.5]])
    assert t.advantage.tolist() == [0.5, 0.5, 0.5, -1.0]
    assert t.logp.tolist() == [-0.1, -0.2, -0.3, -1.0] and t.entropy.tolist() == [1.0, 2.0, 3.0, 0.5]


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    return write_prompts(tmp_path_factory.mktemp("data") / "prompts.jsonl", SHORT_PROMPTS)


def _group_scaled(rewards: list[list[float]], eps: float) -> list[float]:
    """(r − mean_g r)/(std_g r + ε) per response, the std with Bessel's correction, written out."""
    out = []
    for group in rewards:
        mean = sum(group) / len(group)
        std = math.sqrt(sum((r - mean) ** 2 for r in group) / (len(group) - 1))
        out += [(r - mean) / (std + eps) for r in group]
    return out


def test_probe_results_carry_the_proxies_of_its_own_U(tiny_model_dir, prompts_file):
    """The proxies use the trainer objective's advantages (here TRL's: scaled by the group's std + ε)."""
    probe = make_probe(tiny_model_dir, prompts_file, {"objective": {"trainer": "trl"}})
    results, _, U, _ = _run(probe)
    scores = score_sequences(probe.engine, U)
    objective = results["update"]["objective"]
    assert objective["scale_rewards"] == "group"
    per_seq = _group_scaled([[float(r) for r in g] for g in U.rewards], objective["advantage_eps"])
    A = [a for a, T in zip(per_seq, scores.token_logqs, strict=True) for _ in range(len(T))]
    logp = [float(x) for row in scores.token_logqs for x in row]
    H = [float(x) for row in scores.token_entropies for x in row]
    want = _loop_proxies(A, logp, H)
    for name, w in want.items():
        entry = results["predictors"][name]
        assert entry["scale_free"] is True and entry["n_tokens"] == len(A)
        assert entry["delta_h1"] == pytest.approx(w, rel=1e-9, abs=1e-15), name
    assert any(abs(w) > 0 for w in want.values())

"""The E-side surrogate pieces (losses.py) and SE_total (conditional_variance.py) against explicit loops.

Every reference below is written out element by element in plain Python floats, straight from
docs/maths.md §3 and §6, and shares no code with the module under test:
- G_k = Σ_{j>k} H_j, R_k = T − k (k = 1..T);
- Ĥ = Σh/ΣT (per_token) or mean h (per_sequence); D = ΣT or N;
- causal: alpha = G − b, beta = R (per_token) or 0; full_return: alpha = h − b, beta = T or 1;
- loo_position: b_ik = mean over the OTHER sequences j ≠ i that reach position k of c_jk = alpha_jk − Ĥ beta_jk
  (zero where no other sequence reaches k);
- a_i = Σ_k [D_v H_ik + alpha_ik D_v ℓ_ik], r_i = Σ_k beta_ik D_v ℓ_ik;
- SE_total = √(SE_E² + SE_U²).
"""

from __future__ import annotations

import math

import pytest
import torch

from entropy_experiments.estimators import surrogate as losses
from entropy_experiments.estimators.jackknife import se_total

LENGTHS = [5, 1, 3, 5, 2]  # ragged, with ties at the longest length and a length-1 sequence


def _random_entropies(lengths=LENGTHS, seed=0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(T, generator=gen, dtype=torch.float64) * 2 for T in lengths]


# ----------------------------------------------------------------------------- written-out references

def ref_G(H: list[float]) -> list[float]:
    T = len(H)
    out = []
    for k in range(1, T + 1):  # positions k = 1..T; H[j-1] is H_j
        total = 0.0
        for j in range(k + 1, T + 1):
            total += H[j - 1]
        out.append(total)
    return out


def ref_R(T: int) -> list[float]:
    return [float(T - k) for k in range(1, T + 1)]


def ref_H_hat_and_D(H: list[list[float]], normalize: str) -> tuple[float, float]:
    total_h = 0.0
    total_T = 0
    for row in H:
        for value in row:
            total_h += value
        total_T += len(row)
    if normalize == "per_token":
        return total_h / total_T, float(total_T)
    return total_h / len(H), float(len(H))


def ref_raw_coefficients(H: list[list[float]], normalize: str, x_mode: str) -> tuple[list, list]:
    """(alpha, beta) before any baseline, per sequence, as lists of floats."""
    alpha, beta = [], []
    for row in H:
        T = len(row)
        if x_mode == "causal":
            alpha.append(ref_G(row))
            beta.append(ref_R(T) if normalize == "per_token" else [0.0] * T)
        else:
            h = sum(row)
            alpha.append([h] * T)
            beta.append([float(T) if normalize == "per_token" else 1.0] * T)
    return alpha, beta


def ref_loo_baseline(alpha: list[list[float]], beta: list[list[float]], H_hat: float) -> list[list[float]]:
    """b_ik: mean of c_jk over the other sequences j ≠ i with T_j >= k; 0 if there are none."""
    out = []
    for i, row in enumerate(alpha):
        b_i = []
        for k in range(len(row)):
            values = [alpha[j][k] - H_hat * beta[j][k] for j in range(len(alpha)) if j != i and len(alpha[j]) > k]
            b_i.append(sum(values) / len(values) if values else 0.0)
        out.append(b_i)
    return out


def _close(got: torch.Tensor, want: list[float], tol: float = 1e-12) -> None:
    assert got.dtype == torch.float64
    assert len(got) == len(want)
    for g, w in zip(got.tolist(), want):
        assert abs(g - w) <= tol * max(1.0, abs(w)), (got.tolist(), want)


# ----------------------------------------------------------------------------- G_k, R_k, Ĥ, D

@pytest.mark.parametrize("T", [1, 2, 7])
def test_entropy_to_go_is_the_entropy_strictly_after_k(T):
    H = _random_entropies([T], seed=T)[0]
    _close(losses.entropy_to_go(H), ref_G(H.tolist()))


@pytest.mark.parametrize("T", [1, 2, 7])
def test_tokens_to_go_counts_tokens_strictly_after_k(T):
    got = losses.tokens_to_go(T)
    _close(got, ref_R(T))
    assert got[-1] == 0 and got[0] == T - 1  # the last token has nothing after it


@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_entropy_estimate_and_normalizer(normalize):
    H = _random_entropies()
    seq_h = torch.stack([h.sum() for h in H])
    lengths = torch.tensor(LENGTHS, dtype=torch.float64)
    H_hat, D = ref_H_hat_and_D([h.tolist() for h in H], normalize)
    assert losses.entropy_estimate(seq_h, lengths, normalize) == pytest.approx(H_hat, rel=1e-13)
    assert losses.normalizer(lengths, normalize) == D


# ----------------------------------------------------------------------------- surrogate coefficients

@pytest.mark.parametrize("baseline", ["none", "loo_position"])
@pytest.mark.parametrize("x_mode", ["causal", "full_return"])
@pytest.mark.parametrize("normalize", ["per_token", "per_sequence"])
def test_surrogate_coefficients_match_loops(normalize, x_mode, baseline):
    H = _random_entropies()
    H_list = [h.tolist() for h in H]
    coefs = losses.surrogate_coefficients(H, normalize=normalize, x_mode=x_mode, baseline=baseline)
    H_hat, D = ref_H_hat_and_D(H_list, normalize)
    alpha, beta = ref_raw_coefficients(H_list, normalize, x_mode)
    b = ref_loo_baseline(alpha, beta, H_hat) if baseline == "loo_position" else [[0.0] * len(r) for r in alpha]
    assert coefs.H_hat == pytest.approx(H_hat, rel=1e-13) and coefs.D == D
    for i in range(len(H)):
        want_alpha = [alpha[i][k] - b[i][k] for k in range(LENGTHS[i])]
        _close(coefs.alpha[i], want_alpha)
        _close(coefs.beta[i], beta[i])
        _close(coefs.coefficient(i), [want_alpha[k] - H_hat * beta[i][k] for k in range(LENGTHS[i])])


def test_per_token_causal_coefficient_is_G_minus_H_hat_R():
    """The −Ĥ·R_k (denominator) term, written out: c_ik = Σ_{j>k} H_ij − Ĥ·(T_i − k)."""
    H = _random_entropies()
    coefs = losses.surrogate_coefficients(H, normalize="per_token", x_mode="causal", baseline="none")
    H_hat = sum(float(h.sum()) for h in H) / sum(LENGTHS)
    for i, h in enumerate(H):
        T = len(h)
        want = [sum(float(h[j - 1]) for j in range(k + 1, T + 1)) - H_hat * (T - k) for k in range(1, T + 1)]
        _close(coefs.coefficient(i), want)
    assert any(float(c.abs().max()) > 0 for c in coefs.beta), "R must enter the coefficient"


def test_loo_baseline_excludes_the_sequence_itself():
    """Hand-made alpha/beta: b_ik = mean over the other sequences reaching k; 0 where none does."""
    alpha = [torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64), torch.tensor([10.0], dtype=torch.float64),
             torch.tensor([4.0, 8.0], dtype=torch.float64)]
    beta = [torch.tensor([2.0, 1.0, 0.0], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64),
            torch.tensor([1.0, 0.0], dtype=torch.float64)]
    H_hat = 0.5
    c = [[1.0 - 1.0, 2.0 - 0.5, 3.0], [10.0], [4.0 - 0.5, 8.0]]  # c_jk = alpha − Ĥ beta, by hand
    want = [
        [1.0 - (c[1][0] + c[2][0]) / 2, 2.0 - c[2][1], 3.0 - 0.0],  # position 3: nobody else reaches it
        [10.0 - (c[0][0] + c[2][0]) / 2],
        [4.0 - (c[0][0] + c[1][0]) / 2, 8.0 - c[0][1]],
    ]
    got = losses._subtract_loo_position_baseline(alpha, beta, H_hat)
    for g, w in zip(got, want):
        _close(g, w)


def test_loo_baseline_on_a_single_sequence_is_zero():
    alpha = [torch.tensor([1.5, -2.0], dtype=torch.float64)]
    beta = [torch.tensor([1.0, 0.0], dtype=torch.float64)]
    _close(losses._subtract_loo_position_baseline(alpha, beta, 0.3)[0], [1.5, -2.0])


def test_loo_baseline_depends_only_on_the_other_sequences():
    """Unbiasedness needs b_i free of sequence i's own coefficient: with equal lengths, none − loo = the
    plain mean of the OTHER sequences' unbaselined coefficients (sequence 0's own is not in it)."""
    H = _random_entropies([4, 4, 4], seed=5)
    coefs_none = losses.surrogate_coefficients(H, normalize="per_token", x_mode="causal", baseline="none")
    coefs_loo = losses.surrogate_coefficients(H, normalize="per_token", x_mode="causal", baseline="loo_position")
    diff = (coefs_none.alpha[0] - coefs_loo.alpha[0]).tolist()
    for k, value in enumerate(diff):
        others = [float(coefs_none.coefficient(j)[k]) for j in (1, 2)]
        assert value == pytest.approx(sum(others) / 2, rel=1e-12, abs=1e-12)


# ----------------------------------------------------------------------------- directional pieces, loss

def test_directional_pieces_match_loops():
    H = _random_entropies()
    coefs = losses.surrogate_coefficients(H, normalize="per_token", x_mode="causal", baseline="loo_position")
    gen = torch.Generator().manual_seed(3)
    d_logq = [torch.randn(T, generator=gen) for T in LENGTHS]  # float32, as from the model
    d_ent = [torch.randn(T, generator=gen) for T in LENGTHS]
    a, r = losses.directional_pieces(d_logq, d_ent, coefs)
    for i, T in enumerate(LENGTHS):
        al, be = coefs.alpha[i].tolist(), coefs.beta[i].tolist()
        want_a = sum(float(d_ent[i][k]) + al[k] * float(d_logq[i][k]) for k in range(T))
        want_r = sum(be[k] * float(d_logq[i][k]) for k in range(T))
        assert float(a[i]) == pytest.approx(want_a, rel=1e-12, abs=1e-12)
        assert float(r[i]) == pytest.approx(want_r, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("normalize,x_mode", [("per_token", "causal"), ("per_sequence", "causal"),
                                              ("per_token", "full_return")])
def test_surrogate_gradient_along_v_equals_pieces(normalize, x_mode):
    """Autograd of L_X along a direction (ℓ, H depending on a parameter θ) = (Σa − Ĥ Σr)/D."""
    gen = torch.Generator().manual_seed(7)
    theta = torch.randn(3, dtype=torch.float64, requires_grad=True)
    feats = [torch.randn(T, 3, generator=gen, dtype=torch.float64) for T in LENGTHS]
    logq = [-(f @ theta).exp() for f in feats]
    ents = [(f @ theta).sigmoid() for f in feats]
    coefs = losses.surrogate_coefficients([e.detach() for e in ents], normalize=normalize, x_mode=x_mode,
                                          baseline="none")
    coefficients = [coefs.coefficient(i) for i in range(len(LENGTHS))]
    (grad,) = torch.autograd.grad(losses.surrogate_loss(logq, ents, coefficients, coefs.D), theta, retain_graph=True)
    v = torch.tensor([0.3, -1.0, 0.5], dtype=torch.float64)
    d_logq = [torch.stack([torch.autograd.grad(l[k], theta, retain_graph=True)[0] @ v for k in range(len(l))])
              for l in logq]
    d_ent = [torch.stack([torch.autograd.grad(e[k], theta, retain_graph=True)[0] @ v for k in range(len(e))])
             for e in ents]
    a, r = losses.directional_pieces(d_logq, d_ent, coefs)
    assert float(grad @ v) == pytest.approx(float((a.sum() - coefs.H_hat * r.sum()) / coefs.D), rel=1e-10)


# ----------------------------------------------------------------------------- SE_total

@pytest.mark.parametrize("se_e,se_u", [(3.0, 4.0), (1e-7, 2.5e-7), (0.0, 0.2), (0.5, 0.0)])
def test_se_total_is_root_sum_of_squares(se_e, se_u):
    assert se_total(se_e, se_u) == pytest.approx(math.sqrt(se_e * se_e + se_u * se_u), rel=1e-14)


@pytest.mark.parametrize("se_e,se_u", [(float("nan"), 1.0), (1.0, float("nan")), (float("nan"), float("nan"))])
def test_se_total_with_an_unavailable_side_is_unavailable(se_e, se_u):
    """A missing side (NaN) is missing, never zero: the total is NaN, not the other side alone."""
    assert math.isnan(se_total(se_e, se_u))

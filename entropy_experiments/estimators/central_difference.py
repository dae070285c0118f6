"""The per-sequence pieces of the E-side error bars without the second backward (docs/maths.md §6).

The exact jackknife of SE_E needs a_i = D_v L_α,i and r_i = D_v L_β,i per E sequence. `one_pass_sums` gets
both from two backwards per microbatch (∇L_α', ∇L_β with the row hooks). Here instead:

- E is scored first without grad (Ĥ known), then ONE backward of L_X = (L_α − Ĥ·L_β)/D gives X̂ and, by the
  same row hooks, D_v L_X,i = (a_i − Ĥ·r_i)/D per sequence (`entropy_gradient.surrogate_gradient_rows`);
- r_i = Σ_k β_ik D_v ℓ_ik comes from the no-grad passes at θ ± η·v that the ΔH phase runs anyway:

      r_i(η) = Σ_k β_ik (ℓ_ik(θ + η·v) − ℓ_ik(θ − η·v)) / 2η = r_i + (η²/6)·Σ_k β_ik D³_v ℓ_ik + O(η⁴),

  (the even terms cancel), plus fp32 rounding of the two passes divided by 2η (σ_ℓ·√(Σ_k β_ik²)·√2/2η);
- a_i = D·D_v L_X,i + Ĥ·r_i.

An error ε_i in r_i moves δH₁ from the pieces by −Ĥ·Σε_i/D and each jackknife replicate alike: the SE_E it
gives differs from the exact one by about the SE of that error, which must be far below SE_E.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .surrogate import SurrogateCoefficients


def central_difference_r(logq_plus: list[Tensor], logq_minus: list[Tensor], coefs: SurrogateCoefficients,
                         eta: float) -> Tensor:
    """r_i ≈ Σ_k β_ik (ℓ_ik(θ+ηv) − ℓ_ik(θ−ηv)) / 2η per sequence, float64 [N] (per unit of v)."""
    if eta <= 0:
        raise ValueError(f"the central difference needs η > 0, got {eta}")
    return torch.stack([(be * (p.double() - m.double())).sum() / (2.0 * eta)
                        for p, m, be in zip(logq_plus, logq_minus, coefs.beta)])


def pieces_from_rows(d_loss_rows: Tensor, r: Tensor, coefs: SurrogateCoefficients) -> tuple[Tensor, Tensor]:
    """(a [N], r [N]) from the per-sequence D_v L_X,i of one L_X backward and r_i: a_i = D·D_v L_X,i + Ĥ·r_i."""
    return coefs.D * d_loss_rows.double() + coefs.H_hat * r.double(), r.double()

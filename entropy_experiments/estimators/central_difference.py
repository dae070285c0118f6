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

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from .surrogate import SurrogateCoefficients

#: The largest η (per unit of v, like a learning rate) whose ΔH(±η) passes the probe reuses for r_i by default:
#: above it the O(η²) truncation grows (docs/scaling.md "r_i without the second backward": 2.3e-2 of max |r| at
#: 1e-3 on the tiny model), below it the fp32 rounding of the two passes grows as 1/η.
R_ETA_MAX = 1.0e-4


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


def central_difference_eta(r_eta: float | None, etas: Sequence[float]) -> float | None:
    """The η of r_i: `r_eta` when given, else the largest η ≤ R_ETA_MAX whose +η and −η are both in `etas` (the ΔH
    passes; None when there is none)."""
    if r_eta is not None:
        return float(r_eta)
    values = {float(e) for e in etas}
    pairs = [e for e in values if 0 < e <= R_ETA_MAX and -e in values]
    return max(pairs) if pairs else None


def r_eta_message(importance_enabled: bool) -> str:
    """The one line refusing variance.r_method central_difference without an η."""
    where = (f"importance.eta_list has no η ≤ {R_ETA_MAX:g} with its −η (importance.symmetric)"
             if importance_enabled else "importance.enabled is false")
    return (f"variance.r_eta: variance.r_method central_difference needs an η for the ±η passes and {where}; "
            "set variance.r_eta (e.g. 1e-5) or variance.r_method backward")


def beta_log_ratio(new_logqs: list[Tensor], base_logqs: list[Tensor], beta: list[Tensor]) -> np.ndarray:
    """Σ_k β_ik (ℓ'_ik − ℓ_ik) per sequence, float64 [n]: the β-weighted log-ratio of one pass at θ' to θ. Two of
    them at θ ± η·v give r_i by `r_from_log_ratios`."""
    return np.array([float((be * (n.double() - o.double())).sum()) for n, o, be in zip(new_logqs, base_logqs, beta)])


def r_from_log_ratios(plus: np.ndarray, minus: np.ndarray, eta: float) -> Tensor:
    """r_i ≈ (Σ_k β_ik (ℓ_ik(θ+ηv) − ℓ_ik)) − Σ_k β_ik (ℓ_ik(θ−ηv) − ℓ_ik)) / 2η, float64 [N] (per unit of v)."""
    if eta <= 0:
        raise ValueError(f"the central difference needs η > 0, got {eta}")
    return torch.from_numpy((np.asarray(plus, dtype=np.float64) - np.asarray(minus, dtype=np.float64)) / (2.0 * eta))


def pieces_from_weighted_rows(d_loss_rows: Tensor, r: Tensor, coefs: SurrogateCoefficients) -> tuple[Tensor, Tensor]:
    """`pieces_from_rows` when the L_X backward carried the sampler's weights (docs/maths.md §12): the row hooks saw
    s_i·D_v L_X,i, divided back here; a, r stay per sequence and unweighted (both 0 where s_i = 0, as the exact
    pieces). Without weights, `pieces_from_rows` itself."""
    if coefs.weights is None:
        return pieces_from_rows(d_loss_rows, r, coefs)
    s = coefs.weights.double()
    kept = s > 0
    rows = torch.where(kept, d_loss_rows.double() / torch.where(kept, s, torch.ones_like(s)), torch.zeros_like(s))
    a, r = pieces_from_rows(rows, r, coefs)
    return torch.where(kept, a, torch.zeros_like(a)), torch.where(kept, r, torch.zeros_like(r))

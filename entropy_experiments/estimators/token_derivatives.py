"""D_v H_t per realised E token from no-grad passes at θ + η·v, without a forward-mode pass (docs/attribution.md
"How dH is computed").

The token attribution needs, per token t of every E sequence, the derivative of its entropy H_t (at the fixed,
teacher-forced prefix) along the step direction v. The forward-mode jvp gives it exactly for the cost of about
three no-grad forwards. The ΔH and second-order passes already score every E token at θ ± η·v, so a difference
of their per-token entropies gives it for free:

    central   (H_t(θ + η·v) − H_t(θ − η·v)) / 2η = D_v H_t + (η²/6)·D³_v H_t + O(η⁴)
    forward   (H_t(θ + η·v) − H_t(θ)) / η        = D_v H_t + (η/2)·D²_v H_t + O(η²)

plus each pass's fp32 rounding of H_t divided by 2η (or η). Truncation grows with η, rounding falls as 1/η, so
the probe takes a pair from the passes it made by `token_pass_choice`: the central difference at the largest
measured η up to TOKEN_ETA_MAX, else the forward difference at the smallest measured +η.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from .second_difference import symmetric_etas

#: The largest η (per unit of v) whose ±η passes the token derivatives take by default: the second-order passes'
#: default η; above it the truncation (η²/6)·D³_v H_t grows past a percent of D_v H_t on the measured models
#: (docs/attribution.md).
TOKEN_ETA_MAX = 1.0e-3


@dataclass(frozen=True)
class TokenPassChoice:
    """Which passes give D_v H_t: `kind` "central" (+η and −η) or "forward" (+η and the scores at θ), and η > 0."""

    kind: str
    eta: float

    def etas(self) -> tuple[float, ...]:
        """The η of the passes whose per-token entropies the difference needs."""
        return (self.eta, -self.eta) if self.kind == "central" else (self.eta,)


def token_pass_choice(etas: Iterable[float]) -> TokenPassChoice | None:
    """The central difference at the largest η ≤ TOKEN_ETA_MAX with both +η and −η in `etas` (the η of the no-grad
    passes the probe makes), else the forward difference at the smallest +η; None when no η > 0 is measured."""
    values = [float(e) for e in etas]
    pairs = [e for e in symmetric_etas(values) if e <= TOKEN_ETA_MAX]
    if pairs:
        return TokenPassChoice("central", max(pairs))
    positive = [e for e in values if e > 0]
    return TokenPassChoice("forward", min(positive)) if positive else None


def central_token_derivatives(plus: list[Tensor], minus: list[Tensor], eta: float) -> list[Tensor]:
    """(H_t(θ + η·v) − H_t(θ − η·v)) / 2η per token of each sequence, float64 (per unit of v)."""
    _check(plus, minus, eta)
    return [(p.double() - m.double()) / (2.0 * eta) for p, m in zip(plus, minus)]


def forward_token_derivatives(new: list[Tensor], base: list[Tensor], eta: float) -> list[Tensor]:
    """(H_t(θ + η·v) − H_t(θ)) / η per token of each sequence, float64 (per unit of v)."""
    _check(new, base, eta)
    return [(n.double() - b.double()) / eta for n, b in zip(new, base)]


def token_derivatives(choice: TokenPassChoice, entropies: dict[float, list[Tensor]],
                      base: list[Tensor]) -> list[Tensor]:
    """D_v H_t per token by `choice` from the per-token entropies of the passes ({η: [H_t per sequence]}) and
    those at θ (`base`, the forward difference's)."""
    if choice.kind == "central":
        return central_token_derivatives(entropies[choice.eta], entropies[-choice.eta], choice.eta)
    return forward_token_derivatives(entropies[choice.eta], base, choice.eta)


def _check(one: list[Tensor], other: list[Tensor], eta: float) -> None:
    if eta <= 0:
        raise ValueError(f"a finite difference needs η > 0, got {eta}")
    if [len(x) for x in one] != [len(x) for x in other]:
        raise ValueError("the two passes scored sequences of different lengths")
    if not all(torch.is_tensor(x) for x in [*one, *other]):
        raise TypeError("per-token entropies must be tensors")

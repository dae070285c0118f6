"""D_v H_t per realised E token from no-grad passes at θ + η·v, without a forward-mode pass (docs/attribution.md
"How dH is computed").

The token attribution needs, per token t of every E sequence, the derivative of its entropy H_t (at the fixed,
teacher-forced prefix) along the step direction v. The forward-mode jvp gives it exactly for the cost of about
three no-grad forwards. The ΔH and second-order passes already score every E token at θ ± η·v, so a difference
of their per-token entropies gives it for free:

    central   (H_t(θ + η·v) − H_t(θ − η·v)) / 2η = D_v H_t + (η²/6)·D³_v H_t + O(η⁴)
    forward   (H_t(θ + η·v) − H_t(θ)) / η        = D_v H_t + (η/2)·D²_v H_t + O(η²)

plus each pass's fp32 rounding of H_t divided by 2η (or η). Truncation grows with η, rounding falls as 1/η.
`token_pass_choice` takes a difference only where its error can be estimated (else the probe makes the jvp pass):

- central at the largest symmetric η ≤ TOKEN_ETA_MAX, when one more pass η' was made: with the per-token second
  difference S_t = (H_t(η) − 2H_t(0) + H_t(−η))/η², f_t = (H_t(η') − H_t(0))/η' − (η'/2)·S_t is D_v H_t + (η'²/6)·D³_v H_t
  like the central one with η'. Their disagreement |central_t − f_t| is the stated error: with η' ≪ η it is the
  central's truncation (plus f_t's rounding, an overstatement); with η' > η Richardson would scale it down by
  η²/(η'² − η²), but that would hide the central's own rounding (measured on the enumerable toy model at η 1e−3,
  η' 5e−3: the scaled estimate was 0.8× the true error), so it is left as the error of the worse of the two;
- else forward at the smallest +η ≤ FORWARD_ETA_MAX, the limit measured against the jvp (docs/attribution.md:
  at most 1.9 % of the largest |D_v H_t| on three models, where η = 5e−3 was 30 % off on the enumerable toy model):
  its error (η/2)·|S_t| with S_t from a pair ±η_p ≥ 10η when one was measured, else the measured limit alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor

from .rounding_floor import PAIR_OVER_SMALL
from .second_difference import symmetric_etas

#: The largest η (per unit of v) whose ±η passes the token derivatives take by default: the second-order passes'
#: default η; above it the truncation (η²/6)·D³_v H_t grows past a percent of D_v H_t on the measured models
#: (docs/attribution.md).
TOKEN_ETA_MAX = 1.0e-3
#: The largest η of a forward difference (measured against the jvp; module docstring).
FORWARD_ETA_MAX = 1.0e-5
#: results.json warns when the largest estimated error of a token's dH exceeds this share of the largest |dH_t|.
ERROR_SHARE_MAX = 0.1


@dataclass(frozen=True)
class TokenPassChoice:
    """Which passes give D_v H_t: `kind` "central" (+η and −η) or "forward" (+η and the scores at θ), η > 0, and
    `check`, the pass its error estimate takes (central: the one more η'; forward: the pair ±η_p; None: none)."""

    kind: str
    eta: float
    check: float | None = None

    def etas(self) -> tuple[float, ...]:
        """The η of the passes whose per-token entropies the difference and its error estimate need."""
        main = (self.eta, -self.eta) if self.kind == "central" else (self.eta,)
        if self.check is None:
            return main
        return (*main, self.check) if self.kind == "central" else (*main, self.check, -self.check)


def token_pass_choice(etas: Iterable[float]) -> TokenPassChoice | None:
    """From the η of the no-grad passes the probe makes (module docstring): the central difference at the largest
    symmetric η ≤ TOKEN_ETA_MAX checked by the smallest other |η'|, else the forward difference at the smallest
    +η ≤ FORWARD_ETA_MAX (checked by the smallest pair ≥ 10η, if any); None: neither (the jvp)."""
    values = sorted({float(e) for e in etas})
    pairs = symmetric_etas(values)
    central = [e for e in pairs if e <= TOKEN_ETA_MAX]
    if central:
        others = sorted((e for e in values if abs(e) != max(central)), key=abs)
        if others:
            return TokenPassChoice("central", max(central), others[0])
    forward = [e for e in values if 0 < e <= FORWARD_ETA_MAX]
    if not forward:
        return None
    wide = [p for p in pairs if p >= PAIR_OVER_SMALL * min(forward)]
    return TokenPassChoice("forward", min(forward), min(wide) if wide else None)


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


def second_differences(plus: list[Tensor], minus: list[Tensor], base: list[Tensor], eta: float) -> list[Tensor]:
    """S_t = (H_t(θ + η·v) − 2H_t(θ) + H_t(θ − η·v)) / η² per token, float64."""
    _check(plus, minus, eta)
    return [(p.double() - 2.0 * b.double() + m.double()) / eta ** 2 for p, m, b in zip(plus, minus, base)]


def token_errors(choice: TokenPassChoice, entropies: dict[float, list[Tensor]],
                 base: list[Tensor]) -> list[Tensor] | None:
    """The estimated error of `token_derivatives(choice, ...)` per token (module docstring), float64, per unit of v;
    None without a `check` pass."""
    if choice.check is None:
        return None
    if choice.kind == "forward":
        pair = choice.check
        curv = second_differences(entropies[pair], entropies[-pair], base, pair)
        return [0.5 * choice.eta * c.abs() for c in curv]
    eta, other = choice.eta, choice.check
    curv = second_differences(entropies[eta], entropies[-eta], base, eta)
    central = central_token_derivatives(entropies[eta], entropies[-eta], eta)
    shifted = [(n.double() - b.double()) / other - 0.5 * other * c for n, b, c in zip(entropies[other], base, curv)]
    return [(c - f).abs() for c, f in zip(central, shifted)]

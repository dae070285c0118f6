"""The teacher-forced quantities of a batch of sequences, one entry per sequence (docs/maths.md §1, §5, §6).

`SequenceScores` is the one type for them: ℓ_ik = log q(y_k | y_<k) and H_ik (Rao–Blackwell entropy
of the sampling policy at step k) as float64 [T_i] tensors, optionally their exact derivatives along
v, and the independent unit (E prompt) each sequence belongs to, for the jackknife. Sequences are in
(prompt, response) order: sequence n = b·G + g.

`score_sequences` fills it through the policy engine (`policy/engine.py`) — no graph, at θ, at a parameter override
θ + η·v, or with forward-mode derivatives along v; `log_weights` turns two scorings of the same
sequences into importance log-weights.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..data.batch import Batch
from ..policy.engine import PolicyEngine

E_SCORING = "teacher forcing (E scoring)"
ETA_SCORING = "teacher forcing at θ + η·v (ΔH(η) scoring)"
E_JVP = "teacher forcing (jvp, E directional derivatives)"
E_SECOND_ORDER_JVP = "teacher forcing (second-order jvp on E)"


@dataclass
class SequenceScores:
    """ℓ_ik and H_ik per sequence (float64 [T_i]); d_logq / d_entropy: their derivatives along v per unit
    lr, or None; unit_of_sequence: the E prompt each sequence belongs to."""

    token_logqs: list[Tensor]
    token_entropies: list[Tensor]
    unit_of_sequence: list[int]
    d_logq: list[Tensor] | None = None
    d_entropy: list[Tensor] | None = None

    @property
    def lengths(self) -> Tensor:
        """T_i, float64 [N]."""
        return torch.tensor([len(x) for x in self.token_logqs], dtype=torch.float64)

    @property
    def seq_entropies(self) -> Tensor:
        """h_i = Σ_k H_ik, float64 [N]."""
        return torch.stack([h.sum() for h in self.token_entropies])

    def rows(self, indices: list[int]) -> dict[int, tuple]:
        """{global index: (ℓ, H, dℓ, dH)} for sequence j of this object at global index indices[j]."""
        fields = (self.token_logqs, self.token_entropies, self.d_logq, self.d_entropy)
        return {n: tuple(None if f is None else f[j] for f in fields) for j, n in enumerate(indices)}

    def subset(self, indices: list[int]) -> SequenceScores:
        """The scores of sequences `indices` (in that order), with their units."""
        fields = (self.token_logqs, self.token_entropies, self.d_logq, self.d_entropy)
        rows = [tuple(None if f is None else f[i] for f in fields) for i in indices]
        return SequenceScores.from_rows(rows, [self.unit_of_sequence[i] for i in indices])

    @classmethod
    def from_rows(cls, rows: list[tuple], unit_of_sequence: list[int]) -> SequenceScores:
        """Inverse of `rows`, from rows already in global order."""
        cols = list(zip(*rows))
        with_d = bool(rows) and rows[0][2] is not None
        return cls(token_logqs=list(cols[0]), token_entropies=list(cols[1]), unit_of_sequence=unit_of_sequence,
                   d_logq=list(cols[2]) if with_d else None, d_entropy=list(cols[3]) if with_d else None)


def units_of(num_prompts: int, G: int) -> list[int]:
    """The unit (prompt) of each of the num_prompts·G sequences."""
    return [b for b in range(num_prompts) for _ in range(G)]


def score_sequences(engine: PolicyEngine, batch: Batch, *, v_named: Mapping[str, Tensor] | None = None,
                    params_override: Mapping[str, Tensor] | None = None,
                    tf_batch_size: int | None = None) -> SequenceScores:
    """No-grad teacher forcing of a packed batch: at θ, at `params_override`, or (with `v_named`) with the
    exact derivatives along v by forward-mode AD. `tf_batch_size` (rows per forward; None: the engine's
    setting) fixes the batch layout: the same layout gives bitwise the same numbers at the same θ."""
    units = units_of(batch.num_prompts, batch.num_responses_per_prompt)
    if v_named is not None:
        return jvp_scores(directional_rows(engine, batch, v_named, order=1), units)
    lp = engine.teacher_force_logprobs(batch, with_grad=False, compute_rb=True, params_override=params_override,
                                   tf_batch_size=tf_batch_size,
                                   phase=E_SCORING if params_override is None else ETA_SCORING)
    return SequenceScores(token_logqs=[torch.as_tensor(t).double() for row in lp.token_logqs for t in row],
                          token_entropies=[torch.as_tensor(h).double() for row in lp.rb_entropies for h in row],
                          unit_of_sequence=units)


def log_weights(new: SequenceScores, old: SequenceScores) -> np.ndarray:
    """log w_i = Σ_k (ℓ'_ik − ℓ_ik), summed in float64 from per-token differences; −inf when a realised
    token left the new nucleus."""
    return np.array([float((n.double() - o.double()).sum()) for n, o in zip(new.token_logqs, old.token_logqs)])


SECOND_ORDER_KEYS = ("s", "s2", "dh", "d2h", "h", "T")


def directional_rows(engine: PolicyEngine, batch: Batch, v_named: Mapping[str, Tensor], *,
                     order: int) -> list[dict[str, Tensor]]:
    """The forward-mode rows of every sequence in order n = b·G + g (`policy.score.jvp`; order 1: ℓ, H and their
    derivatives along v; order 2 also the second derivatives)."""
    phase = E_JVP if order == 1 else E_SECOND_ORDER_JVP
    return [r for row in engine.teacher_force_directional(batch, v_named, order=order, phase=phase) for r in row]


def jvp_scores(rows: list[dict[str, Tensor]], units: list[int]) -> SequenceScores:
    """The scores with their derivatives along v from forward-mode rows (`directional_rows`, either order)."""
    return SequenceScores(token_logqs=[r["logq"].double() for r in rows],
                          token_entropies=[r["rb_entropy"].double() for r in rows],
                          d_logq=[r["d_logq"].double() for r in rows],
                          d_entropy=[r["d_rb_entropy"].double() for r in rows], unit_of_sequence=units)


def second_order_sums(engine: PolicyEngine, batch: Batch, v_named: Mapping[str, Tensor]) -> dict[str, list[float]]:
    """Per sequence (float64): s = Σ_k D_v ℓ, s2 = Σ_k D²_v ℓ, dh = Σ_k D_v H, d2h = Σ_k D²_v H, h = Σ_k H, T,
    by forward-over-forward mode along v (estimators/second_order.py)."""
    return second_order_sums_of(directional_rows(engine, batch, v_named, order=2))


def second_order_sums_of(rows: list[dict[str, Tensor]]) -> dict[str, list[float]]:
    """`second_order_sums` from order-2 rows (`directional_rows`)."""
    keys = ("d_logq", "d2_logq", "d_rb_entropy", "d2_rb_entropy", "rb_entropy")
    out = {name: [float(r[key].double().sum()) for r in rows] for name, key in zip(SECOND_ORDER_KEYS, keys)}
    out["T"] = [float(len(r["logq"])) for r in rows]
    return out

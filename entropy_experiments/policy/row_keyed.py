"""Row-keyed draws: each row's tokens depend only on (seed, global row index, step), never on which rows share
a generate call.

At step t the token of row r is drawn by inverse CDF from q = softmax(a), a = `sampling_logits` (z/τ, −inf
outside the nucleus): with one uniform u_{r,t}, the first token v (in token-id order) whose cumulative
probability exceeds u. u comes from a counter-based hash of (seed, r, t) computed with vectorised torch int64
ops on the logits' device: two 32-bit hashes make one 53-bit uniform u = k·2⁻⁵³, so tokens down to
q ≈ 1e-16 keep their probability. Rows per call, an out-of-memory halving or a resumed run change nothing.
(Gumbel-max, argmax_v a_v + g_v, needs one uniform per token instead of one per row: measured on the 2-core
CPU host at 8 rows × V = 49,152 it cost ≈ 85 ms per step, as much as the decode step itself; docs/sampling.md.)

`RowKeyedDraw` is the HF LogitsProcessor: it returns scores that are −inf except at the chosen token (HF's own
multinomial can only pick it) and, with `record`, keeps log q_sampler of the chosen token per row and step,
computed in fp32 from the same logits it sampled from.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import LogitsProcessor

from entropy_experiments.policy.sampling_policy import (
    check_generation_logits,
    sampling_logits,
    validate_policy,
)

__all__ = ["RowKeyedDraw", "hash32", "inverse_cdf", "row_keys", "step_uniform_bits", "uniform_from_bits"]

MASK32 = 0xFFFFFFFF
# lowbias32-style mixer constants (hash-prospector's best two-multiply 32-bit hash). Both are < 2³¹, so a 32-bit
# value times a constant stays below 2⁶³: int64 maths never overflows, on any device.
MUL1, MUL2 = 0x21F0AAAD, 0x735A2D97
STREAM_ROW, STREAM_STEP, STREAM_LOW = 0x9E3779B9, 0x85EBCA6B, 0x68E31DA4
TWO_MINUS53 = 2.0 ** -53


def hash32(x: Tensor) -> Tensor:
    """A bijective 32-bit mixer (xorshift-multiply, two rounds) of int64 tensors holding values in [0, 2³²)."""
    x = x ^ (x >> 16)
    x = (x * MUL1) & MASK32
    x = x ^ (x >> 15)
    x = (x * MUL2) & MASK32
    return x ^ (x >> 15)


def _mix(key: Tensor, value: Tensor | int) -> Tensor:
    return hash32(key ^ hash32(torch.as_tensor(value, dtype=torch.long, device=key.device) & MASK32))


def row_keys(seed: int, rows: Tensor) -> Tensor:
    """[n] int64 32-bit keys of (seed, global row index) for rows [n]."""
    seed = int(seed) & ((1 << 64) - 1)
    base = torch.tensor(seed & MASK32, dtype=torch.long, device=rows.device)
    base = _mix(hash32(base), (seed >> 32) ^ STREAM_ROW)
    return _mix(base.expand(rows.shape), rows.long())


def step_uniform_bits(keys: Tensor, step: int) -> Tensor:
    """[n] int64 in [0, 2⁵³): 53 uniform bits per (row key, step), from two 32-bit hashes."""
    step_key = _mix(keys, (int(step) + STREAM_STEP) & MASK32)
    high = hash32(step_key)                        # 32 bits
    low = hash32(step_key ^ STREAM_LOW)            # another 32, of which 21 are kept
    return (high << 21) | (low >> 11)


def uniform_from_bits(bits: Tensor) -> Tensor:
    """float64 u = k·2⁻⁵³ ∈ [0, 1) for 53-bit integers k (exact: every k is a float64, u never reaches 1)."""
    return bits.double() * TWO_MINUS53


def inverse_cdf(a: Tensor, u: Tensor) -> Tensor:
    """tokens [n]: for each row the first v with Σ_{w ≤ v} q_w > u·Σ q, q = softmax(a) (a [n, V], −inf allowed).

    Cumulative sums of non-negative float64 numbers are monotone, so the chosen token always has q > 0."""
    p = torch.softmax(a.double(), dim=-1)
    cdf = torch.cumsum(p, dim=-1)
    total = cdf[:, -1:]
    x = torch.minimum(u.unsqueeze(-1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True).squeeze(-1).clamp_(max=a.shape[-1] - 1)


class RowKeyedDraw(LogitsProcessor):
    """HF LogitsProcessor drawing row r's token at step t by inverse CDF with a uniform keyed by (seed, r, t).

    rows: [n] global row indices of the call's rows (in batch order); prompt_len: Lp (step t =
    input_ids.shape[1] − Lp). With `record`, `logqs()` gives [n, steps] float32 log q of each chosen token
    under the rule it was drawn from (fp32 maths on the logits HF passes, cast to fp32)."""

    def __init__(self, temperature: float, top_p: float, seed: int, rows: Tensor, prompt_len: int, *,
                 record: bool = False):
        validate_policy(temperature, top_p)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.seed, self.rows, self.prompt_len, self.record = int(seed), rows, int(prompt_len), record
        self.recorded: list[Tensor] = []
        self._keys: Tensor | None = None

    def choose(self, scores: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """(tokens [n], the rule's fp32 log-probabilities [n, V]) for scores [n, V] at `step`."""
        a = sampling_logits(scores.float(), self.temperature, self.top_p)
        if self._keys is None or self._keys.device != a.device:
            self._keys = row_keys(self.seed, self.rows.to(a.device))
        return inverse_cdf(a, uniform_from_bits(step_uniform_bits(self._keys, step))), a

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        check_generation_logits(input_ids, scores)
        tokens, a = self.choose(scores, int(input_ids.shape[1]) - self.prompt_len)
        if self.record:
            chosen = a.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            self.recorded.append((chosen - torch.logsumexp(a, dim=-1)).float())
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(-1, tokens.unsqueeze(-1), 0.0)

    def logqs(self) -> Tensor:
        """[n, steps] float32 recorded log q of the chosen tokens (steps = generate's steps)."""
        if not self.recorded:
            return torch.zeros((len(self.rows), 0), dtype=torch.float32)
        return torch.stack(self.recorded, dim=1).cpu()

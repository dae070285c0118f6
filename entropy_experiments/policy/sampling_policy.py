"""The sampling policy q_θ — ONE nucleus rule for generation and scoring (MATH.md §1).

    logits z → a = z/τ → keep tokens in order of decreasing probability until the cumulative
    probability FIRST REACHES top_p (the crossing token included, at least one token) → renormalise.

`sampling_logits` is that rule; generation applies it through `SamplingPolicyLogitsProcessor`
inside `model.generate`, and teacher forcing applies it through `policy_token_stats` /
`token_logq_and_entropy`, so the measure that produced a token is exactly the one it is scored under.

Nucleus membership is always decided in the logits' own precision promoted to at least float32
(never in the float64 entropy maths): generation sees fp32 logits, so deciding the set in fp32 on the
scoring side too means a token sampled inside the nucleus is scored inside it, even when the
boundary is a near tie that float64 would resolve differently.

Vocabulary-sized maths is done in chunks of `chunk_size` rows: no [N × V] temporary (fp64
included) beyond one chunk is alive, which is what makes 1024 tokens at V = 151,936 affordable.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from entropy_experiments.errors import ConfigError, NumericsError

CORE_KEYS = ("logq", "rb_entropy", "logp", "logp_train", "entropy_train")
DIAG_KEYS = ("top1_prob", "margin", "collision", "renyi2", "eff_support", "two_point_entropy",
             "head_mass", "tail_mass", "logit_mean", "logit_var", "eos_prob")


class NonFiniteLogitsError(NumericsError):
    """Logits of some scored row are NaN/±inf; `row` is the row's index among the scored rows."""

    def __init__(self, message: str, row: int):
        super().__init__(message)
        self.row = row


def validate_policy(temperature: float, top_p: float) -> None:
    """ConfigError unless τ > 0 (finite) and top_p ∈ (0, 1]."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ConfigError(f"generation.temperature: must be > 0, got {temperature!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ConfigError(f"generation.top_p: must be in (0, 1], got {top_p!r}")


#: Tokens examined first when looking for the nucleus boundary; rows whose nucleus is larger fall
#: back to a full sort. Natural-language nuclei are small, so this avoids sorting the vocabulary.
NUCLEUS_TOPK = 128


def _kept_counts(cum: Tensor, top_p: float) -> Tensor:
    """Kept-token counts from the cumulative sorted probabilities cum [n, k]: token j (0-based) is kept
    iff the mass before it, cum[j−1], is < top_p; token 0 always. cumsum of non-negative numbers is
    monotone in floating point, so the kept tokens are exactly a prefix."""
    return 1 + (cum[:, :-1] < top_p).sum(-1)


def nucleus_keep_mask(scaled: Tensor, top_p: float, *, topk: int = NUCLEUS_TOPK) -> Tensor | None:
    """Boolean [..., V] mask of the nucleus of softmax(scaled); None when top_p ≥ 1 (everything kept).

    In order of decreasing probability — ties in index order, as a stable sort would give — token k
    is kept iff the probability mass of the tokens before it is < top_p: the crossing token is
    included and the top token always is. The boundary is looked for among the `topk` most probable
    tokens first (no full sort of the vocabulary; only rows whose nucleus is larger are sorted), then
    the mask is `p > p_boundary` plus, for ties at the boundary, the lowest-index equal tokens.
    """
    if top_p >= 1.0:
        return None
    work = scaled.detach()
    if work.dtype not in (torch.float32, torch.float64):
        work = work.float()
    shape = work.shape
    probs = torch.softmax(work.reshape(-1, shape[-1]), dim=-1)
    V = probs.shape[-1]
    k = max(2, min(topk, V))
    vals = probs.topk(k, dim=-1, sorted=True).values
    cum = torch.cumsum(vals, dim=-1)
    count = _kept_counts(cum, top_p)
    # A row is resolved within the top k unless all k are kept and the mass before token k is < top_p.
    unresolved = (count == k) & (cum[:, -1] < top_p) if k < V else torch.zeros_like(count, dtype=torch.bool)
    if bool(unresolved.any()):
        rows = unresolved.nonzero().squeeze(-1)
        full = probs.index_select(0, rows).sort(dim=-1, descending=True, stable=True).values
        count = count.index_put((rows,), _kept_counts(torch.cumsum(full, dim=-1), top_p))
        threshold = full.gather(-1, (count[rows] - 1).unsqueeze(-1)).squeeze(-1)
        boundary = vals.gather(-1, (count.clamp(max=k) - 1).unsqueeze(-1)).squeeze(-1)
        boundary = boundary.index_put((rows,), threshold)
    else:
        boundary = vals.gather(-1, (count - 1).unsqueeze(-1)).squeeze(-1)
    boundary = boundary.unsqueeze(-1)
    keep = probs > boundary
    ties = probs == boundary
    # m = how many of the tokens equal to the boundary value are kept (≥ 1).
    m = count - keep.sum(-1)
    surplus = ties.sum(-1) > m
    keep |= ties
    if bool(surplus.any()):  # keep only the first m equal tokens in index order
        rows = surplus.nonzero().squeeze(-1)
        tie_rows = ties.index_select(0, rows)
        extra = tie_rows & (tie_rows.cumsum(-1) > m.index_select(0, rows).unsqueeze(-1))
        keep.index_put_((rows,), keep.index_select(0, rows) & ~extra)
    return keep.reshape(shape)


def sampling_logits(logits: Tensor, temperature: float, top_p: float) -> Tensor:
    """a = z/τ with −inf outside the nucleus. logits [..., V] → [..., V], same dtype.

    top_p == 1 is the fast path: no sort and no masking (only the division, skipped at τ == 1).
    """
    scaled = logits if temperature == 1.0 else logits / temperature
    keep = nucleus_keep_mask(scaled, top_p)
    return scaled if keep is None else scaled.masked_fill(~keep, float("-inf"))


def _rowdot(x: Tensor, y: Tensor) -> Tensor:
    """Σ_v x[n, v]·y[n, v] → [n] as a batched matmul (no [n, V] product temporary)."""
    return torch.bmm(x.unsqueeze(1), y.unsqueeze(2)).reshape(x.shape[0])


def _chunk_stats(z: Tensor, tokens: Tensor, temperature: float, top_p: float, fp64: bool,
                 diagnostics: bool, eos_token_id: int | None) -> dict[str, Tensor]:
    """Per-row statistics of one chunk. z [n, V] logits, tokens [n] → dict of [n] tensors.

    Core (differentiable): logq = log q(t), rb_entropy = H(q) = log Z − Σ q·a over the kept set,
    logp = log softmax(z)(t) (τ = 1, no nucleus); logp_train / entropy_train = log-prob and entropy of
    softmax(z/τ) with no nucleus, what RL trainers score in their training pass (the same tensors as
    logq / rb_entropy when top_p = 1). Diagnostics (detached, under q): DIAG_KEYS.

    Peak memory is about two [n, V] work tensors: when nothing will be back-propagated through
    them (no-grad, or forward-mode AD) the work buffer is updated in place.
    """
    inplace = not (torch.is_grad_enabled() and z.requires_grad)
    tokens = tokens.unsqueeze(-1)
    # The nucleus is decided on the logits as the model produced them (≥ fp32), before any upcast.
    keep = nucleus_keep_mask(z if temperature == 1.0 else z / temperature, top_p)
    # The caller decides the logits' dtype (precision profiles' cast_logits_fp32); fp64 widens further.
    # A private copy either way, since it may be modified in place below.
    a = z.to(torch.float64 if fp64 else z.dtype, copy=True)
    # Shift by the (detached) row max: values and derivatives are shift-invariant, the top logit
    # becomes exactly 0 (so Σ exp ≥ 1 never overflows or underflows), and log Z − Σ q·a cancels far less.
    shift = a.detach().amax(dim=-1, keepdim=True)
    a = a.sub_(shift) if inplace else a - shift
    e = a.exp()
    sum_raw = e.sum(-1)
    logp = a.gather(-1, tokens).squeeze(-1) - sum_raw.log()
    if temperature != 1.0:
        a = a.div_(temperature) if inplace else a / temperature
    log_z_full = None
    train = None
    if keep is not None:
        train = _tempered_stats(a, tokens)  # before the nucleus mask below (which may work in place)
        if diagnostics:  # tempered, untruncated normaliser, for the nucleus head mass
            log_z_full = (sum_raw.log() if temperature == 1.0 else a.detach().exp().sum(-1).log())
        a = a.masked_fill_(~keep, float("-inf")) if inplace else a.masked_fill(~keep, float("-inf"))
    if keep is not None or temperature != 1.0:
        del e
        e = a.exp()  # exp(−inf) = 0 outside the nucleus
        sum_q = e.sum(-1)
    else:
        sum_q = sum_raw
    log_z = sum_q.log()
    logq = a.gather(-1, tokens).squeeze(-1) - log_z
    q = e.div_(sum_q.unsqueeze(-1)) if inplace else e / sum_q.unsqueeze(-1)
    if keep is not None:
        # −inf · 0 would be NaN in Σ q·a (and in its gradient): use 0 outside the nucleus.
        a = a.masked_fill_(~keep, 0.0) if inplace else a.masked_fill(~keep, 0.0)
    mean_a = _rowdot(q, a)
    out = {"logq": logq, "rb_entropy": log_z - mean_a, "logp": logp}
    out["logp_train"], out["entropy_train"] = train if train is not None else (out["logq"], out["rb_entropy"])
    if diagnostics:
        with torch.no_grad():
            out.update(_diagnostic_stats(q.detach(), a.detach(), mean_a.detach(), out["rb_entropy"].detach(),
                                         log_z.detach(), log_z_full, eos_token_id))
    return out


def _tempered_stats(a: Tensor, tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(log softmax(a)(t), H(softmax(a))) [n] for shifted, tempered logits a [n, V] (no nucleus)."""
    log_z = torch.logsumexp(a, dim=-1)
    p = torch.softmax(a, dim=-1)
    return a.gather(-1, tokens).squeeze(-1) - log_z, log_z - _rowdot(p, a)


def _diagnostic_stats(q: Tensor, a_safe: Tensor, mean_a: Tensor, entropy: Tensor, log_z: Tensor,
                      log_z_full: Tensor | None, eos_token_id: int | None) -> dict[str, Tensor]:
    """Detached per-step shape statistics of q (shapes [n]); a_safe = shifted a with 0 outside the nucleus."""
    k = min(2, q.shape[-1])
    top = q.topk(k, dim=-1).values
    top1 = top[:, 0]
    top2 = top[:, 1] if k > 1 else torch.zeros_like(top1)
    collision = _rowdot(q, q)
    rest = (1.0 - top1).clamp_min(0.0)
    two_point = -(torch.xlogy(top1, top1) + torch.xlogy(rest, rest))
    logit_var = (_rowdot(q, a_safe * a_safe) - mean_a * mean_a).clamp_min(0.0)
    # Mass the nucleus keeps under the tempered, untruncated distribution softmax(z/τ).
    head = torch.ones_like(top1) if log_z_full is None else torch.exp(log_z - log_z_full).clamp(max=1.0)
    eos = q[:, eos_token_id] if eos_token_id is not None else torch.full_like(top1, float("nan"))
    return {
        "top1_prob": top1, "margin": top1 - top2, "collision": collision, "renyi2": -torch.log(collision),
        "eff_support": torch.exp(entropy), "two_point_entropy": two_point, "head_mass": head,
        "tail_mass": (1.0 - head).clamp_min(0.0), "logit_mean": mean_a, "logit_var": logit_var, "eos_prob": eos,
    }


def policy_token_stats(
    logits: Tensor,
    tokens: Tensor,
    temperature: float,
    top_p: float,
    *,
    fp64: bool = True,
    chunk_size: int = 256,
    rows: Tensor | None = None,
    diagnostics: bool = False,
    eos_token_id: int | None = None,
    checkpoint: bool = False,
    check_finite: bool = True,
) -> dict[str, Tensor]:
    """Per-token statistics of the sampling policy, computed `chunk_size` rows at a time.

    logits: [..., V] (flattened to [M, V]; a view when contiguous). tokens: [N] token ids.
    rows: optional [N] indices into the M flattened rows (gathered one chunk at a time, so the
    caller never materialises an [N, V] copy); default: the first N = M rows in order.
    Returns a dict of [N] tensors: CORE_KEYS (+ DIAG_KEYS when `diagnostics`), float64 when `fp64`
    else in the logits' own dtype (cast them to fp32 first for fp32 maths). Core values carry autograd/forward-AD graph from
    `logits`; with `checkpoint` (for backward passes) each chunk's vocabulary-sized intermediates
    are recomputed during backward instead of being saved, so graph memory stays O(N) beyond the logits.
    Non-finite logits in a scored row raise NonFiniteLogitsError(row=index among the N rows).
    """
    if chunk_size < 1:
        raise ConfigError(f"precision.token_chunk_size: must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    n = int(rows.numel()) if rows is not None else int(flat.shape[0])
    if tokens.numel() != n:
        raise ValueError(f"policy_token_stats: {tokens.numel()} tokens for {n} rows")
    tokens = tokens.to(flat.device)
    if rows is not None:
        rows = rows.to(flat.device)
    fn: Callable[..., dict[str, Tensor]] = _chunk_stats
    pieces: list[dict[str, Tensor]] = []
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        chunk = flat[start:stop] if rows is None else flat.index_select(0, rows[start:stop])
        if check_finite:
            finite_rows = torch.isfinite(chunk.detach()).all(dim=-1)
            if not bool(finite_rows.all()):
                bad = start + int((~finite_rows).nonzero()[0, 0])
                raise NonFiniteLogitsError(f"non-finite logits at scored row {bad}", row=bad)
        args = (chunk, tokens[start:stop], temperature, top_p, fp64, diagnostics, eos_token_id)
        if checkpoint and torch.is_grad_enabled() and chunk.requires_grad:
            from torch.utils.checkpoint import checkpoint as _ckpt

            pieces.append(_ckpt(fn, *args, use_reentrant=False))
        else:
            pieces.append(fn(*args))
    if not pieces:
        dtype = torch.float64 if fp64 else flat.dtype
        keys = CORE_KEYS + (DIAG_KEYS if diagnostics else ())
        return {k: torch.zeros(0, dtype=dtype, device=flat.device) for k in keys}
    return {k: torch.cat([piece[k] for piece in pieces]) for k in pieces[0]}


def token_logq_and_entropy(
    logits: Tensor,
    tokens: Tensor,
    temperature: float,
    top_p: float,
    *,
    fp64: bool = True,
    chunk_size: int = 256,
    rows: Tensor | None = None,
    checkpoint: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """(logq [N], rb_entropy [N], logp [N]) for logits [N, V] (or `rows` of [..., V]) and tokens [N].

    logq: log q_θ(t) under the sampling policy; rb_entropy: entropy of the truncated, renormalised
    q_θ(·) (nats); logp: raw model log-prob (τ = 1, no nucleus). Differentiable (autograd and
    torch.func.jvp); chunked as in `policy_token_stats`.
    """
    stats = policy_token_stats(logits, tokens, temperature, top_p, fp64=fp64, chunk_size=chunk_size,
                               rows=rows, checkpoint=checkpoint)
    return stats["logq"], stats["rb_entropy"], stats["logp"]


def _logits_processor_base():
    from transformers import LogitsProcessor

    return LogitsProcessor


class SamplingPolicyLogitsProcessor(_logits_processor_base()):
    """HF LogitsProcessor applying `sampling_logits`; generate then samples from softmax of its output.

    Used with HF's own warpers off (temperature 1, top_p 1, top_k 0), so this is the only rule.
    scores: [batch, V] (HF passes an fp32 copy of the last-position logits).
    """

    def __init__(self, temperature: float, top_p: float):
        validate_policy(temperature, top_p)
        self.temperature = float(temperature)
        self.top_p = float(top_p)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        # NaN / +inf logits would reach torch.multinomial as an opaque RuntimeError: name the row instead.
        bad = torch.isnan(scores).any(dim=-1) | torch.isposinf(scores).any(dim=-1)
        if bool(bad.any()):
            row = int(bad.nonzero()[0, 0])
            error = NonFiniteLogitsError(f"non-finite logits in generation at row {row}, position "
                                         f"{int(input_ids.shape[1])}", row=row)
            error.position = int(input_ids.shape[1])  # the absolute position of the token being drawn
            raise error
        return sampling_logits(scores, self.temperature, self.top_p)


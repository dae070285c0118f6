"""The sampling policy q_θ — ONE nucleus rule for generation and scoring (docs/maths.md §1).

    logits z → a = z/τ → keep tokens in order of decreasing probability until the cumulative
    probability FIRST REACHES top_p (the crossing token included, at least one token) → renormalise.

`sampling_logits` is that rule; generation applies it through `SamplingPolicyLogitsProcessor`
inside `model.generate`, and teacher forcing applies it through `policy_token_stats` /
`token_logq_and_entropy`, so the measure that produced a token is exactly the one it is scored under.

Nucleus membership is always decided in the logits' own precision promoted to at least float32
(never in the float64 entropy maths): generation sees fp32 logits, so deciding the set in fp32 on the
scoring side too means a token sampled inside the nucleus is scored inside it, even when the
boundary is a near tie that float64 would resolve differently.

Vocabulary-sized maths is done in chunks of at most `chunk_size` rows and `chunk_elements` entries:
no [N × V] temporary (fp64 included) beyond one chunk is alive, and without autograd the chunks
share one set of work buffers (`ChunkBuffers`): 1024 tokens at V = 151,936 take 70–95 MB beyond
the logits, 1.1–1.6 % of the same maths on whole [N, V] float64 tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd import forward_ad

from entropy_experiments.errors import ConfigError, NumericsError
from entropy_experiments.policy.stats_request import TokenStatsRequest

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


#: Tokens examined first when looking for the nucleus boundary; rows whose nucleus is larger are
#: re-examined with NUCLEUS_GROWTH times as many, up to the whole vocabulary. Natural-language nuclei
#: are small, so this avoids sorting the vocabulary (a sort of [n, V] costs ~25 ms and 12 bytes per row).
NUCLEUS_TOPK = 128
NUCLEUS_GROWTH = 8

#: Vocabulary entries (rows × V) per chunk of `policy_token_stats`: at ~17 bytes each (fp64 work tensors)
#: a chunk peaks near 70 MB whatever the vocabulary, e.g. 27 rows at V = 151,936, 128 rows at V = 32,768.
CHUNK_ELEMENTS = 1 << 22


def _kept_counts(cum: Tensor, top_p: float) -> Tensor:
    """Kept-token counts from the cumulative sorted probabilities cum [n, k]: token j (0-based) is kept
    iff the mass before it, cum[j−1], is < top_p; token 0 always. cumsum of non-negative numbers is
    monotone in floating point, so the kept tokens are exactly a prefix."""
    return 1 + torch.count_nonzero(cum[:, :-1] < top_p, dim=-1)


def _nucleus_boundary(probs: Tensor, top_p: float, topk: int) -> tuple[Tensor, Tensor, Tensor]:
    """(boundary [n], m [n], surplus [n] bool) for probs [n, V], in the order of a descending sort:
    the probability of the last token each row's nucleus keeps, how many kept tokens equal it, and
    whether more tokens equal to it lie beyond the nucleus (the tie rule must then drop them).

    The k most probable tokens are examined (k = topk first); rows whose nucleus does not end before
    the k-th token are re-examined with k × NUCLEUS_GROWTH (the whole vocabulary last). Top-k values
    are the sorted prefix and a prefix's cumsum the cumsum's prefix: a full sort's answer, bit for bit.
    """
    n, V = probs.shape
    boundary = probs.new_empty(n)
    m = torch.empty(n, dtype=torch.long, device=probs.device)
    surplus = torch.zeros(n, dtype=torch.bool, device=probs.device)
    sel: slice | Tensor = slice(None)  # the rows still unsettled
    k = max(2, min(topk, V))
    while True:
        vals = probs[sel].topk(k, dim=-1, sorted=True).values
        count = _kept_counts(torch.cumsum(vals, dim=-1), top_p)
        last = vals.gather(-1, (count - 1).unsqueeze(-1))
        boundary[sel] = last.squeeze(-1)
        m[sel] = count - torch.count_nonzero(vals > last, dim=-1)  # every larger token is in the prefix
        after = vals.gather(-1, count.clamp(max=k - 1).unsqueeze(-1))  # the next token, when count < k
        surplus[sel] = (count < k) & (after == last).squeeze(-1)
        open_rows = (count == k).nonzero().squeeze(-1)
        if k == V or open_rows.numel() == 0:
            return boundary, m, surplus
        sel = open_rows if isinstance(sel, slice) else sel[open_rows]
        k = min(k * NUCLEUS_GROWTH, V)


def nucleus_keep_mask(scaled: Tensor, top_p: float, *, topk: int = NUCLEUS_TOPK,
                      buffers: ChunkBuffers | None = None) -> Tensor | None:
    """Boolean [..., V] mask of the nucleus of softmax(scaled); None when top_p ≥ 1 (everything kept).

    In order of decreasing probability — ties in index order, as a stable sort would give — token k
    is kept iff the probability mass of the tokens before it is < top_p: the crossing token is
    included and the top token always is. The boundary is found by `_nucleus_boundary` (top-k, no
    sort of the vocabulary), then the mask is `p ≥ p_boundary`, less, in rows with more tokens equal
    to the boundary than the nucleus keeps, the equal tokens after the first m in index order.
    Memory: the probabilities and the mask (with `buffers`, scaled [n, V] only: written into their
    slots "e" and "mask"; `scaled` may be in slot "a").
    """
    if top_p >= 1.0:
        return None
    work = scaled.detach()
    if work.dtype not in (torch.float32, torch.float64):
        work = work.float()
    shape = work.shape
    probs = _into(buffers, "e", work.dtype, torch.softmax, work.reshape(-1, shape[-1]), -1)
    boundary, m, surplus = _nucleus_boundary(probs, top_p, topk)
    keep = _into(buffers, "mask", torch.bool, torch.ge, probs, boundary.unsqueeze(-1))
    if bool(surplus.any()):  # keep only the first m equal tokens in index order
        rows = surplus.nonzero().squeeze(-1)
        ties = probs.index_select(0, rows) == boundary[rows].unsqueeze(-1)
        extra = ties & (ties.cumsum(-1) > m[rows].unsqueeze(-1))
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


class ChunkBuffers:
    """Work memory shared by the chunks of one `policy_token_stats` call (at most `rows` rows of V).

    Slots "a", "e" (8 bytes per entry: the work tensors; before them the nucleus' scaled logits and
    probabilities), "mask" (1 byte) and "z" (logits gathered with `rows=`), allocated on first use.
    Chunks then allocate nothing vocabulary-sized: no page faults per chunk and no glibc heap growth
    (freed chunk-sized blocks got split by small tensors outliving the chunk: +0.5 GB at V = 151,936).
    Only for tensors no derivative flows through (`_plain`): out= has no autograd or forward-mode AD.
    """

    def __init__(self, rows: int, vocab: int, device: torch.device, z_width: int = 8):
        self.rows, self.vocab, self.device = rows, vocab, device
        self.width = {"a": 8, "e": 8, "mask": 1, "z": z_width}
        self.slots: dict[str, Tensor] = {}

    def take(self, slot: str, n: int, dtype: torch.dtype) -> Tensor:
        """The first n × V entries of `slot` viewed as a contiguous [n, V] tensor of `dtype`."""
        size = n * self.vocab * dtype.itemsize
        if n > self.rows or dtype.itemsize > self.width[slot]:
            raise ValueError(f"ChunkBuffers: {n} rows of {dtype} do not fit slot {slot!r}")
        if slot not in self.slots:
            nbytes = self.rows * self.vocab * self.width[slot]
            self.slots[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self.slots[slot][:size].view(dtype).view(n, self.vocab)


def _into(buffers: ChunkBuffers | None, slot: str, dtype: torch.dtype, fn: Callable[..., Tensor],
          x: Tensor, *args) -> Tensor:
    """fn(x, *args) for x [n, V], written into `slot` of `buffers` (as `dtype`) when they are given."""
    if buffers is None:
        return fn(x, *args)
    return fn(x, *args, out=buffers.take(slot, x.shape[0], dtype))


def _plain(t: Tensor) -> bool:
    """True when no derivative flows through t: no autograd graph, no forward-mode tangent, no
    torch.func wrapper. Only then may its chunks' maths write into `ChunkBuffers`."""
    if torch.is_grad_enabled() and t.requires_grad:
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(t):
        return False
    return forward_ad.unpack_dual(t).tangent is None


def _chunk_stats(z: Tensor, tokens: Tensor, temperature: float, top_p: float, fp64: bool,
                 diagnostics: bool, eos_token_id: int | None,
                 buffers: ChunkBuffers | None = None) -> dict[str, Tensor]:
    """Per-row statistics of one chunk. z [n, V] logits, tokens [n] → dict of [n] tensors.

    Core (differentiable): logq = log q(t), rb_entropy = H(q) = log Z − Σ q·a over the kept set,
    logp = log softmax(z)(t) (τ = 1, no nucleus); logp_train / entropy_train = log-prob and entropy of
    softmax(z/τ) with no nucleus, what RL trainers score in their training pass (the same tensors as
    logq / rb_entropy when top_p = 1). Diagnostics (detached, under q): DIAG_KEYS.

    Memory: two [n, V] work tensors a, e (float64 when fp64; before them the nucleus' fp32 scaled
    logits and probabilities) and a boolean mask: 17 bytes per entry with fp64 (+8 with diagnostics
    unless `buffers`). When nothing will be back-propagated through them (no-grad, or forward-mode
    AD) the work tensors are updated in place, and with `buffers` (plain tensors only) they live
    there, so a chunk allocates nothing vocabulary-sized. Two passes of exp over [n, V] (one at τ = 1).
    """
    inplace = not (torch.is_grad_enabled() and z.requires_grad)
    tokens = tokens.unsqueeze(-1)
    # The nucleus is decided on the logits as the model produced them (≥ fp32), before any upcast.
    scaled = z if temperature == 1.0 else _into(buffers, "a", z.dtype, torch.div, z, temperature)
    keep = nucleus_keep_mask(scaled, top_p, buffers=buffers)
    del scaled
    # The caller decides the logits' dtype (precision profiles' cast_logits_fp32); fp64 widens further.
    # a = z − (detached) row max, a private copy: values and derivatives are shift-invariant, the top
    # logit becomes exactly 0 (Σ exp ≥ 1 never overflows), and log Z − Σ q·a cancels far less.
    dtype = torch.float64 if fp64 else z.dtype
    a = z.to(dtype, copy=True) if buffers is None else buffers.take("a", len(z), dtype).copy_(z)
    shift = a.detach().amax(dim=-1, keepdim=True)
    a = a.sub_(shift) if inplace else a - shift
    e = _into(buffers, "e", dtype, torch.exp, a)
    sum_full = e.sum(-1)
    logp = a.gather(-1, tokens).squeeze(-1) - sum_full.log()
    if temperature != 1.0:  # e, sum_full: the tempered, untruncated exponentials and their sum
        a = a.div_(temperature) if inplace else a / temperature
        del e  # (freed first: the peak stays at two work tensors)
        e = _into(buffers, "e", dtype, torch.exp, a)
        sum_full = e.sum(-1)
    log_z_full = sum_full.log()
    a_t = a.gather(-1, tokens).squeeze(-1)
    if keep is None:
        sum_q, log_z, logq, train = sum_full, log_z_full, a_t - log_z_full, None
    else:
        # Trainers' softmax(z/τ) before the nucleus mask: log p(t) and H = log Z − Σ e·a / Σ e.
        train = (a_t - log_z_full, log_z_full - _rowdot(e, a) / sum_full)
        drop = keep.logical_not_()  # our own mask: inverted in place
        kept_t = ~drop.gather(-1, tokens).squeeze(-1)
        # q = 0 outside the nucleus (exp(−inf)); a stays finite there, so q·a = 0 adds nothing to Σ q·a.
        e = e.masked_fill_(drop, 0.0) if inplace else e.masked_fill(drop, 0.0)
        sum_q = e.sum(-1)
        log_z = sum_q.log()
        logq = torch.where(kept_t, a_t - log_z, float("-inf"))
    q = e.div_(sum_q.unsqueeze(-1)) if inplace else e / sum_q.unsqueeze(-1)
    mean_a = _rowdot(q, a)
    out = {"logq": logq, "rb_entropy": log_z - mean_a, "logp": logp}
    out["logp_train"], out["entropy_train"] = train if train is not None else (out["logq"], out["rb_entropy"])
    if diagnostics:
        with torch.no_grad():
            detached = (t.detach() for t in (q, a, mean_a, out["rb_entropy"], log_z, log_z_full))
            out.update(_diagnostic_stats(*detached, eos_token_id, overwrite=buffers is not None))
    return out


def _diagnostic_stats(q: Tensor, a: Tensor, mean_a: Tensor, entropy: Tensor, log_z: Tensor,
                      log_z_full: Tensor, eos_token_id: int | None, overwrite: bool = False
                      ) -> dict[str, Tensor]:
    """Detached per-step shape statistics of q [n, V] (outputs [n]); a [n, V] = the shifted, tempered
    logits (finite; q = 0 outside the nucleus); log_z / log_z_full [n] = log normalisers of q and of
    the untruncated softmax(z/τ). `overwrite`: a is scratch (squared in place, no [n, V] temporary)."""
    k = min(2, q.shape[-1])
    top = q.topk(k, dim=-1).values
    top1 = top[:, 0]
    top2 = top[:, 1] if k > 1 else torch.zeros_like(top1)
    collision = _rowdot(q, q)
    rest = (1.0 - top1).clamp_min(0.0)
    two_point = -(torch.xlogy(top1, top1) + torch.xlogy(rest, rest))
    logit_var = (_rowdot(q, a.square_() if overwrite else a.square()) - mean_a * mean_a).clamp_min(0.0)
    # Mass the nucleus keeps under the tempered, untruncated distribution softmax(z/τ).
    head = torch.exp(log_z - log_z_full).clamp(max=1.0)  # exactly 1 when nothing is truncated
    # a copy, not a view: q may live in a buffer the next chunk overwrites
    eos = q[:, eos_token_id].clone() if eos_token_id is not None else torch.full_like(top1, math.nan)
    return {
        "top1_prob": top1, "margin": top1 - top2, "collision": collision, "renyi2": -torch.log(collision),
        "eff_support": torch.exp(entropy), "two_point_entropy": two_point, "head_mass": head,
        "tail_mass": (1.0 - head).clamp_min(0.0), "logit_mean": mean_a, "logit_var": logit_var, "eos_prob": eos,
    }


def _check_finite(chunk: Tensor, start: int) -> None:
    """NonFiniteLogitsError naming the first row of chunk [n, V] (offset by `start`) with a NaN or ±inf.
    Row max and min propagate NaN and reach ±inf: no [n, V] boolean temporary (aminmax is slower on CPU)."""
    finite_rows = torch.isfinite(chunk.detach().amax(dim=-1)) & torch.isfinite(chunk.detach().amin(dim=-1))
    if not bool(finite_rows.all()):
        bad = start + int((~finite_rows).nonzero()[0, 0])
        raise NonFiniteLogitsError(f"non-finite logits at scored row {bad}", row=bad)


def policy_token_stats(logits: Tensor, tokens: Tensor, request: TokenStatsRequest, rows: Tensor | None = None
                       ) -> dict[str, Tensor]:
    """Per-token statistics of the sampling policy, a chunk at a time: at most `chunk_size` rows and
    `chunk_elements` entries (rows × V; ≥ 1 row), so one chunk's temporaries are bounded whatever V is.

    logits: [..., V] (flattened to [M, V]; a view when contiguous). tokens: [N] token ids.
    rows: optional [N] indices into the M flattened rows (gathered one chunk at a time, so the
    caller never materialises an [N, V] copy); default: the first N = M rows in order.
    Returns a dict of [N] tensors: CORE_KEYS (+ DIAG_KEYS when `diagnostics`), float64 when `fp64`
    else in the logits' own dtype (cast them to fp32 first for fp32 maths). Core values carry the
    autograd / forward-AD graph from `logits`; with `checkpoint` (backward passes) each chunk's
    vocabulary-sized intermediates are recomputed in backward instead of being saved, so graph
    memory stays O(N) beyond the logits.
    Non-finite logits in a scored row raise NonFiniteLogitsError(row=index among the N rows).
    """
    temperature, top_p, fp64, diagnostics = request.temperature, request.top_p, request.fp64, request.diagnostics
    chunk_size, chunk_elements, eos_token_id = request.chunk_size, request.chunk_elements, request.eos_token_id
    checkpoint, check_finite = request.checkpoint, request.check_finite
    chunk_elements = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    if chunk_size < 1:
        raise ConfigError(f"precision.token_chunk_size: must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])
    chunk_size = max(1, min(chunk_size, chunk_elements // max(1, flat.shape[-1])))
    n = int(rows.numel()) if rows is not None else int(flat.shape[0])
    if tokens.numel() != n:
        raise ValueError(f"policy_token_stats: {tokens.numel()} tokens for {n} rows")
    tokens = tokens.to(flat.device)
    if rows is not None:
        rows = rows.to(flat.device)
    fn: Callable[..., dict[str, Tensor]] = _chunk_stats
    buffers = (ChunkBuffers(min(chunk_size, n), flat.shape[-1], flat.device, flat.element_size())
               if n and _plain(flat) else None)
    pieces: list[dict[str, Tensor]] = []
    for start in range(0, n, chunk_size):
        stop = min(start + chunk_size, n)
        z_out = None if buffers is None or rows is None else buffers.take("z", stop - start, flat.dtype)
        chunk = flat[start:stop] if rows is None else torch.index_select(flat, 0, rows[start:stop], out=z_out)
        if check_finite:
            _check_finite(chunk, start)
        args = (chunk, tokens[start:stop], temperature, top_p, fp64, diagnostics, eos_token_id, buffers)
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
    request = TokenStatsRequest(temperature, top_p, fp64=fp64, chunk_size=chunk_size, checkpoint=checkpoint)
    stats = policy_token_stats(logits, tokens, request, rows=rows)
    return stats["logq"], stats["rb_entropy"], stats["logp"]


def _logits_processor_base():
    from transformers import LogitsProcessor

    return LogitsProcessor


class SamplingPolicyLogitsProcessor(_logits_processor_base()):
    """HF LogitsProcessor applying `sampling_logits`; generate then samples from softmax of its output. Used with
    HF's own warpers off (τ 1, top_p 1, top_k 0): the only rule. scores: [batch, V] (HF's fp32 copy of the logits)."""

    def __init__(self, temperature: float, top_p: float):
        validate_policy(temperature, top_p)
        self.temperature = float(temperature)
        self.top_p = float(top_p)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        check_generation_logits(input_ids, scores)
        return sampling_logits(scores, self.temperature, self.top_p)


def check_generation_logits(input_ids: Tensor, scores: Tensor) -> None:
    """NonFiniteLogitsError naming the first row of scores [n, V] with a NaN or +inf (they would reach the
    draw as an opaque RuntimeError); `position` is the absolute position of the token being drawn."""
    bad = torch.isnan(scores).any(dim=-1) | torch.isposinf(scores).any(dim=-1)
    if bool(bad.any()):
        row = int(bad.nonzero()[0, 0])
        error = NonFiniteLogitsError(f"non-finite logits in generation at row {row}, position "
                                     f"{int(input_ids.shape[1])}", row=row)
        error.position = int(input_ids.shape[1])
        raise error


"""X̂ = ∇L_X: the gradient of the entropy surrogate on the evaluation batch E (docs/maths.md §3).

Two ways, both microbatched over whole prompts, each returning float64 sums over the microbatches it is
given (a caller may split the microbatches over workers and add the sums, parallel.py):

- `surrogate_gradient_sum`: the backward of L_X with coefficients computed beforehand from every
  sequence's entropies (needed by the loo_position baseline; E is scored first, `sequence_scores`).
- `one_pass_sums` (baseline none): L_X = (L_α − Ĥ·L_β)/D, where L_α = Σ[H_ik + α_ik ℓ_ik] and
  L_β = Σ β_ik ℓ_ik need only each sequence's own entropies, so each microbatch's forward feeds two
  backward passes (∇L_α, ∇L_β) and Ĥ, D are applied at the end (`finish_one_pass`). With the row
  directions of v (`row_directional`), the per-sequence pieces a_i = D_v L_α,i and r_i = D_v L_β,i of
  the error bars come out of the same backward passes — for several directions at once (the competing
  predictors' directions ride along with v). The probe runs it only when the pieces are wanted: without
  them E is scored first and `surrogate_gradient_sum` needs one backward (`pieces_method`).
  E drawn by a sampler other than the policy (docs/maths.md §12): each sequence's log s_i is known in its own
  microbatch (its forward's ℓ, the batch's sampler log-probs), so its terms are multiplied by the
  UNNORMALISED s̃_i = exp(log s_i − c): the scale cancels in X̂ = (X_α' − (Ĥ − s)·X_β)/D when D is summed
  with the same s̃ (`finish_one_pass`). c is the first microbatch's largest log s, raised (and the float64
  sums rescaled) whenever a later weight would pass e^LOG_WEIGHT_HEADROOM; split runs agree on one c at the
  end (`OnePassSums.rescale`). The hook pieces come out as s̃_i·a_i and are divided back: a, r stay per
  sequence and unweighted (0 for a sequence of weight 0).
- `entropy_only_gradient_sum`: ∇Σ_ik H_ik alone (the `direct_only` predictor), with d_i = D_v h_i per
  sequence from the same backward.
The model stays in eval() (no dropout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..data.batch import Batch
from ..errors import ConfigError
from ..policy.engine import PolicyEngine
from .objective_gradient import NamedTensors, Trainable, chunked, prompts_per_microbatch
from .row_directional import RowDirectionalDerivatives, linear_directions, many_row_directionals
from .sampler_correction import normalised_weights, sampler_log_weights, sequence_weights
from .sequence_scores import SequenceScores
from .surrogate import (
    SurrogateCoefficients,
    entropy_estimate,
    normalizer,
    sequence_coefficients,
    surrogate_coefficients,
    surrogate_loss,
    weighted_logq_sum,
)

E_BACKWARD = "teacher forcing with grad (E backward)"
#: Unnormalised sampler weights s̃ stay below e^30 in the one-pass backward: fp32 gradients keep ~1e25 of room.
LOG_WEIGHT_HEADROOM = 30.0


@dataclass(frozen=True)
class EntropyOptions:
    """The `estimator` and `variance` settings the E side reads."""

    normalize: str = "per_token"        # per_token | per_sequence
    x_mode: str = "causal"              # causal | full
    baseline: str = "none"              # none | loo_position
    microbatch_size: int = 8            # sequences per backward microbatch (whole prompts)
    directional: str = "auto"           # auto | backward_hooks | jvp (how the pieces a, r are taken)


@dataclass
class OnePassSums:
    """What `one_pass_sums` adds up: X_α, X_β (float64), the pieces a, r [N] per direction name (zero outside
    the microbatches run), {sequence: (ℓ, H)} of the sequences run, the shift s it used and, under the
    sampler's weights, the log-scale c of the s̃ = exp(log s − c) in X_α, X_β (None: unweighted or no
    microbatch run)."""

    X_alpha: NamedTensors
    X_beta: NamedTensors
    a: dict[str, Tensor]
    r: dict[str, Tensor]
    rows: dict[int, tuple[Tensor, Tensor]]
    shift: float | None
    log_weight_shift: float | None = None

    def rescale(self, log_scale: float | None) -> None:
        """Put X_α, X_β on the weight scale exp(log s − log_scale) (a, r are unweighted: unchanged)."""
        if log_scale is None:
            return
        if self.log_weight_shift is not None:
            factor = float(torch.exp(torch.tensor(self.log_weight_shift - log_scale, dtype=torch.float64)))
            for sums in (self.X_alpha, self.X_beta):
                for t in sums.values():
                    t.mul_(factor)
        self.log_weight_shift = log_scale


def e_microbatches(num_prompts: int, G: int, microbatch_size: int) -> list[list[int]]:
    """The backward microbatches (whole prompts) a single process runs, in order."""
    return chunked(list(range(num_prompts)), prompts_per_microbatch(microbatch_size, G))


def coefficients(scores: SequenceScores, options: EntropyOptions,
                 weights: Tensor | None = None) -> SurrogateCoefficients:
    """The L_X coefficients of the scored E (with the sampler's weights s [N], docs/maths.md §12)."""
    return surrogate_coefficients(scores.token_entropies, normalize=options.normalize, x_mode=options.x_mode,
                                  baseline=options.baseline, weights=weights)


def sampler_weights(scores: SequenceScores, sampler_rows: list[Tensor] | None) -> Tensor | None:
    """`sampler_correction.sequence_weights` of the scored E as a float64 tensor [N] (None: the sampler is the
    policy), docs/maths.md §12."""
    weights = sequence_weights(scores.token_logqs, sampler_rows)
    return None if weights is None else torch.from_numpy(weights)


def entropy_of(token_entropies: list[Tensor], normalize: str) -> float:
    """Ĥ of a list of per-sequence entropy tensors under `normalize` (no graph)."""
    h = torch.stack([t.detach().double().sum() for t in token_entropies])
    lengths = torch.tensor([len(t) for t in token_entropies], dtype=torch.float64)
    return entropy_estimate(h, lengths, normalize)


def pieces_method(trainable: Trainable, options: EntropyOptions, want_pieces: bool) -> str:
    """How the E side runs: "two_pass" (no pieces: E scored without grad, then ONE backward of L_X with Ĥ known
    — cheaper than `one_pass_sums`' second backward), "backward_hooks" or "jvp" (with the pieces a, r)."""
    if not want_pieces:
        return "two_pass"
    if options.baseline != "none":
        return "jvp"
    if options.directional == "jvp":
        return "jvp"
    hooks_ok = linear_directions(trainable.model, dict(zip(trainable.names, trainable.params))) is not None
    # HF marks checkpointed stacks with `module.gradient_checkpointing = True`; a recomputed forward
    # would register the row hooks twice.
    hooks_ok = hooks_ok and not any(getattr(m, "gradient_checkpointing", False) is True
                                    for m in trainable.model.modules())
    if options.directional == "backward_hooks" and not hooks_ok:
        raise ConfigError("variance.directional=backward_hooks needs every trainable parameter to be an "
                          "nn.Linear weight or bias and gradient checkpointing off; use auto or jvp")
    return "backward_hooks" if hooks_ok else "jvp"


def surrogate_gradient_sum(engine: PolicyEngine, trainable: Trainable, E_batch: Batch, microbatches: list[list[int]],
                           coefs: SurrogateCoefficients, progress=iter) -> NamedTensors:
    """Σ over the given microbatches of ∇L_X (float64), with the coefficients of the whole E."""
    return surrogate_gradient_rows(engine, trainable, E_batch, microbatches, coefs, {}, progress)[0]


def surrogate_gradient_rows(engine: PolicyEngine, trainable: Trainable, E_batch: Batch, microbatches: list[list[int]],
                            coefs: SurrogateCoefficients, directions: dict[str, NamedTensors],
                            progress=iter) -> tuple[NamedTensors, dict[str, Tensor]]:
    """(Σ over the given microbatches of ∇L_X (float64), {name: D_v L_X,i [N]} per direction of `directions` from
    the same backward by the row hooks (zero outside the microbatches run)). With r_i known otherwise (e.g. by
    the central difference of the ±η passes, `central_difference.central_difference_r`), a_i = D·D_v L_X,i + Ĥ·r_i.
    """
    trainable.model.eval()
    G = E_batch.num_responses_per_prompt
    N = E_batch.num_prompts * G
    X = trainable.zeros(torch.float64)
    per_row = {k: torch.zeros(N, dtype=torch.float64) for k in directions}
    with many_row_directionals(hook_directions(trainable, directions)) as rows:
        for idx in progress(microbatches):
            sub = E_batch.subset(idx)
            seq_ids = [b * G + g for b in idx for g in range(G)]
            lp = engine.teacher_force_logprobs(sub, with_grad=True, compute_rb=True,  # one forward
                                               tf_batch_size=len(seq_ids) if rows else None,  # per microbatch
                                               phase=E_BACKWARD)                             # for the hooks
            loss = surrogate_loss(_flatten(lp.token_logqs), _flatten(lp.rb_entropies_torch),
                                  [coefs.coefficient(n) for n in seq_ids], coefs.D, coefs.weights_of(seq_ids))
            for rows_k in rows.values():
                rows_k.reset(len(seq_ids))
            trainable.add_grad(X, loss, f"E backward, prompts {idx}")
            for k, rows_k in rows.items():
                per_row[k][seq_ids] = rows_k.values
    return X, per_row


def one_pass_sums(engine: PolicyEngine, trainable: Trainable, E_batch: Batch, microbatches: list[list[int]], options: EntropyOptions,
                  directions: dict[str, NamedTensors], agree_on_shift: Callable[[float | None], float | None] = lambda s: s,
                  progress=iter, agree_on_scale: Callable[[float | None], float | None] = lambda c: c) -> OnePassSums:
    """Σ over the given microbatches of ∇L_α' and ∇L_β (float64), with the pieces along each of `directions`
    ({name: v}; empty: no pieces).

    α_ik and Ĥ·β_ik nearly cancel (entropy-to-go vs Ĥ × tokens-to-go), so ∇L_α and Ĥ∇L_β would be two
    large fp32 gradients whose difference is X̂. Backpropagating α − s·β with s = the first microbatch's
    Ĥ keeps the buffers small; X̂ = (X_α' − (Ĥ − s)·X_β)/D is the same algebra (`finish_one_pass`).
    `agree_on_shift(s)` is called once with this caller's candidate s (None when it runs no microbatch)
    and returns the s to use — the identity in one process; a split run makes every worker use the same.
    Under the sampler's weights, `agree_on_scale(c)` (called once, c None without a microbatch) returns the
    weight scale every worker's sums are put on at the end (the largest c; the identity in one process).
    """
    if options.baseline != "none":
        raise ValueError("accumulate_X_one_pass needs estimator.baseline none")
    trainable.model.eval()
    N = E_batch.num_prompts * E_batch.num_responses_per_prompt
    row_maps = hook_directions(trainable, directions)
    sums = OnePassSums(trainable.zeros(torch.float64), trainable.zeros(torch.float64),
                       {k: torch.zeros(N, dtype=torch.float64) for k in directions},
                       {k: torch.zeros(N, dtype=torch.float64) for k in directions}, {}, None)
    shift_agreed = False
    sampler_rows = E_batch.sampler_response_logqs()
    with many_row_directionals(row_maps) as rows:
        for idx in progress(microbatches):
            forward = _microbatch_forward(engine, E_batch, idx, options)
            weights = _microbatch_weights(sums, forward[0], forward[1], sampler_rows)
            if not shift_agreed:
                sums.shift, shift_agreed = agree_on_shift(entropy_of(forward[2], options.normalize)), True
            _microbatch_backward(trainable, rows, sums, idx, *forward, weights)
    if not shift_agreed:  # no microbatch here: still take part in agreeing on s
        sums.shift = agree_on_shift(None)
    if sampler_rows is not None:
        sums.rescale(agree_on_scale(sums.log_weight_shift))
    return sums


def hook_directions(trainable: Trainable, directions: dict[str, NamedTensors]) -> dict[str, dict]:
    """`linear_directions` of each named direction; ValueError when the backward hooks cannot take them."""
    maps = {k: linear_directions(trainable.model, v) for k, v in directions.items()}
    if any(m is None for m in maps.values()):
        raise ValueError("backward-hook pieces need every trainable parameter to be an nn.Linear weight/bias")
    return maps


def entropy_only_gradient_sum(engine: PolicyEngine, trainable: Trainable, E_batch: Batch, microbatches: list[list[int]],
                              options: EntropyOptions, v_named: NamedTensors | None,
                              progress=iter, sampler_weights: Tensor | None = None) -> tuple[NamedTensors, Tensor]:
    """(Σ over the given microbatches of ∇Σ_ik H_ik (float64), d [N] with d_i = D_v h_i (zero outside the
    microbatches run, and everywhere without `v_named`)): the `direct_only` predictor's pieces, one forward
    and one backward per microbatch; divide by D for the gradient of Ĥ's explicit part.

    `sampler_weights` s [N] (E drawn by another sampler, docs/maths.md §12): the gradient is of Σ_i s_i h_i;
    d stays the unweighted D_v h_i (the row hooks see s_i·D_v h_i, divided back; 0 where s_i = 0)."""
    trainable.model.eval()
    N = E_batch.num_prompts * E_batch.num_responses_per_prompt
    X_H, d = trainable.zeros(torch.float64), torch.zeros(N, dtype=torch.float64)
    row_maps = hook_directions(trainable, {"v": v_named}) if v_named is not None else {}
    with many_row_directionals(row_maps) as rows:
        for idx in progress(microbatches):
            seq_ids, _, h_mb, _ = _microbatch_forward(engine, E_batch, idx, options)
            for r in rows.values():
                r.reset(len(seq_ids))
            if sampler_weights is None:
                loss = sum(h.sum() for h in h_mb)
            else:
                loss = sum(float(sampler_weights[n]) * h.sum() for n, h in zip(seq_ids, h_mb))
            trainable.add_grad(X_H, loss, f"E backward (Σ H), prompts {idx}")
            if rows:
                d[seq_ids] = rows["v"].values
    if sampler_weights is not None:
        s = sampler_weights.double()
        d = torch.where(s > 0, d / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(d))
    return X_H, d


def _microbatch_forward(engine: PolicyEngine, E_batch: Batch, idx: list[int], options: EntropyOptions) -> tuple:
    """(sequence ids, ℓ with graph, H with graph, (α, β) per sequence) of one microbatch: ONE forward, so
    that batch row j is sequence seq_ids[j] (the row hooks count rows per forward)."""
    G = E_batch.num_responses_per_prompt
    seq_ids = [b * G + g for b in idx for g in range(G)]
    lp = engine.teacher_force_logprobs(E_batch.subset(idx), with_grad=True, compute_rb=True,
                                   tf_batch_size=len(seq_ids), phase=E_BACKWARD)
    l_mb, h_mb = _flatten(lp.token_logqs), _flatten(lp.rb_entropies_torch)
    coefs = [sequence_coefficients(h, normalize=options.normalize, x_mode=options.x_mode) for h in h_mb]
    return seq_ids, l_mb, h_mb, coefs


def _microbatch_weights(sums: OnePassSums, seq_ids: list[int], l_mb: list[Tensor],
                        sampler_rows: list[Tensor] | None) -> Tensor | None:
    """s̃_i = exp(log s_i − c) of the microbatch's sequences (float64 [n]; None: the sampler is the policy), with
    c = sums.log_weight_shift set by the first microbatch and raised (the sums rescaled) when a weight would
    pass e^LOG_WEIGHT_HEADROOM."""
    if sampler_rows is None:
        return None
    log_s = torch.from_numpy(sampler_log_weights([t.detach().double().cpu() for t in l_mb],
                                                 [sampler_rows[n] for n in seq_ids]))
    finite = log_s[torch.isfinite(log_s)]
    top = float(finite.max()) if finite.numel() else None
    if sums.log_weight_shift is None:
        sums.log_weight_shift = top if top is not None else 0.0
    elif top is not None and top - sums.log_weight_shift > LOG_WEIGHT_HEADROOM:
        sums.rescale(top)
    return torch.exp(log_s - sums.log_weight_shift)


def _read_rows(rows_k: RowDirectionalDerivatives, weights: Tensor | None) -> Tensor:
    """The per-row derivatives of the last backward, divided by the rows' weights s̃ (0 where s̃ = 0)."""
    if weights is None:
        return rows_k.values
    values = rows_k.values.double()
    return torch.where(weights > 0, values / torch.where(weights > 0, weights, 1.0), torch.zeros_like(values))


def _microbatch_backward(trainable: Trainable, rows: dict[str, RowDirectionalDerivatives], sums: OnePassSums,
                         idx: list[int], seq_ids: list[int], l_mb: list[Tensor], h_mb: list[Tensor],
                         coefs: list, weights: Tensor | None = None) -> None:
    """Backward of L_α' (and of L_β unless β ≡ 0: causal + per_sequence) into `sums`, with the pieces; each
    sequence's terms times its s̃_i when `weights` are given."""
    loss_alpha = surrogate_loss(l_mb, h_mb, [al - sums.shift * be for al, be in coefs], 1.0, weights)
    has_beta = any(bool(be.any()) for _, be in coefs)
    for rows_k in rows.values():
        rows_k.reset(len(seq_ids))
    trainable.add_grad(sums.X_alpha, loss_alpha, f"E backward, prompts {idx}", retain_graph=has_beta)
    for k, rows_k in rows.items():
        sums.a[k][seq_ids] = _read_rows(rows_k, weights)
    if has_beta:
        betas = [be for _, be in coefs] if weights is None else [w * be for w, (_, be) in zip(weights, coefs)]
        loss_beta = weighted_logq_sum(l_mb, betas)
        for rows_k in rows.values():
            rows_k.reset(len(seq_ids))
        trainable.add_grad(sums.X_beta, loss_beta, f"E backward (β), prompts {idx}")
        for k, rows_k in rows.items():
            sums.r[k][seq_ids] = _read_rows(rows_k, weights)
    for j, n in enumerate(seq_ids):
        sums.rows[n] = (l_mb[j].detach().double().cpu(), h_mb[j].detach().double().cpu())


def finish_one_pass(sums: OnePassSums, scores: SequenceScores, options: EntropyOptions,
                    sampler_rows: list[Tensor] | None = None
                    ) -> tuple[NamedTensors, SurrogateCoefficients, dict[str, tuple[Tensor, Tensor]]]:
    """(X̂ fp32, the coefficients, the pieces {direction name: (a, r)}) from the summed `sums` and the
    scores of all E; `sampler_rows` (the batch's sampler log-probs per sequence) when the sums are weighted:
    the coefficients then carry the mean-1 weights, X̂ divides by D summed with the sums' own s̃."""
    if sampler_rows is None:
        coefs = coefficients(scores, options)
        D = coefs.D
    else:
        log_s = torch.from_numpy(sampler_log_weights(scores.token_logqs, sampler_rows))
        coefs = coefficients(scores, options, torch.from_numpy(normalised_weights(log_s)))
        D = normalizer(scores.lengths, options.normalize, torch.exp(log_s - (sums.log_weight_shift or 0.0)))
    shift = sums.shift or 0.0
    residual = coefs.H_hat - shift
    X = {n: ((sums.X_alpha[n].double() - residual * sums.X_beta[n].double()) / D).float() for n in sums.X_alpha}
    return X, coefs, {k: (sums.a[k] + shift * sums.r[k], sums.r[k]) for k in sums.a}


def _flatten(nested: list[list]) -> list:
    return [x for row in nested for x in row]

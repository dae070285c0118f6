"""Teacher forcing: score the generated tokens of a Batch under the sampling policy q_θ.

`score` runs the batches of `tf_batches.py` through the model — the live module (with grad), or
`torch.func.functional_call` with a parameter mapping (θ + η·v, or the η = 0 mapping of live views) —
computes the token statistics with the same `sampling_logits` rule generation used, and assembles
LogprobResults (+ DiagnosticsResults). `jvp` gives exact directional derivatives D_v of log q and of
the RB entropy by forward-mode AD. Callers name what a pass is for (`phase`); error messages carry it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from entropy_experiments.data.batch import Batch
from entropy_experiments.errors import ConfigError, NumericsError
from entropy_experiments.policy.distribution_diagnostics import DistributionDiagnostics, baseline_features
from entropy_experiments.policy.param_overrides import live_params_mapping, resolve_param_names
from entropy_experiments.policy.policy_model import PolicyModel
from entropy_experiments.policy.precision_utils import ForwardProfile, forward_precision_ctx
from entropy_experiments.policy.progress import progress
from entropy_experiments.policy.sampling_policy import (
    NonFiniteLogitsError,
    TokenStatsRequest,
    policy_token_stats,
)
from entropy_experiments.policy.sequences import (
    DiagnosticsResults,
    LogprobResults,
    response_tokens,
)
from entropy_experiments.policy.tf_batches import TFBatch, run_with_oom_retry, tf_batches

__all__ = ["ScoreRequest", "eager_attention", "forward_logits", "jvp", "located_numerics_error", "score", "token_stats"]

# (batch, mapping or None, profile) -> logits [R, K, V]
LogitsFn = Callable[[TFBatch, Mapping[str, Tensor] | None, ForwardProfile], Tensor]


def forward_logits(policy: PolicyModel, batch: TFBatch, mapping: Mapping[str, Tensor] | None,
                   profile: ForwardProfile) -> Tensor:
    """Logits [R, K, V] at the batch's needed positions; live module when `mapping` is None."""
    kwargs: dict[str, Any] = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask,
                              "position_ids": batch.position_ids, "use_cache": False}
    if policy.supports_logits_to_keep:
        kwargs["logits_to_keep"] = batch.logit_positions
    with forward_precision_ctx(profile.autocast, profile.dtype, policy.device.type):
        if mapping is None:
            out = policy.module(**kwargs)
        else:
            out = torch.func.functional_call(policy.module, dict(mapping), args=(), kwargs=kwargs, strict=False)
    logits = out.logits
    if not policy.supports_logits_to_keep:
        logits = logits[:, batch.logit_positions]
    if profile.cast_logits_fp32 and logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return logits


def located_numerics_error(batch: TFBatch, exc: NonFiniteLogitsError, phase: str = "teacher forcing") -> NumericsError:
    """Turn a flat scored-row index into the (phase, batch, b, g, token) the user can look up."""
    r = int(np.searchsorted(np.cumsum(batch.lengths), exc.row, side="right"))
    b, g = batch.pairs[r]
    return NumericsError(f"non-finite logits in {phase}: batch {batch.index}, sequence b={b} g={g}, "
                         f"token {exc.row - sum(batch.lengths[:r])}")


def token_stats(policy: PolicyModel, logits: Tensor, batch: TFBatch, *, diagnostics: bool, checkpoint: bool,
                phase: str = "teacher forcing") -> dict[str, Tensor]:
    """Chunked policy statistics of the batch's scored tokens; NumericsError names (batch, b, g)."""
    config = policy.config
    try:
        request = TokenStatsRequest(config.temperature, config.top_p, fp64=policy.precision.entropy_fp64,
                                    chunk_size=config.token_chunk_size, diagnostics=diagnostics,
                                    eos_token_id=policy.eos_token_id, checkpoint=checkpoint)
        return policy_token_stats(logits, batch.tokens, request, rows=batch.rows)
    except NonFiniteLogitsError as exc:
        raise located_numerics_error(batch, exc, phase) from None


@dataclass(frozen=True)
class ScoreRequest:
    """What a teacher-forcing pass computes and how.

    grad: the live module under precision.tf_withgrad, outputs carrying the graph (no overrides). Otherwise
    `functional_call` at `params` (θ + η·v; forward under precision.func_override) or at the η = 0 mapping of
    live views (precision.tf_nograd), `buffers` on top. tf_batch_size: rows per forward (None: the settings');
    compute_rb: the RB entropies; baseline: the baseline features; diagnostics: the per-sequence DiagnosticsPacks;
    phase: the pass's name in error messages; can_split=False: a batch that runs out of memory is not split."""

    grad: bool = False
    params: Mapping[str, Tensor] | None = None
    buffers: Mapping[str, Tensor] | None = None
    tf_batch_size: int | None = None
    compute_rb: bool = False
    baseline: bool = False
    diagnostics: bool = False
    phase: str = "teacher forcing"
    can_split: bool = True


def score(policy: PolicyModel, sequences: Batch, request: ScoreRequest = ScoreRequest(), *,
          logits_fn: LogitsFn | None = None) -> tuple[LogprobResults, DiagnosticsResults | None]:
    """Score every generated token; both paths share batching and token maths, only logits differ.

    No grad: outputs detached on CPU. With grad: `logprobs` / `token_logqs` (and `rb_entropies_torch` when
    compute_rb and rb_requires_grad) carry the graph; chunk maths is checkpointed (see `ScoreRequest`).
    """
    grad, params, buffers, phase = request.grad, request.params, request.buffers, request.phase
    logits_fn = logits_fn or (lambda batch, m, prof: forward_logits(policy, batch, m, prof))
    if grad:
        mapping, profile = None, policy.precision.tf_withgrad
    else:
        mapping = dict(params) if params is not None else live_params_mapping(policy.module)
        if buffers is not None:
            mapping.update(buffers)
        profile = policy.precision.func_override if params is not None else policy.precision.tf_nograd
    want_diag = request.diagnostics or request.baseline
    per_seq: dict[tuple[int, int], dict[str, Tensor]] = {}
    size = int(request.tf_batch_size or policy.config.tf_batch_size)
    batches = list(tf_batches(sequences, size, policy.device))
    state: dict = {}

    def run(batch: TFBatch) -> dict[str, Tensor]:
        logits = logits_fn(batch, mapping, profile)
        return token_stats(policy, logits, batch, diagnostics=want_diag, checkpoint=grad, phase=phase)

    with torch.enable_grad() if grad else torch.no_grad():
        for batch in progress(batches, "teacher forcing" + (" (grad)" if grad else "")):
            for sub, stats in run_with_oom_retry(sequences, batch, run, phase=phase, can_split=request.can_split,
                                                 state=state, device=policy.device, logger=policy.logger):
                split = {k: torch.split(v, sub.lengths) for k, v in stats.items()}
                for r, pair in enumerate(sub.pairs):
                    per_seq[pair] = {k: split[k][r] for k in split}
    return assemble(policy, per_seq, sequences, request)


def assemble(policy: PolicyModel, per_seq: dict[tuple[int, int], dict[str, Tensor]], sequences: Batch,
             request: ScoreRequest) -> tuple[LogprobResults, DiagnosticsResults | None]:
    """Per-sequence token statistics → LogprobResults [b][g] (+ DiagnosticsResults)."""
    grad, compute_rb, baseline, diagnostics = request.grad, request.compute_rb, request.baseline, request.diagnostics
    B, G = sequences.num_prompts, sequences.num_responses_per_prompt
    config = policy.config

    def grid(fn):
        return [[fn(per_seq[(b, g)], b, g) for g in range(G)] for b in range(B)]

    def keep(t: Tensor) -> Tensor:
        return t if grad else t.detach().cpu()

    logq_np = grid(lambda s, b, g: s["logq"].detach().double().cpu().numpy())
    lp = LogprobResults(
        logprobs=grid(lambda s, b, g: keep(s["logp"])),
        surprisals=[[-x for x in row] for row in logq_np],
        sequence_logprobs=grid(lambda s, b, g: float(s["logp"].detach().double().sum())),
        rb_entropies=grid(lambda s, b, g: s["rb_entropy"].detach().double().cpu().numpy()) if compute_rb else [],
        rewards=[[0.0] * G for _ in range(B)],
        token_logqs=grid(lambda s, b, g: keep(s["logq"])),
        sequence_logqs=[[float(x.sum()) for x in row] for row in logq_np],
        token_logps_train=grid(lambda s, b, g: keep(s["logp_train"])),
        token_entropies_train=grid(lambda s, b, g: keep(s["entropy_train"])),
    )
    if grad and compute_rb and config.rb_requires_grad:
        lp.rb_entropies_torch = grid(lambda s, b, g: s["rb_entropy"])
    if baseline:
        lp.baseline_feats_torch = grid(lambda s, b, g: baseline_features(s, config.max_new_tokens).cpu())
    diags = None
    if diagnostics:
        dd = DistributionDiagnostics(config.top_p, config.temperature, policy.eos_token_id,
                                     fp64=policy.precision.entropy_fp64, chunk_size=config.token_chunk_size)
        diags = DiagnosticsResults(diagnostics=grid(lambda s, b, g: dd.from_token_stats(
            s, response_tokens(sequences, b, g))))
    return lp, diags


# ------------------------------------------------------------------------------ directional derivatives
@contextlib.contextmanager
def eager_attention(model: nn.Module) -> Iterator[None]:
    """Switch a transformers model to eager attention for the block (forward-mode AD needs it)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(inner, "config", None)
    current = getattr(config, "_attn_implementation", None)
    if current in (None, "eager") or not hasattr(inner, "set_attn_implementation"):
        yield
        return
    inner.set_attn_implementation("eager")
    try:
        yield
    finally:
        inner.set_attn_implementation(current)


def _primals_and_tangents(base: Mapping[str, Tensor], v_named: Mapping[str, Tensor]
                          ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """The named parameters (primals) and v on them (tangents, in each parameter's device and dtype)."""
    names = resolve_param_names(base, list(v_named))
    tangents = {}
    for key, name in names.items():
        theta, v = base[name], v_named[key]
        if tuple(v.shape) != tuple(theta.shape):
            raise ConfigError(f"update vector: '{key}' has shape {tuple(v.shape)}, parameter has {tuple(theta.shape)}")
        tangents[name] = v.detach().to(device=theta.device, dtype=theta.dtype)
    primals = {name: base[name] for name in (names[k] for k in v_named)}
    return primals, tangents


JVP_KEYS = ("logq", "rb_entropy", "d_logq", "d_rb_entropy", "d2_logq", "d2_rb_entropy")


def jvp(policy: PolicyModel, sequences: Batch, v_named: Mapping[str, Tensor], *,
        tf_batch_size: int | None = None, phase: str = "teacher forcing (jvp)",
        logits_fn: LogitsFn | None = None, order: int = 1) -> list[list[dict[str, Tensor]]]:
    """Per [b][g]: `logq`, `rb_entropy`, `d_logq`, `d_rb_entropy` (and with order 2 `d2_logq`,
    `d2_rb_entropy`), each float64 [T] on CPU.

    d_x = D_v x = d/dη x(θ + η·v) at η = 0 and d2_x = D²_v x = d²/dη² x(θ + η·v) at η = 0, exact, by
    forward-mode AD (`torch.func.jvp`; order 2 nests it: forward over forward) through `functional_call`
    with the named parameters as primals and v as tangents, under eager attention (docs/maths.md §6). Token
    maths in float64. The forward uses precision.func_override.
    """
    if order not in (1, 2):
        raise ValueError(f"jvp: order must be 1 or 2, got {order!r}")
    logits_fn = logits_fn or (lambda batch, m, prof: forward_logits(policy, batch, m, prof))
    base = live_params_mapping(policy.module)
    primals, tangents = _primals_and_tangents(base, v_named)
    out: list[list[dict[str, Tensor] | None]] = [[None] * sequences.num_responses_per_prompt
                                                  for _ in range(sequences.num_prompts)]
    profile, config, state = policy.precision.func_override, policy.config, {}
    stats_request = TokenStatsRequest(config.temperature, config.top_p, fp64=True, chunk_size=config.token_chunk_size)

    def run(batch: TFBatch) -> tuple:
        def scores(p: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
            logits = logits_fn(batch, {**base, **p}, profile)
            st = policy_token_stats(logits, batch.tokens, stats_request, rows=batch.rows)
            return st["logq"], st["rb_entropy"]

        def first(p: dict[str, Tensor]) -> tuple:
            return torch.func.jvp(scores, (p,), (tangents,))

        try:
            if order == 1:
                (logq, ent), (d_logq, d_ent) = first(primals)
                return logq, ent, d_logq, d_ent
            ((logq, ent), (d_logq, d_ent)), (_, (d2_logq, d2_ent)) = torch.func.jvp(first, (primals,), (tangents,))
            return logq, ent, d_logq, d_ent, d2_logq, d2_ent
        except NonFiniteLogitsError as exc:
            raise located_numerics_error(batch, exc, phase) from None

    size = int(tf_batch_size or config.tf_batch_size)
    # Nested forward mode needs grad mode on: under no_grad, silu's forward derivative calls silu_backward,
    # which has no forward derivative itself (torch 2.13); with grad mode the composite path is taken.
    # The primals are detached views (live_params_mapping), so no autograd graph is recorded.
    with eager_attention(policy.module), torch.set_grad_enabled(order == 2):
        for batch in progress(list(tf_batches(sequences, size, policy.device)), "teacher forcing (jvp)"):
            for sub, values in run_with_oom_retry(sequences, batch, run, phase=phase, can_split=True, state=state,
                                                  device=policy.device, logger=policy.logger):
                parts = [torch.split(t.detach().cpu(), sub.lengths) for t in values]
                for r, (b, g) in enumerate(sub.pairs):
                    out[b][g] = {key: part[r] for key, part in zip(JVP_KEYS, parts)}
    return out  # type: ignore[return-value]

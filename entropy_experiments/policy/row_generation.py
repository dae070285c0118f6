"""The row-keyed sampler (draws "row_keyed", policy/row_keyed.py): rows in spans of `rows_per_call`, any grouping.

Every row's tokens depend only on (seed, row index b·G + g, step), so the rows per generate call are chosen
for speed, an out-of-memory halving retries the rows left with fewer rows per call and changes nothing, and a
resumed run reuses whatever spans a killed one saved (keyed by their first row) and regenerates the rest.
With `record`, each row's log q_sampler of its T tokens comes back with it. `SpanSampler` is what this sampler
and the continuous-batching one (`cb_generation.py`) share: the sampler model, rows per call, the chunk store.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from entropy_experiments.errors import NumericsError
from entropy_experiments.policy.generate import left_pad, pack
from entropy_experiments.policy.oom import shrink_after_oom, unless_out_of_memory
from entropy_experiments.policy.policy_model import PolicyModel
from entropy_experiments.policy.progress import progress
from entropy_experiments.policy.row_keyed import RowKeyedDraw
from entropy_experiments.policy.sampler_setup import auto_rows_per_call, sampler_module
from entropy_experiments.policy.samplers import Drawn, DrawRequest, SamplerContext, generation_record
from entropy_experiments.policy.sampling_policy import NonFiniteLogitsError

__all__ = ["RowKeyedRun", "RowKeyedSampler", "RowKeyedSpans", "SpanPlan", "SpanSampler", "generate_row_keyed",
           "generate_spans", "sampler_logq_tensor"]


@dataclass(frozen=True)
class SpanPlan:
    """How the B·G rows (row = b·G + g) are drawn in spans: G responses per prompt, `rows_per_call` rows per span,
    the seed, whether each row's log q_sampler is recorded; `done_spans` {first row: {"responses", "logqs"}} (a
    killed run's) are reused when they cover exactly a span, `on_span(first row, responses, logqs)` is called as
    each new span completes (to save it), `on_first_group(rows)` gets the first G responses as soon as they exist."""

    G: int
    rows_per_call: int
    seed: int
    record: bool
    done_spans: Mapping[int, Any] | None = None
    on_span: Callable[..., None] | None = None
    on_first_group: Callable[[list[list[int]]], None] | None = None


@dataclass
class RowKeyedRun:
    """What one span-wise generation did: responses [R], log q per row ([T] float32 each, or None), the rows
    per call it started with and ended with (after any OOM halving), and the spans reused from a store."""

    responses: list[list[int]] = field(default_factory=list)
    logqs: list[Tensor] | None = None
    rows_per_call: int = 0
    rows_per_call_final: int = 0
    reused_spans: int = 0


class SpanSampler:
    """A `Sampler` drawing rows in spans of rows per call from the sampler model (`sampler_setup.sampler_module`),
    the spans saved in and reused from the chunk store; subclasses say how one run of spans is drawn (`run_spans`)."""

    draws_key_has_chunk = False  # whether the draws depend on the rows per call (then saved spans are keyed by it)

    def __init__(self, context: SamplerContext):
        self.context = context

    def run_spans(self, module: nn.Module, spans: SpanPlan, prompt_tokens: list[list[int]],
                  padded: tuple[Tensor, Tensor]) -> RowKeyedRun:
        raise NotImplementedError

    def draw(self, request: DrawRequest) -> Drawn:
        started = time.perf_counter()
        ctx, G, B = self.context, request.G, len(request.prompt_tokens)
        prompt_tokens = [list(p) for p in request.prompt_tokens]
        ids, mask = left_pad(ctx.policy, prompt_tokens)
        seed = request.seed
        if seed is None:  # from torch's generator, as the chunk-seeded draws would use it
            seed = int(torch.randint(0, 2**62, ()).item())
        with sampler_module(ctx.policy.module, ctx.plan.dtype) as module:
            rows = self.rows_per_call(module, request.rows, int(ids.shape[1]))
            done, on_span = self.open_store(request, int(seed), rows) if request.keep_chunks else (None, None)
            spans = SpanPlan(G, rows, int(seed), record=self.records(), done_spans=done, on_span=on_span,
                             on_first_group=request.on_first_group)
            run = self.run_spans(module, spans, prompt_tokens, (ids, mask))
        if run.reused_spans:
            ctx.policy.logger.info("generation: reusing %d saved chunk(s) of %d", run.reused_spans,
                                   -(-request.rows // rows))
        seqs = pack(ctx.policy, prompt_tokens, [run.responses[b * G:(b + 1) * G] for b in range(B)])
        if run.logqs is not None:
            seqs.sampler_logqs = sampler_logq_tensor(run.logqs, B, G, seqs.prompt_lens[0],
                                                     int(seqs.sequences.shape[-1]))
        record = {"rows_per_call": run.rows_per_call, "rows_per_call_after_oom": run.rows_per_call_final}
        return Drawn(seqs, generation_record(ctx.plan, record, seqs, started))

    def records(self) -> bool:
        """Whether each token's log q_sampler is recorded (whenever the sampler is not the fp32 policy)."""
        return self.context.plan.dtype != "fp32"

    def rows_per_call(self, module: nn.Module, total_rows: int, prompt_len: int) -> int:
        ctx = self.context
        if ctx.requested != "auto":
            return int(ctx.requested)
        rows, how = auto_rows_per_call(module, ctx.policy.device, total_rows, prompt_len,
                                       int(ctx.policy.config.max_new_tokens), budget_gb=ctx.memory_budget_gb)
        ctx.policy.logger.info("generation: %d rows per generate call (gen_batch_size auto: %s)", rows, how)
        return rows

    def open_store(self, request: DrawRequest, seed: int, rows: int) -> tuple[Any, Any]:
        """(saved spans, save hook) of the chunk store under this draw's key; (None, None) without a store."""
        ctx = self.context
        if ctx.chunk_store is None:
            return None, None
        generation = {k: v for k, v in dataclasses.asdict(ctx.policy.config).items() if k != "gen_batch_size"}
        chunking = {"chunk": rows} if self.draws_key_has_chunk else {}
        return ctx.chunk_store.open({"seed": seed, "G": int(request.G), "draws": ctx.plan.draws,
                                     "dtype": ctx.plan.dtype, "prompt_tokens": [list(p) for p in request.prompt_tokens],
                                     "generation": generation, **chunking})


class RowKeyedSampler(SpanSampler):
    """`Sampler` of the "row_keyed" draws (HF generate with `RowKeyedDraw`; a static KV cache with
    generation.sampler_engine static_cache)."""

    def run_spans(self, module, spans, prompt_tokens, padded):
        ids, mask = padded
        return generate_row_keyed(RowKeyedSpans(self.context.policy, ids, mask, spans, module,
                                                self.context.chunk_generator))


@dataclass(frozen=True)
class RowKeyedSpans:
    """One row-keyed generation: the policy, the padded prompts (ids, mask [B, Lp]), the span plan, the sampler
    model and the engine's generate seam (`chunk_generator`)."""

    policy: PolicyModel
    ids: Tensor
    mask: Tensor
    spans: SpanPlan
    module: nn.Module
    chunk_generator: Callable[..., Any]

    def call_rows(self, rows: Tensor) -> tuple[list[list[int]], list[Tensor]]:
        """One generate call for the global rows `rows` → (responses, per-row log q of their T tokens)."""
        config, ids, G, record = self.policy.config, self.ids, self.spans.G, self.spans.record
        draw = RowKeyedDraw(config.temperature, config.top_p, self.spans.seed, rows, int(ids.shape[1]), record=record)
        try:
            part, _ = self.chunk_generator(ids, self.mask, (rows // G).to(ids.device), draw=draw, module=self.module)
        except NonFiniteLogitsError as exc:
            b, g = divmod(int(rows[exc.row]), G)
            raise NumericsError(f"non-finite logits in generation: sequence b={b} g={g}, token "
                                f"{getattr(exc, 'position', ids.shape[1]) - ids.shape[1]}") from None
        logq = draw.logqs()
        return part, [logq[i, :len(r)].clone() for i, r in enumerate(part)] if record else []

    def span(self, start: int, stop: int, state: dict) -> tuple[list[list[int]], list[Tensor]]:
        """Rows [start, stop) in calls of at most state["limit"] rows; on OOM the rows not yet done are retried
        with half as many rows per call (their draws do not depend on it)."""
        responses: list[list[int]] = []
        logqs: list[Tensor] = []
        s = start
        while s < stop:
            limit = state["limit"]
            rows = torch.arange(s, min(s + limit, stop))
            out, reason = unless_out_of_memory(lambda rows=rows: self.call_rows(rows))
            if reason is not None:
                state["limit"] = shrink_after_oom(limit, reason, f"generation (rows {s}-{int(rows[-1])})",
                                                  self.policy.logger)
                continue
            responses.extend(out[0])
            logqs.extend(out[1])
            s += len(rows)
        return responses, logqs


def generate_spans(R: int, make_span: Callable[[int, int, int], tuple[list, list]], spans: SpanPlan) -> RowKeyedRun:
    """Rows [0, R) in spans of `spans.rows_per_call`: span i = rows [start, stop) from `make_span(i, start, stop)`
    → (responses, per-row log q [T] or []), unless a saved span covers exactly that span (see `SpanPlan`)."""
    record, on_first_group = spans.record, spans.on_first_group
    run = RowKeyedRun(logqs=[] if record else None, rows_per_call=spans.rows_per_call)
    starts = list(range(0, R, spans.rows_per_call))
    for i, start in enumerate(progress(starts, "generate", total=len(starts))):
        stop = min(start + spans.rows_per_call, R)
        saved = (spans.done_spans or {}).get(start)
        if isinstance(saved, dict) and len(saved["responses"]) == stop - start and \
                (not record or saved.get("logqs") is not None):
            rows = [list(map(int, r)) for r in saved["responses"]]
            logqs = [torch.tensor(q, dtype=torch.float32) for q in saved["logqs"]] if record else []
            run.reused_spans += 1
        else:
            rows, logqs = make_span(i, start, stop)
            if spans.on_span is not None:
                spans.on_span(start, rows, [q.tolist() for q in logqs] if record else None)
        run.responses.extend(rows)
        if record:
            run.logqs.extend(logqs)
        if on_first_group is not None and len(run.responses) >= spans.G:
            on_first_group(run.responses[:spans.G])
            on_first_group = None
    return run


def generate_row_keyed(job: RowKeyedSpans) -> RowKeyedRun:
    """The B·G responses (row = b·G + g) in spans of rows per call, drawn row-keyed from the plan's seed."""
    state = {"limit": job.spans.rows_per_call}
    run = generate_spans(int(job.ids.shape[0]) * job.spans.G,
                         lambda _index, start, stop: job.span(start, stop, state), job.spans)
    run.rows_per_call_final = state["limit"]
    return run


def sampler_logq_tensor(logqs: list[Tensor], B: int, G: int, Lp: int, L: int) -> Tensor:
    """[B, G, L] float32: row b·G + g's log q at its response positions [Lp, Lp + T), 0 elsewhere."""
    out = torch.zeros((B, G, L), dtype=torch.float32)
    for r, q in enumerate(logqs):
        b, g = divmod(r, G)
        out[b, g, Lp:Lp + len(q)] = q
    return out

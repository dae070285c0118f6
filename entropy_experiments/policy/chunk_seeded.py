"""The chunk-seeded sampler (draws "chunk_seeded"): HF generate with torch's multinomial, rows in chunks.

The B·G rows (row = b·G + g) are generated `gen_batch_size` at a time. With a seed per chunk (`keep_chunks`)
chunk i is seeded on its own with `chunk_seed(seed, i)`, so a resumed run can skip the chunks it saved;
otherwise `seed` seeds torch for the whole call. The draws depend on the chunking, which is why this scheme is
kept only for an integer gen_batch_size with an fp32 sampler (`sampler_setup.plan_sampler`), bit for bit as
the probe always drew. Running out of memory halves the rows per call and regenerates the chunk from its seed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from entropy_experiments.errors import NumericsError
from entropy_experiments.policy.generate import chunk_seed, left_pad, pack, seeded
from entropy_experiments.policy.oom import shrink_after_oom, unless_out_of_memory
from entropy_experiments.policy.policy_model import PolicyModel
from entropy_experiments.policy.progress import progress
from entropy_experiments.policy.samplers import Drawn, DrawRequest, SamplerContext, generation_record
from entropy_experiments.policy.sampling_policy import NonFiniteLogitsError

__all__ = ["ChunkPlan", "ChunkSeededSampler", "generate_in_chunks", "generate_span"]

# (ids, mask, prompt_index, output_scores=...) -> (responses, scores): generates the listed rows
ChunkGenerator = Callable[..., tuple[list[list[int]], list[Tensor] | None]]
# (ids, mask, start, stop, G, index, state, reseed) -> responses of rows [start, stop)
SpanGenerator = Callable[..., list[list[int]]]


@dataclass(frozen=True)
class ChunkPlan:
    """How the rows are cut and seeded: G responses per prompt, `chunk` rows per chunk, `seed` (None: torch's
    global generator) for the call or, with `seed_per_chunk`, chunk i seeded with `chunk_seed(seed, i)`; then
    `done_chunks` {i: responses} are reused and `on_chunk(i, responses)` is called as each chunk completes.
    `on_first_group(rows)` gets the first prompt's G responses as soon as they exist."""

    G: int
    chunk: int
    seed: int | None = None
    seed_per_chunk: bool = False
    done_chunks: Mapping[int, Sequence[Sequence[int]]] | None = None
    on_chunk: Callable[[int, list[list[int]]], None] | None = None
    on_first_group: Callable[[list[list[int]]], None] | None = None


class ChunkSeededSampler:
    """`Sampler` of the "chunk_seeded" draws; `done_chunks` / `on_chunk`: a caller's own chunk store (else the
    context's chunk store is used when a request keeps its chunks)."""

    def __init__(self, context: SamplerContext, done_chunks: Mapping[int, Sequence[Sequence[int]]] | None = None,
                 on_chunk: Callable[[int, list[list[int]]], None] | None = None):
        self.context, self.done_chunks, self.on_chunk = context, done_chunks, on_chunk

    def draw(self, request: DrawRequest) -> Drawn:
        started = time.perf_counter()
        ctx, G = self.context, request.G
        prompt_tokens = [list(p) for p in request.prompt_tokens]
        ids, mask = left_pad(ctx.policy, prompt_tokens)
        chunk = int(ctx.requested)
        done_chunks, on_chunk = self.done_chunks, self.on_chunk
        if request.keep_chunks and ctx.chunk_store is not None and done_chunks is None and on_chunk is None:
            # the chunk store's key leaves out the sampler's dtype and engine, so that a run directory whose
            # chunks were keyed without them resumes from them
            generation = {k: v for k, v in dataclasses.asdict(ctx.policy.config).items()
                          if k not in ("sampler_dtype", "sampler_engine")}
            done_chunks, on_chunk = ctx.chunk_store.open({
                "seed": int(request.seed), "G": int(G), "chunk": chunk, "prompt_tokens": prompt_tokens,
                "generation": generation})
            if done_chunks:
                ctx.policy.logger.info("generation: reusing %d saved chunk(s) of %d", len(done_chunks),
                                       -(-request.rows // chunk))
        plan = ChunkPlan(G, chunk, seed=request.seed, seed_per_chunk=request.keep_chunks, done_chunks=done_chunks,
                         on_chunk=on_chunk, on_first_group=request.on_first_group)
        responses = generate_in_chunks(ctx.policy, ids, mask, plan, span=ctx.span)
        seqs = pack(ctx.policy, prompt_tokens, [responses[b * G:(b + 1) * G] for b in range(len(prompt_tokens))])
        return Drawn(seqs, generation_record(ctx.plan, {"rows_per_call": chunk}, seqs, started))


def generate_in_chunks(policy: PolicyModel, ids: Tensor, mask: Tensor, plan: ChunkPlan, *,
                       span: SpanGenerator) -> list[list[int]]:
    """The B·G responses, row = b·G + g, generated `plan.chunk` rows at a time by `span` (see `ChunkPlan`)."""
    G, chunk, seed, seed_per_chunk = plan.G, plan.chunk, plan.seed, plan.seed_per_chunk
    on_first_group = plan.on_first_group
    R = int(ids.shape[0]) * G
    responses: list[list[int]] = []
    state = {"limit": chunk}  # rows per generate call; shrinks for the rest of the call after an OOM
    starts = list(range(0, R, chunk))
    with contextlib.nullcontext() if seed_per_chunk else seeded(policy.device, seed):
        for i, start in enumerate(progress(starts, "generate", total=len(starts))):
            stop = min(start + chunk, R)
            saved = (plan.done_chunks or {}).get(i) if seed_per_chunk else None
            if saved is not None and len(saved) == stop - start:
                responses.extend([list(map(int, r)) for r in saved])
            else:
                reseed = chunk_seed(seed, i) if seed_per_chunk else None
                with seeded(policy.device, reseed):
                    rows = span(ids, mask, start, stop, G, i, state, reseed)
                if plan.on_chunk is not None:
                    plan.on_chunk(i, rows)
                responses.extend(rows)
            if on_first_group is not None and len(responses) >= G:
                on_first_group(responses[:G])
                on_first_group = None
    return responses


def generate_span(policy: PolicyModel, ids: Tensor, mask: Tensor, start: int, stop: int, G: int, index: int,
                  state: dict, reseed: int | None, *, chunk_generator: ChunkGenerator) -> list[list[int]]:
    """Rows [start, stop) in calls of at most state["limit"] rows, halving that limit on OOM.

    After an OOM the chunk starts again from its own seed (when it has one), so what it draws
    does not depend on how far the failed attempt got.
    """
    while True:
        limit = state["limit"]
        attempt = partial(_generate_span_once, ids, mask, start, stop, G, index, limit, chunk_generator)
        rows, reason = unless_out_of_memory(attempt)
        if reason is None:
            return rows
        state["limit"] = shrink_after_oom(limit, reason, f"generation (chunk {index}, rows {start}-{stop - 1})",
                                          policy.logger)
        if reseed is not None:
            torch.manual_seed(int(reseed))


def _generate_span_once(ids: Tensor, mask: Tensor, start: int, stop: int, G: int, index: int, limit: int,
                        chunk_generator: ChunkGenerator) -> list[list[int]]:
    """Rows [start, stop) of chunk `index` in calls of at most `limit` rows."""
    rows: list[list[int]] = []
    for s in range(start, stop, limit):
        prompt_index = torch.arange(s, min(s + limit, stop), device=ids.device) // G
        try:
            part, _ = chunk_generator(ids, mask, prompt_index)
        except NonFiniteLogitsError as exc:
            b, g = divmod(s + exc.row, G)
            raise NumericsError(f"non-finite logits in generation: chunk {index}, sequence b={b} g={g}, "
                                f"token {getattr(exc, 'position', ids.shape[1]) - ids.shape[1]}") from None
        rows.extend(part)
    return rows

"""The sampler interface: one method that draws G responses for each prompt and says how it drew them.

Every way E and U can be drawn is a `Sampler`, one to a module:

- "chunk_seeded" (`chunk_seeded.py`): HF generate with torch's multinomial, each chunk of rows seeded on its own;
- "row_keyed" (`row_generation.py`): HF generate whose tokens depend only on (seed, row, step) — with
  generation.sampler_engine static_cache the same draws through a static KV cache;
- "cb_chunk_seeded" (`cb_generation.py`): transformers' continuous batching, one engine run per chunk;
- the reference sampler (`reference_sampler.py`): one prompt, one response at a time (sampler.batched: false).

`PolicyEngine.sampler` (policy/engine.py) picks one from the generation settings (`sampler_setup.plan_sampler`);
`Sampler.draw(DrawRequest)` returns `Drawn`: the packed sequences and the generation record (dtype, engine,
draws, rows per call, new tokens, seconds) that results.json's "sampler" block reports.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from entropy_experiments.data.batch import Batch
from entropy_experiments.errors import ConfigError
from entropy_experiments.policy.policy_model import PolicyModel
from entropy_experiments.policy.sampler_setup import SamplerPlan

__all__ = ["DrawRequest", "Drawn", "Sampler", "SamplerContext", "generation_record"]


@dataclass(frozen=True)
class DrawRequest:
    """What to draw: G responses for each prompt's token ids, from `seed` (None: torch's global generator).

    keep_chunks: save each completed chunk in the chunk store and reuse the chunks a killed run saved (needs a
    seed); on_first_group(rows): called once with the first prompt's G responses as soon as they exist."""

    prompt_tokens: Sequence[Sequence[int]]
    G: int
    seed: int | None = None
    keep_chunks: bool = False
    on_first_group: Callable[[list[list[int]]], None] | None = None

    def __post_init__(self) -> None:
        if self.G < 1:
            raise ConfigError(f"G: must be >= 1, got {self.G}")
        if self.keep_chunks and self.seed is None:
            raise ValueError("a draw that keeps its chunks needs a seed")

    @property
    def rows(self) -> int:
        """B·G: the rows to draw, row = b·G + g."""
        return len(self.prompt_tokens) * self.G


@dataclass(frozen=True)
class Drawn:
    """A sampler's answer: the packed sequences and the generation record (None for the reference sampler)."""

    sequences: Batch
    record: dict | None


class Sampler(Protocol):
    """Draws rows for prompts (see the module docstring for the implementations)."""

    def draw(self, request: DrawRequest) -> Drawn: ...


@dataclass(frozen=True)
class SamplerContext:
    """What every batched sampler works with: the policy, the settings' rows per call (an int or "auto"), the
    sampler plan, the store of completed chunks (or None), the engine's generation seams (`chunk_generator`:
    rows of the padded prompts in one generate call; `span`: a chunk's rows with the OOM halving) and the memory
    budget that auto rows per call plan for."""

    policy: PolicyModel
    requested: int | str
    plan: SamplerPlan
    chunk_store: Any = None
    chunk_generator: Callable[..., Any] | None = None
    span: Callable[..., Any] | None = None
    memory_budget_gb: float | None = None


def generation_record(plan: SamplerPlan, rows: dict, seqs: Batch, started: float) -> dict:
    """What a draw did: the plan, the rows per call (`rows`), the new tokens, the seconds since `started`."""
    seconds = time.perf_counter() - started
    tokens = int(sum(sum(row) for row in seqs.gen_lens))
    return {"dtype": plan.dtype, "engine": plan.engine, "draws": plan.draws, **rows,
            "new_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds > 0 else None}

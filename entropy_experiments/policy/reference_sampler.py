"""The plain reference sampler: one prompt, one response at a time, no batching tricks.

Used for the parity path (`sampler.batched: false`, as a `Sampler`: `ReferenceSampler`) and as the
benchmark's one-at-a-time baseline. It reuses the policy engine's own pieces — the logits
processor, the stop rule and the packer — so only the batching differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from entropy_experiments.data.batch import Batch
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.policy.generation_config import parse_settings
from entropy_experiments.policy.samplers import Drawn, DrawRequest

__all__ = ["ReferenceSampler", "sample_one_at_a_time", "sample_with_engine"]


class ReferenceSampler:
    """`Sampler` that draws each response alone (`sample_with_engine`); it keeps no chunks, makes no early
    first-group check and leaves no generation record."""

    def __init__(self, engine: PolicyEngine):
        self.engine = engine

    def draw(self, request: DrawRequest) -> Drawn:
        return Drawn(sample_with_engine(self.engine, request.prompt_tokens, request.G, seed=request.seed), None)


def sample_with_engine(engine: PolicyEngine, prompts: Sequence[str], G: int, seed: int | None = None
                       ) -> Batch:
    """G responses per prompt, each generated alone from the unpadded prompt; same packed layout."""
    prompt_tokens = engine.tokenize_prompts(prompts)
    responses = []
    with engine.seeded(seed):
        for tokens in prompt_tokens:
            ids, mask = engine.left_pad([tokens])
            responses.append([engine.generate_rows(ids, mask)[0][0] for _ in range(G)])
    return engine.pack(prompt_tokens, responses, prompts)


def sample_one_at_a_time(model: nn.Module, tokenizer, prompts: Sequence[str], G: int, gen_config: Any,
                         seed: int | None = None) -> Batch:
    """`sample_with_engine` on a fresh engine for `model`; `gen_config`: a GenerationConfig, PolicySettings,
    dict or ProbeConfig (`parse_settings`). The process-wide precision switches are left as they are."""
    engine = PolicyEngine(model, tokenizer, parse_settings(gen_config), apply_precision=False)
    return sample_with_engine(engine, prompts, G, seed)

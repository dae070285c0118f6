"""The plain reference sampler: one prompt, one response at a time, no batching tricks.

Used for the parity path (`probe_rework.use_sequence_processor_sampling: false`) and as the
benchmark's one-at-a-time baseline. It reuses the SequenceProcessor's own pieces — the logits
processor, the stop rule and the packer — so only the batching differs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from entropy_experiments.compat.sequence_processor import BatchedSequences, SequenceProcessor


def sample_one_at_a_time(model: nn.Module, tokenizer, prompts: Sequence[str], G: int, gen_config: Any,
                         seed: int | None = None) -> BatchedSequences:
    """G responses per prompt, each generated alone from the unpadded prompt; same packed layout.

    `gen_config`: anything SequenceProcessor accepts (GenerationConfig, dict, ProbeConfig). The
    process-wide precision switches are left as they are.
    """
    sp = SequenceProcessor(model, tokenizer, gen_config, apply_precision=False)
    prompt_tokens = sp.tokenize_prompts(prompts)
    responses = []
    with sp.seeded(seed):
        for tokens in prompt_tokens:
            ids, mask = sp.left_pad([tokens])
            responses.append([sp.generate_rows(ids, mask)[0][0] for _ in range(G)])
    return sp.pack(prompt_tokens, responses, prompts)

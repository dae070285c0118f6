"""The continuous-batching sampler (generation.sampler_engine: continuous_batching): transformers' paged-cache
continuous batching samples E and U, and every token comes back with its log-probability under the engine's
OWN sampling distribution, which the estimators' importance correction needs (docs/maths.md §12).

transformers' engine (`init_continuous_batching`, the machinery of `generate_batch`) applies the temperature
through its warper, draws with torch.multinomial from softmax of the processed fp32 scores and, with
`return_logprobs`, returns log of the chosen token's probability from those same probabilities. Its nucleus
(top-p) rule is not ours (ties, the crossing token: tests/test_cb_sampler.py), so top_p < 1 is refused
(`generation_config.check_engine_policy`). It stops on EOS and max_new_tokens; stop strings are cut
afterwards by the probe's stop rule (`stop_rule.response_length`), keeping the kept tokens' log-probs (a
token's log-prob depends only on its prefix, never on where the response is later cut).

Draws "cb_chunk_seeded": rows (b·G + g) go to the engine in chunks of `rows_per_call`; chunk i is one engine
run seeded with `chunk_seed(seed, i)` whose paged cache holds all its rows at once. A chunk's draws depend on
(seed, i, its rows, the device): a resumed run regenerates a missing chunk identically, but a different
rows_per_call gives other (equally valid) draws. Requests are queued BEFORE the engine's loop starts, so its
first batch always holds every row of the chunk (generate_batch starts the loop first and races it).
Out of memory: the chunk is rerun with a cache for half as many concurrent rows (the engine queues the rest),
which changes that chunk's draws, not their distribution.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from entropy_experiments.errors import NumericsError
from entropy_experiments.policy.generate import chunk_seed, neutral_generation_config
from entropy_experiments.policy.oom import shrink_after_oom, unless_out_of_memory
from entropy_experiments.policy.policy_model import PolicyModel
from entropy_experiments.policy.row_generation import RowKeyedRun, SpanPlan, SpanSampler, generate_spans
from entropy_experiments.policy.stop_rule import response_length

__all__ = ["CB_DRAWS", "ContinuousBatchingSampler", "cb_batching_config", "cb_generation_config", "generate_cb", "run_engine"]

CB_DRAWS = "cb_chunk_seeded"
#: Tokens per cache page (the engine's default; its flash decode path wants multiples of 256).
PAGE_SIZE = 256
#: Most tokens per forward (the engine's own default): bounds the prefill's activations.
MAX_BATCH_TOKENS = 8192
#: Seconds without any finished request after which a stalled engine is reported.
STALL_SECONDS = 600.0


def cb_generation_config(temperature: float, max_new_tokens: int, eos_token_ids: Sequence[int], pad_token_id: int):
    """HF GenerationConfig whose only logits rule is the temperature (no top-k, top-p, min-p, penalties)."""
    from transformers import GenerationConfig as HFGenerationConfig

    return HFGenerationConfig(do_sample=True, temperature=float(temperature), top_p=1.0, top_k=0, typical_p=1.0,
                              min_p=None, repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1,
                              num_return_sequences=1, max_new_tokens=int(max_new_tokens), min_new_tokens=None,
                              eos_token_id=list(eos_token_ids), pad_token_id=pad_token_id)


def cb_batching_config(concurrent: int, max_prompt_len: int, max_new_tokens: int, seed: int, bf16: bool):
    """ContinuousBatchingConfig: a paged cache holding `concurrent` rows of prompt + max_new_tokens tokens
    (fixed, not sized from free memory: the schedule, hence the draws, must not depend on it), log-probs on,
    `seed`; flash attention only for a bf16 sampler (it has no fp32 kernels)."""
    from transformers import ContinuousBatchingConfig

    blocks_per_row = math.ceil((max_prompt_len + max_new_tokens + 1) / PAGE_SIZE)
    return ContinuousBatchingConfig(
        page_size=PAGE_SIZE, num_blocks=concurrent * blocks_per_row + 1,
        max_batch_tokens=max(concurrent, min(concurrent * max_prompt_len, MAX_BATCH_TOKENS)),
        max_requests_per_batch=concurrent, return_logprobs=True, seed=int(seed), auto_switch_to_flash=bf16,
        cpu_offload_space=0.0)


def _check_rule(manager: Any) -> None:
    """The engine must apply exactly the temperature warper (or nothing at τ = 1)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper

    extra = [type(p).__name__ for p in manager.logit_processor.logits_processor
             if not isinstance(p, TemperatureLogitsWarper)]
    if extra:
        raise NumericsError(f"generation.sampler_engine: continuous batching added logits processors {extra}; "
                            "the sampler's rule would not be the probe's")


@contextlib.contextmanager
def _own_rng(device: torch.device) -> Iterator[None]:
    """The engine seeds torch's global generators: restore the caller's state afterwards."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def _collect(manager: Any, request_ids: list[str]) -> list[Any]:
    results: dict[str, Any] = {}
    last = time.monotonic()
    while len(results) < len(request_ids):
        out = manager.get_result(timeout=1)
        if out is not None and out.is_finished():
            results[out.request_id], last = out, time.monotonic()
        elif out is None and (not manager.is_running() or time.monotonic() - last > STALL_SECONDS):
            raise RuntimeError(f"continuous batching stopped with {len(request_ids) - len(results)} request(s) "
                               "unfinished")
    failed = [results[i].error for i in request_ids if results[i].error is not None]
    if failed:
        raise RuntimeError(f"continuous batching failed a request: {failed[0]}")
    return [results[i] for i in request_ids]


def run_engine(module: nn.Module, prompts: Sequence[Sequence[int]], generation_config: Any, batching_config: Any,
               ) -> tuple[list[list[int]], list[list[float]]]:
    """One engine run: (generated tokens, their log-probs) per prompt, in order. All requests are queued
    before the loop starts; the model's attention implementation, train/eval mode and torch's RNG state
    are restored afterwards. The engine's memory-sizing MemoryError becomes torch.OutOfMemoryError."""
    was_training = module.training
    try:
        with torch.no_grad(), _own_rng(module.device), neutral_generation_config(module):
            manager = module.init_continuous_batching(generation_config=generation_config,
                                                      continuous_batching_config=batching_config)
            try:
                _check_rule(manager)
                ids = manager.add_requests(inputs=[list(map(int, p)) for p in prompts])
                manager.start()
                outs = _collect(manager, ids)
            finally:
                manager.stop(block=True)
                manager.destroy()
    except MemoryError as exc:
        raise torch.OutOfMemoryError(f"out of memory: continuous batching cache ({exc})") from None
    finally:
        module.train(was_training)
    return [list(o.generated_tokens) for o in outs], [list(o.logprobs) for o in outs]


def _chunk(policy: PolicyModel, module: nn.Module, prompt_tokens, *, G: int, rows: tuple[int, int], seed: int,
           state: dict, bf16: bool) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Rows [start, stop) = `rows` in one engine run seeded with `seed`, cut by the stop rule; on OOM rerun with a cache
    for half as many concurrent rows (state["limit"])."""
    start, stop = rows
    prompts = [prompt_tokens[r // G] for r in range(start, stop)]
    config = policy.config
    gen = cb_generation_config(config.temperature, config.max_new_tokens, policy.eos_token_ids, policy.pad_token_id)
    Lp = max(len(p) for p in prompts)
    while True:
        limit = min(state["limit"], stop - start)
        batching = cb_batching_config(limit, Lp, int(config.max_new_tokens), seed, bf16)
        out, reason = unless_out_of_memory(lambda batching=batching: run_engine(module, prompts, gen, batching))
        if reason is None:
            break
        state["limit"] = shrink_after_oom(limit, reason, f"generation (rows {start}-{stop - 1})", policy.logger)
    responses, logqs = [], []
    for tokens, logprobs in zip(*out, strict=True):
        T = response_length(policy, tokens)
        responses.append(tokens[:T])
        logqs.append(torch.tensor(logprobs[:T], dtype=torch.float32))
    return responses, logqs


class ContinuousBatchingSampler(SpanSampler):
    """`Sampler` of the "cb_chunk_seeded" draws: its log-probs are always recorded, its saved chunks keyed by their
    size (the draws depend on the chunking)."""

    draws_key_has_chunk = True

    def records(self) -> bool:
        return True

    def run_spans(self, module, spans, prompt_tokens, padded):
        return generate_cb(self.context.policy, prompt_tokens, spans, module=module,
                           bf16=self.context.plan.dtype == "bf16")


def generate_cb(policy: PolicyModel, prompt_tokens: Sequence[Sequence[int]], spans: SpanPlan, *,
                module: nn.Module, bf16: bool) -> RowKeyedRun:
    """The B·G responses (row = b·G + g) and their log q_sampler, chunk i = rows [i·n, (i+1)·n) of
    n = spans.rows_per_call drawn by one engine run seeded with chunk_seed(spans.seed, i); saved chunks reused
    and new ones saved as `SpanPlan` says."""
    state = {"limit": spans.rows_per_call}

    def make_span(index: int, start: int, stop: int):
        return _chunk(policy, module, prompt_tokens, G=spans.G, rows=(start, stop),
                      seed=chunk_seed(spans.seed, index), state=state, bf16=bf16)

    run = generate_spans(len(prompt_tokens) * spans.G, make_span, spans)
    run.rows_per_call_final = state["limit"]
    return run

"""Generation pieces under the sampling policy: tokenise, left-pad, HF generate, cut, pack (docs/maths.md §1).

B prompts, G responses each; prompts left-padded to ONE padded length Lp per call; a response of T
tokens sits at [Lp, Lp + T) of its row; everything after it is pad with attention mask 0. q_θ
(temperature + nucleus, `sampling_policy.py`) is applied through a LogitsProcessor inside HF
`generate` with HF's own warpers off, and responses are cut by the stop rule (`stop_rule.py`); rows
that share a prompt share its prefill. The samplers (`samplers.py`) are built from these pieces;
`chunk_seed` is the seed of chunk i of a chunk-seeded draw (`chunk_seeded.py`, `cb_generation.py`).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from entropy_experiments.data.batch import Batch
from entropy_experiments.errors import ConfigError, DataError
from entropy_experiments.policy.policy_model import PolicyModel
from entropy_experiments.policy.precision_utils import forward_precision_ctx
from entropy_experiments.policy.sampling_policy import SamplingPolicyLogitsProcessor
from entropy_experiments.policy.stop_rule import StopStringCriterion, response_length

__all__ = ["chunk_seed", "generate_chunk", "generate_rows", "left_pad", "pack", "seeded", "tokenize_prompts"]


def chunk_seed(seed: int, index: int) -> int:
    """The torch seed of generation chunk `index` in a call seeded with `seed` (`seed_per_chunk`).

    Chunk 0 uses `seed` itself (a one-chunk call draws exactly what a plain seeded call draws); later
    chunks get a hash of (seed, index), so any chunk can be regenerated alone — which is what lets a
    resumed run skip the chunks it saved and still produce the batch an uninterrupted run produces.
    """
    if index == 0:
        return int(seed)
    digest = hashlib.sha256(f"{int(seed)}:{int(index)}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextlib.contextmanager
def seeded(device: torch.device, seed: int | None) -> Iterator[None]:
    """Seed torch for the block without touching the caller's RNG state; no-op when seed is None."""
    if seed is None:
        yield
        return
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(seed))
        yield


# ------------------------------------------------------------------------------------ prompts
def max_prompt_tokens(policy: PolicyModel) -> int | None:
    """generation.max_prompt_tokens, else the model's context minus max_new_tokens (None: unknown)."""
    if policy.config.max_prompt_tokens is not None:
        return int(policy.config.max_prompt_tokens)
    limit = getattr(getattr(policy.hf_model, "config", None), "max_position_embeddings", None)
    if limit is None:
        return None
    room = int(limit) - int(policy.config.max_new_tokens)
    if room < 1:
        raise ConfigError(f"generation.max_new_tokens={policy.config.max_new_tokens} leaves no room for a prompt "
                          f"in the model's context of {limit} tokens")
    return room


def tokenize_prompts(policy: PolicyModel, prompts: Sequence[str | Sequence[int]]) -> list[list[int]]:
    """Token ids of each prompt (no padding), checked against max_prompt_tokens.

    A string is tokenised (the tokenizer adds its special tokens); a sequence of ints is taken as the
    prompt's token ids (rendered by the caller, e.g. with the trainer's chat template)."""
    if isinstance(prompts, str):
        raise DataError("prompts: expected a list of strings, got a single string")
    texts = [i for i, p in enumerate(prompts) if isinstance(p, str)]
    encoded = policy.tokenizer([prompts[i] for i in texts], padding=False)["input_ids"] if texts else []
    ids = [None if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    for i, row in zip(texts, encoded, strict=True):
        ids[i] = list(row)
    limit = max_prompt_tokens(policy)
    for i, row in enumerate(ids):
        if not row:
            raise DataError(f"prompt {i} is empty after tokenisation")
        if limit is not None and len(row) > limit:
            if policy.config.prompt_overflow == "truncate":
                policy.logger.warning("prompt %d has %d tokens; keeping its last %d (generation.prompt_overflow: "
                                      "truncate)", i, len(row), limit)
                ids[i] = row[-limit:]
            else:
                raise DataError(f"prompt {i} has {len(row)} tokens, more than generation.max_prompt_tokens={limit} "
                                "(set generation.prompt_overflow: truncate to keep its last tokens)")
    return ids


def left_pad(policy: PolicyModel, token_lists: Sequence[Sequence[int]], length: int | None = None
             ) -> tuple[Tensor, Tensor]:
    """Left-pad to one length → (ids [n, Lp], mask [n, Lp]) on the model's device."""
    Lp = length if length is not None else max(len(t) for t in token_lists)
    ids = torch.full((len(token_lists), Lp), policy.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(token_lists), Lp), dtype=torch.long)
    for i, row in enumerate(token_lists):
        if row:
            ids[i, Lp - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, Lp - len(row):] = 1
    return ids.to(policy.device), mask.to(policy.device)


# ------------------------------------------------------------------------------------ HF generate
@contextlib.contextmanager
def neutral_generation_config(model: nn.Module) -> Iterator[None]:
    """Temporarily give the model (and a PEFT wrapper's base) a blank HF GenerationConfig.

    transformers fills every generate() setting left at None from `model.generation_config`
    (e.g. a checkpoint's min_p, repetition_penalty or suppress_tokens). Blanking it for the call
    guarantees the only logits rule is ours.
    """
    from transformers import GenerationConfig as HFGenerationConfig

    holders = [model]
    if hasattr(model, "get_base_model"):
        holders.append(model.get_base_model())
    saved = []
    for holder in holders:
        if getattr(holder, "generation_config", None) is not None:
            saved.append((holder, holder.generation_config))
            holder.generation_config = HFGenerationConfig()
    try:
        yield
    finally:
        for holder, cfg in saved:
            holder.generation_config = cfg


def hf_generation_config(policy: PolicyModel, *, output_scores: bool, static_cache: bool = False):
    """Generation settings with every HF warper neutral: our LogitsProcessor is the only rule."""
    from transformers import GenerationConfig as HFGenerationConfig

    extra = {"cache_implementation": "static"} if static_cache else {}
    return HFGenerationConfig(**extra,
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, typical_p=1.0, min_p=None,
        repetition_penalty=1.0, no_repeat_ngram_size=0, num_beams=1, num_return_sequences=1,
        max_new_tokens=int(policy.config.max_new_tokens), min_new_tokens=None, min_length=0,
        pad_token_id=policy.pad_token_id, eos_token_id=list(policy.eos_token_ids), use_cache=True,
        renormalize_logits=False, output_scores=output_scores, return_dict_in_generate=output_scores,
    )


def generate_rows(policy: PolicyModel, input_ids: Tensor, attention_mask: Tensor, *, past_key_values: Any = None,
                  output_scores: bool = False, draw: Any = None, module: nn.Module | None = None
                  ) -> tuple[list[list[int]], list[Tensor] | None]:
    """Sample one response per row of the left-padded prompts [R, Lp] with HF generate (KV cache).

    `past_key_values`: optionally a cache already holding the first Lp − 1 prompt positions of
    every row (see `shared_prompt_cache`); generate then only runs the last prompt token.
    Returns the responses cut at T (token id lists) and, with `output_scores`, HF's processed
    scores per step ([R, V] each: the logits it sampled from, after every processor). `draw`: the
    LogitsProcessor choosing the tokens (default: `SamplingPolicyLogitsProcessor` and HF's multinomial);
    `module`: the model to sample with (default: the policy's; e.g. a bf16 sampler copy).
    """
    from transformers import LogitsProcessorList, StoppingCriteriaList

    if policy.module.training:
        policy.warn_once("training", "policy engine: the model is in train() mode (dropout on); "
                                     "the probe expects eval()")
    Lp = int(input_ids.shape[1])
    config = policy.config
    module = module if module is not None else policy.module
    processors = LogitsProcessorList([draw if draw is not None else
                                      SamplingPolicyLogitsProcessor(config.temperature, config.top_p)])
    criteria = StoppingCriteriaList()
    if config.stop_strings:
        criteria.append(StopStringCriterion(policy.tokenizer, config.stop_strings, Lp))
    extra = {} if past_key_values is None else {"past_key_values": past_key_values}
    # Autocast off, as in scoring: tokens are drawn from the same fp32 logits they are scored by.
    static = config.sampler_engine == "static_cache" and draw is not None
    with torch.no_grad(), neutral_generation_config(module), \
            forward_precision_ctx(False, "float32", policy.device.type):
        out = module.generate(
            input_ids=input_ids, attention_mask=attention_mask,
            generation_config=hf_generation_config(policy, output_scores=output_scores, static_cache=static),
            logits_processor=processors, stopping_criteria=criteria, **extra,
        )
    sequences = out.sequences if output_scores else out
    generated = sequences[:, Lp:].tolist()
    responses = [row[: response_length(policy, row)] for row in generated]
    return responses, (list(out.scores) if output_scores else None)


def shared_prompt_cache(policy: PolicyModel, input_ids: Tensor, attention_mask: Tensor, prompt_index: Tensor,
                        module: nn.Module | None = None) -> Any:
    """KV cache of the first Lp − 1 positions of each distinct prompt, expanded to the rows.

    With G > 1 responses per prompt, running each prompt once instead of G times divides the
    prefill cost (which dominates for long prompts on CPU) by G. input_ids / attention_mask:
    [P, Lp] distinct prompts; prompt_index: [R] the prompt of each row. Position ids come from
    the mask, as generate computes them, so the continuation sees identical positions.
    """
    prefix_ids, prefix_mask = input_ids[:, :-1], attention_mask[:, :-1]
    position_ids = (prefix_mask.long().cumsum(-1) - 1).masked_fill(prefix_mask == 0, 0)
    kwargs: dict[str, Any] = {"logits_to_keep": 1} if policy.supports_logits_to_keep else {}
    module = module if module is not None else policy.module
    with torch.no_grad(), forward_precision_ctx(False, "float32", policy.device.type):
        out = module(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=position_ids,
                            use_cache=True, **kwargs)
    cache = out.past_key_values
    cache.batch_select_indices(prompt_index.to(prefix_ids.device))
    return cache


def generate_chunk(policy: PolicyModel, ids: Tensor, mask: Tensor, prompt_index: Tensor, *,
                   output_scores: bool = False, draw: Any = None, module: nn.Module | None = None
                   ) -> tuple[list[list[int]], list[Tensor] | None]:
    """Generate the rows `prompt_index` (indices into the padded prompts ids/mask [B, Lp]); `draw`, `module`
    as in `generate_rows`.

    Rows that share a prompt share its prefill through `shared_prompt_cache` (not with a static cache, which
    generate allocates itself).
    """
    unique, inverse = torch.unique(prompt_index, return_inverse=True)
    cache = None
    static = policy.config.sampler_engine == "static_cache" and draw is not None
    if len(unique) < len(prompt_index) and ids.shape[1] > 1 and not static:
        cache = shared_prompt_cache(policy, ids[unique], mask[unique], inverse, module)
    return generate_rows(policy, ids[prompt_index], mask[prompt_index], past_key_values=cache,
                         output_scores=output_scores, draw=draw, module=module)


def pack(policy: PolicyModel, prompt_tokens: Sequence[Sequence[int]], responses: Sequence[Sequence[Sequence[int]]],
         prompts: Sequence[str] | None = None) -> Batch:
    """Packed layout from per-prompt token ids [B] and responses [B][G] (token id lists)."""
    B, G = len(prompt_tokens), len(responses[0]) if responses else 0
    Lp = max(len(p) for p in prompt_tokens)
    T_max = max((len(r) for row in responses for r in row), default=0)
    L = Lp + T_max
    seqs = torch.full((B, G, L), policy.pad_token_id, dtype=torch.long)
    masks = torch.zeros((B, G, L), dtype=torch.long)
    for b, prompt in enumerate(prompt_tokens):
        p = torch.tensor(list(prompt), dtype=torch.long)
        seqs[b, :, Lp - len(prompt):Lp] = p
        masks[b, :, Lp - len(prompt):Lp] = 1
        for g, resp in enumerate(responses[b]):
            seqs[b, g, Lp:Lp + len(resp)] = torch.tensor(list(resp), dtype=torch.long)
            masks[b, g, Lp:Lp + len(resp)] = 1
    texts = [policy.tokenizer.batch_decode([list(r) for r in row], skip_special_tokens=True) for row in responses]
    return Batch(sequences=seqs, attention_masks=masks, prompt_lens=[Lp] * B,
                 gen_lens=[[len(r) for r in row] for row in responses], responses_text=texts,
                 prompts=list(prompts) if prompts is not None else None)

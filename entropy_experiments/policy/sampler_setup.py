"""The sampler: which precision and draw scheme generation uses, how many rows per generate call, and the model copy.

The scored policy q_θ is always the fp32 model (teacher forcing, gradients, jvp). Sampling may use another
sampler q_s — a bf16 copy of the policy with SDPA attention, built for the sampling phase and freed after it —
because E only has to be a sample from a KNOWN distribution: the sampler records log q_s of every token it draws
(`Batch.sampler_logqs`) for the estimators' importance correction (docs/maths.md §12).

Draw schemes (each a `Sampler`, samplers.py): "chunk_seeded" (chunk_seeded.py: torch's multinomial, each chunk of
`gen_batch_size` rows seeded on its own: the draws depend on the chunking; kept bit for bit for an integer
gen_batch_size with an fp32 sampler) and "row_keyed" (row_generation.py with row_keyed.py: every row's draws depend
only on (seed, row, step)), and with the continuous-batching engine "cb_chunk_seeded" (cb_generation.py: the
engine's own multinomial, one engine run per chunk of rows seeded on its own; its log-probs are always recorded).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from entropy_experiments.errors import ConfigError
from entropy_experiments.policy.memory_budget import ModelShape

__all__ = ["CPU_ROWS_PER_CALL", "SamplerPlan", "auto_rows_per_call", "bf16_copy", "plan_sampler", "sampler_module"]

#: Rows per generate call on CPU with gen_batch_size auto. Provisional: bench/bench_sampling.py measures it, but on
#: the loaded shared 2-core host its numbers were not reliable (docs/sampling.md "Measuring").
CPU_ROWS_PER_CALL = 16
#: Most rows per call on CUDA however much memory is free (beyond this decode is compute-bound anyway).
MAX_ROWS_PER_CALL = 256
#: Fraction of the free memory the estimate may fill (allocator fragmentation, the prefill's activations).
MEMORY_FILL = 0.7
#: fp32 [rows, V] tensors alive per decode step (HF's logits copy, scaled/masked logits, float64 softmax and cdf).
LOGIT_FP32_COPIES = 6


@dataclass(frozen=True)
class SamplerPlan:
    """What generation will do: dtype "fp32" | "bf16", draws "chunk_seeded" | "row_keyed" | "cb_chunk_seeded",
    engine."""

    dtype: str
    draws: str
    engine: str


def is_quantized(module: nn.Module) -> bool:
    return any(getattr(module, attr, False) for attr in ("is_loaded_in_4bit", "is_loaded_in_8bit", "is_quantized"))


def plan_sampler(gen_batch_size: int | str, sampler_dtype: str, engine: str, device: torch.device,
                 module: nn.Module) -> SamplerPlan:
    """The sampler's dtype (auto: bf16 on CUDA unless the model is quantized, else fp32) and draw scheme.

    ConfigError for bf16 on a quantized (QLoRA) model: its weights cannot be copied to bf16 here."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module
    if sampler_dtype == "auto":
        dtype = "bf16" if device.type == "cuda" and not is_quantized(base) else "fp32"
    elif sampler_dtype == "bf16" and is_quantized(base):
        raise ConfigError("generation.sampler_dtype: bf16 needs an unquantized model (this one is loaded in 4/8 "
                          "bits); use fp32 or auto")
    else:
        dtype = sampler_dtype
    if engine == "continuous_batching":
        return SamplerPlan(dtype=dtype, draws="cb_chunk_seeded", engine=engine)
    legacy = isinstance(gen_batch_size, int) and dtype == "fp32" and engine == "generate"
    return SamplerPlan(dtype=dtype, draws="chunk_seeded" if legacy else "row_keyed", engine=engine)


def bf16_copy(module: nn.Module) -> nn.Module:
    """A bf16 copy of the policy with SDPA attention, in eval mode; a PEFT model's adapter is merged into the copy
    (in fp32, then cast), so the copy is a plain model whose decode runs no adapter matmuls."""
    work = copy.deepcopy(module)
    if hasattr(work, "merge_and_unload"):
        work = work.merge_and_unload()
    work = work.to(torch.bfloat16).eval()
    for p in work.parameters():
        p.requires_grad_(False)
    config = getattr(work, "config", None)
    if config is not None and hasattr(work, "set_attn_implementation"):
        with contextlib.suppress(Exception):  # a model without SDPA keeps its own attention
            work.set_attn_implementation("sdpa")
    elif config is not None:
        config._attn_implementation = "sdpa"
    return work


@contextlib.contextmanager
def sampler_module(module: nn.Module, dtype: str) -> Iterator[nn.Module]:
    """The module to sample with: the live policy for fp32, a bf16 copy (freed on exit) for bf16."""
    if dtype == "fp32":
        yield module
        return
    work = bf16_copy(module)
    try:
        yield work
    finally:
        del work
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def kv_row_bytes(module: nn.Module, positions: int, dtype_bytes: int) -> int:
    """Bytes of one row's KV cache over `positions` positions."""
    config = module.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return 2 * int(text.num_hidden_layers) * kv_heads * head_dim * positions * dtype_bytes


def auto_rows_per_call(module: nn.Module, device: torch.device, total_rows: int, prompt_len: int,
                       max_new_tokens: int, *, budget_gb: float | None = None) -> tuple[int, str]:
    """(rows per generate call, how it was chosen) for gen_batch_size auto.

    CUDA: the rows whose KV cache (prompt + max_new_tokens) and fp32 [rows, V] logit work fit MEMORY_FILL of the
    free device memory (or of estimator.memory_budget_gb less the sampler's weights); the OOM halving stays the
    safety net. CPU: CPU_ROWS_PER_CALL. Never more than the rows to generate."""
    if device.type != "cuda":
        rows = CPU_ROWS_PER_CALL
        how = f"CPU: {CPU_ROWS_PER_CALL}"
    else:
        dtype_bytes = next(module.parameters()).element_size()
        shape = ModelShape.of(module)
        positions = prompt_len + max_new_tokens
        per_row = (kv_row_bytes(module, positions, dtype_bytes) + 4 * LOGIT_FP32_COPIES * shape.vocab
                   + dtype_bytes * prompt_len * (4 * shape.hidden + 2 * shape.intermediate))
        if budget_gb is not None:
            weights = sum(p.numel() * p.element_size() for p in module.parameters())
            room, where = budget_gb * 2**30 - weights, f"estimator.memory_budget_gb {budget_gb:g}"
        else:
            room, where = float(torch.cuda.mem_get_info(device)[0]), "free CUDA memory"
        rows = max(1, min(MAX_ROWS_PER_CALL, int(MEMORY_FILL * room // per_row)))
        how = f"{where} {room / 2**30:.1f} GB at ≈ {per_row / 2**20:.1f} MB per row"
    return max(1, min(rows, total_rows)), how

"""Micro-batch sizes from a memory budget (`estimator.memory_budget_gb`), before anything runs out of memory.

On a GPU an out-of-memory error is caught and the rows per forward halved (oom.py); on a CPU host the kernel's
OOM killer ends the process instead, and a halving after the fact cannot help. So the with-grad passes — the
probe's memory peak (U backward, E backward; docs/maths.md §7: fp32 activations kept for backward, fp32 logits over
the vocabulary) — take at most as many sequences per microbatch as the budget holds by the estimate below.

Per sequence of S positions (prompt + response, padded) with T scored response tokens, fp32:
  activations kept for backward ≈ 4 B · S · L · (ACT_HIDDEN · d + ACT_FFN · f + heads · S)   (eager attention
  keeps its softmax output, heads · S a token) and the logits ≈ 4 B · LOGIT_COPIES · T · V. The constants count
  the tensors autograd saves. Against the growth of the resident memory during each phase (bench/bench_scaling.py,
  SmolLM2-135M → Qwen2.5-1.5B): U's is 1.5–2.7× below the estimate for its microbatch; the E phase's is 0.84–1.7×
  below it, i.e. up to 19 % above it at E ≥ 16 or T = 512, where the phase also holds what it keeps across
  microbatches and what the allocator does not return. Leave ≈ 25 % headroom (README "Scaling").
"""

from __future__ import annotations

from dataclasses import dataclass

from entropy_experiments.errors import DeviceError

__all__ = ["ModelShape", "grad_row_bytes", "microbatch_within_budget"]

ACT_HIDDEN = 14      # fp32 tensors of width d saved per token per layer (norms, q/k/v/o, residuals, LoRA inputs)
ACT_FFN = 5          # of width f (gate, up, activation, product, down input)
LOGIT_COPIES = 3     # logits, their log-softmax for the scored tokens, the gradient buffer
FLOAT_BYTES = 4


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set a decoder's activation memory."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    vocab: int

    @classmethod
    def of(cls, model) -> ModelShape:
        """From a transformers model (a PeftModel forwards `.config` to its base)."""
        config = model.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(layers=int(text.num_hidden_layers), hidden=int(text.hidden_size),
                   intermediate=int(text.intermediate_size), heads=int(text.num_attention_heads),
                   vocab=int(text.vocab_size))


def grad_row_bytes(shape: ModelShape, positions: int, response_tokens: int) -> int:
    """Estimated bytes one sequence adds to a with-grad microbatch (activations + vocabulary-wide logits)."""
    per_token_layer = ACT_HIDDEN * shape.hidden + ACT_FFN * shape.intermediate + shape.heads * positions
    activations = FLOAT_BYTES * positions * shape.layers * per_token_layer
    logits = FLOAT_BYTES * LOGIT_COPIES * response_tokens * shape.vocab
    return int(activations + logits)


def microbatch_within_budget(budget_gb: float, shape: ModelShape, positions: int, response_tokens: int,
                             requested: int) -> tuple[int, str | None]:
    """(sequences per with-grad microbatch ≤ `requested` that fit `budget_gb`, a message when it is lowered).

    DeviceError (one line) when a single sequence does not fit: nothing smaller exists to fall back to."""
    row = grad_row_bytes(shape, positions, response_tokens)
    budget = float(budget_gb) * 2**30
    fits = int(budget // row)
    if fits < 1:
        raise DeviceError(f"estimator.memory_budget_gb {budget_gb:g}: one sequence of {positions} positions "
                          f"({response_tokens} response tokens, vocab {shape.vocab}) needs about {row / 2**30:.2f} GB "
                          "with grad; raise the budget or lower generation.max_new_tokens")
    if fits >= requested:
        return requested, None
    return fits, (f"estimator.memory_budget_gb {budget_gb:g}: microbatch_size lowered from {requested} to {fits} "
                  f"sequences (about {row / 2**20:.1f} MB each with grad at {positions} positions)")

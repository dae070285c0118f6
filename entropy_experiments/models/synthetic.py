"""Models of real architectures without a hub: published configuration numbers, random weights.

`build_synthetic_model_dir("qwen2.5-1.5b", DIR)` writes a Hugging Face model directory (config.json,
safetensors in the published dtype, bf16, and a tokenizer made in code whose length is the real
vocabulary size) that every loader of this project reads like a downloaded checkpoint. Nothing is
downloaded and no weights are shipped: the numbers below are the architecture, the weights are drawn
from the model's own initialiser with a fixed seed.

Random weights give near-uniform next-token distributions over the whole vocabulary: responses run to
`max_new_tokens` and every vocabulary-sized computation sees its worst case — what a scaling benchmark
wants. `make-checkpoint --synthetic NAME` (cli.py) trains a LoRA adapter + AdamW state on top.

`SyntheticSpec.scaled(...)` gives the same architecture at a toy width and depth (tests); the real
sizes are checked by parameter count on the meta device (`parameter_count`), never allocated in a test.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import ConfigError, closest_match
from ..testing.tiny_model import build_tiny_tokenizer

__all__ = ["SYNTHETIC_SPECS", "SyntheticSpec", "build_synthetic_model", "build_synthetic_model_dir",
           "build_synthetic_tokenizer", "parameter_count", "spec_named"]


@dataclass(frozen=True)
class SyntheticSpec:
    """The numbers of a published config.json that fix a model's shapes and its rotary embedding."""

    name: str
    source: str                 # where the numbers come from
    architecture: str           # "qwen2" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float
    published_parameters: int   # what the model card / config gives, for the meta-device check

    def scaled(self, *, hidden_size: int = 64, num_hidden_layers: int = 2, intermediate_size: int = 128,
               num_attention_heads: int = 4, num_key_value_heads: int = 2,
               vocab_size: int | None = None) -> SyntheticSpec:
        """The same architecture (and, by default, the same vocabulary) at a toy width and depth."""
        return replace(self, name=f"{self.name}-scaled", hidden_size=hidden_size,
                       num_hidden_layers=num_hidden_layers, intermediate_size=intermediate_size,
                       num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                       vocab_size=vocab_size or self.vocab_size, published_parameters=0)


# Qwen2.5: config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B}-Instruct on the Hugging Face hub (architectures
# Qwen2ForCausalLM; attention q/k/v biases; vocab_size 151,936 = the tokenizer's 151,665 padded).
# Parameter counts: the model cards' "Number of Parameters: 0.49B / 1.54B / 7.61B" (exact sums in the tests).
# 7B (untied embeddings, vocab 152,064): for the GPU projection of README "Scaling"; too large to build here.
# SmolLM2: config.json of HuggingFaceTB/SmolLM2-{135M,360M}-Instruct (LlamaForCausalLM, no biases).
SYNTHETIC_SPECS: dict[str, SyntheticSpec] = {spec.name: spec for spec in (
    SyntheticSpec("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B-Instruct config.json", "qwen2", vocab_size=151_936,
                  hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32_768,
                  tie_word_embeddings=True, initializer_range=0.02, published_parameters=494_032_768),
    SyntheticSpec("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B-Instruct config.json", "qwen2", vocab_size=151_936,
                  hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32_768,
                  tie_word_embeddings=True, initializer_range=0.02, published_parameters=1_543_714_304),
    SyntheticSpec("qwen2.5-7b", "Qwen/Qwen2.5-7B-Instruct config.json", "qwen2", vocab_size=152_064,
                  hidden_size=3584, intermediate_size=18_944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, rope_theta=1_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=32_768,
                  tie_word_embeddings=False, initializer_range=0.02, published_parameters=7_615_616_512),
    SyntheticSpec("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct config.json", "llama", vocab_size=49_152,
                  hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, rope_theta=100_000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                  tie_word_embeddings=True, initializer_range=0.041666666666666664,
                  published_parameters=134_515_008),
    SyntheticSpec("smollm2-360m", "HuggingFaceTB/SmolLM2-360M-Instruct config.json", "llama", vocab_size=49_152,
                  hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15,
                  num_key_value_heads=5, rope_theta=100_000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
                  tie_word_embeddings=True, initializer_range=0.02, published_parameters=361_821_120),
)}


def spec_named(name: str) -> SyntheticSpec:
    """The spec of `name` (case-insensitive); a ConfigError naming the choices otherwise."""
    spec = SYNTHETIC_SPECS.get(str(name).strip().lower())
    if spec is None:
        hint = closest_match(str(name).lower(), list(SYNTHETIC_SPECS))
        raise ConfigError(f"--synthetic {name!r}: unknown model (choose one of {', '.join(SYNTHETIC_SPECS)})"
                          + (f"; did you mean {hint!r}?" if hint else ""))
    return spec


def hf_config(spec: SyntheticSpec, eos_token_id: int):
    """The transformers config of `spec` (eager attention: forward-mode AD needs it)."""
    from transformers import LlamaConfig, Qwen2Config

    common = {"vocab_size": spec.vocab_size, "hidden_size": spec.hidden_size,
              "intermediate_size": spec.intermediate_size, "num_hidden_layers": spec.num_hidden_layers,
              "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_key_value_heads,
              "rms_norm_eps": spec.rms_norm_eps, "max_position_embeddings": spec.max_position_embeddings,
              "tie_word_embeddings": spec.tie_word_embeddings, "initializer_range": spec.initializer_range,
              "hidden_act": "silu", "eos_token_id": eos_token_id, "pad_token_id": eos_token_id, "bos_token_id": None,
              "attn_implementation": "eager",
              "rope_parameters": {"rope_type": "default", "rope_theta": spec.rope_theta}}
    if spec.architecture == "qwen2":
        return Qwen2Config(use_sliding_window=False, **common)
    return LlamaConfig(attention_bias=False, mlp_bias=False, **common)


def _model_class(spec: SyntheticSpec):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM

    return Qwen2ForCausalLM if spec.architecture == "qwen2" else LlamaForCausalLM


def parameter_count(spec: SyntheticSpec) -> int:
    """Distinct parameters of the model (tied embeddings once), built on the meta device: nothing allocated."""
    with torch.device("meta"):
        model = _model_class(spec)(hf_config(spec, eos_token_id=0))
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def prompt_pool_texts() -> list[str]:
    """The default data set's offline prompt pool (gsm_symbolic_r1_template, 500 prompts): the BPE's corpus."""
    from ..data.datasets import load_examples

    return [example.question for example in load_examples("gsm_symbolic_r1_template", "train", pool_size=500)]


MERGE_VOCAB = 4096  # learnt tokens (special, byte alphabet, merges) before the filler padding


def build_synthetic_tokenizer(vocab_size: int):
    """A byte-level BPE with MERGE_VOCAB entries learnt on the default prompt pool, padded with byte-level
    filler tokens to exactly `vocab_size` entries. The learnt merges make a default prompt 169–268 tokens
    (mean ≈ 198; a real Qwen or SmolLM2 tokenizer makes ≈ 150–250 of them, the 384-token tiny BPE 270–578).
    Fillers have no merges, so they never appear in an encoded prompt; a sampled filler decodes to its bytes
    (two or three byte-level characters), as real rare tokens do."""
    import json

    from tokenizers import Tokenizer, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tiny = build_tiny_tokenizer(MERGE_VOCAB, extra_corpus=prompt_pool_texts())
    state = json.loads(tiny.backend_tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    missing = vocab_size - len(tiny)
    if missing < 0:
        raise ConfigError(f"vocab_size {vocab_size} is smaller than the tiny tokenizer's {len(tiny)} tokens")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    next_id = max(vocab.values()) + 1
    for filler in _filler_strings(alphabet, vocab):
        if missing == 0:
            break
        vocab[filler] = next_id
        next_id, missing = next_id + 1, missing - 1
    core = Tokenizer.from_str(json.dumps(state))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                        unk_token=None, padding_side="left",
                                        additional_special_tokens=["<|im_start|>", "<|endoftext|>"])
    tokenizer.chat_template = tiny.chat_template
    return tokenizer


def _filler_strings(alphabet: list[str], taken: dict[str, int]):
    """Byte-level strings of two, then three characters, in a fixed order, skipping those already taken."""
    for a in alphabet:
        for b in alphabet:
            if a + b not in taken:
                yield a + b
    for a in alphabet:
        for b in alphabet:
            for c in alphabet:
                yield a + b + c


def build_synthetic_model(spec: SyntheticSpec, eos_token_id: int, *, seed: int = 0,
                          dtype: torch.dtype = torch.bfloat16):
    """`spec` with the model's own random initialisation (seeded), in `dtype`, eval mode, eager attention."""
    from transformers import GenerationConfig

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = _model_class(spec)._from_config(hf_config(spec, eos_token_id), dtype=dtype)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return model.eval()


def build_synthetic_model_dir(name_or_spec: str | SyntheticSpec, path: str | Path, *, seed: int = 0,
                              dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write model + tokenizer of `name_or_spec` to `path` (created); bf16 safetensors as published.

    The directory loads with `AutoModelForCausalLM.from_pretrained(path)` / `AutoTokenizer.from_pretrained`.
    """
    spec = name_or_spec if isinstance(name_or_spec, SyntheticSpec) else spec_named(name_or_spec)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_synthetic_tokenizer(spec.vocab_size)
    model = build_synthetic_model(spec, tokenizer.eos_token_id, seed=seed, dtype=dtype)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "SYNTHETIC.txt").write_text(
        f"{spec.name}: random weights (seed {seed}) in the architecture of {spec.source}; "
        "built by entropy_experiments.models.synthetic, not a trained model.\n", encoding="utf-8")
    return path

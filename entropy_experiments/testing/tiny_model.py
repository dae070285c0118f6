"""A tiny random Qwen2 with a byte-level BPE tokenizer trained in code.

Used by the unit tests (milliseconds per pass) and by anything that needs a real Hugging Face model
without a hub: it is saved to a directory and loaded back through the same public loaders as a
real checkpoint (`AutoModelForCausalLM.from_pretrained(path)`).
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# Enough text for the BPE trainer to learn merges that cover the R1 template and GSM answers.
_CORPUS = [
    "A conversation between User and Assistant. The user asks a question, and the Assistant solves it.",
    "The reasoning process and answer are enclosed within <think> </think> and <answer> </answer> tags.",
    "User: Tom has 3 apples and buys 5 more. How many apples does he have?",
    "Show your work in <think> </think> tags. And return the final answer in <answer> </answer> tags.",
    "Assistant: Let me solve this step by step.\nResponse: <think> 3 + 5 = 8 </think> <answer>8</answer>",
    "0 1 2 3 4 5 6 7 8 9 10 12 18 24 36 48 100 + - * / = , . ? ! $ % ( )",
    "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<answer>4</answer><|im_end|>",
]

_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


_BOS_CHAT_TEMPLATE = "{{ bos_token }}" + _CHAT_TEMPLATE


def build_tiny_tokenizer(vocab_size: int = 384, *, add_bos: bool = False, extra_corpus: list[str] | None = None):
    """Train a byte-level BPE tokenizer in code; eos = pad = "<|im_end|>", left padding.

    extra_corpus: more training text beside the built-in corpus (the synthetic models learn their merges on
    the prompt pool, so prompts encode to about as many tokens as a real tokenizer makes of them).

    add_bos: the tokenizer adds a BOS ("<|endoftext|>") to every encoded text, and its chat template writes
    one too (as Llama's do), so a chat rendered and then encoded with special tokens would start with two.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(_CORPUS * 4 + list(extra_corpus or []), trainer=trainer)
    bos = {}
    if add_bos:
        bos_id = core.token_to_id("<|endoftext|>")
        core.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos_id)])
        bos = {"bos_token": "<|endoftext|>"}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token=None,
        padding_side="left",
        additional_special_tokens=["<|im_start|>", "<|endoftext|>"],
        **bos,
    )
    tokenizer.chat_template = _BOS_CHAT_TEMPLATE if add_bos else _CHAT_TEMPLATE
    return tokenizer


def build_tiny_model(vocab_size: int, eos_token_id: int, *, seed: int = 0, hidden_size: int = 64,
                     num_layers: int = 2, initializer_range: float = 0.3):
    """A random Qwen2ForCausalLM (fp32, eval mode, eager attention).

    `initializer_range` is larger than the usual 0.02 so that next-token distributions are peaked
    rather than near-uniform: entropies and their derivatives then vary visibly between positions.
    """
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        bos_token_id=None,
        attn_implementation="eager",
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    # A clean generation config: no sampling defaults that could leak into probes.
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id, pad_token_id=eos_token_id)
    return model.float().eval()


def build_tiny_model_dir(path: str | Path, *, seed: int = 0, initializer_range: float = 0.3) -> Path:
    """Write the tiny model and its tokenizer to `path` (created) and return it.

    initializer_range: the weights' init scale (see `build_tiny_model`); 0.1 keeps the residual stream below ≈ 3
    instead of ≈ 50 at 0.3, for checks whose rounding error grows with the activations' size (a bf16 sampler).

    The directory loads with `AutoModelForCausalLM.from_pretrained(path)` and
    `AutoTokenizer.from_pretrained(path)` like any local checkpoint.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), tokenizer.eos_token_id, seed=seed, initializer_range=initializer_range)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def add_random_lora(model, *, r: int = 4, alpha: int = 8, seed: int = 0, b_scale: float = 0.05):
    """Wrap `model` in a LoRA adapter (q,k,v,o; dropout 0) whose B matrices are random, not zero.

    PEFT initialises lora_B to zero, which would make the adapter a no-op and hide bugs in anything
    that depends on the adapter's weights; a small random B gives a real, trained-looking adapter.
    """
    from peft import LoraConfig, get_peft_model

    lora_config = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=0.0,
                             target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    with torch.random.fork_rng():
        torch.manual_seed(seed)  # lora_A's initialisation draws from the global RNG too
        peft_model = get_peft_model(model, lora_config)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, b_scale)
    return peft_model.eval()


TOY_TOKENS = ["<|im_end|>", "a", "b", "x"]


def build_toy_enumerable_dir(path: str | Path, *, seed: int = 0, initializer_range: float = 0.8) -> Path:
    """A 4-token LM ("<|im_end|>" = EOS = pad, "a", "b", "x") small enough to enumerate every response.

    With the prompt "x" and max_new_tokens = 3 there are 1 + 3 + 9 + 27 = 40 possible responses, so
    exact entropies and their derivatives can be computed by brute force for reference tests.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    core = Tokenizer(models.WordLevel({t: i for i, t in enumerate(TOY_TOKENS)}, unk_token="x"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                        unk_token="x", padding_side="left")
    model = build_tiny_model(len(TOY_TOKENS), tokenizer.eos_token_id, seed=seed, hidden_size=16, num_layers=1,
                             initializer_range=initializer_range)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path

"""A real, tiny `trl.GRPOTrainer` run on CPU that leaves HF Trainer checkpoints (`checkpoint-N/`).

Tests use it to check that what the probe reads is what TRL really writes: the PEFT adapter files, the
`optimizer.pt` of the HF Trainer's AdamW (param groups, ids, saved lr), `scheduler.pt` and
`trainer_state.json`. The policy is the tiny random Qwen2 of `tiny_model.py` under a LoRA r = 4; the
prompts and the reward function are built here, so the run needs no hub and no network.

`trl` is an optional (test-only) dependency: `pip install 'entropy_experiments[trl]'`. It is imported
inside `run_tiny_grpo`, so importing this module never needs it.

What a run with the defaults writes (trl 1.16.0, transformers 5.23.0, torch 2.13.0, CPU), per
`checkpoint-N/`: adapter_config.json, adapter_model.safetensors, README.md, chat_template.jinja,
tokenizer.json, tokenizer_config.json, optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json,
training_args.bin. See `tests/test_trl_run.py` for the optimizer state's layout.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Prompts with varied lengths; the rewards below then vary within every group of completions.
PROMPTS = [
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "What is 2 + 2?",
    "Show your work in <think> </think> tags.",
    "The user asks a question, and the Assistant solves it.",
    "0 1 2 3 4 5 6 7 8 9",
    "Let me solve this step by step.",
    "A conversation between User and Assistant.",
    "And return the final answer in <answer> </answer> tags.",
]

REWARD_CHARS = "aeiou"


def count_vowels_reward(prompts, completions, **kwargs) -> list[float]:
    """A TRL-style reward function: the number of lower-case vowels in each completion (as floats)."""
    return [float(sum(text.count(c) for c in REWARD_CHARS)) for text in completions]


def tiny_prompt_dataset(n_prompts: int = 8):
    """A `datasets.Dataset` with one "prompt" column of plain-text prompts (cycled from PROMPTS)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": [PROMPTS[i % len(PROMPTS)] for i in range(n_prompts)]})


LORA_QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


def math_density_reward(prompts, completions, **kwargs) -> list[float]:
    """TRL's calling convention around the probe's registered `math_density` reward (the same numbers)."""
    from entropy_experiments.data.rewards.basic import math_density

    return math_density("", list(completions), None)


def cpu_grpo_trainer(model_dir: str | Path, out_dir: str | Path, *, reward_funcs, train_dataset, steps: int,
                     learning_rate: float, num_generations: int, prompts_per_step: int, max_completion_length: int,
                     seed: int = 0, lora_r: int = 8, lora_alpha: int = 16,
                     lora_targets: tuple[str, ...] | str = LORA_QKVO, lr_scheduler_type: str = "constant",
                     **config_overrides):
    """A `trl.GRPOTrainer` on CPU, built but not trained: the model in `model_dir` (fp32, eager attention, left
    padding) under a LoRA (dropout 0), G·B completions per step, a checkpoint after every step, no bf16, no
    warm-up. `config_overrides` are further GRPOConfig fields (save_strategy="no", temperature=1.0, …)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    targets = lora_targets if isinstance(lora_targets, str) else list(lora_targets)
    lora = LoraConfig(r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.0, target_modules=targets,
                      task_type="CAUSAL_LM")
    args = GRPOConfig(**{
        "output_dir": str(out_dir), "use_cpu": True, "report_to": "none", "max_steps": steps,
        "save_strategy": "steps", "save_steps": 1, "logging_steps": 1, "disable_tqdm": True,
        "per_device_train_batch_size": num_generations * prompts_per_step, "num_generations": num_generations,
        "max_completion_length": max_completion_length, "learning_rate": learning_rate,
        "lr_scheduler_type": lr_scheduler_type, "warmup_steps": 0, "bf16": False, "fp16": False, "seed": seed,
        "dataloader_num_workers": 0, "log_completions": False, **config_overrides})
    return GRPOTrainer(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                       processing_class=tokenizer, peft_config=lora)


def run_tiny_grpo(out_dir: str | Path, **kwargs) -> Path:
    """`train_tiny_grpo`'s last checkpoint (the arguments are its own)."""
    return train_tiny_grpo(out_dir, **kwargs)[1]


def train_tiny_grpo(out_dir: str | Path, *, steps: int = 2, **options):
    """Train the tiny Qwen2 + LoRA with `trl.GRPOTrainer` for `steps` optimizer steps → (the trainer, its last
    checkpoint: `out_dir/checkpoint-{steps}`, with adapter, optimizer.pt, scheduler.pt, trainer_state.json, ...).
    The options are `tiny_grpo_trainer`'s."""
    trainer = tiny_grpo_trainer(out_dir, steps=steps, **options)
    trainer.train()
    checkpoint = Path(out_dir) / f"checkpoint-{steps}"
    if not checkpoint.is_dir():
        raise RuntimeError(f"GRPOTrainer finished but wrote no {checkpoint}")
    return trainer, checkpoint


def tiny_grpo_trainer(out_dir: str | Path, *, steps: int = 2, model_dir: str | Path | None = None,
                      loss_type: str | None = None, num_generations: int = 2, prompts_per_step: int = 2,
                      gradient_accumulation_steps: int = 1, learning_rate: float = 1e-3,
                      lora_targets: tuple[str, ...] | str = ("q_proj", "v_proj"), seed: int = 0,
                      train_dataset=None, reward_funcs=None, **config_overrides):
    """The tiny Qwen2 + LoRA under a `trl.GRPOTrainer`, built but not trained (callbacks can be added first).

    Args:
        out_dir: the Trainer's output_dir; it receives `checkpoint-1/` … `checkpoint-{steps}/`.
        model_dir: a directory from `build_tiny_model_dir` (built under `out_dir/tiny_base` when None).
        loss_type: GRPOConfig.loss_type (None: TRL's default, "dapo" in trl 1.16.0).
        num_generations, prompts_per_step: G and B; each micro-batch holds G·B completions.
        gradient_accumulation_steps: micro-batches per optimizer step (= steps_per_generation by default).
        lora_targets: LoRA target modules (r = 4, alpha = 8, dropout 0); "all-linear" for every Linear.
        train_dataset, reward_funcs: the data set and reward function(s) (default: `tiny_prompt_dataset`, plain
            prompts, and `count_vowels_reward`).
        config_overrides: further GRPOConfig fields (e.g. beta=0.04, scale_rewards="none", reward_weights=[...]).
    """
    from entropy_experiments.testing.tiny_model import build_tiny_model_dir

    out_dir = Path(out_dir)
    if model_dir is None:
        model_dir = build_tiny_model_dir(out_dir / "tiny_base", seed=seed)
    if loss_type is not None:
        config_overrides["loss_type"] = loss_type
    n_prompts = max(8, steps * prompts_per_step * gradient_accumulation_steps)
    return cpu_grpo_trainer(
        model_dir, out_dir, reward_funcs=reward_funcs or count_vowels_reward,
        train_dataset=train_dataset if train_dataset is not None else tiny_prompt_dataset(n_prompts),
        steps=steps, learning_rate=learning_rate, num_generations=num_generations,
        prompts_per_step=prompts_per_step, max_completion_length=config_overrides.pop("max_completion_length", 8),
        seed=seed, lora_r=4, lora_alpha=8, lora_targets=lora_targets,
        lr_scheduler_type=config_overrides.pop("lr_scheduler_type", "linear"),
        gradient_accumulation_steps=gradient_accumulation_steps, **config_overrides)

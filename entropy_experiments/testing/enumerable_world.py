"""A GRPO world small enough to enumerate: exact entropy and exact expected reward after every step.

The policy is the 4-token toy LM (`tiny_model.build_toy_enumerable_dir`: EOS, "a", "b", "x"; responses of at
most 3 tokens, 40 per prompt) under a LoRA r = 8 on every linear layer, trained by a real `trl.GRPOTrainer`
on CPU with 8 prompts × 8 completions per step. The reward is 1 when the completion contains the word "a":
many policies are optimal, high-entropy ones among them, yet at lr 2e-2 the uncontrolled entropy collapses
(seed 2: from 1.07 to 0.2–0.5 nats/token in 12 steps, while the reward climbs by 0.2–0.55).

`ExactMeter` records, before training and after every optimizer step, the exact per-token entropy
H = Σ_p Σ_y q(y|p)·h(p, y) / Σ_p Σ_y q(y|p)·|y| and the exact expected reward R = mean_p Σ_y q(y|p)·[a ∈ y]
over the uniform prompt pool, every response enumerated, in float64 — no probe code involved.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import torch
from transformers import TrainerCallback

PROMPTS = ["x", "a", "b", "x a", "a b", "b x", "x x", "a a"]
MAX_NEW = 3
WORLD_SEED, INIT_RANGE = 2, 0.4
LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def contains_a(prompts, completions, **kwargs) -> list[float]:
    """TRL's reward convention: 1.0 where the completion contains the word "a"."""
    return [float("a" in c.split()) for c in completions]


def responses(n_tokens: int, eos: int) -> list[list[int]]:
    """Every response: EOS after 0…MAX_NEW−1 other tokens, or MAX_NEW other tokens (truncated)."""
    others = [t for t in range(n_tokens) if t != eos]
    out = [list(p) + [eos] for n in range(MAX_NEW) for p in itertools.product(others, repeat=n)]
    return out + [list(p) for p in itertools.product(others, repeat=MAX_NEW)]


def exact_sums(model, tokenizer) -> tuple:
    """(Σ q·h, Σ q·|y|, Σ_p Σ q·[a ∈ y]) over PROMPTS and every response, float64 tensors carrying the model's
    graph: H = first / second, R = third / len(PROMPTS), and ∇H by autograd through them."""
    eos, a = tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("a")
    every = responses(len(tokenizer), eos)
    num = den = reward = torch.zeros((), dtype=torch.float64)
    for prompt in PROMPTS:
        p_ids = tokenizer(prompt).input_ids
        ids = torch.tensor([p_ids + r + [eos] * (MAX_NEW - len(r)) for r in every])
        logq = torch.log_softmax(model(input_ids=ids).logits.double(), -1)
        for i, r in enumerate(every):
            steps = logq[i, len(p_ids) - 1: len(p_ids) - 1 + len(r)]
            q = torch.exp(steps.gather(-1, torch.tensor(r)[:, None]).sum())
            num = num + q * -(steps.exp() * steps).sum()
            den = den + q * len(r)
            reward = reward + q * (a in r)
    return num, den, reward


@torch.no_grad()
def exact_entropy_and_reward(model, tokenizer) -> tuple[float, float]:
    """(H per token, R) of `model` over PROMPTS by enumeration, float64."""
    num, den, reward = exact_sums(copy.deepcopy(model).double().eval(), tokenizer)
    return float(num / den), float(reward) / len(PROMPTS)


class ExactMeter(TrainerCallback):
    """The exact H and R before training and after every optimizer step."""

    def __init__(self, trainer):
        self.trainer, self.H, self.R = trainer, [], []

    def measure(self):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        H, R = exact_entropy_and_reward(model, self.trainer.processing_class)
        self.H.append(H)
        self.R.append(R)

    def on_train_begin(self, args, state, control, **kwargs):
        self.measure()

    def on_step_end(self, args, state, control, **kwargs):
        self.measure()


def world_model(folder: str | Path, seed: int = WORLD_SEED) -> Path:
    """The world's toy model (initialiser range 0.4; seed 2 unless another world is asked for), written to
    `folder`."""
    from entropy_experiments.testing.tiny_model import build_toy_enumerable_dir

    return build_toy_enumerable_dir(folder, seed=seed, initializer_range=INIT_RANGE)


def world_trainer(model_dir: Path, out: Path, *, steps: int = 12, lr: float = 2e-2, seed: int = 0, **overrides):
    """The world's GRPOTrainer (8 prompts × 8 completions per step, constant lr, no checkpoints) and its meter.
    `overrides`: further GRPOConfig fields (TRL's adaptive entropy settings, …)."""
    from datasets import Dataset

    from entropy_experiments.testing.trl_run import cpu_grpo_trainer

    trainer = cpu_grpo_trainer(model_dir, out, reward_funcs=contains_a,
                               train_dataset=Dataset.from_dict({"prompt": PROMPTS * 16}), steps=steps,
                               learning_rate=lr, num_generations=8, prompts_per_step=8, max_completion_length=MAX_NEW,
                               seed=seed, lora_r=8, lora_alpha=16, lora_targets=LORA_ALL, save_strategy="no",
                               gradient_checkpointing=False, **overrides)
    meter = ExactMeter(trainer)
    trainer.add_callback(meter)
    return trainer, meter

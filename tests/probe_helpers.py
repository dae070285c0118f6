"""Build OfflineEntropyProbe instances on the tiny models without checkpoint files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.offline_entropy_probe import OfflineEntropyProbe
from entropy_experiments.testing.tiny_model import add_random_lora

SHORT_PROMPTS = ["User: Tom has 3 apples", "Hi", "What is 2 + 2?", "User: 18 - 5 =", "Show your work",
                 "Let me solve this", "User: 36 / 4", "Response: <think>"]


def write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"question": p, "answer": "1"}) + "\n" for p in prompts))
    return path


def trained_adamw(params, *, lr=1e-3, weight_decay=0.01, steps=3, seed=0, **kwargs) -> torch.optim.AdamW:
    """An AdamW whose state (moments, step count) comes from a few real steps on random gradients."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, **kwargs)
    gen = torch.Generator().manual_seed(seed)
    saved = [p.detach().clone() for p in params]
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 0.01
        opt.step()
    with torch.no_grad():  # keep the parameters, only the optimizer state should be "trained"
        for p, s in zip(params, saved):
            p.copy_(s)
            p.grad = None
    return opt


def merge_sections(config: dict, sections: dict) -> dict:
    """`sections` merged onto `config` in place: a dict updates that section's keys, anything else replaces it."""
    for section, values in sections.items():
        if isinstance(values, dict):
            config.setdefault(section, {}).update(values)
        else:
            config[section] = values
    return config


def make_probe(model_dir: Path, data_path: Path, config: dict, *, lora_seed: int = 0) -> OfflineEntropyProbe:
    """A probe over the model in `model_dir` + a random LoRA, with a trained AdamW, and `config` merged
    onto small defaults (jsonl data at `data_path`, reward tests.probe_rewards:count_a)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = {
        "checkpoint": {"base_model": str(model_dir), "device_map": "cpu"},
        "batch_config": {"dataset_name": "jsonl", "dataset_path": str(data_path), "B_E": 8, "B_U": 4, "G": 2},
        "generation": {"max_new_tokens": 6, "gen_batch_size": 64, "tf_batch_size": 64},
        "reward": {"name": "tests.probe_rewards:count_a"},
        "estimator": {"microbatch_size": 64},
        "importance": {"eta_list": [1e-3]},
        "output": {"plot": False},
    }
    merge_sections(base, config)
    probe = OfflineEntropyProbe(config_from_dict(base))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    model = add_random_lora(model, seed=lora_seed)
    probe.model, probe.tokenizer = model, tokenizer
    probe.optimizer = trained_adamw([p for p in model.parameters() if p.requires_grad])
    return probe

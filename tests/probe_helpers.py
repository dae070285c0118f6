"""Probe set-ups on the tiny models without checkpoint files, for the core API (`entropy_experiments.probe.recipe`).

`make_probe` gives a `ProbeSetup`: a validated config and the `Policy` (policy engine, trainable LoRA parameters,
a trained AdamW) that the recipe's phase functions take — `recipe.run(setup.config, policy=setup.policy)`,
`recipe.update_gradients(setup.config, setup.policy, U, groups)`, ...
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from entropy_experiments.config import ProbeConfig, config_from_dict
from entropy_experiments.estimators.objective_gradient import Trainable
from entropy_experiments.policy.engine import PolicyEngine
from entropy_experiments.probe import recipe
from entropy_experiments.probe.parallel import SINGLE
from entropy_experiments.probe.results import Policy, WarningLog
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


@dataclass
class ProbeSetup:
    """A config and the policy the recipe's phases run on (`policy.engine` scores and generates)."""

    config: ProbeConfig
    policy: Policy

    @property
    def model(self):
        return self.policy.trainable.model

    @property
    def tokenizer(self):
        return self.policy.tokenizer

    @property
    def engine(self) -> PolicyEngine:
        return self.policy.engine

    @property
    def optimizer(self):
        return self.policy.optimizer

    def with_config(self, config: ProbeConfig) -> ProbeSetup:
        """The same model and optimizer under another config (a new engine for its generation settings)."""
        return ProbeSetup(config, engine_policy(config, self.model, self.tokenizer, self.optimizer))

    def run(self, **kwargs) -> recipe.ProbeOutcome:
        """`recipe.run` on this config and policy (kwargs: batches, on_batches, ...)."""
        return recipe.run(self.config, policy=self.policy, **kwargs)

    def sample(self, *, B_E: int, B_U: int, G: int) -> tuple[dict, dict, object]:
        """(E, U, index plan) by `recipe.sample_phase` with these batch sizes."""
        bc = self.config.batch_config.model_copy(update={"B_E": B_E, "B_U": B_U, "G": G})
        samples = recipe.sample_phase(self.config.model_copy(update={"batch_config": bc}), self.engine)
        return samples.E, samples.U, samples.plan


def load_probe(config: ProbeConfig) -> tuple[ProbeSetup, list[str]]:
    """(set-up, warnings) from the checkpoint the config names, loaded by `recipe.load_phase` in one process."""
    notes = WarningLog(recipe.log)
    return ProbeSetup(config, recipe.load_phase(config, SINGLE, notes)), notes.messages


def engine_policy(config: ProbeConfig, model, tokenizer, optimizer) -> Policy:
    """The `Policy` recipe.load_phase would build around an already loaded model (no checkpoint info)."""
    return Policy(PolicyEngine(model, tokenizer, config.policy_settings()), Trainable.of(model), optimizer, tokenizer)


def make_probe(model_dir: Path, data_path: Path, config: dict, *, lora_seed: int = 0) -> ProbeSetup:
    """The model in `model_dir` + a random LoRA, with a trained AdamW, and `config` merged onto small
    defaults (jsonl data at `data_path`, reward tests.probe_rewards:count_a)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = {
        "checkpoint": {"base_model": str(model_dir), "device_map": "cpu"},
        "batch_config": {"dataset_name": "jsonl", "dataset_path": str(data_path), "B_E": 8, "B_U": 4, "G": 2},
        "generation": {"max_new_tokens": 6, "gen_batch_size": 64, "tf_batch_size": 64},
        "reward": {"name": "tests.probe_rewards:count_a"},
        "estimator": {"microbatch_size": 64},
        "importance": {"eta_list": [1e-3], "symmetric": True},
        "predictors": {"enabled": True},
        "output": {"plot": False},
    }
    merge_sections(base, config)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    model = add_random_lora(model, seed=lora_seed)
    optimizer = trained_adamw([p for p in model.parameters() if p.requires_grad])
    config = config_from_dict(base)
    return ProbeSetup(config, engine_policy(config, model, tokenizer, optimizer))

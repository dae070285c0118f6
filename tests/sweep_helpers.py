"""A real run to sweep on the enumerable toy model, and its exact entropies by enumeration.

`train_run` trains a LoRA on the 4-token toy model (testing/tiny_model.py) with real AdamW steps
(`make_checkpoint(save_every=1)`: step_1/ … step_S/), optionally ending like a linear schedule (the last
checkpoint's saved lr set to 0.0). `exact_entropy` computes H(θ) of a checkpoint by summing over every
response of every prompt (the toy model has 40 responses per prompt at max_new_tokens = 3), in float64,
with a code path of its own (one padded forward per prompt, no probe code).
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.make_checkpoint.trained import make_checkpoint
from tests.probe_helpers import merge_sections, write_prompts

TOY_PROMPTS = ["x", "a", "b", "x a", "a b", "b x", "x x", "a a"]
MAX_NEW = 3


def sweep_config(toy_dir: Path, data: Path, **sections) -> dict:
    """The probe config of the sweep tests: toy model, E = B_E prompts with replacement, U = 8 × 4, one η."""
    config = {
        "seed": 11,
        "checkpoint": {"base_model": str(toy_dir), "device_map": "cpu"},
        "batch_config": {"dataset_name": "jsonl", "dataset_path": str(data), "B_E": 400, "B_U": 8, "G": 4},
        "generation": {"max_new_tokens": MAX_NEW, "gen_batch_size": 1024, "tf_batch_size": 1024},
        "reward": {"name": "tests.probe_rewards:count_a"},
        "estimator": {"microbatch_size": 1024},
        "objective": {"max_grad_norm": 1.0},  # make_checkpoint clips at 1.0
        "importance": {"eta_list": [1.0e-2], "symmetric": False},
        "variance": {"u_groups": 4},
        "second_order": {"enabled": False},
        "predictors": {"enabled": True},  # the displacement predictor, the decomposition and the proxies
        "output": {"plot": False},
    }
    merge_sections(config, sections)
    return config


def train_run(folder: Path, toy_dir: Path, *, steps: int = 3, lr: float = 2e-2, end_with_lr_zero: bool = False,
              **sections) -> tuple[Path, dict]:
    """(directory holding step_1/ … step_<steps>/, the probe config dict): real AdamW steps on the toy model."""
    folder.mkdir(parents=True, exist_ok=True)
    data = write_prompts(folder / "toy_prompts.jsonl", TOY_PROMPTS)
    config = sweep_config(toy_dir, data, **sections)
    run = folder / "run"
    make_checkpoint(run, config_from_dict(config), steps=steps, lr=lr, save_every=1)
    if end_with_lr_zero:  # what a Trainer saves after the last step of a linear schedule
        path = run / f"step_{steps}" / "optimizer.pt"
        state = torch.load(path, weights_only=True)
        for group in state["param_groups"]:
            group["lr"] = 0.0
        torch.save(state, path)
    return run, config


def _responses(n_tokens: int, eos: int) -> list[list[int]]:
    """Every response: EOS after 0…MAX_NEW−1 other tokens, or MAX_NEW other tokens (truncated)."""
    others = [t for t in range(n_tokens) if t != eos]
    out = [list(p) + [eos] for n in range(MAX_NEW) for p in itertools.product(others, repeat=n)]
    return out + [list(p) for p in itertools.product(others, repeat=MAX_NEW)]


@torch.no_grad()
def exact_entropy(model, tokenizer, normalize: str = "per_token") -> float:
    """H(θ) = Σ_p Σ_t q(t|p) h(p, t) / Σ_p Σ_t q(t|p) d(t) over the uniform prompt pool TOY_PROMPTS, every
    response t enumerated (d = T per token, 1 per sequence); float64, one right-padded forward per prompt."""
    model64 = copy.deepcopy(model).double().eval()
    eos = tokenizer.eos_token_id
    responses = _responses(len(tokenizer), eos)
    num = den = 0.0
    for prompt in TOY_PROMPTS:
        p_ids = tokenizer(prompt).input_ids
        ids = torch.tensor([p_ids + r + [eos] * (MAX_NEW - len(r)) for r in responses])
        logq_all = torch.log_softmax(model64(input_ids=ids).logits.double(), -1)
        mass = 0.0
        for i, r in enumerate(responses):
            steps = logq_all[i, len(p_ids) - 1: len(p_ids) - 1 + len(r)]
            q = float(torch.exp(steps.gather(-1, torch.tensor(r)[:, None]).sum()))
            h = float(-(steps.exp() * steps).sum())
            num += q * h
            den += q * (len(r) if normalize == "per_token" else 1.0)
            mass += q
        assert abs(mass - 1.0) < 1e-9, "the enumeration must cover every response"
    return num / den


def load_checkpoint_model(toy_dir: Path, checkpoint: Path):
    """(PeftModel, tokenizer) of one checkpoint, loaded fresh (base + adapter) through the probe's loaders."""
    from entropy_experiments.checkpoint.adapter import load_peft_for_probe
    from entropy_experiments.checkpoint.base_model import load_tokenizer

    return (load_peft_for_probe(str(toy_dir), checkpoint / "model", device_map="cpu"),
            load_tokenizer(str(toy_dir)))

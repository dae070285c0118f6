"""Your run, as it was trained: TRL GRPO on a conversational data set, then the probe on checkpoint-1 with the
same data set, chat template and reward functions.

    .venv/bin/python examples/trl_conversational.py [--out runs/trl_conversational_example] [--steps 2]

Needs the `trl` extra and nothing from the network. The policy is the embedded SmolLM2-135M-Instruct (its
tokenizer has a chat template) under a LoRA r = 8 on q/k/v/o. The data set is
`entropy_experiments.testing.conversational` (system + user messages, columns `answer` and `level`), saved with
`save_to_disk` into OUT/data; the reward functions are that module's two conversational functions (completions
arrive as [{"role": "assistant", "content": ...}]) with weights 1.0 and 0.5. TRL writes OUT/run/checkpoint-1/ …;
the probe then runs on checkpoint-1 (constant lr, so its saved lr is the next step's) with

    entropy-probe run --config OUT/probe.yaml --out OUT/probe

— `dataset_name: hf` on OUT/data, the same reward functions and weights, `objective.trainer: trl` (TRL's loss,
and its sampling: temperature 1, top_p 1, no stop string), U = the trainer's step (B_U prompts × G =
per_device_train_batch_size), ΔH measured at η = lr. It prints δH₁ ± SE, ΔH, and one U prompt's token ids as TRL
renders them beside the ids the probe generated from.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS_PER_STEP, G, MAX_NEW, B_E, SEED, LR = 2, 4, 24, 16, 11, 1e-4


def train(out: Path, data: Path, model_dir: Path, *, steps: int):
    """GRPO with TRL on the conversational data set; returns the trainer (its checkpoints are in `out`)."""
    from datasets import load_from_disk

    from entropy_experiments.testing.conversational import REWARD_FUNCTIONS, REWARD_WEIGHTS
    from entropy_experiments.testing.trl_run import cpu_grpo_trainer

    trainer = cpu_grpo_trainer(model_dir, out, reward_funcs=REWARD_FUNCTIONS, train_dataset=load_from_disk(str(data)),
                               steps=steps, learning_rate=LR, num_generations=G, prompts_per_step=PROMPTS_PER_STEP,
                               max_completion_length=MAX_NEW, seed=SEED, reward_weights=REWARD_WEIGHTS,
                               gradient_checkpointing=False)
    trainer.train()
    return trainer


def probe_config(data: Path, checkpoint: Path) -> dict:
    """The probe's config: the trainer's data set, rewards, loss, sampling and step size."""
    from entropy_experiments.testing.conversational import REWARD_SPECS, REWARD_WEIGHTS

    return {
        "seed": SEED,
        "checkpoint": {"checkpoint_path": str(checkpoint), "device_map": "cpu"},
        "batch_config": {"dataset_name": "hf", "dataset_path": str(data), "B_E": B_E, "B_U": PROMPTS_PER_STEP,
                         "G": G},
        "generation": {"max_new_tokens": MAX_NEW, "gen_batch_size": 16, "tf_batch_size": 16},
        "reward": {"functions": REWARD_SPECS, "weights": REWARD_WEIGHTS},
        "objective": {"trainer": "trl", "max_completion_length": MAX_NEW,
                      "trainer_batch_completions": PROMPTS_PER_STEP * G},
        "estimator": {"microbatch_size": 8},
        "importance": {"eta_list": [LR], "symmetric": False},
        "second_order": {"enabled": False},
        "output": {"plot": False},
    }


def side_by_side(trainer, run_dir: Path) -> None:
    """The first U prompt's token ids as TRL renders them and as the probe generated from them."""
    import torch
    from datasets import load_from_disk

    U = torch.load(run_dir / "U_batch.pt", weights_only=True)
    row = load_from_disk(str(run_dir.parent / "data"))[U["prompt_ids"][0]]
    trl_ids = list(trainer._tokenize_prompts([row["prompt"]])[0][0])
    mask = U["attention_masks"][0, 0, :U["prompt_lens"][0]].bool()
    probe_ids = U["sequences"][0, 0, :U["prompt_lens"][0]][mask].tolist()
    print(f"\nprompt id {U['prompt_ids'][0]}: {row['prompt'][-1]['content']!r}")
    print(f"TRL   ({len(trl_ids)} tokens): {trl_ids}")
    print(f"probe ({len(probe_ids)} tokens): {probe_ids}")
    print(f"identical: {trl_ids == probe_ids}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/trl_conversational_example")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    from entropy_experiments.cli import _setup_logging
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.models.embedded import ensure_embedded_model
    from entropy_experiments.probe.runner import run_probe
    from entropy_experiments.testing.conversational import conversational_dataset

    _setup_logging()
    for noisy in ("transformers", "trl", "accelerate", "datasets"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"error: {out} is not empty; choose another --out")
    t0 = time.perf_counter()
    conversational_dataset(16).save_to_disk(str(out / "data"))
    trainer = train(out / "run", out / "data", ensure_embedded_model(), steps=args.steps)
    t_train = time.perf_counter() - t0
    config = probe_config(out / "data", out / "run" / "checkpoint-1")
    (out / "probe.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    results = run_probe(config_from_dict(config), out=str(out / "probe"))
    true = results["true"][0]
    print(f"\nδH₁ = {results['deltaH1']:+.4e} ± {results['se']['total']:.2e} (SE)   "
          f"ΔH(η = lr = {true['eta']:g}) = {true['deltaH_true']:+.4e} ± {true['se']:.2e}   "
          f"Ĥ = {results['H_orig']['per_token']:.4f} nats/token")
    print(f"tokenizer: {json.dumps(results['checkpoint']['tokenizer'])}")
    side_by_side(trainer, out / "probe")
    print(f"\ntraining {t_train:.0f} s, probe {time.perf_counter() - t0 - t_train:.0f} s; run directory: {out / 'probe'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

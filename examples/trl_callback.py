"""Worked example of `EntropyProbeCallback`: TRL GRPO on the embedded model with the probe inside the loop.

    .venv/bin/python examples/trl_callback.py [--out runs/trl_callback_example] [--steps 20] [--every 5]
                                              [--lr 1e-4]

Needs the `trl` extra and nothing from the network: the embedded SmolLM2-135M-Instruct under a LoRA r = 8 on
q/k/v/o, the offline GSM-symbolic R1 prompts, the `math_density` reward (as in examples/trl_sweep.py). Every
`--every` steps the callback predicts the step's entropy change (δH₁ ± SE, from its own E and U) and, after the
step, measures it on the same E (realised), along with δH_Δθ (first order along the step TRL really took). The
rows are logged as their own `entropy_probe/...` entries at the same step as TRL's (whose loss, grad_norm and
metrics stay as without the callback: docs/callback.md) and written to OUT/entropy_probe.jsonl;
OUT/entropy_probe.png draws them against the step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS_PER_STEP, G, MAX_NEW, SEED = 2, 4, 16, 7
PROBE = {"B_E": 16, "B_U": 2, "G": 4, "microbatch_size": 4}


def trainer_for(out: Path, model_dir: Path, *, steps: int, lr: float):
    """A GRPOTrainer on the embedded model (no checkpoints: the callback needs none)."""
    from datasets import Dataset

    from entropy_experiments.data.datasets import load_examples
    from entropy_experiments.testing.trl_run import cpu_grpo_trainer, math_density_reward

    questions = [ex.question for ex in load_examples("gsm_symbolic_r1_template", "train", pool_size=500)]
    return cpu_grpo_trainer(model_dir, out, reward_funcs=math_density_reward,
                            train_dataset=Dataset.from_dict({"prompt": questions}), steps=steps, learning_rate=lr,
                            num_generations=G, prompts_per_step=PROMPTS_PER_STEP, max_completion_length=MAX_NEW,
                            seed=SEED, save_strategy="no", temperature=1.0, top_p=1.0, top_k=0,
                            gradient_checkpointing=False)


def plot(rows: list[dict], path: Path) -> None:
    """Predicted (δH₁), first order along the real step (δH_Δθ) and realised change per probed step, ± 1.96 SE."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if "error" not in r]
    fig, ax = plt.subplots(figsize=(7, 4))
    for offset, (key, se, label) in enumerate([("delta_h1", "se", "predicted δH₁ (own U)"),
                                               ("displacement", "displacement_se", "δH_Δθ (the real step)"),
                                               ("realised", "realised_se", "realised ΔH (same E)")]):
        x = [r["step"] + 0.15 * (offset - 1) for r in rows]
        ax.errorbar(x, [r[key] for r in rows], yerr=[1.96 * (r[se] or 0) for r in rows], fmt="o", capsize=3,
                    label=label)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_xlabel("training step")
    ax.set_ylabel("entropy change (nats / token)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/trl_callback_example")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)
    from entropy_experiments.integrations.trl_callback import LOG_FILE, EntropyProbeCallback
    from entropy_experiments.models.embedded import ensure_embedded_model

    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"error: {out} is not empty; choose another --out")
    t0 = time.perf_counter()
    trainer = trainer_for(out, ensure_embedded_model(), steps=args.steps, lr=args.lr)
    trainer.add_callback(EntropyProbeCallback(trainer, every=args.every, seed=SEED, **PROBE))
    trainer.train()
    rows = [json.loads(line) for line in (out / LOG_FILE).read_text().splitlines()]
    plot(rows, out / "entropy_probe.png")
    print(f"{args.steps} steps in {time.perf_counter() - t0:.0f} s; rows: {out / LOG_FILE}; plot: "
          f"{out / 'entropy_probe.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

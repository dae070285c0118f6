"""Entropy control in a miniature TRL GRPO run: no control, TRL's adaptive entropy bonus, and `EntropyAutopilot`.

    OMP_NUM_THREADS=1 .venv/bin/python examples/entropy_autopilot.py [--steps 30] [--lr 5e-2] [--target 3.2]
        [--tuned-delta 0.05] [--floor 0.01] [--push 10] [--B-E 64] [--seeds 0,1,2] [--arms none,trl_default,...]
        [--plot docs/entropy_autopilot.png]

The policy is the tests' tiny random Qwen2 (vocabulary 384) under a LoRA r = 4 on q/v, trained by a real
`trl.GRPOTrainer` on CPU (plain-text prompts, the vowel-count reward, G = 4 completions of 2 prompts per step)
with completions of ONE token (at lr 5e-2 the uncontrolled entropy wanders and falls within 30 steps). Every
response is enumerable, so the yardstick is exact: the next-token entropy averaged over the run's 8 prompts (the
same fixed set at every step, float64; not held out, the run trains on them), beside TRL's own logged
`entropy` (from the step's sampled completions). The arms share the seed and the model:

    none          no control
    trl δ=…       GRPOConfig(use_adaptive_entropy=True, entropy_target=target, entropy_coef_delta=δ) at TRL's
                  default δ and at a larger one (the bonus coefficient moves ±δ per step toward the target)
    autopilot     EntropyAutopilot(trainer, target=target, every=1): each step's lr scaled so its predicted
                  entropy change aims at the target (defaults: m in [0.1, 2], max_drop 0.05 per step)
    autopilot min_m=…  the same with a lower floor for m (--floor, default 0.01)
    … max_push=…  the same with the entropy push on (--push, default 10): where the entropy must rise, an
                  entropy-gradient term is added to the gradient

Prints per arm the rms and max |H − target| over the steps, the mean reward of the first and last five steps,
the wall time, and (autopilot) the range of the lr multiplier; draws the curves to --plot.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TRL_DEFAULT_DELTA = 0.005


def exact_entropy(trainer, prompts: list[str]) -> float:
    """The policy's next-token entropy (nats) averaged over `prompts`: exact, as completions are one token."""
    import torch

    tokenizer, model = trainer.processing_class, trainer.model
    values = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            logp = torch.log_softmax(model(input_ids=ids).logits[0, -1].double(), -1)
            values.append(float(-(logp.exp() * logp).sum()))
    return sum(values) / len(values)


def yardstick(prompts: list[str]):
    """A TrainerCallback that records the exact entropy before training and after every step."""
    from transformers import TrainerCallback

    class ExactEntropy(TrainerCallback):
        def __init__(self):
            self.trainer, self.H = None, []

        def on_train_begin(self, args, state, control, **kwargs):
            self.H.append(exact_entropy(self.trainer, prompts))

        def on_step_end(self, args, state, control, **kwargs):
            self.H.append(exact_entropy(self.trainer, prompts))

    return ExactEntropy()


def build_trainer(out: Path, model_dir: Path, *, steps: int, lr: float, trl_delta: float | None, target: float,
                  seed: int):
    """The arm's GRPOTrainer: one-token completions, constant lr, no checkpoints."""
    from entropy_experiments.testing.trl_run import tiny_grpo_trainer

    extra = ({} if trl_delta is None else
             {"use_adaptive_entropy": True, "entropy_target": target, "entropy_coef_delta": trl_delta})
    return tiny_grpo_trainer(out, steps=steps, model_dir=model_dir, learning_rate=lr, max_completion_length=1,
                             num_generations=4, prompts_per_step=2, seed=seed, save_strategy="no",
                             lr_scheduler_type="constant", gradient_checkpointing=False, **extra)


def run_arm(name: str, out: Path, model_dir: Path, args, seed: int, *, trl_delta=None, autopilot=None) -> dict:
    """Train one arm; its exact entropy (before and after each step), TRL's logs and the wall time."""
    from entropy_experiments.testing.trl_run import PROMPTS

    trainer = build_trainer(out, model_dir, steps=args.steps, lr=args.lr, trl_delta=trl_delta, target=args.target,
                            seed=seed)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    meter = yardstick(PROMPTS)
    meter.trainer = trainer
    trainer.add_callback(meter)
    pilot = None
    if autopilot is not None:  # the autopilot's options ({} for its defaults)
        from entropy_experiments.integrations.autopilot import EntropyAutopilot

        pilot = EntropyAutopilot(trainer, target=args.target, every=1, B_E=args.B_E, seed=seed, **autopilot)
        trainer.add_callback(pilot)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    logs = [h for h in trainer.state.log_history if "reward" in h]
    multipliers = [r["lr_multiplier"] for r in pilot.rows if "lr_multiplier" in r] if pilot else []
    return {"name": name, "seed": seed, "H": meter.H, "trl_entropy": [h.get("entropy", math.nan) for h in logs],
            "reward": [h["reward"] for h in logs], "wall": wall, "multipliers": multipliers}


def deviations(run: dict, target: float) -> tuple[float, float]:
    """(rms, max) of |H − target| over the exact entropies after each step."""
    gaps = [h - target for h in run["H"][1:]]
    return math.sqrt(sum(g * g for g in gaps) / len(gaps)), max(abs(g) for g in gaps)


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def table(runs: list[dict], target: float) -> str:
    """The per-arm summary as a Markdown table (means over the seeds; rms dev also per seed)."""
    head = ("| arm | exact H end | rms dev (per seed) | max dev | TRL entropy end | reward first 5 → last 5 "
            "| wall s / run | lr multiplier |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for name in dict.fromkeys(run["name"] for run in runs):
        arm = [run for run in runs if run["name"] == name]
        devs = [deviations(run, target) for run in arm]
        mult = [m for run in arm for m in run["multipliers"]]
        lines.append(
            f"| {name} | {_mean(r['H'][-1] for r in arm):.3f} | {_mean(d[0] for d in devs):.3f} "
            f"({', '.join(f'{d[0]:.2f}' for d in devs)}) | {_mean(d[1] for d in devs):.3f} "
            f"| {_mean(_mean(r['trl_entropy'][-5:]) for r in arm):.3f} "
            f"| {_mean(_mean(r['reward'][:5]) for r in arm):.2f} → {_mean(_mean(r['reward'][-5:]) for r in arm):.2f} "
            f"| {_mean(r['wall'] for r in arm):.1f} | {f'{min(mult):.2f}–{max(mult):.2f}' if mult else '—'} |")
    return "\n".join(lines)


def plot(runs: list[dict], target: float, path: Path) -> None:
    """Exact entropy, TRL's logged entropy and the reward against the step, one colour per arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for run in runs:
        axes[0].plot(range(len(run["H"])), run["H"], label=run["name"])
        axes[1].plot(range(1, len(run["trl_entropy"]) + 1), run["trl_entropy"], label=run["name"])
        axes[2].plot(range(1, len(run["reward"]) + 1), run["reward"], label=run["name"])
    for ax, title in zip(axes, ("exact entropy (nats/token)", "TRL's logged entropy", "mean reward")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
    for ax in axes[:2]:
        ax.axhline(target, color="grey", ls="--", lw=1, label="target")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=5e-2)
    parser.add_argument("--target", type=float, default=3.2, help="entropy target, nats/token")
    parser.add_argument("--tuned-delta", type=float, default=0.05)
    parser.add_argument("--B-E", dest="B_E", type=int, default=64, help="the autopilot's E per probed step")
    parser.add_argument("--seeds", default="0,1,2", help="model, data and sampling seeds; arms share each seed")
    parser.add_argument("--floor", type=float, default=0.01, help="autopilot_floor's min_multiplier")
    parser.add_argument("--push", type=float, default=10.0, help="autopilot_push's max_push")
    parser.add_argument("--arms", default="none,trl_default,trl_tuned,autopilot,autopilot_floor,autopilot_push")
    parser.add_argument("--plot", default="docs/entropy_autopilot.png")
    return parser.parse_args(argv)


def run_arms(args, tmp: Path) -> list[dict]:
    """Every arm named in --arms at every seed (each seed: its own tiny model, shared by the arms)."""
    from entropy_experiments.testing.tiny_model import build_tiny_model_dir

    arms = {"none": {}, "trl_default": {"trl_delta": TRL_DEFAULT_DELTA}, "trl_tuned": {"trl_delta": args.tuned_delta},
            "autopilot": {"autopilot": {}}, "autopilot_floor": {"autopilot": {"min_multiplier": args.floor}},
            "autopilot_push": {"autopilot": {"min_multiplier": args.floor, "max_push": args.push}}}
    names = {"trl_default": f"trl δ={TRL_DEFAULT_DELTA:g}", "trl_tuned": f"trl δ={args.tuned_delta:g}",
             "autopilot_floor": f"autopilot min_m={args.floor:g}",
             "autopilot_push": f"autopilot min_m={args.floor:g} max_push={args.push:g}"}
    runs = []
    for seed in (int(s) for s in args.seeds.split(",")):
        model_dir = build_tiny_model_dir(tmp / f"tiny{seed}", seed=seed)
        for key in args.arms.split(","):
            runs.append(run_arm(names.get(key, key), tmp / f"{key}{seed}", model_dir, args, seed, **arms[key]))
            print(f"seed {seed} {key}: H {' '.join(f'{h:.2f}' for h in runs[-1]['H'])}", flush=True)
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs = run_arms(args, Path(tmp))
    print(table(runs, args.target))
    print(f"target {args.target} nats/token, lr {args.lr}, {args.steps} steps, seeds {args.seeds}; "
          f"{time.perf_counter() - t0:.0f} s in all")
    if args.plot:
        first = [run for run in runs if run["seed"] == runs[0]["seed"]]
        plot(first, args.target, Path(args.plot))
        print(f"wrote {args.plot} (seed {runs[0]['seed']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

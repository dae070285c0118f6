"""Does first order explain what a real GRPO run did? A miniature TRL run with statistical power, swept.

    .venv/bin/python examples/miniature_grpo_sweep.py [--out runs/miniature_grpo] [--steps 30] [--lr 1e-2]
                                                      [--B-E 1024]

A real `trl.GRPOTrainer` run at miniature scale, then `entropy-probe sweep` on every checkpoint:

* the policy is the project's tiny random Qwen2 (2 layers, hidden 64, a byte-level BPE tokenizer of 384 tokens
  trained in code: `entropy_experiments.testing.tiny_model`) under a LoRA r = 8 on q/k/v/o — no hub, no network;
* the prompts are 64 arithmetic questions made here (`OUT/prompts.jsonl`, the probe reads the same file);
  the reward is the registered `math_density` (share of digits and operators), which the random policy can
  learn, so the entropy really moves;
* TRL trains with its default loss (dapo, group-scaled advantages), G = 8 completions of ≤ 8 tokens for 8
  prompts per step (64 sequences per optimizer step), a constant lr (1e-2: per-step entropy changes from ≈ 1 to
  ≈ 40 paired SEs), `save_steps = 1`: OUT/run/checkpoint-1 …
  checkpoint-N;
* the sweep probes each checkpoint with E = `--B-E` sequences (default 1024) and U = the trainer's batch
  (8 prompts × 8), and — because every checkpoint's next one is known — the `displacement` predictor
  δH_Δθ = X̂·(θ_{N+1} − θ_N) with its second-order term, the first-order residual per interval and the
  U-noise test (README "Across a run").

At the end it prints the calibration of the realised intervals twice: with the realised change the sweep
reports (`method` importance or independent batches; docs/realised-change.md) and with the paired difference
Ĥ(E_{N'}) − Ĥ(E_N) the sweep used before (sweep.json's `paired_diagnostic` fields), which misses the responses
that would change between checkpoints drawn with common random numbers.

On 2 idle CPU cores the whole script takes about 1.5 minutes (training 6 s, sweep ≈ 3 s a checkpoint; E = 4096
takes about 7 minutes). The same sweep by hand: `entropy-probe sweep --config OUT/probe.yaml --checkpoints OUT/run
--out OUT/sweep`; one interval cut finer: examples/path_refinement.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

PROMPTS_PER_STEP, G, MAX_NEW, SEED, N_PROMPTS, INIT_RANGE = 8, 8, 8, 3, 64, 0.3


def prompts() -> list[str]:
    """64 short arithmetic prompts (the probe's jsonl and TRL's data set hold the same strings)."""
    ops = ["+", "-", "*"]
    return [f"User: {a} {ops[i % 3]} {b} = ? Assistant:" for i, (a, b) in
            enumerate((x, y) for x in range(2, 10) for y in range(1, 9))][:N_PROMPTS]


def build_model_dir(path: Path) -> Path:
    """The tiny Qwen2 with weights drawn at std INIT_RANGE (peaked next-token distributions: responses drawn with
    the same generator seed then stay paired across nearby checkpoints) and its tokenizer, saved to `path`."""
    from entropy_experiments.testing.tiny_model import build_tiny_model, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(len(tokenizer), tokenizer.eos_token_id, seed=SEED, initializer_range=INIT_RANGE)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train(out: Path, model_dir: Path, *, steps: int, lr: float) -> Path:
    """GRPO with TRL on the tiny model, a checkpoint after every step; returns the output_dir."""
    from datasets import Dataset

    from entropy_experiments.testing.trl_run import cpu_grpo_trainer, math_density_reward

    data = Dataset.from_dict({"prompt": prompts() * max(1, steps * PROMPTS_PER_STEP // N_PROMPTS + 1)})
    trainer = cpu_grpo_trainer(model_dir, out, reward_funcs=math_density_reward, train_dataset=data, steps=steps,
                               learning_rate=lr, num_generations=G, prompts_per_step=PROMPTS_PER_STEP,
                               max_completion_length=MAX_NEW, seed=SEED, temperature=1.0, top_p=1.0, top_k=0,
                               gradient_checkpointing=False)
    trainer.train()
    return out


def probe_config(model_dir: Path, data: Path, lr: float, B_E: int) -> dict:
    """The sweep's probe config: the run's prompts, reward, sampling and loss; U = the trainer's batch."""
    return {
        "seed": SEED,
        "checkpoint": {"base_model": str(model_dir), "device_map": "cpu"},
        "batch_config": {"dataset_name": "jsonl", "dataset_path": str(data), "B_E": B_E,
                         "B_U": PROMPTS_PER_STEP, "G": G},
        "generation": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": MAX_NEW, "stop_strings": [],
                       "gen_batch_size": 256, "tf_batch_size": 256},
        "reward": {"name": "math_density"},
        "objective": {"trainer": "trl"},
        "estimator": {"microbatch_size": 256},
        "importance": {"eta_list": [lr], "symmetric": False},
        "second_order": {"enabled": False},
        "predictors": {"enabled": True},  # the displacement predictor and the field's proxies, scored by the sweep
        "output": {"plot": False},
    }


def _realised_comparisons(doc: dict, paired: bool) -> dict[str, tuple[list, list, list, list]]:
    """{name: (predicted, measured, z, SE of measured)} over the realised intervals: the predictors' z against
    the realised change (`paired`: against the paired difference, z = (paired − predicted)/√(se² + se_pred² +
    se_batch²); the displacement's z is the first-order residual's), and the second-order residual's z."""
    out: dict[str, tuple[list, list, list, list]] = {}
    for row in doc["realised"]:
        diag = row.get("paired_diagnostic") or {}
        measured, se = (diag.get("value"), diag.get("se")) if paired else (row["dH_realised"], row["se"])
        for name, pred in row["predictors"].items():
            z = pred["z"]
            if paired and name == "displacement":
                z = ((row["first_order"] or {}).get("paired_diagnostic") or {}).get("z")
            elif paired and None not in (measured, se, pred["dH_predicted"], pred["se"]):
                z = (measured - pred["dH_predicted"]) / math.sqrt(se ** 2 + pred["se"] ** 2 + (pred["se_batch"] or 0) ** 2)
            for i, v in enumerate((pred["dH_predicted"], measured, z, se)):
                out.setdefault(f"{name} vs realised", ([], [], [], []))[i].append(v)
        entry = row.get("with_second_order") or {}  # the first-order residual is the displacement's z
        z = (entry.get("paired_diagnostic") or {}).get("z") if paired else entry.get("z")
        out.setdefault("residual with ½·D²_Δθ H", ([], [], [], []))[2].append(z)
    return out


def print_before_after(doc: dict) -> None:
    """Coverage of |z| < 1.96, rms z, resolved intervals and sign agreement on them, with the paired difference
    (before) and with the sweep's realised change (after)."""
    from entropy_experiments.sweep.calibration import metrics

    print("\n| comparison | realised change | coverage (n) | rms z | resolved | sign (resolved) |\n|---|---|---|---|---|---|")
    for paired, label in ((True, "paired difference (before)"), (False, "importance (after)")):
        for name, (pred, meas, z, se) in _realised_comparisons(doc, paired).items():
            zs = [v for v in z if v is not None and math.isfinite(v)]
            rms = math.sqrt(sum(v * v for v in zs) / len(zs)) if zs else float("nan")
            cov = sum(abs(v) < 1.96 for v in zs) / len(zs) if zs else float("nan")
            if pred:
                m = metrics(pred, meas, z, se)
                agree = m["sign_agreement_resolved"]
                resolved, sign = str(m["n_resolved"]), "—" if agree is None else f"{agree:.2f}"
            else:
                resolved = sign = "—"
            print(f"| {name} | {label} | {cov:.2f} ({len(zs)}) | {rms:.2f} | {resolved} | {sign} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/miniature_grpo")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--B-E", dest="B_E", type=int, default=1024)
    args = parser.parse_args(argv)
    from entropy_experiments.cli import setup_logging
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.sweep import run_sweep

    setup_logging()
    for noisy in ("transformers", "trl", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"error: {out} is not empty; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    data = out / "prompts.jsonl"
    data.write_text("".join(json.dumps({"question": p, "answer": ""}) + "\n" for p in prompts()))
    t0 = time.perf_counter()
    model_dir = build_model_dir(out / "tiny_base")
    run_dir = train(out / "run", model_dir, steps=args.steps, lr=args.lr)
    t_train = time.perf_counter() - t0
    config = probe_config(model_dir, data, args.lr, args.B_E)
    (out / "probe.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    doc = run_sweep(config_from_dict(config), run_dir, out=str(out / "sweep"))
    print_before_after(doc)
    print(f"\ntraining {t_train:.0f} s, sweep {time.perf_counter() - t0 - t_train:.0f} s; "
          f"sweep directory: {out / 'sweep'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

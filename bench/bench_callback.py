"""Benchmark of EntropyProbeCallback: the overhead of one probed step as a ratio to a training step, per mode.

    .venv/bin/python bench/bench_callback.py [--model-dir DIR | --embedded] [--steps 4] [--repeats 2]
                                             [--B-E 16 --B-U 2] [--max-new-tokens 16]
                                             [--modes probe_U,trainer_step] [--device cpu|cuda]
    .venv/bin/python bench/bench_callback.py --processes 2 [--steps 4] [--repeats 2] [--B-E 16]

Side by side and alternating, the same TRL GRPOTrainer run (same seed, same model, same data) is trained for
`--steps` optimizer steps without the callback and with it probing EVERY step (every=1), once per `predict`
mode (probe_U: the probe's own U step; trainer_step: the trainer's own next AdamW step, which needs no U and
no generation beyond E) and for `EntropyAutopilot` at its defaults (a steered step: the trainer_step probe's E
and one pass over it that also gives the entropy term). The callback's own timer gives the probe's seconds; the ratio reported is

    overhead per probed step / training step = (probe seconds / steps) / (plain run's seconds / steps)

and, as a check that the timer accounts for the difference, the wall-time difference of the two runs per step.
The default model is the tiny random Qwen2 of the tests (fast, overhead-dominated); `--embedded` uses the
embedded SmolLM2-135M (LoRA on q/v, as the tests' runs). `--device cuda` trains (and so probes) on the GPU; the
trainer stays fp32 with eager attention, as on the CPU.

`--processes N` runs the tiny model's trainer under torchrun (DDP, gloo on CPU, one thread per rank) with 1 and
with N processes side by side, the callback in its trainer_step mode: per rank, the seconds of a training step
without the callback and of a probed step's probe work with it (E split across the ranks), and their ratio
(`entropy_experiments/testing/trl_ddp_run.py`, scenario bench).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def one_run(model_dir: Path, out: Path, args, mode: str | None) -> tuple[float, float]:
    """(wall seconds of trainer.train(), the callback's probe seconds or 0); mode None: no callback."""
    from entropy_experiments.integrations.trl_callback import EntropyProbeCallback
    from entropy_experiments.testing.trl_run import tiny_grpo_trainer

    trainer = tiny_grpo_trainer(out, steps=args.steps, model_dir=model_dir, learning_rate=1e-4,
                                max_completion_length=args.max_new_tokens, num_generations=4, prompts_per_step=2,
                                save_strategy="no", gradient_checkpointing=False, use_cpu=args.device == "cpu")
    callback = None
    if mode == "autopilot":  # at its defaults, steering every step
        from entropy_experiments.integrations.autopilot import EntropyAutopilot
        callback = EntropyAutopilot(trainer, target="initial", B_E=args.B_E)
    elif mode is not None:
        callback = EntropyProbeCallback(trainer, every=1, B_E=args.B_E, B_U=args.B_U, predict=mode)
    if callback is not None:
        trainer.add_callback(callback)
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    rows = callback.rows if callback else []
    drawing = sum(r.get("seconds_drawing_E", 0.0) for r in rows)
    if drawing:
        measuring = sum(r.get("seconds_measuring", 0.0) for r in rows)
        print(f"    of the probe's {callback.probe_seconds:.1f} s, drawing E took {drawing:.1f} s and measuring the "
              f"candidate steps {measuring:.1f} s", flush=True)
    return wall, (callback.probe_seconds if callback else 0.0)


def ddp_run(model_dir: Path, out: Path, args, processes: int) -> dict:
    """Rank 0's {"step_s", "probe_s"} of the bench scenario on `processes` torchrun ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           "-m", "entropy_experiments.testing.trl_ddp_run", "--out", str(out), "--model-dir", str(model_dir),
           "--scenarios", "bench", "--steps", str(args.steps), "--B-E", str(args.B_E)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"torchrun with {processes} processes failed:\n{proc.stderr[-3000:]}")
    return torch.load(out / "bench" / "rank0.pt", weights_only=False)


def processes_table(model_dir: Path, tmp: Path, args) -> None:
    """Per-rank training step, probe per probed step and their ratio for 1 and N processes, alternating."""
    counts = sorted({1, args.processes})
    seen = {n: [] for n in counts}
    for r in range(args.repeats):
        for n in counts:
            seen[n].append(ddp_run(model_dir, tmp / f"ddp{n}_{r}", args, n))
            print(f"repeat {r + 1}, {n} process(es): {seen[n][-1]}", flush=True)
    print(f"cpu (gloo), 1 thread per rank, B_E {args.B_E}, {args.steps} steps, median of {args.repeats} repeats, "
          "per rank:")
    for n in counts:
        step = statistics.median(x["step_s"] for x in seen[n])
        probe = statistics.median(x["probe_s"] for x in seen[n])
        print(f"  {n} process(es): training step {step:.3f} s, probe per probed step {probe:.3f} s, "
              f"ratio {statistics.median(x['probe_s'] / x['step_s'] for x in seen[n]):.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--embedded", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--B-E", dest="B_E", type=int, default=16)
    parser.add_argument("--B-U", dest="B_U", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--modes", default="probe_U,trainer_step,autopilot",
                        help="predict modes (and `autopilot`: EntropyAutopilot at its defaults), comma-separated")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the trainer runs")
    parser.add_argument("--processes", type=int, default=None, help="DDP on CPU: 1 and this many processes")
    args = parser.parse_args()
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if args.embedded:
            from entropy_experiments.models.embedded import ensure_embedded_model
            model_dir = ensure_embedded_model()
        elif args.model_dir:
            model_dir = Path(args.model_dir)
        else:
            from entropy_experiments.testing.tiny_model import build_tiny_model_dir
            model_dir = build_tiny_model_dir(tmp / "tiny")
        if args.processes:
            processes_table(model_dir, tmp, args)
            return 0
        ratios = {mode: [] for mode in modes}
        walls = {mode: [] for mode in modes}
        for r in range(args.repeats):
            plain, _ = one_run(model_dir, tmp / f"plain{r}", args, None)
            step = plain / args.steps
            print(f"repeat {r + 1}: training step {step:.2f} s", flush=True)
            for mode in modes:
                probed, probe_s = one_run(model_dir, tmp / f"{mode}{r}", args, mode)
                ratios[mode].append(probe_s / args.steps / step)
                walls[mode].append((probed - plain) / args.steps / step)
                print(f"  {mode}: probe {probe_s / args.steps:.2f} s per probed step; wall-time difference "
                      f"{(probed - plain) / args.steps:.2f} s per step", flush=True)
    print(f"{args.device}, {torch.get_num_threads()} threads, B_E {args.B_E}, B_U {args.B_U}, {args.max_new_tokens} new tokens, "
          f"{args.steps} steps, median of {args.repeats} repeats:")
    for mode in modes:
        print(f"  {mode:>12}: overhead per probed step / training step = {statistics.median(ratios[mode]):.2f} "
              f"({[round(x, 2) for x in ratios[mode]]}; from wall times {statistics.median(walls[mode]):.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

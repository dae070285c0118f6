"""Where the probe's time goes: each phase under `torch.profiler`, with its wall time and top entries.

    .venv/bin/python bench/profile_probe.py [--checkpoint DIR] [--B-E 8 --B-U 2 --G 4 --max-new-tokens 24]
                                            [--top 12] [--threads N] [--phases training phases_1_3 delta_h ...]

The same E and U (sampled once, as bench_probe.py samples them) go through: one Dr-GRPO training step
(bench_probe.training_step_seconds), phases 1–3 (`recipe.estimate_phase`), ΔH(±η) (`beyond.delta_h_phase`),
the second order (`beyond.second_order_phase`), the predictors and the attribution, each in its own profiler
session, and the training step again at the end. Per phase: wall seconds, ratio to the mean of the two
training steps, and the top entries by self CPU time (the ops a
phase spends its time in: matmuls of the forward and backward, the vocabulary-sized softmax maths, copies,
Python-side per-sequence work shows as many small ops).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_probe import demo_probe, sample_E_U, training_step_seconds
from torch.profiler import ProfilerActivity, profile

PHASES = ("training", "phases_1_3", "delta_h", "second_order", "predictors", "attribution")


def profiled(fn, top: int, sort_by: str = "self_cpu_time_total"):
    """(fn's result, wall seconds, the profiler's top `top` rows by `sort_by`)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - t0
    return out, wall, prof.key_averages().table(sort_by=sort_by, row_limit=top, max_name_column_width=48)


def phase_fns(demo, E, U):
    """{phase: callable} running each phase on the same batches; later phases use the estimates' results."""
    from entropy_experiments.probe import beyond, recipe
    from entropy_experiments.probe.attribution import attribution_phase
    from entropy_experiments.probe.results import WarningLog
    from entropy_experiments.probe.tangent import tangent_phase

    config, policy, state = demo.config, demo.policy, {}

    def estimates():
        state["est"] = recipe.estimate_phase(config, policy, E, U, WarningLog())
        return state["est"]

    def delta_h():
        est = state["est"]
        state["truth"] = est.truth or beyond.delta_h_phase(config, policy, E, est.delta_h1)
        return state["truth"]

    def attribution():
        res, bars = state["est"].delta_h1, state["est"].error_bars
        along_v = tangent_phase(config, policy, E, res).scores  # a pass only where the attribution needs one
        return attribution_phase(config, policy, E, U, res, bars, along_v, state["truth"])

    return {
        "training": lambda: training_step_seconds(demo, E, U),
        "phases_1_3": estimates,
        "delta_h": delta_h,
        "second_order": lambda: beyond.second_order_phase(config, policy, E, state["est"].delta_h1, state["truth"]),
        "predictors": lambda: beyond.predictors_phase(config, policy, E, state["est"].delta_h1,
                                                      state["est"].error_bars, state["truth"]),
        "attribution": attribution,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--B-E", dest="B_E", type=int, default=8)
    parser.add_argument("--B-U", dest="B_U", type=int, default=2)
    parser.add_argument("--G", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--etas", type=float, nargs="+", default=None)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from entropy_experiments.config.sections import ImportanceSection

    args.etas = args.etas or ImportanceSection().eta_list
    demo = demo_probe(args)
    E, U = sample_E_U(demo)
    print(f"E {E.count_tokens()} response tokens {tuple(E.sequences.shape)}, U {U.count_tokens()} "
          f"{tuple(U.sequences.shape)}; threads {torch.get_num_threads()}", flush=True)
    fns, walls = phase_fns(demo, E, U), {}
    needed = {"training", "phases_1_3", "delta_h", *args.phases}  # what the later phases need, and the asked
    for name in (*PHASES, "training"):
        if name not in needed:
            continue
        _, wall, table = profiled(fns[name], args.top)
        walls.setdefault(name, []).append(wall)
        if name in args.phases:
            print(f"\n=== {name}: {wall:.1f} s (load average {os.getloadavg()[0]:.1f})\n{table}", flush=True)
    train = statistics.mean(walls["training"])  # timed first and last: the load moves during the run
    print(f"\ntraining step {walls['training'][0]:.1f} s first, {walls['training'][1]:.1f} s last")
    for name in (p for p in PHASES[1:] if p in walls):
        print(f"{name}: {walls[name][0]:.1f} s = {walls[name][0] / train:.2f} × training step (their mean)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of the ΔH(η) stage: its cost per η against a bare forward over E.

    .venv/bin/python bench/bench_delta_h.py [--repeats 3] [--B-E 32 --max-new-tokens 40] [--threads N]

On the embedded SmolLM2-135M with the demo checkpoint (as bench_probe.py) and one sampled E, side by side
and alternating, in the batch layout phase 1 uses (`estimator.microbatch_size` rows per forward):

- bare forward: the live model's no-grad forward over E (logits at the response positions only, nothing
  else) — the least any pass over E can cost;
- scoring at θ: `score_sequences` (forward + the fp64 per-token maths), what the ΔH stage would add if it
  scored θ itself (it does not: phase 1's scores are the base);
- ΔH per η: `measure_delta_h` at one η with phase 1's scores as the base — θ + η·v built, one no-grad
  forward over E, the token maths, the log-weights and the SNIS estimate with its jackknife.

Goal: ΔH per η / bare forward ≤ 1.1. The median of the per-repeat ratios is reported.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from bench_probe import demo_probe, print_verdict, sample_E_U

GOAL = 1.1


def bare_forward_seconds(engine, E, rows_per_forward: int) -> float:
    """One no-grad forward of the live model over E, logits at the scored positions only."""
    from entropy_experiments.policy.score import forward_logits
    from entropy_experiments.policy.tf_batches import tf_batches

    policy = engine.policy
    t0 = time.perf_counter()
    with torch.no_grad():
        for batch in tf_batches(E, rows_per_forward, policy.device):
            forward_logits(policy, batch, None, policy.precision.tf_nograd)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--B-E", dest="B_E", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--eta", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    args.B_U, args.G = 2, 4

    from entropy_experiments.estimators.delta_h import measure_delta_h
    from entropy_experiments.estimators.sequence_scores import score_sequences

    demo = demo_probe(args)
    engine = demo.policy.engine
    E, _ = sample_E_U(demo)
    rows = demo.config.estimator.microbatch_size
    v = {n: torch.randn_like(p) for n, p in demo.policy.trainable.model.named_parameters() if p.requires_grad}
    print(f"E: {E.count_tokens()} response tokens, {tuple(E.sequences.shape)}; {rows} rows per forward; "
          f"threads {torch.get_num_threads()}", flush=True)
    base = score_sequences(engine, E, tf_batch_size=rows)  # phase 1's scores (not timed: the probe has them)
    bare, scoring, per_eta = [], [], []
    for rep in range(args.repeats):
        bare.append(bare_forward_seconds(engine, E, rows))
        t0 = time.perf_counter()
        score_sequences(engine, E, tf_batch_size=rows)
        scoring.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        measure_delta_h(engine, E, v, [args.eta], normalize=demo.config.estimator.normalize, base=base,
                        tf_batch_size=rows)
        per_eta.append(time.perf_counter() - t0)
        print(f"repeat {rep + 1}: bare forward {bare[-1]:.2f} s, scoring at θ {scoring[-1]:.2f} s, "
              f"ΔH at one η {per_eta[-1]:.2f} s", flush=True)
    score_ratio = statistics.median(s / b for s, b in zip(scoring, bare))
    print(f"scoring at θ / bare forward = {score_ratio:.2f} (the token maths' share; ΔH does not pay it at θ)")
    return print_verdict("ΔH per η / bare forward over E", [e / b for e, b in zip(per_eta, bare)], GOAL)


if __name__ == "__main__":
    sys.exit(main())

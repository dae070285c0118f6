"""δH₁ of the same checkpoint and the same saved E / U batches under several trainer objectives.

    .venv/bin/python bench/compare_objectives.py RUN_DIR [--objective default] [--objective trainer=trl] ...

RUN_DIR is a finished (or batches-saved) run directory: its config.yaml names the checkpoint and its
E_batch.pt / U_batch.pt are reused. X̂ is computed once on E; for each objective the U gradient and
the AdamW direction v are recomputed, and the script prints δH₁ = lr·X̂·v, ‖v‖ and the cosine between
every pair of directions — how much the choice of objective changes the prediction.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from entropy_experiments.checkpoint.learning_rate import resolve_learning_rate
from entropy_experiments.config import config_from_dict, load_config
from entropy_experiments.data.batch import Batch
from entropy_experiments.estimators import update_direction as adam
from entropy_experiments.probe import recipe
from entropy_experiments.probe.parallel import SINGLE
from entropy_experiments.report.run_dir import RunDirectory


def parse_objective(spec: str) -> dict:
    """'default' → {}; 'trainer=trl,loss_type=grpo' → {'trainer': 'trl', 'loss_type': 'grpo'}."""
    if spec == "default":
        return {}
    pairs = [item.split("=", 1) for item in spec.split(",")]
    return {k.strip(): v.strip() for k, v in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir")
    parser.add_argument("--objective", action="append", default=None,
                        help="'default' or key=value[,key=value] of the objective section (repeatable)")
    args = parser.parse_args(argv)
    specs = args.objective or ["default", "trainer=trl", "trainer=verl"]
    run = RunDirectory(args.run_dir)
    config = load_config(Path(args.run_dir) / "config.yaml")
    E, U = run.load_batch("E"), run.load_batch("U")
    if E is None or U is None:
        print(f"error: {args.run_dir} holds no saved E/U batches", file=sys.stderr)
        return 2
    E, U = Batch.from_dict(E, "E_batch"), Batch.from_dict(U, "U_batch")
    policy = recipe.load_phase(config, SINGLE, recipe.WarningLog())
    t0 = time.perf_counter()
    X = recipe.one_pass_phase(config, policy, E, {}).X_hat
    lr = resolve_learning_rate(config.learning_rate, policy.optimizer.param_groups).value
    print(f"X̂ on E ({E.num_prompts} sequences) in {time.perf_counter() - t0:.1f} s; lr = {lr:.3g}")
    directions = {}
    for spec in specs:
        t0 = time.perf_counter()
        cfg = config_from_dict({**config.to_dict(), "objective": parse_objective(spec)})
        update = recipe.update_phase(cfg, policy, U, None)
        v, info = update.v, update.info
        directions[spec] = v
        obj = info["objective"]
        print(f"{spec:>28}: δH₁ = {lr * adam.named_dot(X, v):+.4e}  ‖v‖ = {info['norm']:.4g}  "
              f"‖g‖ = {info['grad_norm']:.4g} clipped={info['clipped']}  [{obj['loss_type']}, "
              f"scale_rewards={obj['scale_rewards']}, max_grad_norm={obj['max_grad_norm']}] "
              f"({time.perf_counter() - t0:.1f} s)")
    for a, b in itertools.combinations(specs, 2):
        va, vb = directions[a], directions[b]
        cos = adam.named_dot(va, vb) / math.sqrt(adam.named_dot(va, va) * adam.named_dot(vb, vb))
        print(f"cos(v[{a}], v[{b}]) = {cos:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

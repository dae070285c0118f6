"""Small-E bias of the realised change (docs/realised-change.md, "Bias at small E").

The importance estimate is a difference of self-normalised ratios, each biased by O(1/n) in the number n of
draws. On the enumerable toy model (tests/realised_toy.py: exact entropies by enumeration, checkpoints one real
torch AdamW step apart, E drawn with common random numbers as the sweep draws it) this measures, per E size,
the mean error of the estimate against the exact change over REPS independent E seeds, its standard error, and
the typical jackknife SE of one estimate: the bias matters when |mean error| is a visible fraction of that SE.

    OMP_NUM_THREADS=1 python bench/bench_realised_bias.py [--reps 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from entropy_experiments.estimators.realised_change import realised_change_entry
from tests.realised_toy import checkpoints, cross_scored, draw_E, exact_entropy

SIZES = (4, 8, 16, 32, 64, 128)


def errors(lr: float, n_draws: int, reps: int, ck_seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(estimate − exact, jackknife SE) over `reps` E seeds at one interval of checkpoint seed `ck_seed`."""
    theta0, theta1 = checkpoints(ck_seed, 1, lr)
    exact = exact_entropy(theta1) - exact_entropy(theta0)
    err, se = [], []
    for rep in range(reps):
        seed = 10_000 * ck_seed + rep
        E0, E1 = draw_E(theta0, n_draws, seed), draw_E(theta1, n_draws, seed)
        entry = realised_change_entry(cross_scored(E0, theta0, theta1), cross_scored(E1, theta1, theta0),
                                      normalize="per_token")
        if np.isfinite(entry["value"]) and np.isfinite(entry["se"]):
            err.append(entry["value"] - exact)
            se.append(entry["se"])
    return np.array(err), np.array(se)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--ck-seeds", type=int, default=3)
    parser.add_argument("--lr", type=float, action="append", help="AdamW lr of the step (repeatable; default 1e-3)")
    args = parser.parse_args()
    print(f"{'lr':>7} {'n':>5} {'mean error':>12} {'± SE(mean)':>11} {'median jk SE':>13} {'bias/SE':>8} "
          f"{'rms z':>6}")
    for lr in args.lr or [1e-3]:
        for n in SIZES:
            pairs = [errors(lr, n, args.reps, s) for s in range(args.ck_seeds)]
            err = np.concatenate([e for e, _ in pairs])
            se = np.concatenate([s for _, s in pairs])
            bias, bias_se, typical = err.mean(), err.std(ddof=1) / np.sqrt(err.size), np.median(se)
            rms_z = float(np.sqrt(np.mean(np.square(err / np.where(se > 0, se, np.nan)))))
            print(f"{lr:>7.0e} {n:>5} {bias:>+12.3e} {bias_se:>11.1e} {typical:>13.3e} {bias / typical:>+8.3f} "
                  f"{rms_z:>6.2f}", flush=True)


if __name__ == "__main__":
    main()

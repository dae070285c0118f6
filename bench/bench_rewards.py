"""Benchmark of the `tag_pref` reward: the wall time of one call once sympy and math-verify are warm.

    .venv/bin/python bench/bench_rewards.py [--calls 15] [--budget-ms 50]

`score_response` on a short answer is called once to import sympy and fill math-verify's caches, then
`--calls` times; the median, minimum and maximum per call are printed in milliseconds. A probe scores
B_E·G + B_U·G responses per run, so the median against `--budget-ms` (50 ms: a few seconds for a thousand
responses) says whether the reward is cheap beside the model passes. Exit code 1 when the median is over
budget. (tests/test_rewards.py checks only what the reward returns; its speed is measured here.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RESPONSE, GOLD = "</think> <answer>1234.5</answer>", "1234.5"


def time_calls(calls: int) -> list[float]:
    """Seconds of each of `calls` warm calls of tag_pref's score_response."""
    from entropy_experiments.data.rewards.tag_pref import score_response

    score_response(RESPONSE, GOLD)  # the first call imports sympy and warms caches
    durations = []
    for _ in range(calls):
        start = time.perf_counter()
        score_response(RESPONSE, GOLD)
        durations.append(time.perf_counter() - start)
    return durations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--budget-ms", type=float, default=50.0)
    args = parser.parse_args(argv)
    ms = [1000 * s for s in time_calls(args.calls)]
    median = statistics.median(ms)
    print(f"tag_pref score_response: median {median:.2f} ms, min {min(ms):.2f} ms, max {max(ms):.2f} ms "
          f"over {len(ms)} warm calls (budget {args.budget_ms:g} ms)")
    return 0 if median < args.budget_ms else 1


if __name__ == "__main__":
    sys.exit(main())

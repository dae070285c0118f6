"""The token attribution's D_v H_t by finite differences of no-grad passes against the exact forward-mode jvp.

    .venv/bin/python bench/token_attribution_options.py [--model tiny|embedded] [--B-E 16] [--max-new-tokens 16]
                                                        [--etas 1e-6 1e-5 1e-4 1e-3 3e-3] [--threads N]

On the same sampled E of one checkpoint (the tiny model of the tests, or the embedded SmolLM2-135M's demo
checkpoint) after phases 1–3: the exact D_v H_t of every realised token from the first-order jvp along v (what
`output.token_attribution_method: jvp` runs), then for each η the central difference (passes at θ ± η·v) and the
forward difference (θ + η·v against the scores at θ), as `estimators/token_derivatives.py` forms them. Per
option: the RMS error over RMS |D_v H_t|, the largest error over the largest |D_v H_t|, how many of the exact top
20 tokens by |dH| it also ranks top 20, and the error of Σ_t D_v H_t (the `direct_only` sum) relative to it;
seconds of the jvp pass and of one no-grad pass.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch


def flat(rows) -> np.ndarray:
    return np.concatenate([r.detach().double().numpy().reshape(-1) for r in rows])


def agreement(approx: np.ndarray, exact: np.ndarray, top: int = 20) -> dict[str, float]:
    """Errors of `approx` against `exact` (both flat per token)."""
    err = approx - exact
    top_exact = set(np.argsort(-np.abs(exact))[:top])
    top_approx = set(np.argsort(-np.abs(approx))[:top])
    return {"rms": float(np.sqrt(np.mean(err ** 2)) / np.sqrt(np.mean(exact ** 2))),
            "max": float(np.abs(err).max() / np.abs(exact).max()),
            "top": len(top_exact & top_approx),
            "sum": float(abs(err.sum()) / abs(exact.sum()))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "embedded"), default="tiny")
    parser.add_argument("--B-E", dest="B_E", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--etas", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4, 1e-3, 3e-3])
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from bench.second_order_options import estimated_run
    from entropy_experiments.estimators.delta_h import score_at_eta
    from entropy_experiments.estimators.token_derivatives import (
        central_token_derivatives,
        forward_token_derivatives,
    )
    from entropy_experiments.probe.e_pass import score_E

    with tempfile.TemporaryDirectory() as tmp:
        config, policy, E, _, res = estimated_run(Path(tmp), args.model, args.B_E, args.max_new_tokens)
        t0 = time.perf_counter()
        exact_scores = score_E(config, policy, E, res.v)
        t_jvp = time.perf_counter() - t0
        exact = flat(exact_scores.d_entropy)
        entropies, t_pass = {}, []
        for eta in args.etas:
            for s in (1, -1):
                t0 = time.perf_counter()
                entropies[s * eta] = score_at_eta(policy.engine, E, res.v, s * eta,
                                                  tf_batch_size=res.scores_tf_batch).token_entropies
                t_pass.append(time.perf_counter() - t0)
    print(f"model {args.model}, E = {E.num_prompts}×{E.num_responses_per_prompt} sequences, {exact.size} response "
          f"tokens; RMS |D_v H_t| {np.sqrt(np.mean(exact ** 2)):.4g}, max {np.abs(exact).max():.4g}; jvp pass "
          f"{t_jvp:.2f} s, one no-grad pass {np.median(t_pass):.2f} s (jvp / pass = {t_jvp / np.median(t_pass):.2f})")
    print("| difference | η | RMS error / RMS | max error / max | top-20 kept | Σ error / |Σ| |")
    print("|---|---|---|---|---|---|")
    for eta in args.etas:
        for kind, rows in (("central", central_token_derivatives(entropies[eta], entropies[-eta], eta)),
                           ("forward", forward_token_derivatives(entropies[eta], res.scores.token_entropies, eta))):
            a = agreement(flat(rows), exact)
            print(f"| {kind} | {eta:g} | {a['rms']:.2e} | {a['max']:.2e} | {a['top']} | {a['sum']:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

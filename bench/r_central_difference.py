"""r_i by the central difference of the ±η passes against the exact r_i of the second backward (docs/maths.md §6).

    .venv/bin/python bench/r_central_difference.py [--checkpoint DIR | --tiny] [--B-E 16] [--etas 1e-5 1e-4 1e-3]

On one checkpoint (default: the embedded model's demo checkpoint, as bench_probe.py; `--tiny`: the tiny run of
tests/test_cuda.py) and one sampled E, U: the exact E side (`one_pass_sums`: one forward, two backwards per
microbatch) beside the lean one (a no-grad scoring of E, ONE backward of L_X with the row hooks, and r_i from the
no-grad passes at θ ± η·v that the ΔH phase runs anyway). Per η: max |r_cd − r| / max |r|, the SE_E from the
lean pieces against the exact SE_E, and δH₁ from them; then the seconds of each E side (the ±η passes apart).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch


def lean_pieces(config, policy, E, v: dict, etas: list[float]) -> dict:
    """{"seconds", "X", "rows", "coefs", "scores", "r": {η: r_cd}, "pm_seconds"}: the lean E side."""
    from entropy_experiments.estimators.central_difference import central_difference_r
    from entropy_experiments.estimators.delta_h import score_at_eta
    from entropy_experiments.estimators.entropy_gradient import (
        coefficients,
        e_microbatches,
        surrogate_gradient_rows,
    )
    from entropy_experiments.estimators.sequence_scores import score_sequences

    options = config.entropy_options()
    t0 = time.perf_counter()
    scores = score_sequences(policy.engine, E)
    coefs = coefficients(scores, options)
    X, rows = surrogate_gradient_rows(policy.engine, policy.trainable, E,
                                      e_microbatches(E.num_prompts, E.num_responses_per_prompt,
                                                     options.microbatch_size), coefs, {"v": v})
    seconds, t0 = time.perf_counter() - t0, time.perf_counter()
    r = {}
    for eta in etas:
        plus, minus = (score_at_eta(policy.engine, E, v, s * eta) for s in (1, -1))
        r[eta] = central_difference_r(plus.token_logqs, minus.token_logqs, coefs, eta)
    return {"seconds": seconds, "X": X, "rows": rows["v"], "coefs": coefs, "scores": scores, "r": r,
            "pm_seconds": (time.perf_counter() - t0) / len(etas)}


def compare(config, policy, E, U, etas: list[float]) -> list[str]:
    """The lines of the comparison on one E, U."""
    from entropy_experiments.estimators.central_difference import pieces_from_rows
    from entropy_experiments.estimators.jackknife import se_E
    from entropy_experiments.probe import recipe

    t0 = time.perf_counter()
    res = recipe.delta_h1_phase(config, policy, E, U, per_sequence_pieces=True)
    exact_seconds = res.timings["e_pass_backward"]
    lean = lean_pieces(config, policy, E, res.v, etas)
    a, r = res.pieces
    s, lr, normalize = res.scores, res.learning_rate, config.estimator.normalize
    exact = se_E(a, r, s.seq_entropies, s.lengths, s.unit_of_sequence, normalize=normalize, learning_rate=lr)
    x_rel = max(float((lean["X"][n] - res.X_hat[n].double()).abs().max() / res.X_hat[n].abs().max().clamp(min=1e-30))
                for n in res.X_hat)
    lines = [(f"E {len(s.lengths)} sequences, {int(s.lengths.sum())} tokens; δH₁ {exact[0]:+.6e}, SE_E {exact[1]:.4e} "
             f"(exact pieces, {time.perf_counter() - t0:.1f} s with the U side); max rel |X̂_lean − X̂| {x_rel:.1e}"),
             "| η | max abs(r_cd − r) / max abs(r) | SE_E lean / exact − 1 | δH₁ lean / exact − 1 | abs(Δ SE_E) / SE_E |",
             "|---|---|---|---|---|"]
    for eta in etas:
        a_cd, r_cd = pieces_from_rows(lean["rows"], lean["r"][eta], lean["coefs"])
        d1, se = se_E(a_cd, r_cd, s.seq_entropies, s.lengths, s.unit_of_sequence, normalize=normalize,
                      learning_rate=lr)
        err = float((r_cd - r).abs().max() / r.abs().max())
        lines.append(f"| {eta:g} | {err:.2e} | {se / exact[1] - 1:+.2e} | {d1 / exact[0] - 1:+.2e} | "
                     f"{abs(se - exact[1]) / exact[1]:.1e} |")
    lines.append(f"E side seconds: exact (one forward, two backwards) {exact_seconds:.2f}; lean (no-grad scoring + "
                 f"one backward) {lean['seconds']:.2f} → {lean['seconds'] / exact_seconds:.2f}×; "
                 f"one ±η pair (shared with ΔH) {lean['pm_seconds']:.2f}")
    return lines


def setup(args, folder: Path):
    """(config, policy, E, U) of the chosen checkpoint."""
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.probe import recipe
    from entropy_experiments.probe.results import WarningLog

    if args.tiny:
        from entropy_experiments.testing.tiny_model import build_tiny_model_dir
        from tests.run_helpers import make_run_setup

        _, d = make_run_setup(folder, build_tiny_model_dir(folder / "tiny"), estimator={"microbatch_size": 4},
                              batch_config={"B_E": args.B_E})
        config = config_from_dict(d)
        policy = recipe.load_phase(config, recipe.SINGLE, WarningLog())
    else:
        from bench.bench_probe import demo_probe
        args.B_U, args.G, args.max_new_tokens, args.device = 2, 2, 24, "cpu"
        demo = demo_probe(args)
        config, policy = demo.config, demo.policy
    samples = recipe.sample_phase(config, policy.engine)
    return config, policy, samples.E, samples.U


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--B-E", dest="B_E", type=int, default=16)
    parser.add_argument("--etas", type=float, nargs="+", default=[1e-5, 1e-4, 1e-3])
    args = parser.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        config, policy, E, U = setup(args, Path(tmp))
        print("\n".join(compare(config, policy, E, U, args.etas)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

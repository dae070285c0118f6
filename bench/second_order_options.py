"""The second order's options side by side on one E: d2 ± SE, seconds, and seconds / one training step.

    .venv/bin/python bench/second_order_options.py [--model tiny|embedded] [--B-E 16] [--max-new-tokens 16]
                                                   [--etas 1e-6 1e-5 1e-4 1e-3] [--fractions 0.5 0.25]

On the same sampled E of one checkpoint (the tiny model of the tests, or the embedded SmolLM2-135M's demo
checkpoint) after phases 1–3:

- jvp: the exact nested forward-over-forward pass along v (`second_order.method: jvp`);
- the first-order jvp along v alone (what the token attribution needs), for the cost of sharing it;
- finite_difference at each η: ΔH(+η) and ΔH(−η) by two no-grad passes, d2(η) = (ΔH(+η) + ΔH(−η))/η², its
  jackknife SE, its distance from the jvp's d2 in units of the jvp's SE, and the rounding part √3·F/η² with F
  the fp32 rounding floor of ΔH (estimators/rounding_floor.py; fp32 − fp64 scores at θ);
- the jvp on the first fraction of E's prompts (d2 ± SE of the subsample);
- one Dr-GRPO training step on E ∪ U (bench/bench_probe.py's baseline) to give each its ratio.

Seconds are wall time, or with `--cpu-time` this process's CPU time (with `--threads 1`, what a shared machine's
other load leaves alone).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
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

CLOCK = [time.perf_counter]  # --cpu-time: time.process_time (this process's CPU seconds: robust to other load)


def timed(fn):
    t0 = CLOCK[0]()
    out = fn()
    return out, CLOCK[0]() - t0


def tiny_setup(folder: Path, B_E: int, max_new_tokens: int):
    """(config, policy) of the tiny model's 1-step checkpoint (tests/run_helpers.py)."""
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.probe import recipe
    from entropy_experiments.probe.parallel import SINGLE
    from entropy_experiments.testing.tiny_model import build_tiny_model_dir
    from tests.run_helpers import make_run_setup

    _, d = make_run_setup(folder / "run", build_tiny_model_dir(folder / "tiny"), batch_config={"B_E": B_E},
                          generation={"max_new_tokens": max_new_tokens})
    config = config_from_dict(d)
    return config, recipe.load_phase(config, SINGLE, recipe.WarningLog())


def embedded_setup(B_E: int, max_new_tokens: int):
    from bench.bench_probe import demo_probe

    args = argparse.Namespace(B_E=B_E, B_U=2, G=2, max_new_tokens=max_new_tokens, etas=[1e-5], device="cpu",
                              checkpoint=None)
    demo = demo_probe(args)
    return demo.config, demo.policy


def estimated_run(folder: Path, model: str, B_E: int, max_new_tokens: int):
    """(config, policy, E, U, the δH₁ result) of `model` (tiny | embedded) after sampling and phases 1–3."""
    from entropy_experiments.probe import recipe

    config, policy = (tiny_setup(folder, B_E, max_new_tokens) if model == "tiny"
                      else embedded_setup(B_E, max_new_tokens))
    samples = recipe.sample_phase(config, policy.engine)
    res = recipe.estimate_phase(config, policy, samples.E, samples.U, recipe.WarningLog()).delta_h1
    return config, policy, samples.E, samples.U, res


def rounding_floor(policy, config, E) -> float:
    """F of estimators/rounding_floor.py from fp32 − fp64 scores of E at θ."""
    from entropy_experiments.estimators.rounding_floor import delta_h_rounding_floor, per_token_rounding
    from entropy_experiments.estimators.sequence_scores import score_sequences
    from entropy_experiments.policy.engine import PolicyEngine

    model = copy.deepcopy(policy.trainable.model).to(torch.float64)
    model.set_attn_implementation("sdpa")
    s64 = score_sequences(PolicyEngine(model, policy.tokenizer, config.policy_settings()), E, tf_batch_size=8)
    s32 = score_sequences(policy.engine, E, tf_batch_size=8)
    var_h = per_token_rounding(s32.token_entropies, s64.token_entropies)
    var_l = per_token_rounding(s32.token_logqs, s64.token_logqs)
    return delta_h_rounding_floor(s64.seq_entropies, s64.lengths, var_h, var_l,
                                  normalize=config.estimator.normalize)


def finite_differences(config, policy, E, res, etas):
    """{η: (d2 Estimate, seconds of the two no-grad passes)}."""
    from entropy_experiments.estimators.delta_h import eta_values, score_at_eta
    from entropy_experiments.estimators.second_difference import second_difference
    from entropy_experiments.estimators.sequence_scores import units_of

    units = units_of(E.num_prompts, E.num_responses_per_prompt)
    h, T = res.scores.seq_entropies.numpy(), res.scores.lengths.numpy()
    out = {}
    for eta in etas:
        t0 = CLOCK[0]()
        vals = {s: eta_values(score_at_eta(policy.engine, E, res.v, s * eta, tf_batch_size=res.scores_tf_batch),
                              res.scores) for s in (1, -1)}
        seconds = CLOCK[0]() - t0
        est = second_difference(vals[1]["logw"], vals[1]["h_new"], vals[-1]["logw"], vals[-1]["h_new"], h, T, eta,
                                normalize=config.estimator.normalize, units=units)
        out[eta] = (est, seconds)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "embedded"), default="tiny")
    parser.add_argument("--B-E", dest="B_E", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--etas", type=float, nargs="+", default=[1e-6, 1e-5, 1e-4, 1e-3])
    parser.add_argument("--fractions", type=float, nargs="*", default=[0.5, 0.25])
    parser.add_argument("--no-floor", action="store_true", help="skip the fp64 scoring of the rounding floor")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time by this process's CPU seconds (with --threads 1: robust to a shared machine)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.cpu_time:
        CLOCK[0] = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)

    from bench.bench_probe import DemoProbe, training_step_seconds
    from entropy_experiments.probe.beyond import second_derivative_along
    from entropy_experiments.probe.e_pass import score_E

    with tempfile.TemporaryDirectory() as tmp:
        config, policy, E, U, res = estimated_run(Path(tmp), args.model, args.B_E, args.max_new_tokens)
        _, train = timed(lambda: training_step_seconds(DemoProbe(config, policy), E, U))
        (d2, cols), t_jvp = timed(lambda: second_derivative_along(config, policy, E, res.v))
        _, t_first = timed(lambda: score_E(config, policy, E, res.v))
        fd = finite_differences(config, policy, E, res, args.etas)
        F = None if args.no_floor else rounding_floor(policy, config, E)
        subs = {}
        for f in args.fractions:
            m = max(2, round(f * E.num_prompts))
            subs[f] = timed(lambda m=m: second_derivative_along(config, policy, E.subset(list(range(m))), res.v)[0])
    tokens = float(res.scores.lengths.sum())
    print(f"model {args.model}, E = {E.num_prompts}×{E.num_responses_per_prompt} sequences, {tokens:.0f} response "
          f"tokens, X̂·v = {res.x_hat_dot_v:+.4e}, lr = {res.learning_rate:g}; training step {train:.2f} s; "
          f"rounding floor F = {F if F is None else f'{F:.2e}'}")
    print("| option | d2 | SE | |d2 − d2_jvp| / SE_jvp | rounding √3F/η² | s | / jvp | / training step |")
    print("|---|---|---|---|---|---|---|---|")
    row = "| {} | {:+.4g} | {:.3g} | {} | {} | {:.2f} | {:.2f} | {:.2f} |"
    print(row.format("jvp (exact)", d2.value, d2.se, "0", "–", t_jvp, 1.0, t_jvp / train))
    print(f"| first-order jvp (attribution) | – | – | – | – | {t_first:.2f} | {t_first / t_jvp:.2f} | "
          f"{t_first / train:.2f} |")
    for eta, (est, sec) in fd.items():
        noise = "–" if F is None else f"{math.sqrt(3) * F / eta ** 2:.3g}"
        print(row.format(f"finite_difference η={eta:g}", est.value, est.se, f"{abs(est.value - d2.value) / d2.se:.2f}",
                         noise, sec, sec / t_jvp, sec / train))
    for f, (est, sec) in subs.items():
        print(row.format(f"jvp on {f:g} of E", est.value, est.se, f"{abs(est.value - d2.value) / d2.se:.2f}", "–",
                         sec, sec / t_jvp, sec / train))
    etas = sorted(fd)
    for a, b in itertools.pairwise(etas):
        fourth = 12 * (fd[b][0].value - fd[a][0].value) / (b ** 2 - a ** 2)
        print(f"Ĥ'''' from η = {a:g}, {b:g}: {fourth:+.3g}; bias of d2 at {b:g}: {b ** 2 * fourth / 12:+.3g}")
    slopes = np.asarray(cols["s"])
    print(f"s_i = D_v log q(y_i): SD {slopes.std():.3g}, max |s_i| {np.abs(slopes).max():.3g}")
    print(f"d2 (jvp) SE / |d2| = {d2.se / abs(d2.value):.2f}; η* = {0.2 * abs(res.x_hat_dot_v) / abs(d2.value):.3g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

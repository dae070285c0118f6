"""Benchmark of the probe's phases 1–3 against one plain Dr-GRPO training step.

    .venv/bin/python bench/bench_probe.py [--repeats N] [--B-E 32 --B-U 4 --G 4 --max-new-tokens 40]
                                          [--no-variance] [--passes] [--compare-jvp] [--threads N]

Both sides run on the embedded SmolLM2-135M with the demo checkpoint (made once and cached, as
`entropy-probe demo` does) on the SAME sampled E and U sequences:

- baseline: one Dr-GRPO training step over every E ∪ U sequence — microbatched forward + backward of
  the Dr-GRPO loss (E sequences given advantage 1 so that they carry gradient), gradient clipping and
  `torch.optim.AdamW.step()` (on a copy of the optimizer; parameters restored afterwards);
- ours: phases 1–3 exactly as `run_mixed_probe` runs them (U gradient, v from the AdamW state, X̂ on E,
  δH₁ with SE_E, SE_U, SE_total), read from its `phase1_3_total` timing. Importance sampling is off.

Target: ours / baseline ≤ 1.2; the profile line shows the E side's share. With error bars (the
default) each E microbatch runs one forward and TWO backwards — ∇L_α' and ∇L_β; the second gives each
sequence's r_i = D_v L_β,i, without which the delete-one jackknife of SE_E is not exact (Ĥ moves in every
replicate) — against training's one forward and one backward; `--passes` times those passes on one E
microbatch. `--no-variance` times the run without error bars: E scored without grad, then one backward with
Ĥ known. The sides alternate and the median of the per-repeat ratios is reported, so a burst of load
elsewhere on the machine spoils one pair, not the verdict. `--compare-jvp` also times the forward-mode (jvp)
pieces for reference.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

TARGET = 1.2


@dataclass
class DemoProbe:
    """The demo checkpoint loaded for the probe (`probe.load_phase`) and the config it was loaded with."""

    config: Any      # ProbeConfig
    policy: Any      # phase_results.Policy: engine, trainable, optimizer


def demo_probe(args) -> DemoProbe:
    from entropy_experiments.config import config_from_dict, load_config, packaged_config_path
    from entropy_experiments.make_checkpoint.trained import ensure_demo_checkpoint
    from entropy_experiments.probe import recipe as probe
    from entropy_experiments.probe.parallel import SINGLE

    config = load_config(packaged_config_path("demo"))
    d = config.to_dict()
    d["batch_config"].update({"B_E": args.B_E, "B_U": args.B_U, "G": args.G})
    d["generation"]["max_new_tokens"] = args.max_new_tokens
    d["importance"]["enabled"] = False
    ckpt = ensure_demo_checkpoint(config_from_dict(d))
    d["checkpoint"].update({"checkpoint_path": str(ckpt), "adapter_path": None, "optimizer_path": None})
    config = config_from_dict(d)
    return DemoProbe(config, probe.load_phase(config, SINGLE, probe.WarningLog()))


def sample_E_U(demo: DemoProbe) -> tuple[dict, dict]:
    """E and U as the probe samples them (`probe.sample_phase`) for the demo's batch_config."""
    from entropy_experiments.probe import recipe as probe

    samples = probe.sample_phase(demo.config, demo.policy.engine)
    return samples.E, samples.U


def training_step_seconds(demo: DemoProbe, E: dict, U: dict) -> dict[str, float]:
    """Wall time of one Dr-GRPO step on a copy of the optimizer: a microbatched forward + backward over EVERY
    E ∪ U sequence (U with its Dr-GRPO advantages, E with advantage 1 so that it carries gradient; a trainer
    back-propagates all-zero-advantage prompts too), clipping and AdamW.step(). {"U", "E", "total"} seconds."""
    from entropy_experiments.estimators.objective_gradient import (
        Trainable,
        chunked,
        objective_gradient_sums,
        prompts_per_microbatch,
        u_terms,
    )
    from entropy_experiments.estimators.objectives import SequenceTerms

    engine, options = demo.policy.engine, demo.config.objective_options()
    trainable = Trainable.of(demo.policy.trainable.model)
    E_terms = [[SequenceTerms(1.0, 1.0 / float(E.count_tokens()), 0.0)] * E.num_responses_per_prompt
               for _ in range(E.num_prompts)]
    saved = [p.detach().clone() for p in trainable.params]
    optimizer = copy.deepcopy(demo.policy.optimizer)
    params_of_copy = [p for group in optimizer.param_groups for p in group["params"]]
    t0 = time.perf_counter()
    total, parts = trainable.zeros(torch.float64), {}
    for what, batch, terms in (("U", U, u_terms(U, options)), ("E", E, E_terms)):
        t_part = time.perf_counter()
        per_mb = prompts_per_microbatch(demo.config.estimator.microbatch_size, batch.num_responses_per_prompt)
        items = [(0, idx) for idx in chunked(list(range(batch.num_prompts)), per_mb)]
        sums, _ = objective_gradient_sums(engine, trainable, batch, items, terms, options, 1)
        for name in total:
            total[name] += sums[0][name]
        parts[what] = time.perf_counter() - t_part
    for p, name in zip(params_of_copy, trainable.names):
        p.grad = total[name].float()
    torch.nn.utils.clip_grad_norm_(params_of_copy, 1.0)
    optimizer.step()
    parts["total"] = time.perf_counter() - t0
    with torch.no_grad():
        for p, s in zip(trainable.params, saved):
            p.copy_(s)
            p.grad = None
    return parts


def phases_1_3_seconds(demo: DemoProbe, E, U, directional: str = "auto",
                       variance: bool = True) -> tuple[float, dict]:
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.probe import recipe as probe

    d = demo.config.to_dict()
    d["variance"]["directional"] = directional
    d["variance"]["enabled"] = variance
    d["second_order"]["enabled"] = False  # not part of phases 1–3 (and the timed run is phase1_3_total only)
    results = probe.run(config_from_dict(d), policy=demo.policy, batches=(E, U)).results
    return results["timing"]["phase1_3_total"], results


def profile_lines(breakdown: dict, train_parts: dict) -> str:
    """Where the ratio comes from (last repeat): each side's U and E parts; with U at par the ratio's floor is
    (U_train + E_probe) / total_train."""
    u_probe = breakdown.get("phase1_3_U_gradient_and_direction")
    e_probe = breakdown.get("phase1_3_E_backward", 0.0) + breakdown.get("phase1_3_E_scoring", 0.0)
    if u_probe is None or not e_probe:
        return "profile: n/a (no E timing)"
    floor = (train_parts["U"] + e_probe) / train_parts["total"]
    return (f"profile: U {u_probe:.1f} s (training {train_parts['U']:.1f} s); E {e_probe:.1f} s (training "
            f"{train_parts['E']:.1f} s, ×{e_probe / train_parts['E']:.2f}); with U at par the E side alone puts "
            f"the ratio at {floor:.2f}")


def pass_seconds(demo: DemoProbe, E: dict) -> dict[str, float]:
    """The passes over ONE E microbatch (second of two timings each): a no-grad forward, a forward with grad, the
    backward of L_α' and the backward of L_β — what a training step's forward + backward is made of, and why
    the exact pieces cost a second backward (r_i = D_v L_β,i exists only in a backward of L_β or a tangent)."""
    from entropy_experiments.estimators.entropy_gradient import e_microbatches
    from entropy_experiments.estimators.objective_gradient import Trainable
    from entropy_experiments.estimators.surrogate import (
        sequence_coefficients,
        surrogate_loss,
        weighted_logq_sum,
    )

    engine, options = demo.policy.engine, demo.config.entropy_options()
    params = Trainable.of(demo.policy.trainable.model).params
    idx = e_microbatches(E.num_prompts, E.num_responses_per_prompt, options.microbatch_size)[0]
    seqs = E.subset(idx).as_sequences()
    rows = len(idx) * E.num_responses_per_prompt
    out: dict[str, float] = {}
    for _ in range(2):
        t0 = time.perf_counter()
        engine.teacher_force_logprobs(seqs, with_grad=False, compute_rb=True, tf_batch_size=rows)
        t1 = time.perf_counter()
        lp = engine.teacher_force_logprobs(seqs, with_grad=True, compute_rb=True, tf_batch_size=rows)
        ell = [x for row in lp.token_logqs for x in row]
        h = [x for row in lp.rb_entropies_torch for x in row]
        coefs = [sequence_coefficients(x, normalize=options.normalize, x_mode=options.x_mode) for x in h]
        t2 = time.perf_counter()
        torch.autograd.grad(surrogate_loss(ell, h, [a for a, _ in coefs], 1.0), params, retain_graph=True)
        t3 = time.perf_counter()
        torch.autograd.grad(weighted_logq_sum(ell, [b for _, b in coefs]), params)
        t4 = time.perf_counter()
        out = {"no-grad forward": t1 - t0, "forward with grad": t2 - t1, "backward L_α": t3 - t2,
               "backward L_β": t4 - t3}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--B-E", dest="B_E", type=int, default=32)
    parser.add_argument("--B-U", dest="B_U", type=int, default=4)
    parser.add_argument("--G", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--compare-jvp", action="store_true")
    parser.add_argument("--no-variance", action="store_true",
                        help="variance.enabled false: no pieces, E scored without grad then one backward")
    parser.add_argument("--passes", action="store_true", help="also time the passes over one E microbatch")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)


    demo = demo_probe(args)
    t0 = time.perf_counter()
    E, U = sample_E_U(demo)
    print(f"sampled E ({E.count_tokens()} response tokens, {E.sequences.shape}) and U "
          f"({U.count_tokens()} response tokens, {U.sequences.shape}) in {time.perf_counter() - t0:.0f} s; "
          f"threads {torch.get_num_threads()}", flush=True)

    baseline, ours, jvp = [], [], []
    breakdown, train_parts = {}, {}
    for rep in range(args.repeats):
        train_parts = training_step_seconds(demo, E, U)
        baseline.append(train_parts["total"])
        seconds, results = phases_1_3_seconds(demo, E, U, variance=not args.no_variance)
        ours.append(seconds)
        breakdown = {k: round(v, 1) for k, v in results["timing"].items() if k.startswith("phase1_3")}
        line = f"repeat {rep + 1}: training step {baseline[-1]:.1f} s, phases 1–3 {ours[-1]:.1f} s"
        if args.compare_jvp:
            jvp.append(phases_1_3_seconds(demo, E, U, "jvp")[0])
            line += f", phases 1–3 with jvp pieces {jvp[-1]:.1f} s"
        print(line, flush=True)

    # The median of the per-repeat ratios: each pair ran back to back, so a burst of load elsewhere
    # on the machine inflates one pair, not the comparison.
    ratios = [o / b for o, b in zip(ours, baseline)]
    b, o = statistics.median(baseline), statistics.median(ours)
    print(f"phases 1–3 breakdown (last repeat, s): {breakdown}")
    print(profile_lines(breakdown, train_parts))
    if args.passes:
        passes = pass_seconds(demo, E)
        print("one E microbatch: " + ", ".join(f"{k} {v:.2f} s" for k, v in passes.items()))
    print(f"δH₁ = {results['deltaH1']:+.4e} ± {results['se'].get('total', float('nan')):.2e}, pieces: "
          f"{results['consistency'].get('pieces_method')}")
    if jvp:
        jvp_ratio = statistics.median([j / b for j, b in zip(jvp, baseline)])
        print(f"phases 1–3 with jvp pieces / training step = {jvp_ratio:.2f} (reference)")
    return print_verdict("phases 1–3 / training step", ratios, TARGET, f"; medians {o:.1f} s / {b:.1f} s")


def print_verdict(what: str, ratios: list[float], limit: float, detail: str = "") -> int:
    """Print `what = median (median of the per-repeat ratios…) (target ≤ limit) PASS|FAIL`; 0 if met, else 1."""
    ratio = statistics.median(ratios)
    verdict = "PASS" if ratio <= limit else "FAIL"
    print(f"{what} = {ratio:.2f} (median of {[round(x, 2) for x in ratios]}{detail})  (target ≤ {limit})  {verdict}")
    return 0 if ratio <= limit else 1


if __name__ == "__main__":
    sys.exit(main())

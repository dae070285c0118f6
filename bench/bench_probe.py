"""Benchmark of the whole probe, phase by phase, against one plain Dr-GRPO training step on the same tokens.

    .venv/bin/python bench/bench_probe.py [--checkpoint DIR] [--device cpu|cuda] [--repeats N]
                                          [--B-E 32 --B-U 4 --G 4 --max-new-tokens 40] [--etas 1e-5 1e-4]
                                          [--no-previous] [--compare-second-order] [--no-variance] [--passes]
                                          [--compare-jvp] [--r-methods] [--threads N]

Both sides run on the SAME sampled E and U sequences of one checkpoint: `--checkpoint DIR` (a checkpoint the
probe loads: adapter + optimizer state, or a full model), by default the embedded SmolLM2-135M with the demo
checkpoint (made once and cached, as `entropy-probe demo` does), on `--device`.

- baseline: one Dr-GRPO training step over every E ∪ U sequence — microbatched forward + backward of
  the Dr-GRPO loss (E sequences given advantage 1 so that they carry gradient), gradient clipping and
  `torch.optim.AdamW.step()` (on a copy of the optimizer; parameters restored afterwards);
- ours: the probe's phases as `recipe.run` times them, sampling and loading apart (the batches and the loaded
  model are handed in), under the default config (`--etas`: importance.eta_list at ±η instead) and, unless
  `--no-previous`, under the previous default (PREVIOUS_DEFAULT: three η at ±η, the second difference at two η,
  the predictors, the attribution's own jvp pass); `--compare-second-order` adds that with the exact (jvp) second
  order. Each side's d2 ± SE is printed.

Per repeat the sides alternate (training step, then each side) and the median of the per-repeat ratios is
reported, so a burst of load elsewhere on the machine spoils one repeat, not the verdict. A table then gives each
part (phases 1–3, ΔH(η), the second order, the predictors, the attribution) and the whole probe, one column pair
per side: median seconds and median ratio to the training step of the same repeat. Targets: the whole default
probe ≤ 2.5 × the training step (the exit status), phases 1–3 ≤ 1.2 ×.
With error bars (the default) each E microbatch runs one forward and TWO backwards — ∇L_α' and ∇L_β; the second
gives each sequence's r_i = D_v L_β,i, without which the delete-one jackknife of SE_E is not exact (Ĥ moves in
every replicate) — against training's one forward and one backward; `--passes` times those passes on one E
microbatch. `--no-variance` times the run without error bars. `--compare-jvp` also times phases 1–3 with the
forward-mode (jvp) pieces. `--r-methods` also times phases 1–3 with `variance.r_method` backward and
central_difference (r_i from the ΔH(±η) passes, then one backward per E microbatch) side by side, ΔH at the
largest `--etas` only and the predictors off (their directions keep the second backward).
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
from typing import TYPE_CHECKING, Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from entropy_experiments.report.run_lines import sampler_lines

if TYPE_CHECKING:
    from entropy_experiments.data.batch import Batch

TARGET = 1.2        # phases 1–3 / training step
WHOLE_TARGET = 2.5  # the whole default probe (no loading or sampling) / training step


@dataclass
class DemoProbe:
    """The checkpoint loaded for the probe (`recipe.load_phase`) and the config it was loaded with."""

    config: Any      # ProbeConfig
    policy: Any      # probe.results.Policy: engine, trainable, optimizer


def demo_probe(args) -> DemoProbe:
    """`--checkpoint DIR` (else the embedded model's cached demo checkpoint) loaded on `--device`, with the default
    config's phases (importance at ±`--etas` when given) and the demo's data and reward."""
    from entropy_experiments.config import config_from_dict, load_config, packaged_config_path
    from entropy_experiments.make_checkpoint.trained import ensure_demo_checkpoint
    from entropy_experiments.probe import recipe
    from entropy_experiments.probe.parallel import SINGLE

    defaults = load_config(packaged_config_path("default")).to_dict()
    d = load_config(packaged_config_path("demo")).to_dict()
    for section in ("importance", "second_order", "predictors", "output"):
        d[section] = defaults[section]
    d["batch_config"].update({"B_E": args.B_E, "B_U": args.B_U, "G": args.G})
    d["generation"]["max_new_tokens"] = args.max_new_tokens
    if args.etas:
        d["importance"].update(eta_list=list(args.etas), symmetric=True)
    d["checkpoint"]["device_map"] = args.device
    if args.checkpoint:
        d["checkpoint"].update({"checkpoint_path": str(args.checkpoint), "base_model": None})
    else:
        d["checkpoint"]["checkpoint_path"] = str(ensure_demo_checkpoint(config_from_dict(d)))
    d["checkpoint"].update({"adapter_path": None, "optimizer_path": None})
    config = config_from_dict(d)
    return DemoProbe(config, recipe.load_phase(config, SINGLE, recipe.WarningLog()))


def sample_E_U(demo: DemoProbe) -> tuple[Batch, Batch]:
    """E and U as the probe samples them (`probe.sampling.sample_phase`) for the demo's batch_config."""
    from entropy_experiments.probe import recipe

    samples = recipe.sample_phase(demo.config, demo.policy.engine)
    return samples.E, samples.U


def training_step_seconds(demo: DemoProbe, E: Batch, U: Batch) -> dict[str, float]:
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


def probe_run(demo: DemoProbe, E: Batch, U: Batch, **sections: dict) -> dict:
    """results.json of `recipe.run` on the given batches and loaded model, with `sections` merged into the config."""
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.probe import recipe

    d = demo.config.to_dict()
    for section, values in sections.items():
        d[section].update(values)
    return recipe.run(config_from_dict(d), policy=demo.policy, batches=(E, U)).results


def phases_1_3_seconds(demo: DemoProbe, E: Batch, U: Batch, directional: str = "auto",
                       variance: bool = True) -> tuple[float, dict]:
    """(phases 1–3 seconds, results) with everything after phase 3 off."""
    results = probe_run(demo, E, U, variance={"directional": directional, "enabled": variance},
                        importance={"enabled": False}, second_order={"enabled": False},
                        predictors={"enabled": False})
    return results["timing"]["delta_h1_total"], results


R_METHODS = ("backward", "central_difference")


def r_method_runs(demo: DemoProbe, E: Batch, U: Batch, eta: float) -> dict[str, dict]:
    """{variance.r_method: results} with ΔH at ±`eta` only (the passes central_difference reuses for r_i), the
    second order, the predictors (whose directions keep the L_β backward) and the attribution off."""
    return {m: probe_run(demo, E, U, variance={"r_method": m}, importance={"eta_list": [eta], "symmetric": True},
                         second_order={"enabled": False}, predictors={"enabled": False},
                         output={"token_attribution": False}) for m in R_METHODS}


def r_method_lines(rows: list[dict[str, dict]], baseline: list[float]) -> list[str]:
    """Per r_method: median phases 1–3 / training step and (phases 1–3 + ΔH(±η)) / training step, SE_E, r's η."""
    lines = []
    for m in R_METHODS:
        p13 = statistics.median([r[m]["timing"]["delta_h1_total"] / b for r, b in zip(rows, baseline)])
        with_dh = statistics.median([(r[m]["timing"]["delta_h1_total"] + r[m]["timing"]["delta_h"]) / b
                                     for r, b in zip(rows, baseline)])
        last = rows[-1][m]
        lines.append(f"r_method {m}: phases 1–3 / training step = {p13:.2f}, with ΔH(±η) {with_dh:.2f}; "
                     f"SE_E {last['se']['E']:.6e}, δH₁ {last['deltaH1']:+.6e}, r's η {last['consistency']['r_eta']}")
    se = [rows[-1][m]["se"]["E"] for m in R_METHODS]
    lines.append(f"SE_E central_difference / backward − 1 = {se[1] / se[0] - 1:+.2e}")
    return lines


# the timing keys of phases 1–3 that the breakdown prints: the U side, the E pass and their total
PHASES_1_3 = ("update_direction", "e_pass_scoring", "e_pass_backward", "delta_h1_total")
PHASES = (("phases 1–3", "delta_h1_total"), ("ΔH(η)", "delta_h"), ("second order", "second_order"),
          ("predictors", "predictors"), ("attribution", "attribution"))

# the default of the previous release: three η at ±η, the second difference at two η, the predictors (and the
# field's proxies), and the token attribution by its own forward-mode pass along v
PREVIOUS_DEFAULT = {"importance": {"eta_list": [1e-6, 3e-6, 1e-5], "symmetric": True},
                    "second_order": {"method": "finite_difference", "eta_list": [3e-4, 1e-3]},
                    "predictors": {"enabled": True}, "output": {"token_attribution_method": "jvp"}}
JVP_SECOND_ORDER = {"second_order": {"method": "jvp"}}  # the release before: the exact nested jvp


def whole_probe(demo: DemoProbe, E: Batch, U: Batch, sides: dict[str, dict], variance: bool = True
                ) -> dict[str, dict]:
    """{side: results} of the whole probe (sampling and loading apart) under each side's config sections merged
    onto the default ({}: the default itself)."""
    out = {}
    for side, sections in sides.items():
        merged = {"variance": {"enabled": variance}}
        for section, values in sections.items():
            merged[section] = {**merged.get(section, {}), **values}
        out[side] = probe_run(demo, E, U, **merged)
    return out


def phase_seconds(results: dict) -> dict[str, float]:
    """Seconds per part (PHASES; 0 where the part did not run) and `whole probe` (the run's total: no loading or
    sampling happened in it)."""
    timing = results["timing"]
    out = {name: timing.get(key, 0.0) for name, key in PHASES}
    out["whole probe"] = timing["total"] - timing.get("sample", 0.0)
    return out


def passes_line(results: dict) -> str:
    """What a side measured: the no-grad passes of ΔH and of the second order, the predictors, the attribution."""
    so = results.get("second_order") or {}
    tokens = (results.get("attribution") or {}).get("E_tokens") or {}
    return (f"ΔH at η {[r['eta'] for r in results['true']]}; second order {so.get('method')} "
            f"(η {[r['eta'] for r in so.get('per_eta', [])]}); predictors {sorted(results.get('predictors') or [])}; "
            f"token dH by {tokens.get('dH_method')} (η {tokens.get('dH_eta')})")


def ratio_table(seconds: dict[str, list[dict[str, float]]], baseline: list[float]) -> list[str]:
    """Each part and the whole, one column pair per side: median seconds and median ratio to the training step
    of the same repeat."""
    sides = list(seconds)
    head = f"{'part':<32}" + "".join(f"{side + ' s':>22}{'×':>8}" for side in sides)
    lines = [head, f"{'training step (Dr-GRPO, E ∪ U)':<32}"
             + "".join(f"{statistics.median(baseline):>22.1f}{1.0:>8.2f}" for _ in sides)]
    for part in seconds[sides[0]][0]:
        row = f"{part:<32}"
        for side in sides:
            secs = statistics.median([s[part] for s in seconds[side]])
            ratio = statistics.median([s[part] / b for s, b in zip(seconds[side], baseline)])
            row += f"{secs:>22.1f}{ratio:>8.2f}"
        lines.append(row)
    return lines


def second_order_lines(runs: dict[str, dict]) -> list[str]:
    """d2 ± SE of each side's second order on the same E (the finite difference's per-η values and bias estimate)."""
    lines = []
    for side, results in runs.items():
        so = results.get("second_order")
        if not so:
            continue
        line = f"d2 ({side}, {so['method']}) = {so['d2']:+.5g} ± {so['se']:.3g}"
        if so["method"] == "finite_difference":
            line += f" at η {so['eta']:g}, bias estimate {so['bias_estimate']}; per η: " + ", ".join(
                f"{r['eta']:g}: {r['d2']:+.4g} ± {r['se']:.2g}" for r in so["per_eta"])
        lines.append(line)
    return lines


def profile_lines(breakdown: dict, train_parts: dict) -> str:
    """Where the ratio comes from (last repeat): each side's U and E parts; with U at par the ratio's floor is
    (U_train + E_probe) / total_train."""
    u_probe = breakdown.get("update_direction")
    e_probe = breakdown.get("e_pass_backward", 0.0) + breakdown.get("e_pass_scoring", 0.0)
    if u_probe is None or not e_probe:
        return "profile: n/a (no E timing)"
    floor = (train_parts["U"] + e_probe) / train_parts["total"]
    return (f"profile: U {u_probe:.1f} s (training {train_parts['U']:.1f} s); E {e_probe:.1f} s (training "
            f"{train_parts['E']:.1f} s, ×{e_probe / train_parts['E']:.2f}); with U at par the E side alone puts "
            f"the ratio at {floor:.2f}")


def pass_seconds(demo: DemoProbe, E: Batch) -> dict[str, float]:
    """The passes over ONE E microbatch (second of two timings each): the model's forward alone (logits of the
    scored positions, no token maths), a ΔH pass at θ + η·v (a parameter override), a no-grad forward, a forward
    with grad, the
    backward of L_α' and the backward of L_β — what a training step's forward + backward is made of, and why
    the exact pieces cost a second backward (r_i = D_v L_β,i exists only in a backward of L_β or a tangent)."""
    from entropy_experiments.estimators.delta_h import score_at_eta
    from entropy_experiments.estimators.entropy_gradient import e_microbatches
    from entropy_experiments.estimators.objective_gradient import Trainable
    from entropy_experiments.estimators.surrogate import (
        sequence_coefficients,
        surrogate_loss,
        weighted_logq_sum,
    )
    from entropy_experiments.policy.score import forward_logits
    from entropy_experiments.policy.tf_batches import tf_batches

    engine, options = demo.policy.engine, demo.config.entropy_options()
    trainable = Trainable.of(demo.policy.trainable.model)
    params = trainable.params
    demo_v = {n: torch.full_like(p, 1e-3) for n, p in zip(trainable.names, params)}  # any direction: cost only
    idx = e_microbatches(E.num_prompts, E.num_responses_per_prompt, options.microbatch_size)[0]
    seqs = E.subset(idx)
    rows = len(idx) * E.num_responses_per_prompt
    out: dict[str, float] = {}
    for _ in range(2):
        t_model = time.perf_counter()
        with torch.no_grad():
            for batch in tf_batches(seqs, rows, engine.device):
                forward_logits(engine.policy, batch, None, engine.precision.tf_nograd)
        t_eta = time.perf_counter()
        score_at_eta(engine, seqs, demo_v, 1e-5, tf_batch_size=rows)
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
        out = {"model forward alone (no token maths)": t_eta - t_model, "ΔH pass at θ + η·v": t0 - t_eta,
               "no-grad forward": t1 - t0, "forward with grad": t2 - t1, "backward L_α": t3 - t2,
               "backward L_β": t4 - t3}
    return out


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="checkpoint directory (default: the embedded model's cached demo checkpoint)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--B-E", dest="B_E", type=int, default=32)
    parser.add_argument("--B-U", dest="B_U", type=int, default=4)
    parser.add_argument("--G", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--etas", type=float, nargs="+", default=None,
                        help="importance.eta_list, measured at ±η (default: the default config's)")
    parser.add_argument("--compare-jvp", action="store_true", help="also time phases 1–3 with the jvp pieces")
    parser.add_argument("--no-previous", action="store_true", help="time the default alone, not the previous one")
    parser.add_argument("--compare-second-order", action="store_true",
                        help="also run the previous default with the exact (jvp) second order")
    parser.add_argument("--no-variance", action="store_true",
                        help="variance.enabled false: no pieces, E scored without grad then one backward")
    parser.add_argument("--passes", action="store_true", help="also time the passes over one E microbatch")
    parser.add_argument("--r-methods", action="store_true",
                        help="also time phases 1–3 with variance.r_method backward and central_difference (ΔH at "
                             "the largest --etas only, predictors off)")
    parser.add_argument("--threads", type=int, default=None)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    sides = {"default": {}}
    if not args.no_previous:
        sides["previous default"] = PREVIOUS_DEFAULT
    if args.compare_second_order:
        sides["previous, jvp second order"] = {**PREVIOUS_DEFAULT, **JVP_SECOND_ORDER}
    demo = demo_probe(args)
    t0 = time.perf_counter()
    E, U = sample_E_U(demo)
    print(f"sampled E ({E.count_tokens()} response tokens, {E.sequences.shape}) and U "
          f"({U.count_tokens()} response tokens, {U.sequences.shape}) in {time.perf_counter() - t0:.0f} s on "
          f"{args.device}; threads {torch.get_num_threads()}; load average {os.getloadavg()[0]:.1f}", flush=True)

    baseline, seconds, jvp, runs, train_parts, r_rows = [], {s: [] for s in sides}, [], {}, {}, []
    for rep in range(args.repeats):
        train_parts = training_step_seconds(demo, E, U)
        baseline.append(train_parts["total"])
        runs = whole_probe(demo, E, U, sides, variance=not args.no_variance)
        for side, results in runs.items():
            seconds[side].append(phase_seconds(results))
        line = f"repeat {rep + 1}: training step {baseline[-1]:.1f} s; " + "; ".join(
            f"{side}: whole {seconds[side][-1]['whole probe']:.1f} s" for side in sides)
        if args.compare_jvp:
            jvp.append(phases_1_3_seconds(demo, E, U, "jvp", variance=not args.no_variance)[0])
            line += f", phases 1–3 with jvp pieces {jvp[-1]:.1f} s"
        if args.r_methods:
            r_rows.append(r_method_runs(demo, E, U, max(args.etas or [1e-5])))
            line += ", phases 1–3 " + ", ".join(f"({m}) {r_rows[-1][m]['timing']['delta_h1_total']:.1f} s"
                                                for m in R_METHODS)
        print(line + f" (load average {os.getloadavg()[0]:.1f})", flush=True)

    results = runs["default"]
    breakdown = {k: round(v, 1) for k, v in results["timing"].items() if k in PHASES_1_3}
    print(f"phases 1–3 breakdown (last repeat, s): {breakdown}")
    print(profile_lines(breakdown, train_parts))
    if args.passes:
        passes = pass_seconds(demo, E)
        print("one E microbatch: " + ", ".join(f"{k} {v:.2f} s" for k, v in passes.items()))
    print(f"δH₁ = {results['deltaH1']:+.4e} ± {results['se'].get('total', float('nan')):.2e}, E pass: "
          f"{results.get('e_pass')}")
    for label, text in sampler_lines(results.get("sampler")):
        print(f"{label}: {text}")
    for side, side_results in runs.items():
        print(f"{side}: {passes_line(side_results)}")
    print("\n".join(second_order_lines(runs)))
    if r_rows:
        print("\n".join(r_method_lines(r_rows, baseline)))
    if jvp:
        jvp_ratio = statistics.median([j / b for j, b in zip(jvp, baseline)])
        print(f"phases 1–3 with jvp pieces / training step = {jvp_ratio:.2f} (reference)")
    print("\n".join(ratio_table(seconds, baseline)))
    p13 = [s["phases 1–3"] for s in seconds["default"]]
    b, o = statistics.median(baseline), statistics.median(p13)
    print_verdict("phases 1–3 / training step", [o_ / b_ for o_, b_ in zip(p13, baseline)], TARGET,
                  f"; medians {o:.1f} s / {b:.1f} s")
    whole = [s["whole probe"] for s in seconds["default"]]
    return print_verdict("whole default probe / training step", [w / b_ for w, b_ in zip(whole, baseline)],
                         WHOLE_TARGET)


def print_verdict(what: str, ratios: list[float], limit: float, detail: str = "") -> int:
    """Print `what = median (median of the per-repeat ratios…) (target ≤ limit) PASS|FAIL`; 0 if met, else 1."""
    ratio = statistics.median(ratios)
    verdict = "PASS" if ratio <= limit else "FAIL"
    print(f"{what} = {ratio:.2f} (median of {[round(x, 2) for x in ratios]}{detail})  (target ≤ {limit})  {verdict}")
    return 0 if ratio <= limit else 1


if __name__ == "__main__":
    sys.exit(main())

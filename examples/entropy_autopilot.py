"""Entropy control in real TRL GRPO runs: no control, TRL's adaptive entropy bonus, and `EntropyAutopilot`.

    OMP_NUM_THREADS=1 .venv/bin/python examples/entropy_autopilot.py --world toy [--steps 12] [--lr 2e-2]
        [--seeds 0,1,2,3] [--arms none,trl_default,trl_tuned,autopilot[,oracle]] [--tuned-delta 0.05]
        [--world-seed 2 | --world-seed 0,1,2,...] [--plot docs/entropy_autopilot.png] [--json out.json]
    OMP_NUM_THREADS=2 .venv/bin/python examples/entropy_autopilot.py --world embedded --steps 8 --lr 5e-4 --seeds 0

Worlds:
    toy       testing/enumerable_world.py: the 4-token toy LM under a LoRA r = 8, reward "the completion contains
              the word a", 8 prompts × 8 completions per step. Exact entropy H and exact expected reward R after
              every step, by enumeration (the yardstick owes nothing to the probe).
    embedded  the embedded SmolLM2-135M-Instruct under a LoRA r = 8, GSM-symbolic prompts, 16-token completions
              and the `math_density` reward (the share of digits and arithmetic symbols), 2 prompts × 4
              completions per step. Every arm carries the `trainer_step` probe callback (an observer that does
              not change a step, or the autopilot itself), so its entropy path is the running sum of the paired
              realised changes; the reward is TRL's logged mean reward.

Arms (same seed, same model): none; TRL's `use_adaptive_entropy` at its default δ (0.005) and at --tuned-delta,
both with the target H₀; `EntropyAutopilot(trainer, target="initial")` at its defaults; in the toy world only and
on request, "oracle" (testing/oracle_hold.py): after every step the exact entropy put back on H₀ along the exact
entropy gradient made orthogonal to the exact reward gradient, the reward a direction controller with perfect
information keeps. Prints per arm the rms deviation of H from H₀ over the steps, the reward gain, the lr
multiplier's mean, the steps with an entropy term, and the wall time, then each arm's ratios to no control (and
to the TRL arm at --tuned-delta) per world; draws entropy and reward per step (one panel each, all arms, the
first world and seed) to --plot. Several --world-seed values survey several enumerable worlds in one run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TRL_DEFAULT_DELTA = 0.005
ARMS = ("none", "trl_default", "trl_tuned", "autopilot")
TOY_ONLY = ("oracle",)  # needs the exact gradients only the enumerable world has
EMBEDDED = {"prompts_per_step": 2, "G": 4, "max_new": 16, "B_E": 16}


def trl_settings(arm: str, target: float, tuned_delta: float) -> dict:
    """GRPOConfig fields of a TRL arm (none for the others)."""
    delta = {"trl_default": TRL_DEFAULT_DELTA, "trl_tuned": tuned_delta}.get(arm)
    return {} if delta is None else {"use_adaptive_entropy": True, "entropy_target": target,
                                     "entropy_coef_delta": delta}


def quiet(trainer) -> None:
    """No per-step log dicts on the console (the summary lines are the output)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    for callback in (PrinterCallback, ProgressCallback):
        trainer.remove_callback(callback)


def toy_arm(arm: str, model_dir: Path, out: Path, args, seed: int, H0: float) -> dict:
    """One arm in the enumerable world: its exact H and R per step, rows, wall time."""
    from entropy_experiments.integrations.autopilot import EntropyAutopilot
    from entropy_experiments.testing.enumerable_world import world_trainer

    trainer, meter = world_trainer(model_dir, out, steps=args.steps, lr=args.lr, seed=seed,
                                   **trl_settings(arm, H0, args.tuned_delta))
    quiet(trainer)
    pilot = EntropyAutopilot(trainer, target="initial", seed=seed, **args.options) if arm == "autopilot" else None
    if pilot is not None:
        trainer.add_callback(pilot)
    if arm == "oracle":
        from entropy_experiments.testing.oracle_hold import OracleHold

        trainer.add_callback(OracleHold(trainer))
    t0 = time.perf_counter()
    trainer.train()
    return {"arm": arm, "seed": seed, "H": meter.H, "R": meter.R, "wall": time.perf_counter() - t0,
            "rows": [r for r in (pilot.rows if pilot else []) if "realised" in r]}


def embedded_trainer(model_dir: Path, out: Path, steps: int, lr: float, seed: int, **overrides):
    from datasets import Dataset

    from entropy_experiments.data.datasets import load_examples
    from entropy_experiments.testing.trl_run import cpu_grpo_trainer, math_density_reward

    questions = [ex.question for ex in load_examples("gsm_symbolic_r1_template", "train", pool_size=200)]
    return cpu_grpo_trainer(model_dir, out, reward_funcs=math_density_reward,
                            train_dataset=Dataset.from_dict({"prompt": questions}), steps=steps, learning_rate=lr,
                            num_generations=EMBEDDED["G"], prompts_per_step=EMBEDDED["prompts_per_step"],
                            max_completion_length=EMBEDDED["max_new"], seed=seed, save_strategy="no",
                            temperature=1.0, top_p=1.0, top_k=0, gradient_checkpointing=False, **overrides)


def embedded_arm(arm: str, model_dir: Path, out: Path, args, seed: int, H0: float) -> dict:
    """One arm on the embedded model: H₀ + the running sum of paired realised changes, TRL's logged reward."""
    from entropy_experiments.integrations.autopilot import EntropyAutopilot
    from entropy_experiments.integrations.trl_callback import EntropyProbeCallback

    trainer = embedded_trainer(model_dir, out, args.steps, args.lr, seed, **trl_settings(arm, H0, args.tuned_delta))
    quiet(trainer)
    probe = (EntropyAutopilot(trainer, target="initial", seed=seed, **{"B_E": EMBEDDED["B_E"], **args.options})
             if arm == "autopilot" else
             EntropyProbeCallback(trainer, every=1, predict="trainer_step", seed=seed, B_E=EMBEDDED["B_E"]))
    trainer.add_callback(probe)
    t0 = time.perf_counter()
    trainer.train()
    rows = [r for r in probe.rows if "realised" in r]
    start = rows[0]["H"] if rows else math.nan
    H = [start]
    for row in rows:
        H.append(H[-1] + row["realised"])
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {"arm": arm, "seed": seed, "H": H, "R": rewards, "wall": time.perf_counter() - t0, "rows": rows,
            "probe_seconds": probe.probe_seconds}


def summary(run: dict, world: str) -> dict:
    """rms |H − H₀| over the steps, the reward gain, Σ‖Δθ‖ and the autopilot's levers (and the run's world)."""
    H, R, rows = run["H"], run["R"], run["rows"]
    rms = math.sqrt(sum((h - H[0]) ** 2 for h in H[1:]) / max(len(H) - 1, 1))
    if world == "toy":
        gain = R[-1] - R[0]
    else:  # TRL's logged reward is noisy per step: the mean of the last three against the first three
        gain = sum(R[-3:]) / len(R[-3:]) - sum(R[:3]) / len(R[:3])
    multipliers = [r.get("lr_multiplier", 1.0) for r in rows] or [1.0]
    return {"world": run.get("world"), "arm": run["arm"], "seed": run["seed"], "rms": rms, "gain": gain, "H_end": H[-1],
            "m_mean": sum(multipliers) / len(multipliers), "terms": sum(bool(r.get("entropy_term")) for r in rows),
            "step_norm": sum(r.get("step_norm", 0.0) for r in rows), "wall": run["wall"]}


def arm_means(summaries: list[dict]) -> dict[str, dict[str, float]]:
    """{arm: its means over the seeds} of one world's summaries, the arms in the order they ran."""
    keys = ("rms", "gain", "H_end", "m_mean", "terms", "wall")
    means = {}
    for arm in dict.fromkeys(s["arm"] for s in summaries):
        rows = [s for s in summaries if s["arm"] == arm]
        means[arm] = {k: sum(r[k] for r in rows) / len(rows) for k in keys}
    return means


def table(summaries: list[dict]) -> str:
    """Means over the seeds per arm (one world) as a Markdown table (rms per seed in brackets)."""
    head = ("| arm | rms \\|H − H₀\\| (per seed) | reward gain | H end | mean lr multiplier | steps with a term "
            "| wall s / run |")
    lines = [head, "|---|---|---|---|---|---|---|"]
    for arm, mean in arm_means(summaries).items():
        per_seed = ", ".join(f"{r['rms']:.2f}" for r in summaries if r["arm"] == arm)
        lines.append(f"| {arm} | {mean['rms']:.3f} ({per_seed}) "
                     f"| {mean['gain']:+.3f} | {mean['H_end']:.3f} | {mean['m_mean']:.2f} | {mean['terms']:.1f} "
                     f"| {mean['wall']:.1f} |")
    return "\n".join(lines)


def ratios(summaries: list[dict]) -> str:
    """Per world and arm, the means over the seeds as ratios: rms to no control's and to trl_tuned's, reward gain
    to no control's (a ratio is left blank where its reference arm did not run)."""
    lines = ["| world | arm | rms / none's | rms / trl_tuned's | reward gain / none's |", "|---|---|---|---|---|"]
    for world in dict.fromkeys(s["world"] for s in summaries):
        mean = arm_means([s for s in summaries if s["world"] == world])
        for arm in mean:
            lines.append(f"| {'embedded' if world is None else world} | {arm} | {ratio(mean, arm, 'rms', 'none')} "
                         f"| {ratio(mean, arm, 'rms', 'trl_tuned')} | {ratio(mean, arm, 'gain', 'none')} |")
    return "\n".join(lines)


def ratio(mean: dict, arm: str, key: str, reference: str) -> str:
    """mean[arm][key] / mean[reference][key] to 2 decimals; blank for the reference itself or where it is absent."""
    ref = mean.get(reference, {}).get(key)
    return "" if ref is None or arm == reference or ref == 0 else f"{mean[arm][key] / ref:.2f}"


def plot(runs: list[dict], path: Path, world: str) -> None:
    """Entropy and reward against the step, one panel each, every arm of the first world and seed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    first = runs[0]["world"], runs[0]["seed"]
    for run in (r for r in runs if (r["world"], r["seed"]) == first):
        axes[0].plot(range(len(run["H"])), run["H"], marker=".", label=run["arm"])
        offset = 0 if world == "toy" else 1
        axes[1].plot(range(offset, len(run["R"]) + offset), run["R"], marker=".", label=run["arm"])
    axes[0].axhline(runs[0]["H"][0], color="grey", ls="--", lw=1, label="target H₀")
    names = (("exact entropy (nats/token)", "exact expected reward") if world == "toy" else
             ("H₀ + Σ paired realised ΔH (nats/token)", "TRL's logged mean reward"))
    for ax, title in zip(axes, names):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def initial_entropy(world: str, model_dir: Path, tmp: Path, args, seed: int) -> float:
    """H₀, the target of every arm: exact (toy) or the probe's Ĥ before the first step of an uncontrolled run."""
    if world == "toy":
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from entropy_experiments.testing.enumerable_world import exact_entropy_and_reward

        model = AutoModelForCausalLM.from_pretrained(model_dir)
        return exact_entropy_and_reward(model, AutoTokenizer.from_pretrained(model_dir))[0]
    return embedded_arm("none", model_dir, tmp / f"h0_{seed}", argparse.Namespace(**{**vars(args), "steps": 1}),
                        seed, 0.0)["H"][0]


def run_all(args, tmp: Path) -> tuple[list[dict], list[dict]]:
    """Every arm for every trainer seed, in every world asked for (the toy's --world-seed values; the embedded
    model is one world)."""
    runs, summaries = [], []
    for world in args.world_seed or [None]:
        if args.world == "toy":
            from entropy_experiments.testing.enumerable_world import world_model

            model_dir, arm_of = world_model(tmp / f"toy{world}", world), toy_arm
        else:
            from entropy_experiments.models.embedded import ensure_embedded_model

            model_dir, arm_of = ensure_embedded_model(), embedded_arm
        for seed in (int(s) for s in args.seeds.split(",")):
            H0 = initial_entropy(args.world, model_dir, tmp, args, seed)
            for arm in args.arms.split(","):
                runs.append({"world": world, **arm_of(arm, model_dir, tmp / f"{arm}{world}_{seed}", args, seed, H0)})
                summaries.append(summary(runs[-1], args.world))
                print(json.dumps(summaries[-1]), flush=True)
    return runs, summaries


def world_seeds(text: str) -> list[int]:
    """--world-seed: one seed or a comma-separated list (argparse reports a bad one in one line, exit 2)."""
    try:
        return [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a seed or a comma-separated list of seeds: {text!r}") from None


def main(argv=None) -> int:
    from entropy_experiments.testing.enumerable_world import WORLD_SEED

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", choices=("toy", "embedded"), default="toy")
    parser.add_argument("--world-seed", type=world_seeds, default=None,
                        help=f"toy: the seed of the toy model's initial weights, another enumerable world (default "
                             f"{WORLD_SEED}); several, comma-separated, survey several worlds")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--lr", type=float, default=2e-2)
    parser.add_argument("--seeds", default="0,1,2,3", help="trainer seeds; the arms share each")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--tuned-delta", type=float, default=0.05)
    parser.add_argument("--plot", default="")
    parser.add_argument("--json", default="", help="write every run (paths, rows) here")
    parser.add_argument("--options", type=json.loads, default={},
                        help='the autopilot\'s keywords as JSON, e.g. \'{"budget": 0.05}\' (default: its defaults)')
    args = parser.parse_args(argv)
    if args.world != "toy" and args.world_seed is not None:
        print(f"error: --world-seed: the {args.world} world is one model; --world-seed builds enumerable worlds "
              f"(--world toy)", file=sys.stderr)
        return 2
    if args.world == "toy" and args.world_seed is None:
        args.world_seed = [WORLD_SEED]
    valid = ARMS + (TOY_ONLY if args.world == "toy" else ())
    unknown = [arm for arm in args.arms.split(",") if arm not in valid]
    if unknown:
        print(f"error: --arms: unknown arm {unknown[0]!r} in the {args.world} world (valid: {', '.join(valid)})",
              file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        runs, summaries = run_all(args, Path(tmp))
    for world in dict.fromkeys(s["world"] for s in summaries):
        if world is not None:
            print(f"world {world}:")
        print(table([s for s in summaries if s["world"] == world]))
    print(ratios(summaries))
    print(f"{args.world}: lr {args.lr}, {args.steps} steps, seeds {args.seeds}; {time.perf_counter() - t0:.0f} s")
    if args.plot:
        plot(runs, Path(args.plot), args.world)
    if args.json:
        Path(args.json).write_text(json.dumps({"summaries": summaries, "runs": runs}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

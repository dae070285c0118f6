"""Cost curves of the probe: time and peak memory per phase, swept over E, response length T
and model size, on random models of the real architectures (entropy_experiments/models/synthetic.py).

    .venv/bin/python bench/bench_scaling.py --quick            # 4 points: ≈ 4 min on 2 idle cores
    .venv/bin/python bench/bench_scaling.py                    # the full sweep, ≈ 46 min (README "Scaling")
    .venv/bin/python bench/bench_scaling.py --checkpoint qwen2.5-1.5b=DIR   # reuse a make-checkpoint output

Every point (model, E, T) runs in a fresh subprocess: the probe (`recipe.run`) with B_U = 2, G = 2, one η
(±), second order and predictors on, and each phase function wrapped to record its wall time and its peak
resident memory (VmHWM reset at the phase's start; on CUDA also torch's peak allocated bytes). Random
weights give near-uniform next-token distributions, so every response runs to exactly T tokens.

Output (in --out): points.json, a markdown table on stdout, the fitted exponents time ∝ E^a · T^b per phase
(least squares in log-log over the E and T sweeps) and time ∝ P^c over model size, and scaling.png (log-log).
Part 2 calls bench_sequence_processor's memory check (1024 tokens = 2 responses of T = 512 at V = 151,936:
the vocabulary-sized maths depends on V and the token count, not on the model's width) for the ≤ 1/32 target.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

# (phase label, module, function): the probe's phase functions, wrapped in the worker
PHASES = [
    ("sampling", "entropy_experiments.probe.recipe", "sample_phase"),
    ("U gradient + v", "entropy_experiments.probe.recipe", "update_phase"),
    ("E passes", "entropy_experiments.probe.e_pass", "one_pass_phase"),
    ("E passes", "entropy_experiments.probe.e_pass", "scored_pieces_phase"),
    ("ΔH per η", "entropy_experiments.probe.beyond", "delta_h_phase"),
    ("second order", "entropy_experiments.probe.beyond", "second_order_phase"),
    ("predictors", "entropy_experiments.probe.beyond", "predictors_phase"),
]
LABELS = list(dict.fromkeys(label for label, _, _ in PHASES))
ETA = 1.0e-5

# targets: (model, E, T) points run after the sweeps, outside the fits — the 1.5B probe under a
# memory budget (GB) that keeps its with-grad microbatches inside this machine's 24 GB beside 6.2 GB of weights
QUICK = {"E": [2, 4], "T": [32, 64], "models": ["smollm2-135m", "qwen2.5-0.5b"], "base": (2, 32), "targets": []}
FULL = {"E": [4, 8, 16, 32], "T": [32, 64, 128, 256, 512],
        "models": ["smollm2-135m", "smollm2-360m", "qwen2.5-0.5b", "qwen2.5-1.5b"], "base": (4, 64),
        "targets": [("qwen2.5-1.5b", 16, 128)]}
TARGET_BUDGET_GB = 12.0


# ------------------------------------------------------------------------------------ worker
def _rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status")


def _wrap(label: str, fn, record: dict):
    """fn timed, with the peak RSS (and CUDA peak allocated) during the call added to record[label]."""
    def timed(*args, **kwargs):
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current RSS
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = _rss_mb("VmRSS")
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn(*args, **kwargs)
        entry = record.setdefault(label, {"seconds": 0.0, "cpu_seconds": 0.0, "peak_rss_mb": 0.0, "calls": 0,
                                          "start_rss_mb": start})
        entry["seconds"] += time.perf_counter() - t0
        entry["cpu_seconds"] += time.process_time() - c0  # this process's CPU time: robust to other jobs
        entry["peak_rss_mb"] = max(entry["peak_rss_mb"], _rss_mb("VmHWM"))
        entry["calls"] += 1
        if torch.cuda.is_available():
            entry["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        return out
    return timed


def point_config(checkpoint: str, E: int, T: int, device: str, budget_gb: float | None = None):
    from entropy_experiments.config import config_from_dict

    return config_from_dict({
        "seed": 1,
        "checkpoint": {"checkpoint_path": checkpoint, "device_map": device},
        "batch_config": {"B_E": E, "B_U": 2, "G": 2},
        "generation": {"max_new_tokens": T, "gen_batch_size": max(4, E), "tf_batch_size": 4},
        "reward": {"name": "math_density"},
        "estimator": {"microbatch_size": 4, "memory_budget_gb": budget_gb},
        "importance": {"eta_list": [ETA], "symmetric": True},
        "second_order": {"enabled": True}, "predictors": {"enabled": True},
    })


def worker(checkpoint: str, E: int, T: int, device: str, budget_gb: float | None = None) -> dict:
    """Subprocess body: one probe run with every phase wrapped; the record as a dict."""
    import logging

    from entropy_experiments.probe import recipe

    logging.getLogger("entropy_experiments").setLevel(logging.WARNING)
    record: dict = {}
    for label, module_name, name in PHASES:
        module = importlib.import_module(module_name)
        if hasattr(module, name):  # names may move: a missing one is reported as absent
            setattr(module, name, _wrap(label, getattr(module, name), record))
    t0, shapes = time.perf_counter(), {}
    outcome = recipe.run(point_config(checkpoint, E, T, device, budget_gb),
                        on_batches=lambda e, u: shapes.update(E=e["sequences"].shape[-1], U=u["sequences"].shape[-1]))
    total = time.perf_counter() - t0
    record["estimate"] = budget_estimate(outcome.policy.trainable.model, shapes, T)
    record["total"] = {"seconds": total, "cpu_seconds": time.process_time(), "peak_rss_mb": _rss_mb("VmHWM"),
                       "calls": 1}
    if "ΔH per η" in record:
        for key in ("seconds", "cpu_seconds"):
            record["ΔH per η"][key] /= 2  # ±η: two no-grad passes over E
    lengths = [row["T"] for row in outcome.per_sequence_rows]  # random weights: every response runs to T
    return {"phases": record, "mean_E_length": sum(lengths) / max(1, len(lengths)),
            "timing": outcome.results.get("timing", {})}


def budget_estimate(model, positions: dict[str, int], T: int) -> dict:
    """policy/memory_budget.py's with-grad estimate for one microbatch of 4 sequences, to set beside the
    measured peak of the U and E phases (peak − RSS at the phase's start)."""
    from entropy_experiments.policy.memory_budget import ModelShape, grad_row_bytes

    shape = ModelShape.of(model)
    return {side: {"positions": S, "microbatch_mb": 4 * grad_row_bytes(shape, S, T) / 2**20}
            for side, S in positions.items()}


# ------------------------------------------------------------------------------------ driver
def ensure_checkpoint(name: str, cache: Path, given: dict[str, str]) -> str:
    """A one-step make-checkpoint --synthetic NAME (tiny batches), cached in cache/NAME."""
    if name in given:
        return given[name]
    out = cache / name
    if not (out / "checkpoint.json").is_file():
        subprocess.run([sys.executable, "-m", "entropy_experiments.cli", "make-checkpoint", "--synthetic", name,
                        "--out", str(out), "--steps", "1", "--set", "checkpoint.device_map=cpu",
                        "--set", "batch_config.B_U=2", "--set", "batch_config.G=2",
                        "--set", "generation.max_new_tokens=8", "--set", "estimator.microbatch_size=2"],
                       check=True, env=os.environ.copy())
    return str(out)


def run_point(model: str, checkpoint: str, E: int, T: int, device: str, budget_gb: float | None = None) -> dict:
    t0 = time.perf_counter()
    budget = [] if budget_gb is None else [str(budget_gb)]
    proc = subprocess.run([sys.executable, __file__, "--worker", checkpoint, str(E), str(T), device, *budget],
                          check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"point {model} E={E} T={T} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result.update(model=model, E=E, T=T, wall=time.perf_counter() - t0, memory_budget_gb=budget_gb)
    print(f"  {model} E={E} T={T}: {result['phases']['total']['seconds']:.1f}s, peak RSS "
          f"{result['phases']['total']['peak_rss_mb']:.0f} MB", flush=True)
    return result


def sweep_points(plan: dict) -> list[tuple[str, int, int]]:
    """(model, E, T): the E sweep and the T sweep on the first model, the model sweep at the base (E, T)."""
    E0, T0 = plan["base"]
    first = plan["models"][0]
    points = [(first, E, T0) for E in plan["E"]] + [(first, E0, T) for T in plan["T"]]
    points += [(m, E0, T0) for m in plan["models"]]
    return list(dict.fromkeys(points))


def _slope(xs: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of log y on log x (None with fewer than two distinct x)."""
    if len(set(xs)) < 2:
        return None
    x = torch.tensor(xs, dtype=torch.float64).log()
    y = torch.tensor(ys, dtype=torch.float64).log()
    xc = x - x.mean()
    return float((xc * (y - y.mean())).sum() / (xc * xc).sum())


def fit_exponents(points: list[dict], model: str, E0: int, T0: int) -> dict[str, tuple]:
    """Per phase: (a, b) of time ∝ E^a T^b — a from the E sweep at T0, b from the T sweep at E0 (None: not run)."""
    out = {}
    for label in [*LABELS, "total"]:
        rows = [p for p in points if p["model"] == model and label in p["phases"]]
        at_T0 = [p for p in rows if p["T"] == T0]
        at_E0 = [p for p in rows if p["E"] == E0]
        a = _slope([p["E"] for p in at_T0], [p["phases"][label]["seconds"] for p in at_T0])
        b = _slope([p["T"] for p in at_E0], [p["phases"][label]["seconds"] for p in at_E0])
        if a is not None or b is not None:
            out[label] = (a, b)
    return out


def fit_size_exponent(points: list[dict], params: dict[str, int], E0: int, T0: int) -> dict[str, float]:
    """Per phase: c of time ∝ P^c over the model sweep at (E0, T0)."""
    out = {}
    for label in [*LABELS, "total"]:
        rows = [p for p in points if p["E"] == E0 and p["T"] == T0 and label in p["phases"]]
        c = _slope([params[p["model"]] for p in rows], [p["phases"][label]["seconds"] for p in rows])
        if c is not None:
            out[label] = c
    return out


def print_table(points: list[dict], params: dict[str, int]) -> None:
    print("\n| model | params | E | T | " + " | ".join(f"{lab} s (MB)" for lab in [*LABELS, "total"]) + " |")
    print("|" + "---|" * (5 + len(LABELS)))
    for p in points:
        cells = []
        for label in [*LABELS, "total"]:
            entry = p["phases"].get(label)
            cells.append("—" if entry is None else f"{entry['seconds']:.1f} ({entry['peak_rss_mb']:.0f})")
        print(f"| {p['model']} | {params[p['model']] / 1e6:.0f}M | {p['E']} | {p['T']} | " + " | ".join(cells) + " |")


def print_budget_check(points: list[dict]) -> None:
    """The memory-budget estimate of a 4-sequence with-grad microbatch beside the measured peak − start RSS."""
    for p in points:
        estimate = p["phases"].get("estimate")
        if not estimate:
            continue
        cells = []
        for side, label in (("U", "U gradient + v"), ("E", "E passes")):
            entry = p["phases"].get(label)
            if entry and "start_rss_mb" in entry and side in estimate:
                measured = entry["peak_rss_mb"] - entry["start_rss_mb"]
                cells.append(f"{side} (S = {estimate[side]['positions']}): measured {measured:.0f} MB, estimate "
                             f"{estimate[side]['microbatch_mb']:.0f} MB")
        print(f"  budget check {p['model']} E={p['E']} T={p['T']}: " + "; ".join(cells))


def plot(points: list[dict], params: dict[str, int], plan: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    E0, T0 = plan["base"]
    first = plan["models"][0]
    sweeps = [("E", [p for p in points if p["model"] == first and p["T"] == T0], lambda p: p["E"]),
              ("T (response tokens)", [p for p in points if p["model"] == first and p["E"] == E0], lambda p: p["T"]),
              ("parameters", [p for p in points if p["E"] == E0 and p["T"] == T0], lambda p: params[p["model"]])]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (xlabel, rows, xof) in zip(axes, sweeps):
        rows = sorted(rows, key=xof)
        for label in [*LABELS, "total"]:
            pts = [(xof(p), p["phases"][label]["seconds"]) for p in rows if label in p["phases"]]
            if len(pts) >= 2:
                ax.loglog(*zip(*pts), marker="o", label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("seconds")
        ax.grid(True, which="both", alpha=0.3)
    if axes[0].get_legend_handles_labels()[0]:
        axes[0].legend(fontsize=7)
    fig.suptitle("entropy probe: time per phase (log-log; CPU, random models of the real architectures)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        checkpoint, E, T, device = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
        budget_gb = float(sys.argv[6]) if len(sys.argv) > 6 else None
        print(json.dumps(worker(checkpoint, E, T, device, budget_gb)))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the small sweep: 4 points (≈ 4 min on 2 idle cores; the full one ≈ 46 min)")
    parser.add_argument("--out", default="runs/bench_scaling")
    parser.add_argument("--cache", default=None, help="where the synthetic checkpoints are made (default OUT/ckpts)")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="use DIR (a make-checkpoint --synthetic NAME output) instead of making one")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip-memory", action="store_true", help="skip the vocabulary-maths memory check")
    parser.add_argument("--report-only", action="store_true", help="only re-report OUT/points.json")
    args = parser.parse_args()
    from entropy_experiments.models.synthetic import parameter_count, spec_named

    plan, out = (QUICK if args.quick else FULL), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cache = Path(args.cache) if args.cache else out / "ckpts"
    given = dict(item.split("=", 1) for item in args.checkpoint)
    params = {m: parameter_count(spec_named(m)) for m in plan["models"]}
    t0 = time.perf_counter()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load "
          f"{os.getloadavg()[0]:.1f}; {'quick' if args.quick else 'full'} sweep", flush=True)
    if args.report_only:
        report(json.loads((out / "points.json").read_text()), params, plan, out)
        return 0
    points = []
    for model, E, T in sweep_points(plan):
        points.append(run_point(model, ensure_checkpoint(model, cache, given), E, T, args.device))
        (out / "points.json").write_text(json.dumps(points, indent=1))
    for model, E, T in plan["targets"]:
        points.append(run_point(model, ensure_checkpoint(model, cache, given), E, T, args.device, TARGET_BUDGET_GB))
        (out / "points.json").write_text(json.dumps(points, indent=1))
    report(points, params, plan, out)
    ok, verdict = True, "skipped (--skip-memory)"
    if not args.skip_memory:
        import bench_sequence_processor

        ok = all(bench_sequence_processor.bench_memory(256))
        verdict = "met" if ok else "MISSED"
    print(f"sweep of {len(points)} points in {time.perf_counter() - t0:.0f}s; vocabulary-maths memory target {verdict}")
    return 0 if ok else 1


def report(points: list[dict], params: dict[str, int], plan: dict, out: Path) -> None:
    E0, T0 = plan["base"]
    print_table(points, params)
    print(f"\nexponents (time ∝ E^a · T^b on {plan['models'][0]}; time ∝ P^c over models at E={E0}, T={T0}):")
    ab = fit_exponents(points, plan["models"][0], E0, T0)
    c = fit_size_exponent(points, params, E0, T0)
    for label in [*LABELS, "total"]:
        a, b = ab.get(label, (None, None))
        print(f"  {label:15s} a = " + ("—" if a is None else f"{a:.2f}") + "  b = " + ("—" if b is None else f"{b:.2f}")
              + ("  c = —" if label not in c else f"  c = {c[label]:.2f}"))
    (out / "exponents.json").write_text(json.dumps({"E_T": ab, "params": c}, indent=1))
    print_budget_check(points)
    plot(points, params, plan, out / "scaling.png")
    print(f"plot: {out / 'scaling.png'}")


if __name__ == "__main__":
    raise SystemExit(main())

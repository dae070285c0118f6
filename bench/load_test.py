"""Load test: repeated tiny-model probe runs show no memory growth and identical numbers.

    .venv/bin/python bench/load_test.py [--fresh 50] [--in-process 20] [--workdir DIR] [--json OUT]

- fresh processes: `entropy-probe run` N times, each a new process with its own run directory; the peak
  RSS of each child comes from os.wait4 (ru_maxrss). Checks: every run exits 0, every results.json has
  identical numbers (timings and environment aside), and the peak RSS does not grow over the runs.
- one process: the model loaded once (`probe.recipe.run` hands back its policy), then `recipe.run` M times
  on it through the Python API. After each run: gc, RSS, the number of live torch tensors, the hooks registered on the
  model's modules, and a checksum of its parameters. Checks: identical numbers, a constant tensor count
  after the warm-up run (no leaked graphs), no hooks left, parameters untouched (no leaked overrides),
  and no RSS trend.

tests/test_load.py runs reduced counts in CI (ENTROPY_LOAD_FRESH / ENTROPY_LOAD_IN_PROCESS raise them) and checks
only the functional part there (exit codes, identical numbers, tensors, hooks, parameters): memory is measured here.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

RSS_SLACK_MB = 24.0  # allocator noise allowed between the early and the late runs


# RSS is noisy (allocator arenas, page-cache timing, other processes' pressure): a single late run above a
# single early one proves nothing, so the growth checks compare MEDIANS of several runs.
def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def grows(early: list[float], late: list[float], slack_mb: float = RSS_SLACK_MB) -> bool:
    """True when the median of the late runs exceeds the median of the early ones by more than slack_mb."""
    return median(late) > median(early) + slack_mb


def make_setup(workdir: Path) -> Path:
    """The tiny random Qwen2, a 1-step checkpoint and a probe config (no plot) in `workdir`."""
    from entropy_experiments.testing.tiny_model import build_tiny_model_dir
    from tests.run_helpers import make_run_setup

    model_dir = build_tiny_model_dir(workdir / "tiny_model")
    path, _ = make_run_setup(workdir / "setup", Path(model_dir))
    return path


def numbers(res: dict) -> str:
    from tests.run_helpers import numbers as pick

    return json.dumps(pick(res), sort_keys=True)


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def fresh_process_runs(config: Path, n: int, workdir: Path) -> list[dict]:
    from tests.run_helpers import cli_command, subprocess_env

    records = []
    for i in range(n):
        out = workdir / f"fresh_{i:03d}"
        log = open(workdir / f"fresh_{i:03d}.log", "w")  # noqa: SIM115 - closed below
        t0 = time.perf_counter()
        proc = subprocess.Popen(cli_command("run", "--config", str(config), "--out", str(out)), cwd=workdir,
                                env=subprocess_env(), stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.close()
        rec = {"run": i, "rc": proc.returncode, "seconds": time.perf_counter() - t0,
               "peak_rss_mb": usage.ru_maxrss / 1024}
        if proc.returncode == 0:
            rec["numbers"] = numbers(json.loads((out / "results.json").read_text()))
        records.append(rec)
        print(f"fresh {i:3d}: rc {rec['rc']}  peak RSS {rec['peak_rss_mb']:.1f} MB  {rec['seconds']:.1f} s",
              flush=True)
    return records


def _hooks(model) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
               + len(getattr(m, "_backward_pre_hooks", {})) for m in model.modules())


def in_process_runs(config: Path, n: int) -> list[dict]:
    import torch

    from entropy_experiments.config import load_config
    from entropy_experiments.probe import recipe

    probe_config, policy = load_config(config), None
    records = []
    checksum0 = hooks0 = None
    for i in range(n):
        outcome = recipe.run(probe_config, policy=policy)  # the first run loads the checkpoint
        policy, res, model = outcome.policy, outcome.results, outcome.policy.trainable.model
        del res["timing"], outcome
        gc.collect()
        with torch.no_grad():
            checksum = float(sum(p.double().sum() for p in model.parameters()))
        if checksum0 is None:
            checksum0, hooks0 = checksum, _hooks(model)
        rec = {"run": i, "rss_mb": _rss_mb(), "numbers": numbers(res),
               "live_tensors": sum(1 for o in gc.get_objects() if torch.is_tensor(o)),
               "hooks": _hooks(model), "hooks_before": hooks0, "params_changed": checksum != checksum0}
        records.append(rec)
        print(f"in-process {i:3d}: RSS {rec['rss_mb']:.1f} MB  live tensors {rec['live_tensors']}  "
              f"hooks {rec['hooks']}", flush=True)
    return records


def check_fresh(records: list[dict]) -> list[str]:
    problems = [f"run {r['run']} exited {r['rc']}" for r in records if r["rc"] != 0]
    if len({r.get("numbers") for r in records}) != 1:
        problems.append("results differ between fresh runs of the same seed")
    peaks = [r["peak_rss_mb"] for r in records]
    half = max(1, len(peaks) // 2)
    if grows(peaks[:half], peaks[half:] or peaks):
        problems.append(f"peak RSS grows: first half median {median(peaks[:half]):.1f} MB, "
                        f"second half median {median(peaks[half:] or peaks):.1f} MB")
    return problems


def check_in_process(records: list[dict]) -> list[str]:
    problems = []
    if len({r["numbers"] for r in records}) != 1:
        problems.append("results differ between in-process runs of the same seed")
    tensors = [r["live_tensors"] for r in records[1:]]
    if tensors and max(tensors) > tensors[0]:
        problems.append(f"live tensors grow after the warm-up run: {tensors}")
    if any(r["hooks"] != r["hooks_before"] for r in records):
        problems.append(f"hooks left on the model: {[r['hooks'] for r in records]}")
    if any(r["params_changed"] for r in records):
        problems.append("model parameters changed between runs (leaked override or step)")
    rss = [r["rss_mb"] for r in records[1:]]  # run 0 is the warm-up (first allocations, lazy imports)
    k = max(1, min(5, len(rss) // 3))
    if len(rss) >= 2 and grows(rss[:k], rss[-k:]):
        problems.append(f"RSS grows: median {median(rss[:k]):.1f} MB over runs 1–{k}, "
                        f"{median(rss[-k:]):.1f} MB over the last {k}")
    return problems


def summary(fresh: list[dict], inproc: list[dict]) -> dict:
    out = {}
    if fresh:
        peaks = [r["peak_rss_mb"] for r in fresh]
        out["fresh"] = {"runs": len(fresh), "ok": sum(r["rc"] == 0 for r in fresh),
                        "distinct_results": len({r.get("numbers") for r in fresh}),
                        "peak_rss_mb": {"min": min(peaks), "max": max(peaks), "first": peaks[0], "last": peaks[-1]},
                        "seconds_per_run": sum(r["seconds"] for r in fresh) / len(fresh)}
    if inproc:
        rss = [r["rss_mb"] for r in inproc]
        out["in_process"] = {"runs": len(inproc), "distinct_results": len({r["numbers"] for r in inproc}),
                             "rss_mb": {"after_run_0": rss[0], "after_run_1": rss[min(1, len(rss) - 1)],
                                        "last": rss[-1], "max": max(rss)},
                             "live_tensors": sorted({r["live_tensors"] for r in inproc}),
                             "hooks": sorted({r["hooks"] for r in inproc})}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fresh", type=int, default=50)
    parser.add_argument("--in-process", type=int, default=20)
    parser.add_argument("--workdir")
    parser.add_argument("--json", help="write the records and the summary here")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="entropy_load_"))
    workdir.mkdir(parents=True, exist_ok=True)
    config = make_setup(workdir)
    fresh = fresh_process_runs(config, args.fresh, workdir) if args.fresh else []
    inproc = in_process_runs(config, args.in_process) if args.in_process else []
    problems = (check_fresh(fresh) if fresh else []) + (check_in_process(inproc) if inproc else [])
    result = summary(fresh, inproc)
    result["problems"] = problems
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": result, "fresh": fresh, "in_process": inproc}, indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark: the probe on 2 CPU ranks (torchrun, gloo) vs 1 process on the same work.

    .venv/bin/python bench/bench_distributed.py [--model demo|tiny] [--B-E 8 --B-U 4 --G 2 --max-new-tokens 16]
                                                [--repeats 1] [--fresh]

Same work: one probe run makes E and U (saved batches); then `entropy-probe run --resume` on copies of
that run directory is timed on 1 process and under `torchrun --nproc_per_node=2`, so both sides
teacher-force, back-propagate and importance-sample exactly the same sequences. Both sides get the
same cores: the single process runs with OMP_NUM_THREADS = 2, each rank with 1 thread.

Printed: the wall time of each launch (process start-up and imports included) and the probe's own
`timing.total` from results.json (load + phases 1–5), and their ratios 2 ranks / 1 process (< 1: the
2-rank run is faster). The parity of δH₁ between the two is printed as a check. `--fresh` also times
fresh runs (sampling included; different samples, same sizes).

--model demo: the embedded SmolLM2-135M demo checkpoint (made once and cached, as `entropy-probe demo`
does); --model tiny: the tiny random Qwen2 of the test suite (start-up dominated; a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml


def _env(threads: int) -> dict:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": str(threads), "PYTHONPATH": os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])})
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args: list[str], nproc: int, cores: int) -> float:
    """Wall seconds of `entropy-probe ARGS` on `nproc` ranks (1: a plain process), `cores` threads in all."""
    if nproc == 1:
        cmd = [sys.executable, "-m", "entropy_experiments.cli", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
               f"--master_port={_port()}", "-m", "entropy_experiments.cli", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=_env(max(1, cores // nproc)), capture_output=True, text=True, cwd=REPO, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"launch failed ({' '.join(cmd)}):\n{proc.stderr[-3000:]}")
    return wall


def make_config(args, folder: Path) -> Path:
    if args.model == "demo":
        from entropy_experiments.config import load_config, packaged_config_path
        from entropy_experiments.make_checkpoint.trained import ensure_demo_checkpoint

        config = load_config(packaged_config_path("demo")).to_dict()
        ckpt = ensure_demo_checkpoint(load_config(packaged_config_path("demo")))
        config["checkpoint"].update({"checkpoint_path": str(ckpt), "adapter_path": str(ckpt / "model"),
                                     "optimizer_path": str(ckpt / "optimizer.pt")})
    else:
        from entropy_experiments.config import ProbeConfig, load_config
        from entropy_experiments.make_checkpoint.trained import make_checkpoint
        from entropy_experiments.testing.tiny_model import build_tiny_model_dir

        model = build_tiny_model_dir(folder / "tiny_model")
        data = folder / "prompts.jsonl"
        data.write_text("".join(json.dumps({"question": f"User: {i} + {i} =", "answer": str(2 * i)}) + "\n"
                                for i in range(64)))
        config = ProbeConfig().to_dict()
        config["checkpoint"].update({"base_model": str(model), "device_map": "cpu"})
        config["batch_config"].update({"dataset_name": "jsonl", "dataset_path": str(data)})
        config["reward"]["name"] = "math_density"
        (folder / "mk.yaml").write_text(yaml.safe_dump(config))
        make_checkpoint(folder / "ckpt", load_config(folder / "mk.yaml"), steps=1)
        config["checkpoint"]["checkpoint_path"] = str(folder / "ckpt")
    config["batch_config"].update({"B_E": args.B_E, "B_U": args.B_U, "G": args.G})
    config["generation"]["max_new_tokens"] = args.max_new_tokens
    config["estimator"]["microbatch_size"] = args.microbatch_size
    config["output"]["plot"] = False
    config["importance"].update({"eta_list": args.etas, "symmetric": False})
    path = folder / "probe.yaml"
    path.write_text(yaml.safe_dump(config, allow_unicode=True))
    return path


def _probe_seconds(run_dir: Path) -> tuple[float, float]:
    res = json.loads((run_dir / "results.json").read_text())
    return res["timing"]["total"], res["deltaH1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["demo", "tiny"], default="demo")
    parser.add_argument("--B-E", dest="B_E", type=int, default=8)
    parser.add_argument("--B-U", dest="B_U", type=int, default=4)
    parser.add_argument("--G", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--etas", type=float, nargs="+", default=[1.0e-4], help="importance.eta_list (one side)")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--cores", type=int, default=2, help="threads in all, shared by the ranks")
    parser.add_argument("--fresh", action="store_true", help="also time fresh runs (sampling included)")
    args = parser.parse_args()

    folder = Path(tempfile.mkdtemp(prefix="bench_dist_"))
    try:
        config = make_config(args, folder)
        print(f"model {args.model}: B_E {args.B_E}, B_U {args.B_U} × G {args.G}, max_new_tokens "
              f"{args.max_new_tokens}, {args.cores} cores", flush=True)
        base = folder / "base"
        fresh_wall_1 = launch(["run", "--config", str(config), "--out", str(base)], 1, args.cores)
        rows = {1: [], 2: []}
        for _ in range(args.repeats):
            for nproc in (1, 2):  # alternate, so that a burst of load elsewhere spoils one pair, not the verdict
                run = Path(shutil.copytree(base, folder / f"resume{nproc}_{len(rows[nproc])}"))
                (run / "results.json").unlink()
                wall = launch(["run", "--resume", str(run)], nproc, args.cores)
                probe_s, dh1 = _probe_seconds(run)
                rows[nproc].append((wall, probe_s, dh1))
        med = {n: (statistics.median(r[0] for r in rows[n]), statistics.median(r[1] for r in rows[n])) for n in rows}
        rel = abs(rows[2][0][2] - rows[1][0][2]) / abs(rows[1][0][2])
        print(f"same work (--resume on the same batches), median of {args.repeats}:")
        print(f"  1 process : wall {med[1][0]:7.1f} s   probe timing.total {med[1][1]:7.1f} s")
        print(f"  2 ranks   : wall {med[2][0]:7.1f} s   probe timing.total {med[2][1]:7.1f} s")
        print(f"  ratio 2 ranks / 1 process: wall {med[2][0] / med[1][0]:.2f}, probe {med[2][1] / med[1][1]:.2f}")
        print(f"  δH₁ parity: relative difference {rel:.1e}")
        if args.fresh:
            fresh_wall_2 = launch(["run", "--config", str(config), "--out", str(folder / "fresh2")], 2, args.cores)
            print(f"fresh runs (sampling included): wall 1 process {fresh_wall_1:.1f} s, 2 ranks "
                  f"{fresh_wall_2:.1f} s, ratio {fresh_wall_2 / fresh_wall_1:.2f}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()

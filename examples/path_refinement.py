"""Is a first-order miss on an interval higher order or a bug? Cut the step into K parts and sweep the path.

    .venv/bin/python examples/path_refinement.py --run runs/miniature_grpo/run --from 4 --parts 4 \
        --config runs/miniature_grpo/probe.yaml --out runs/path_4_5

Between checkpoint-N and checkpoint-(N+1) of a run the step is Δθ = θ_{N+1} − θ_N. This script writes K + 1
checkpoints on the straight path, OUT/path/checkpoint-j holding θ_N + (j − 1)/K · Δθ (checkpoint-N's files
with the adapter weights replaced; the last one is θ_{N+1} itself), and sweeps them with the run's probe config.
Each part's displacement predictor is then X̂(θ_N + t·Δθ) · Δθ/K, and the parts' sum is a Riemann sum of
∫₀¹ X̂(θ_N + t·Δθ)·Δθ dt = H(θ_{N+1}) − H(θ_N) (fundamental theorem of calculus, per E draw in expectation):

* if X̂ is right and the whole-step miss is higher order, the parts' first-order residuals shrink like 1/K²
  (second order ∝ ‖Δθ/K‖²), their z come back within ±2, and the sum of the parts' δH approaches the
  realised change of the whole step;
* if X̂ were biased, the sum would stay away from the realised change however fine the cut.

The sweep summary (printed) has one row per part; the last lines compare the sum with the whole step. The
sweep's U-noise columns (z_U, cos, norm ratio) compare the probe's whole AdamW step with a 1/K part and mean
nothing here (the script says so when it ends).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import yaml

ADAPTER = "adapter_model.safetensors"


def write_path(run: Path, start: int, parts: int, out: Path) -> Path:
    """OUT/checkpoint-1 … checkpoint-(parts + 1) on the straight path from checkpoint-start to the next one."""
    from safetensors.torch import load_file, save_file

    src, dst = run / f"checkpoint-{start}", run / f"checkpoint-{start + 1}"
    for where in (src, dst):
        if not (where / ADAPTER).is_file():
            sys.exit(f"error: {where / ADAPTER} not found (--run must hold checkpoint-{start} and -{start + 1})")
    theta0, theta1 = load_file(src / ADAPTER), load_file(dst / ADAPTER)
    if theta0.keys() != theta1.keys():
        sys.exit(f"error: {src} and {dst} hold different adapter parameters")
    for j in range(parts + 1):
        here = out / f"checkpoint-{j + 1}"
        shutil.copytree(src, here, ignore=shutil.ignore_patterns("training_args.bin", "rng_state*.pth"))
        t = j / parts
        save_file({k: (theta0[k] + t * (theta1[k] - theta0[k])).contiguous() for k in theta0}, here / ADAPTER)
        if j == parts:
            shutil.copy2(dst / ADAPTER, here / ADAPTER)  # the end point exactly, not a rounded sum
        state = json.loads((here / "trainer_state.json").read_text())
        state["global_step"] = j + 1
        (here / "trainer_state.json").write_text(json.dumps(state))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="the training run's output_dir (checkpoint-N/ …)")
    parser.add_argument("--from", dest="start", type=int, required=True, help="N: the step checkpoint-N → N+1")
    parser.add_argument("--parts", type=int, default=4)
    parser.add_argument("--config", required=True, help="the probe config the run was swept with")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    from entropy_experiments.cli import setup_logging
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.sweep import run_sweep

    if args.parts < 1:
        sys.exit(f"error: --parts {args.parts}: must be >= 1")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        sys.exit(f"error: {out} is not empty; choose another --out")
    setup_logging()
    path = write_path(Path(args.run), args.start, args.parts, out / "path")
    config = yaml.safe_load(Path(args.config).read_text())
    doc = run_sweep(config_from_dict(config), path, out=str(out / "sweep"))
    parts = doc["realised"]
    total = sum(p["displacement"]["value"] for p in parts)
    realised = sum(p["dH_realised"] for p in parts)
    print(f"\nnote: each part is 1/{args.parts} of one training step, while the sweep's U-noise columns (z_U, cos, "
          "norm ratio, K·lr·X̂·v) compare the probe's whole AdamW step with it: ignore them here.")
    print(f"step {args.start}→{args.start + 1} cut in {args.parts}: Σ parts' δH_Δθ/K = {total:+.5f}, "
          f"Σ parts' realised = {realised:+.5f}; per part z₁ = "
          + ", ".join(f"{p['first_order']['z']:+.2f}" for p in parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

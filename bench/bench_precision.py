"""bf16 base vs fp32 on the same samples: δH₁, SE_E, SE_U and ΔH(η) at η = lr, 10·lr, 100·lr.

    .venv/bin/python bench/bench_precision.py                      # the embedded SmolLM2-135M demo checkpoint
    .venv/bin/python bench/bench_precision.py --checkpoint DIR     # e.g. a make-checkpoint --synthetic output

The probe runs once with precision.runtime_dtype fp32 (sampling E and U), then again with runtime_dtype
bf16 (base weights bf16; adapter, θ + η·v, logits and all entropy maths fp32) on the SAME E and U batches,
so every difference is the precision's. Also ΔH at η = lr/1000 (where the true change is a thousandth of
δH₁'s): with a bf16 base that is the rounding floor. The numbers decide the guards in
checkpoint/runtime_precision.py (README "Scaling").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MULTIPLES = [1e-3, 1.0, 10.0, 100.0]


def probe_config(checkpoint: str, runtime_dtype: str, lr: float, args, allow_tf32: bool = False):
    from entropy_experiments.config import config_from_dict, load_config, packaged_config_path

    d = load_config(packaged_config_path("demo")).to_dict()
    d["checkpoint"].update(checkpoint_path=checkpoint, device_map=args.device, base_model=None)
    d["precision"]["allow_tf32"] = allow_tf32
    d["batch_config"].update(B_E=args.B_E, B_U=args.B_U, G=args.G)
    d["generation"]["max_new_tokens"] = args.T
    d["precision"]["runtime_dtype"] = runtime_dtype
    d["importance"].update(eta_list=[m * lr for m in MULTIPLES], symmetric=args.symmetric)
    d["second_order"]["enabled"] = False
    d["predictors"]["enabled"] = False
    return config_from_dict(d)


def summary(results: dict) -> dict:
    return {"deltaH1": results["deltaH1"], "SE_E": results["se"]["E"], "SE_U": results["se"]["U"],
            "deltaH": {f"{row['eta']:.3g}": (row["deltaH_true"], row["se"]) for row in results["true"]},
            "warnings": [w for w in results["warnings"] if "bf16" in w]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=None, help="checkpoint dir (default: the embedded demo checkpoint)")
    parser.add_argument("--lr", type=float, default=1e-5, help="the checkpoint's lr (make-checkpoint's default)")
    parser.add_argument("--B_E", type=int, default=32)
    parser.add_argument("--B_U", type=int, default=4)
    parser.add_argument("--G", type=int, default=4)
    parser.add_argument("--T", type=int, default=24)
    parser.add_argument("--symmetric", action="store_true", help="also ΔH at −η")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    parser.add_argument("--device", default="cpu", help="checkpoint.device_map (cpu, cuda)")
    parser.add_argument("--tf32", action="store_true", help="also fp32 with precision.allow_tf32 true (GPU)")
    args = parser.parse_args()
    from entropy_experiments.config import load_config, packaged_config_path
    from entropy_experiments.make_checkpoint.trained import ensure_demo_checkpoint
    from entropy_experiments.probe import recipe

    logging.basicConfig(level=logging.WARNING)
    checkpoint = args.checkpoint or str(ensure_demo_checkpoint(load_config(packaged_config_path("demo"))))
    batches = {}
    fp32 = recipe.run(probe_config(checkpoint, "fp32", args.lr, args),
                     on_batches=lambda E, U: batches.update(E=E, U=U)).results
    assert abs(fp32["learning_rate"] - args.lr) <= 1e-12 * args.lr, (fp32["learning_rate"], args.lr)
    bf16 = recipe.run(probe_config(checkpoint, "bf16", args.lr, args), batches=(batches["E"], batches["U"])).results
    table = {"fp32": summary(fp32), "bf16": summary(bf16), "lr": args.lr, "checkpoint": checkpoint,
             "sizes": {"B_E": args.B_E, "B_U": args.B_U, "G": args.G, "T": args.T},
             "seconds": {"fp32": phase_seconds(fp32), "bf16": phase_seconds(bf16)}}
    print_table(table)
    if args.tf32:
        tf32 = recipe.run(probe_config(checkpoint, "fp32", args.lr, args, allow_tf32=True),
                         batches=(batches["E"], batches["U"])).results
        table["fp32_tf32"], table["seconds"]["fp32_tf32"] = summary(tf32), phase_seconds(tf32)
        print_table({**table, "bf16": table["fp32_tf32"]}, "fp32 + TF32")
    print("seconds (phases after sampling):", {k: round(v, 2) for k, v in table["seconds"].items()})
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))
    return 0


def phase_seconds(results: dict) -> float:
    """Seconds of the run's phases after sampling (loading and sampling apart)."""
    timing = results["timing"]
    return timing["total"] - timing.get("load", 0.0) - timing.get("sample", 0.0)


def print_table(table: dict, other: str = "bf16 base") -> None:
    a, b = table["fp32"], table["bf16"]
    print(f"\n| quantity | fp32 | {other} | {other} − fp32 | relative | ({other} − fp32) / SE |  (lr = {table['lr']:g})")
    print("|---|---|---|---|---|---|")
    se_total = (a["SE_E"] ** 2 + a["SE_U"] ** 2) ** 0.5
    for key in ("deltaH1", "SE_E", "SE_U"):
        diff = b[key] - a[key]
        print(f"| {key} | {a[key]:+.4e} | {b[key]:+.4e} | {diff:+.2e} | {diff / abs(a[key]):+.2e} | "
              f"{diff / se_total:+.3f} |")
    for eta, (value, se) in a["deltaH"].items():
        other, _ = b["deltaH"][eta]
        diff = other - value
        print(f"| ΔH(η = {eta}) | {value:+.4e} ± {se:.1e} | {other:+.4e} | {diff:+.2e} | {diff / abs(value):+.2e} | "
              f"{diff / se if se > 0 else float('nan'):+.3f} |")
    for w in b["warnings"]:
        print("bf16 warning:", w)


if __name__ == "__main__":
    raise SystemExit(main())

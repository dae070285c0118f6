"""ΔH(η) under different floating-point reduction orders, against float64 scoring and the rounding floor.

    .venv/bin/python bench/delta_h_rounding.py [--etas 1e-5 1e-4 1e-3 1e-2] [--B-E 4] [--max-new-tokens 8]

The tiny run of tests/test_cuda.py (the same prompts, checkpoint, seed and batches) is probed once on the CPU;
then E is re-scored at θ and at θ ± η·v in layouts that differ ONLY in how the sums are ordered — rows per
forward (`tf_batch_size` 1, 2, 4, 8: other matmul shapes and padding lengths), 1 or 2 threads, SDPA instead of eager
attention — and once with the model in float64 (the reference). Per η it prints ΔH of each
fp32 layout minus the float64 ΔH, their spread, and the rounding floor F of estimators/rounding_floor.py from the
per-token fp32 − fp64 rounding at θ (docs/maths.md §8).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch


def tiny_run(folder: Path, B_E: int, max_new_tokens: int, etas: list[float]):
    """The CPU probe of tests/test_cuda.py: (outcome, config, E)."""
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.probe import recipe
    from entropy_experiments.testing.tiny_model import build_tiny_model_dir
    from tests.run_helpers import make_run_setup

    model_dir = build_tiny_model_dir(folder / "tiny")
    _, d = make_run_setup(folder / "run", model_dir, estimator={"microbatch_size": 4},
                          batch_config={"B_E": B_E}, generation={"max_new_tokens": max_new_tokens},
                          importance={"eta_list": etas})
    config = config_from_dict(d)
    batches = {}
    outcome = recipe.run(config, on_batches=lambda E, U: batches.update(E=E, U=U))
    return outcome, config, batches["E"]


def delta_h_by_layout(engine, E, v, etas: list[float], tf: int | None, base=None) -> dict[float, float]:
    """ΔH(η) per η with the base and the η passes scored in `tf` rows per forward (base: given scores)."""
    from entropy_experiments.estimators.delta_h import measure_delta_h

    truth = measure_delta_h(engine, E, v, etas, normalize="per_token", base=base, tf_batch_size=tf)
    return {row["eta"]: row["deltaH_true"] for row in truth.rows}


def sdpa_engine(outcome, config, dtype: torch.dtype):
    """A policy engine over a copy of the probed model in `dtype` with SDPA attention (another reduction order
    than eager's; float64: the reference scoring — transformers' eager mask gives NaN rows in float64 with left
    padding)."""
    from entropy_experiments.policy.engine import PolicyEngine

    model = copy.deepcopy(outcome.policy.trainable.model).to(dtype)
    model.set_attn_implementation("sdpa")
    return PolicyEngine(model, outcome.policy.tokenizer, config.policy_settings())


def layouts(outcome, config, E, etas: list[float]) -> dict[str, dict[float, float]]:
    """{layout name: {η: ΔH}} for the fp32 layouts and float64."""
    engine, v = outcome.policy.engine, outcome.update_vector
    out = {}
    for tf in (1, 2, 4, 8):
        out[f"fp32 tf_batch {tf}"] = delta_h_by_layout(engine, E, v, etas, tf)
    torch.set_num_threads(2)
    out["fp32 tf_batch 8, 2 threads"] = delta_h_by_layout(engine, E, v, etas, 8)
    torch.set_num_threads(1)
    out["fp32 as the probe ran"] = {row["eta"]: row["deltaH_true"] for row in outcome.results["true"]}
    out["fp32 SDPA attention"] = delta_h_by_layout(sdpa_engine(outcome, config, torch.float32), E, v, etas, 8)
    v64 = {k: t.double() for k, t in v.items()}
    out["float64"] = delta_h_by_layout(sdpa_engine(outcome, config, torch.float64), E, v64, etas, 8)
    return out


def floor_of(outcome, config, E) -> dict[str, float]:
    """The rounding floor F (pooled per-token and realised) from fp32 − fp64 scores at θ."""
    from entropy_experiments.estimators.rounding_floor import (
        delta_h_rounding_floor,
        per_token_rounding,
        realised_rounding_floor,
    )
    from entropy_experiments.estimators.sequence_scores import score_sequences

    s32 = score_sequences(outcome.policy.engine, E, tf_batch_size=8)
    s64 = score_sequences(sdpa_engine(outcome, config, torch.float64), E, tf_batch_size=8)
    var_h = per_token_rounding(s32.token_entropies, s64.token_entropies)
    var_l = per_token_rounding(s32.token_logqs, s64.token_logqs)
    err_h = [a - b for a, b in zip(s32.token_entropies, s64.token_entropies)]
    err_l = [a - b for a, b in zip(s32.token_logqs, s64.token_logqs)]
    return {"sigma_H": var_h ** 0.5, "sigma_logq": var_l ** 0.5, "tokens": float(s64.lengths.sum()),
            "F": delta_h_rounding_floor(s64.seq_entropies, s64.lengths, var_h, var_l),
            "F_realised": realised_rounding_floor(s64.seq_entropies, s64.lengths, err_h, err_l)}


def report(table: dict[str, dict[float, float]], floor: dict[str, float], etas: list[float]) -> None:
    ref = table["float64"]
    print(f"per-token rounding (fp32 − fp64 at θ): σ_H {floor['sigma_H']:.2e}, σ_ℓ {floor['sigma_logq']:.2e} "
          f"over {floor['tokens']:.0f} tokens; floor F = {floor['F']:.2e} (realised {floor['F_realised']:.2e})")
    print("| layout | " + " | ".join(f"η = {e:g}" for e in etas) + " |")
    print("|---|" + "---|" * len(etas))
    print("| ΔH float64 | " + " | ".join(f"{ref[e]:+.5e}" for e in etas) + " |")
    for name, row in table.items():
        if name != "float64":
            print(f"| {name} − float64 | " + " | ".join(f"{row[e] - ref[e]:+.2e}" for e in etas) + " |")
    fp32 = [name for name in table if name != "float64"]
    spread = {e: float(np.std([table[n][e] for n in fp32], ddof=1)) for e in etas}
    worst = {e: max(abs(table[a][e] - table[b][e]) for a in fp32 for b in fp32) for e in etas}
    print("| SD across fp32 layouts | " + " | ".join(f"{spread[e]:.2e}" for e in etas) + " |")
    print("| largest fp32 − fp32 | " + " | ".join(f"{worst[e]:.2e}" for e in etas) + " |")
    print("| largest / (√2·F) | " + " | ".join(f"{worst[e] / (2 ** 0.5 * floor['F']):.2f}" for e in etas) + " |")
    print("| √2·F / abs(ΔH) | " + " | ".join(f"{2 ** 0.5 * floor['F'] / abs(ref[e]):.1e}" for e in etas) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--etas", type=float, nargs="+", default=[1e-5, 1e-4, 1e-3, 1e-2])
    parser.add_argument("--B-E", dest="B_E", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        outcome, config, E = tiny_run(Path(tmp), args.B_E, args.max_new_tokens, args.etas)
        etas = sorted(row["eta"] for row in outcome.results["true"])
        report(layouts(outcome, config, E, etas), floor_of(outcome, config, E), etas)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

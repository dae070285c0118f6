"""Shared by the report tests: a results dict shaped like a real run, and a check for leftover temp files."""

from __future__ import annotations

from pathlib import Path

import torch

from entropy_experiments.report.results_schema import SCHEMA_VERSION


def fake_results(**changes) -> dict:
    """A results dict shaped like a real per_token run on the embedded model (numbers are made up but consistent)."""
    lr, x_hat_dot_v = 1e-5, -12.3456
    true = []
    for eta, ratio, khat in [(-1e-5, 0.98, 0.12), (1e-6, 1.01, 0.05), (1e-5, 0.97, 0.21), (1e-4, 0.71, 0.93)]:
        true.append({
            "eta": eta, "deltaH_true": eta * x_hat_dot_v * ratio, "H_upd": 0.6123 + eta * x_hat_dot_v * ratio,
            "ess": 60.0 * (1 - khat / 2), "ess_frac": 0.9375 * (1 - khat / 2), "psis_khat": khat,
            "khat_threshold": 0.7, "logw": {"min": -0.31, "median": 0.002, "max": 0.27},
            "zero_weight_count": 2 if eta == 1e-4 else 0, "se": abs(eta * x_hat_dot_v) * 0.1,
        })
    res = {
        "schema_version": SCHEMA_VERSION, "deltaH1": lr * x_hat_dot_v, "x_hat_dot_v": x_hat_dot_v, "learning_rate": lr,
        "e_pass": "backward_hooks",
        "se": {"E": 1.5e-5, "U": 2.0e-5, "total": 2.5e-5},
        "H_orig": {"per_token": 0.61234, "per_sequence": 41.876},
        "true": true,
        "linearity": {"slope_through_origin": -9.1234, "loglog_slope": 1.043,
                      "symmetric_slopes": [{"eta": 1e-5, "slope": -12.05}]},
        "counts": {"B_E": 64, "unique_E_prompts": 61, "B_U": 8, "G": 4, "E_tokens": 4380, "U_tokens": 2210,
                   "zero_advantage_prompts": 3},
        "update": {"direction": "adamw_step", "norm": 153.2, "grad_norm": 0.8765, "clipped": False,
                   "hyperparameters": {"beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.01}},
        "timing": {"sampling": 12.5, "x_hat": 3.1, "snis": 4.4, "total": 20.0},
        "environment": {"versions": {"torch": torch.__version__}, "device": "cpu",
                        "dtypes": {"runtime": "float32"}, "seeds": {"seed": 42}},
        "config_hash": "0123456789abcdef", "normalize": "per_token",
        "warnings": ["k̂ > 0.7 at η=0.0001: ΔH(η) is unreliable there"],
        "checkpoint": "runs/step_40",
    }
    res.update(changes)
    return res


def no_temp_files(directory: Path) -> bool:
    """Whether `directory` (recursively) holds no temp file of an atomic write."""
    return not [p for p in directory.rglob("*") if p.name.endswith(".tmp")]

"""A probe run against one recorded on another machine (tests/fixtures/probe_fp32_run.json): the same config,
checkpoint and token ids, but other CPU kernels (AVX2, AVX-512, the scalar `default` set: ATEN_CPU_CAPABILITY),
so other reduction orders and other fp32 roundings. Every float is compared within a tolerance that follows from
fp32 rounding measured on this run's own E (estimators/rounding_floor.py, docs/maths.md §8), never with `==`:

* the fields tests/device_comparison.py checks between a CPU and a GPU, predictors aside (δH₁ to
  `GRADIENT_REL`, SEs to `SE_REL`, ΔH(η) to rel·|ΔH| + Z·√2·F, d2);
* every other float to `SE_REL` of its size (the loosest of those tolerances), plus an absolute part for the
  numbers that are differences of rounded numbers: ΔH's own tolerance for H_upd and the residual (ΔH − its
  prediction) and the residual's z; Z·2·σ_ℓ·√T for a sequence's log w (two scorings per run, two runs);
  `GRADIENT_REL` of the scale a sum cancels from for the attribution sums, the predictors' slopes and SEs and
  `consistency.relative_difference`; `ILL_CONDITIONED_REL` for a predictor the probe flags as dominated by
  entries divided by AdamW's ε.

Measured from the AVX2 recording: AVX-512 moves δH₁ by 3e-7 relative, the scalar set by 1.1e-5, ΔH(±1e-3) by
up to 0.8·√2·F, the flagged no_momentum predictor by 0.9 %; each well inside its tolerance.

Strings, ints, bools and None are compared exactly: they carry no rounding (token ids: see the test).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from entropy_experiments.config import config_from_dict
from entropy_experiments.data.batch import Batch
from entropy_experiments.estimators.rounding_floor import delta_h_rounding_floor, delta_h_tolerance
from entropy_experiments.probe import recipe as probe
from entropy_experiments.probe.results import WarningLog
from tests.device_comparison import GRADIENT_REL, SE_REL, Z, differences, token_rounding

ILL_CONDITIONED_REL = 0.05


@dataclass(frozen=True)
class Rounding:
    """F (ΔH's rounding floor, nats per token) and the per-token fp32 − fp64 SDs of H and ℓ on a run's E."""
    floor: float
    sigma_h: float
    sigma_l: float


def measured_rounding(run_dir: Path) -> Rounding:
    """The fp32 rounding of the run's own E at θ, on this machine's kernels (tests/device_comparison.py)."""
    config = config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")))
    policy = probe.load_phase(config, probe.process_context(config), WarningLog())
    E = Batch.from_dict(torch.load(run_dir / "E_batch.pt", weights_only=True), "E_batch")
    var_h, var_l, s64 = token_rounding(policy, E, config)
    F = delta_h_rounding_floor(s64.seq_entropies, s64.lengths, var_h, var_l, normalize=config.estimator.normalize)
    return Rounding(F, math.sqrt(var_h), math.sqrt(var_l))


def _leaf_tolerance(path: tuple, slack: dict) -> float:
    """The absolute part of a float leaf's tolerance (0 for a plain quantity: SE_REL of its size only)."""
    return next((tol for prefix, tol in slack.items() if path[:len(prefix)] == prefix), 0.0)


def _compare(new, old, path: tuple, slack: dict, bad: list[str]) -> None:
    where = ".".join(map(str, path))
    if isinstance(old, dict):
        if not isinstance(new, dict):
            bad.append(f"{where}: {new!r} is not a dict")
            return
        for key, value in old.items():
            if key not in new:
                bad.append(f"{where}.{key} missing")
            else:
                _compare(new[key], value, (*path, key), slack, bad)
    elif isinstance(old, list):
        if not isinstance(new, list) or len(new) != len(old):
            bad.append(f"{where}: {len(new) if isinstance(new, list) else new!r} items, recorded {len(old)}")
            return
        for i, (a, b) in enumerate(zip(new, old)):
            _compare(a, b, (*path, i), slack, bad)
    elif isinstance(old, float) and isinstance(new, float) and math.isfinite(old):
        tol = SE_REL * max(abs(new), abs(old)) + _leaf_tolerance(path, slack)
        if not abs(new - old) <= tol:
            bad.append(f"{where}: {new!r} vs recorded {old!r} (tolerance {tol:.2e})")
    elif new != old or type(new) is not type(old):
        bad.append(f"{where}: {new!r} != recorded {old!r}")


def _slack(old_results: dict, old_rows: list[dict], r: Rounding) -> dict[tuple, float]:
    """{path prefix: absolute tolerance} for the leaves that are differences of rounded numbers."""
    slack = {}
    T_max = max(row["T"] for row in old_rows)
    for i, row in enumerate(old_results["true"]):
        dh = delta_h_tolerance(row["deltaH_true"], r.floor, z=Z)
        slack |= {("results", "true", i, key): dh for key in ("deltaH_true", "H_upd")}
        slack[("results", "true", i, "residual", "value")] = dh
        slack[("results", "true", i, "residual", "z")] = dh / row["residual"]["se"]
        slack[("results", "true", i, "logw")] = Z * 2.0 * r.sigma_l * math.sqrt(T_max)
    for j, row in enumerate(old_rows):
        slack[("per_sequence", j, "logw")] = Z * 2.0 * r.sigma_l * math.sqrt(row["T"])
    slack[("results", "consistency", "relative_difference")] = GRADIENT_REL
    tokens = old_results.get("attribution", {}).get("E_tokens")
    if tokens:
        cancel = GRADIENT_REL * tokens["sum_abs_dH"]  # Σ dH cancels from Σ|dH|: each dH is a gradient quantity
        slack |= {("results", "attribution", "E_tokens", k): cancel for k in ("sum_dH", "direct_only")}
        for i, share in enumerate(tokens["top_shares"]):  # a share of Σ dH moves with Σ dH
            slack[("results", "attribution", "E_tokens", "top_shares", i, "share_of_sum")] = \
                abs(share["share_of_sum"]) * cancel / abs(tokens["sum_dH"])
        slack[("results", "attribution", "U_groups")] = GRADIENT_REL * abs(old_results["deltaH1"])
    return slack | _predictor_slack(old_results, r)


def _predictor_slack(old_results: dict, r: Rounding) -> dict[tuple, float]:
    """A predictor's slope and SEs: `GRADIENT_REL` of δH₁'s scale (a small slope such as direct_only is a sum
    that cancels from that scale); its measured_over_predicted moves by ΔH's relative tolerance at the smallest
    positive η plus the slope's.
    A predictor the probe itself flags (`warning`: dominated by entries divided by AdamW's ε) amplifies the
    gradient's rounding by up to 1/ε: `ILL_CONDITIONED_REL` of its size (measured: 0.9 % from AVX2 to `default`)."""
    positive = min((row for row in old_results["true"] if row["eta"] > 0), key=lambda row: row["eta"])
    rel_dh = delta_h_tolerance(positive["deltaH_true"], r.floor, z=Z) / abs(positive["deltaH_true"])
    slack = {}
    for name, entry in (old_results.get("predictors") or {}).items():
        at = ("results", "predictors", name)
        if "warning" in entry:
            slack |= {(*at, k): ILL_CONDITIONED_REL * abs(x) for k, x in entry.items() if isinstance(x, float)}
            continue
        scale = GRADIENT_REL * max(abs(old_results["deltaH1"]), abs(entry["delta_h1"]))
        if entry.get("measured_over_predicted") is not None:
            slack[(*at, "measured_over_predicted")] = abs(entry["measured_over_predicted"]) * (
                rel_dh + scale / abs(entry["delta_h1"]))
        slack[at] = scale
    return slack


def recorded_differences(new_results: dict, new_rows: list[dict], old_results: dict, old_rows: list[dict],
                         rounding: Rounding) -> list[str]:
    """Every field of a recorded run (results.json less paths, per_sequence.jsonl) that a new run on the same
    token ids misses or breaks its tolerance; `rounding` measured on the new run's E."""
    # warnings: every recorded one must still be given; a run may add new ones (a check the recording predates)
    new_warnings, old_warnings = new_results.get("warnings", []), old_results.get("warnings", [])
    new_results = {k: v for k, v in new_results.items() if k != "warnings"}
    old_results = {k: v for k, v in old_results.items() if k != "warnings"}
    bad = [f"results.warnings: recorded {w!r} not given" for w in old_warnings if w not in new_warnings]
    bad += differences({**new_results, "predictors": None}, {**old_results, "predictors": None}, rounding.floor)
    slack = _slack(old_results, old_rows, rounding)
    _compare(new_results, old_results, ("results",), slack, bad)
    _compare(new_rows, old_rows, ("per_sequence",), slack, bad)
    return bad

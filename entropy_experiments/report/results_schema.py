"""results.json: the keys every results file holds, strict JSON (no NaN / inf), and reading it back."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import OutputError, os_error_reason

RESULTS_FILE = "results.json"

# ----------------------------------------------------------------------------------------------
# Strict JSON
# ----------------------------------------------------------------------------------------------


def to_strict_json(obj: Any) -> Any:
    """Convert `obj` to plain JSON types; non-finite floats become None (JSON has no NaN / inf).

    Handles dicts (keys made str), lists / tuples, numpy scalars and arrays, torch tensors, Paths.
    Anything else is a programming error and raises TypeError naming its type.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): to_strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_strict_json(v) for v in obj]
    if isinstance(obj, (np.generic, np.ndarray)):
        return to_strict_json(obj.tolist())
    if isinstance(obj, torch.Tensor):
        return to_strict_json(obj.detach().cpu().tolist())
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"cannot write a {type(obj).__name__} to JSON: {obj!r:.80}")


def dumps_strict(obj: Any, indent: int | None = None) -> str:
    """json.dumps after `to_strict_json`, with allow_nan=False as a second guard."""
    return json.dumps(to_strict_json(obj), indent=indent, allow_nan=False, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------
# results.json schema
# ----------------------------------------------------------------------------------------------

# Nested keys every results.json holds (docs/outputs.md). None = a leaf whose inner layout is free.
REQUIRED_SCHEMA: dict[str, Any] = {
    "deltaH1": None,
    "x_hat_dot_v": None,  # X̂·v, δH₁ per unit lr
    "bars_dot": None,     # legacy alias of x_hat_dot_v (LEGACY_RESULT_KEYS)
    "learning_rate": None,
    "se": {"E": None, "U": None, "total": None},  # and U_df (SE_U's degrees of freedom), optional: not every run has it
    "H_orig": {"per_token": None, "per_sequence": None},
    "true": None,  # list of TRUE_ENTRY_SCHEMA, checked separately
    "linearity": {"slope_through_origin": None, "loglog_slope": None, "symmetric_slopes": None},
    "counts": {"B_E": None, "unique_E_prompts": None, "B_U": None, "G": None, "E_tokens": None,
               "U_tokens": None, "zero_advantage_prompts": None},
    "update": {"direction": None, "norm": None, "grad_norm": None, "clipped": None, "hyperparameters": None},
    "timing": {"total": None},  # plus one key per phase
    "environment": {"versions": None, "device": None, "dtypes": None, "seeds": None},
    "config_hash": None,
    "normalize": None,
    "warnings": None,
}
TRUE_ENTRY_SCHEMA: dict[str, Any] = {
    "eta": None, "deltaH_true": None, "H_upd": None, "ess": None, "ess_frac": None, "psis_khat": None,
    "khat_threshold": None, "logw": {"min": None, "median": None, "max": None}, "zero_weight_count": None,
    "se": None,
}
NORMALIZE_MODES = ("per_token", "per_sequence")
# Legacy keys results.json writes beside their canonical key, same value, so that a reader that asks for the seed
# API's name (`bars_dot`, its word for X̂·v) keeps working: legacy key -> canonical key.
LEGACY_RESULT_KEYS: dict[str, str] = {"bars_dot": "x_hat_dot_v"}
# The same in `second_order` and each of its per_eta rows: legacy key -> canonical key.
LEGACY_SECOND_ORDER_KEYS: dict[str, str] = {"bias_bound": "bias_estimate"}
# The timing keys are the phases' names (docs/development.md "The phases of one run"); results.json also writes
# each under its earlier numbered name, same value: legacy timing key -> phase timing key.
LEGACY_TIMING_KEYS: dict[str, str] = {
    "phase0_sampling": "sample", "phase1_3_U_gradient_and_direction": "update_direction",
    "phase1_3_E_scoring": "e_pass_scoring", "phase1_3_E_backward": "e_pass_backward",
    "phase3_variance": "error_bars", "phase3_r_central_difference": "r_central_difference",
    "phase1_3_total": "delta_h1_total", "phase4_importance": "delta_h", "phase5_second_order": "second_order",
    "phase6_predictors": "predictors", "phase7_attribution": "attribution",
}


def with_legacy_timing_keys(timing: dict[str, float]) -> dict[str, float]:
    """`timing` plus each of its phase keys under its legacy name too (LEGACY_TIMING_KEYS)."""
    return {**timing, **{legacy: timing[key] for legacy, key in LEGACY_TIMING_KEYS.items() if key in timing}}


def with_legacy_second_order_keys(second_order: dict[str, Any]) -> dict[str, Any]:
    """`second_order` and its per_eta rows with each LEGACY_SECOND_ORDER_KEYS name beside its canonical one."""
    def legacy(entry: dict[str, Any]) -> dict[str, Any]:
        return {**entry, **{old: entry[new] for old, new in LEGACY_SECOND_ORDER_KEYS.items() if new in entry}}

    out = legacy(second_order)
    if out.get("per_eta") is not None:
        out["per_eta"] = [legacy(row) for row in out["per_eta"]]
    return out


def bias_estimate_of(entry: dict[str, Any]) -> Any:
    """The d2 bias estimate of a `second_order` entry or per_eta row, also of one written with only `bias_bound`."""
    return entry["bias_estimate"] if "bias_estimate" in entry else entry.get("bias_bound")


def x_hat_dot_v_of(results: dict[str, Any]) -> Any:
    """X̂·v of a results dict, also of one that carries it only under the seed API's name `bars_dot`, so that
    the report reads every results.json that holds the number."""
    return results["x_hat_dot_v"] if "x_hat_dot_v" in results else results.get("bars_dot")


def _check_keys(obj: Any, schema: dict[str, Any], where: str) -> None:
    if not isinstance(obj, dict):
        raise ValueError(f"results: {where or 'top level'} must be an object, got {type(obj).__name__}")  # noqa: TRY004
    for key, sub in schema.items():
        dotted = f"{where}.{key}" if where else key
        if key not in obj:
            raise ValueError(f"results: missing key '{dotted}'")
        if sub is not None:
            _check_keys(obj[key], sub, dotted)


def validate_results_schema(results: dict[str, Any]) -> None:
    """Raise ValueError naming the first missing key (dotted path, e.g. 'true[1].logw.median')."""
    _check_keys(results, REQUIRED_SCHEMA, "")
    if not isinstance(results["true"], list):
        raise ValueError("results: 'true' must be a list of per-η entries")  # noqa: TRY004
    for i, entry in enumerate(results["true"]):
        _check_keys(entry, TRUE_ENTRY_SCHEMA, f"true[{i}]")
    if results["normalize"] not in NORMALIZE_MODES:
        raise ValueError(f"results: 'normalize' must be one of {NORMALIZE_MODES}, got {results['normalize']!r}")
    if not isinstance(results["warnings"], list):
        raise ValueError("results: 'warnings' must be a list of strings")  # noqa: TRY004
    aliases = [(results, legacy, key, legacy) for legacy, key in LEGACY_RESULT_KEYS.items()]
    aliases += [(results["timing"], legacy, key, f"timing.{legacy}") for legacy, key in LEGACY_TIMING_KEYS.items()
                if key in results["timing"]]
    for obj, legacy, canonical, where in aliases:
        if not _same_value(obj.get(legacy), obj[canonical]):
            raise ValueError(f"results: '{where}' must equal '{canonical}' (its legacy alias), "
                             f"got {obj.get(legacy)!r} and {obj[canonical]!r}")


def _same_value(a: Any, b: Any) -> bool:
    """Equal, or both NaN / null (a non-finite float is written as null)."""
    return a == b or all(x is None or (isinstance(x, float) and math.isnan(x)) for x in (a, b))


def load_results(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read RUN_DIR/results.json (or a results.json path given directly) for `entropy-probe report`."""
    path = Path(run_dir)
    if path.is_dir() or path.suffix != ".json":
        path = path / RESULTS_FILE
    if not path.is_file():
        raise OutputError(f"no results file at {path}: is {run_dir} a finished run directory?")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise OutputError(f"cannot read {path}: {os_error_reason(err)}") from err
    except json.JSONDecodeError as err:
        raise OutputError(f"{path} is not valid JSON (line {err.lineno}: {err.msg})") from err

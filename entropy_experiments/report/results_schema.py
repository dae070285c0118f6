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

# Nested keys every results.json holds (ARCHITECTURE.md). None = a leaf whose inner layout is free.
REQUIRED_SCHEMA: dict[str, Any] = {
    "deltaH1": None,
    "bars_dot": None,
    "learning_rate": None,
    "se": {"E": None, "U": None, "total": None},
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

"""results.json: the keys every results file holds, strict JSON (no NaN / inf), its schema version, and reading it
back (any version, through `upgrade_results`)."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, OutputError, os_error_reason

RESULTS_FILE = "results.json"
# The version of results.json's layout and of the config hash (config/probe_config.ProbeConfig.config_hash) that a
# run directory records: written into results.json, run_meta.json and sweep_meta.json. A file without the key is
# version 1. --resume refuses a directory of another version (`refuse_other_schema`); its results.json still reads.
SCHEMA_VERSION = 2

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
    "schema_version": None,
    "deltaH1": None,
    "x_hat_dot_v": None,  # X̂·v, δH₁ per unit lr
    "learning_rate": None,
    "e_pass": None,       # the E pass that ran: probe/e_pass.E_PASSES
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
# Version 1's names of keys results.json holds under another name since version 2: {version-1 name: name}.
V1_RESULT_KEYS: dict[str, str] = {"bars_dot": "x_hat_dot_v"}
V1_SECOND_ORDER_KEYS: dict[str, str] = {"bias_bound": "bias_estimate"}  # `second_order` and each per_eta row
V1_TIMING_KEYS: dict[str, str] = {  # the phases' names: docs/development.md "The phases of one run"
    "phase0_sampling": "sample", "phase1_3_U_gradient_and_direction": "update_direction",
    "phase1_3_E_scoring": "e_pass_scoring", "phase1_3_E_backward": "e_pass_backward",
    "phase3_variance": "error_bars", "phase3_r_central_difference": "r_central_difference",
    "phase1_3_total": "delta_h1_total", "phase4_importance": "delta_h", "phase5_second_order": "second_order",
    "phase6_predictors": "predictors", "phase7_attribution": "attribution",
}


def upgrade_results(results: dict[str, Any]) -> dict[str, Any]:
    """`results` (a results.json of any version) under the current schema's names: every reader goes through
    here, so that version 1's names are known here alone. A current one is returned as it is; OutputError for a
    version this code does not know."""
    version = results.get("schema_version", 1)
    if version == SCHEMA_VERSION:
        return results
    if version != 1:
        raise OutputError(f"results.json has schema_version {version!r}: this entropy-probe reads versions 1 to "
                          f"{SCHEMA_VERSION}; read it with the entropy-probe that wrote it")
    return {"schema_version": SCHEMA_VERSION, **_from_version_1(copy.deepcopy(results))}


def _renamed(entry: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """`entry` with each key of `names` under its new name (the new one wins where both are present)."""
    out = {k: v for k, v in entry.items() if k not in names}
    for old, new in names.items():
        if old in entry and new not in out:
            out[new] = entry[old]
    return out


def _from_version_1(results: dict[str, Any]) -> dict[str, Any]:
    """Version 1's names mapped (V1_*_KEYS); a predictor's `ratio_to_measured` (predicted / measured) becomes
    `measured_over_predicted`, its inverse, where that is missing; `e_pass` is read off `consistency`
    (`v1_e_pass`)."""
    out = _renamed(results, V1_RESULT_KEYS)
    out.setdefault("e_pass", v1_e_pass(out.get("consistency")))
    if isinstance(out.get("consistency"), dict):
        out["consistency"] = {k: v for k, v in out["consistency"].items() if k != "pieces_method"}
    if isinstance(out.get("timing"), dict):
        out["timing"] = _renamed(out["timing"], V1_TIMING_KEYS)
    if isinstance(out.get("second_order"), dict):
        out["second_order"] = _renamed(out["second_order"], V1_SECOND_ORDER_KEYS)
        if isinstance(out["second_order"].get("per_eta"), list):
            out["second_order"]["per_eta"] = [_renamed(r, V1_SECOND_ORDER_KEYS) for r in out["second_order"]["per_eta"]]
    for name, entry in (out.get("predictors") or {}).items():
        ratio = entry.pop("ratio_to_measured", None)
        if "measured_over_predicted" not in entry:
            finite = isinstance(ratio, (int, float)) and math.isfinite(ratio) and ratio != 0
            out["predictors"][name] = {**entry, "measured_over_predicted": 1.0 / ratio if finite else None}
    return out


def v1_e_pass(consistency: dict[str, Any] | None) -> str | None:
    """The E pass of a version-1 results.json from its `consistency`: `pieces_method` backward_hooks with r_i by the
    central difference is central_difference, backward_hooks and jvp are themselves, and an empty one (error bars
    off: no pieces) is two_pass; None where it does not say."""
    if consistency == {}:
        return "two_pass"
    method = (consistency or {}).get("pieces_method")
    if method == "backward_hooks" and consistency.get("r_method") == "central_difference":
        return "central_difference"
    return method


def refuse_other_schema(meta: dict[str, Any] | None, path: str | os.PathLike) -> None:
    """ConfigError when the run or sweep directory `path`, whose meta file holds `meta`, was written under another
    SCHEMA_VERSION: its config hash is another function of the config, so nothing of it may be mixed with a new run."""
    version = (meta or {}).get("schema_version", 1)
    if meta and version != SCHEMA_VERSION:
        raise ConfigError(f"--resume {path}: that directory was written by schema version {version}, this "
                          f"entropy-probe writes version {SCHEMA_VERSION}; start a fresh output directory (--out)")


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
    if results["schema_version"] != SCHEMA_VERSION:
        raise ValueError(f"results: 'schema_version' must be {SCHEMA_VERSION}, got {results['schema_version']!r}")


def load_results(run_dir: str | os.PathLike) -> dict[str, Any]:
    """Read RUN_DIR/results.json (or a results.json path given directly) under the current names
    (`upgrade_results`), for `entropy-probe report`."""
    path = Path(run_dir)
    if path.is_dir() or path.suffix != ".json":
        path = path / RESULTS_FILE
    if not path.is_file():
        raise OutputError(f"no results file at {path}: is {run_dir} a finished run directory?")
    try:
        results = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise OutputError(f"cannot read {path}: {os_error_reason(err)}") from err
    except json.JSONDecodeError as err:
        raise OutputError(f"{path} is not valid JSON (line {err.lineno}: {err.msg})") from err
    return upgrade_results(results)

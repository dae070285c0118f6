"""Run directory, atomic writes, results.json, the ΔH(η) plot and the console summary.

A run directory holds everything a result needs to be checked or resumed (ARCHITECTURE.md, "Run directory"):

    config.yaml                 the fully resolved config
    run_meta.json               {"config_hash", "created", "status"}: marks the directory as ours
    results.json                strict JSON (non-finite floats written as null), schema in REQUIRED_SCHEMA
    E_batch.pt, U_batch.pt      packed batch dicts, loadable with torch.load(weights_only=True)
    update_vector.safetensors   v per unit learning rate, keyed by parameter name
    per_sequence.jsonl          one JSON object per E sequence
    delta_h_vs_eta.png          the plot
    probe.log                   the log of the run
    partial/<name>.pt           checkpointed intermediate state, used by --resume

Every file except probe.log is written to a temp file in the same directory, fsynced and moved into
place with os.replace (`io_utils`), so a killed run never leaves a half-written file where a good one was.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from . import io_utils
from .errors import OutputError

CONFIG_FILE = "config.yaml"
META_FILE = "run_meta.json"
RESULTS_FILE = "results.json"
UPDATE_VECTOR_FILE = "update_vector.safetensors"
PER_SEQUENCE_FILE = "per_sequence.jsonl"
PLOT_FILE = "delta_h_vs_eta.png"
LOG_FILE = "probe.log"
PARTIAL_DIR = "partial"
BATCH_FILES = {"E": "E_batch.pt", "U": "U_batch.pt"}

# Every file name a run writes at the top level; overwrite deletes these and nothing else.
RUN_FILES: tuple[str, ...] = (CONFIG_FILE, META_FILE, RESULTS_FILE, *BATCH_FILES.values(),
                              UPDATE_VECTOR_FILE, PER_SEQUENCE_FILE, PLOT_FILE, LOG_FILE)
RUN_STATUSES = ("running", "complete", "failed")
_PARTIAL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")

# Kept for callers and tests that read it here: the process umask that written files respect
# (0o666 & ~umask); the atomic-write logic itself lives in io_utils.
_UMASK = io_utils.UMASK


# ----------------------------------------------------------------------------------------------
# Atomic writes (io_utils, with OS errors turned into one-line OutputErrors)
# ----------------------------------------------------------------------------------------------

def _os_reason(err: OSError) -> str:
    return err.strerror or str(err)


def _atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Run `write(f)` on a temp file beside `path`, fsync it, then os.replace it onto `path`.

    On any failure (including KeyboardInterrupt) the temp file is removed and `path` keeps its old
    content. OS errors become OutputError naming the path and the OS reason; others propagate.
    """
    try:
        io_utils.atomic_write(path, write)
    except OSError as err:
        raise OutputError(f"cannot write {path}: {_os_reason(err)}") from err


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` atomically (temp file in the same directory + fsync + os.replace)."""
    _atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` as UTF-8 to `path` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """torch.save `obj` to `path` atomically. Keep `obj` to tensors, containers and primitives so
    that torch.load(weights_only=True) can read it back."""
    _atomic_write(path, lambda f: torch.save(obj, f))


def atomic_save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike,
                            metadata: dict[str, str] | None = None) -> None:
    """Save named tensors as a .safetensors file atomically (tensors are moved to CPU, made contiguous)."""
    from safetensors.torch import save

    cpu = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    atomic_write_bytes(path, save(cpu, metadata=metadata))


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
        raise OutputError(f"cannot read {path}: {_os_reason(err)}") from err
    except json.JSONDecodeError as err:
        raise OutputError(f"{path} is not valid JSON (line {err.lineno}: {err.msg})") from err


# ----------------------------------------------------------------------------------------------
# Run directory
# ----------------------------------------------------------------------------------------------

def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


# Temp files made by _atomic_write are '.<final name>.<random>.tmp'.
_is_our_temp = io_utils.is_temp_name


def _to_cpu(obj: Any) -> Any:
    """Move tensors nested in dicts / lists to CPU so the saved batch loads on any machine."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v) for v in obj)
    return obj


class RunDirectory:
    """One run's output directory. The constructor does no I/O; `prepare` creates / checks it."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDirectory({str(self.path)!r})"

    # ---- creation, overwrite, resume ------------------------------------------------------

    @classmethod
    def prepare(cls, path: str | os.PathLike, config_yaml: str, config_hash: str, *,
                overwrite: bool, resume: bool) -> RunDirectory:
        """Create or reopen a run directory and write config.yaml + run_meta.json (status "running").

        - new or empty directory: created (parents too);
        - directory of a run with a different config hash: OutputError unless `overwrite`
          (`resume` needs the same config, so it gets the same error);
        - directory of a run with the same config: `resume` keeps its batches and partial state;
          otherwise the stale files are cleared so that a later --resume never mixes two runs;
        - `overwrite` deletes only the files a run writes (and our temp files), never other content,
          and refuses a directory that holds other files but is not a run directory.
        """
        if overwrite and resume:
            raise OutputError(f"run directory {path}: --overwrite and --resume exclude each other")
        run = cls(path)
        run._create()
        meta = run.read_meta()
        ours = meta is not None
        old_hash = (meta or {}).get("config_hash") or "unknown"
        has_old_run = ours or (run.path / CONFIG_FILE).exists()
        if resume and not ours:
            raise OutputError(f"nothing to resume in {run.path}: it holds no {META_FILE}")
        if has_old_run and old_hash != config_hash and not overwrite:
            hint = "; --resume needs the config the run was started with" if resume else ""
            raise OutputError(f"run directory {run.path} holds a different config (hash {old_hash} ≠ "
                              f"{config_hash}); pass --overwrite to replace it or choose another --out{hint}")
        if not ours and not overwrite:
            leftovers = [n for n in RUN_FILES if (run.path / n).exists()] + (
                [PARTIAL_DIR] if (run.path / PARTIAL_DIR).exists() else [])
            if leftovers:
                raise OutputError(f"run directory {run.path} holds run files ({', '.join(leftovers)}) but no "
                                  f"{META_FILE}; pass --overwrite to replace them or choose another --out")
        if overwrite:
            unknown = run._unknown_entries()
            if unknown and not ours:
                raise OutputError(f"refusing to overwrite {run.path}: it is not a run directory and holds "
                                  f"other files ({', '.join(unknown[:3])}{', …' if len(unknown) > 3 else ''})")
        if overwrite or (ours and not resume):
            run._clear_run_files()
            meta = None
        created = (meta or {}).get("created") or _now()
        run.write_config(config_yaml)
        run._write_meta({"config_hash": config_hash, "created": created, "status": "running"})
        return run

    def _create(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise OutputError(f"run directory {self.path} exists and is not a directory")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OutputError(f"cannot create run directory {self.path}: {_os_reason(err)}") from err
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise OutputError(f"cannot write to run directory {self.path}: permission denied")

    def _unknown_entries(self) -> list[str]:
        known = set(RUN_FILES) | {PARTIAL_DIR}
        return sorted(n for n in os.listdir(self.path) if n not in known and not _is_our_temp(n, RUN_FILES))

    def _clear_run_files(self) -> None:
        """Delete the files a run writes and our stale temp files; leave anything else alone."""
        try:
            for name in os.listdir(self.path):
                if name in RUN_FILES or _is_our_temp(name, RUN_FILES):
                    entry = self.path / name
                    if entry.is_file() or entry.is_symlink():
                        entry.unlink()
            partial = self.path / PARTIAL_DIR
            if partial.is_dir():
                for entry in partial.iterdir():
                    if entry.is_file() and (entry.suffix == ".pt" or _is_our_temp(entry.name)):
                        entry.unlink()
                if not any(partial.iterdir()):
                    partial.rmdir()
        except OSError as err:
            raise OutputError(f"cannot clear run directory {self.path}: {_os_reason(err)}") from err

    # ---- run_meta.json ----------------------------------------------------------------------

    def read_meta(self) -> dict[str, Any] | None:
        """run_meta.json as a dict; None when absent; {} when unreadable (still marks the dir as ours)."""
        path = self.path / META_FILE
        if not path.exists():
            return None
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def _write_meta(self, meta: dict[str, Any]) -> None:
        atomic_write_text(self.path / META_FILE, dumps_strict(meta, indent=2) + "\n")

    def mark_status(self, status: str) -> None:
        """Record the run's status in run_meta.json: "running" | "complete" | "failed"."""
        if status not in RUN_STATUSES:
            raise ValueError(f"run status must be one of {RUN_STATUSES}, got {status!r}")
        meta = self.read_meta() or {}
        meta["status"] = status
        self._write_meta(meta)

    # ---- files ------------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        return self.path / LOG_FILE

    @property
    def results_path(self) -> Path:
        return self.path / RESULTS_FILE

    @property
    def plot_path(self) -> Path:
        return self.path / PLOT_FILE

    def write_config(self, yaml_text: str) -> None:
        """Write the fully resolved config as config.yaml."""
        atomic_write_text(self.path / CONFIG_FILE, yaml_text)

    def write_results(self, results: dict[str, Any], *, validate: bool = True) -> Path:
        """Write results.json: strict JSON (NaN / ±inf → null), indent 2. Checks the schema first."""
        if validate:
            validate_results_schema(results)
        atomic_write_text(self.results_path, dumps_strict(results, indent=2) + "\n")
        return self.results_path

    def _batch_path(self, name: str) -> Path:
        if name not in BATCH_FILES:
            raise ValueError(f"batch name must be one of {sorted(BATCH_FILES)}, got {name!r}")
        return self.path / BATCH_FILES[name]

    def save_batch(self, name: str, batch: dict[str, Any]) -> Path:
        """Save the packed "E" or "U" batch dict (tensors, lists, ints, strs, floats) as E_batch.pt / U_batch.pt."""
        path = self._batch_path(name)
        atomic_torch_save(_to_cpu(batch), path)
        return path

    def load_batch(self, name: str) -> dict[str, Any] | None:
        """Load a saved batch with weights_only=True; None when it was never saved."""
        return _load_pt(self._batch_path(name))

    def save_update_vector(self, v_named: dict[str, torch.Tensor], metadata: dict[str, Any] | None = None) -> Path:
        """Save v (per unit learning rate, keyed by parameter name) as update_vector.safetensors.

        safetensors metadata must be str → str: non-string values are stored as JSON text.
        """
        meta = {str(k): v if isinstance(v, str) else dumps_strict(v) for k, v in (metadata or {}).items()}
        path = self.path / UPDATE_VECTOR_FILE
        atomic_save_safetensors(v_named, path, meta)
        return path

    def load_update_vector(self) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """(v_named, metadata) from update_vector.safetensors; None when absent."""
        from safetensors import safe_open

        path = self.path / UPDATE_VECTOR_FILE
        if not path.exists():
            return None
        try:
            with safe_open(str(path), framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118
        except Exception as err:  # safetensors raises its own error types for corrupt files
            raise OutputError(f"cannot read {path}: {err}") from err

    def write_per_sequence(self, rows: list[dict[str, Any]]) -> Path:
        """Write per_sequence.jsonl: one strict-JSON object per line."""
        path = self.path / PER_SEQUENCE_FILE
        atomic_write_text(path, "".join(dumps_strict(row) + "\n" for row in rows))
        return path

    def attach_log_handler(self, logger: logging.Logger, level: int = logging.INFO) -> logging.FileHandler:
        """Append `logger`'s records to probe.log; the caller removes and closes the returned handler."""
        try:
            handler = logging.FileHandler(self.log_path, mode="a", encoding="utf-8")
        except OSError as err:
            raise OutputError(f"cannot open log file {self.log_path}: {_os_reason(err)}") from err
        handler.setLevel(level)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        return handler

    # ---- partial state for --resume -------------------------------------------------------

    def _partial_path(self, name: str) -> Path:
        # The name becomes a file name: keep it to a plain token so it cannot escape partial/.
        if not _PARTIAL_NAME.match(name):
            raise ValueError(f"partial state name must match {_PARTIAL_NAME.pattern}, got {name!r}")
        return self.path / PARTIAL_DIR / f"{name}.pt"

    def has_partial(self, name: str) -> bool:
        return self._partial_path(name).is_file()

    def save_partial(self, name: str, obj: Any) -> Path:
        """Checkpoint intermediate state (tensors, containers, primitives) as partial/<name>.pt, atomically."""
        path = self._partial_path(name)
        try:
            path.parent.mkdir(exist_ok=True)
        except OSError as err:
            raise OutputError(f"cannot create {path.parent}: {_os_reason(err)}") from err
        atomic_torch_save(_to_cpu(obj), path)
        return path

    def load_partial(self, name: str) -> Any | None:
        """Load partial/<name>.pt with weights_only=True; None when absent."""
        return _load_pt(self._partial_path(name))

    def has_partial_chunks(self) -> bool:
        """Whether partial/ holds generation chunks saved by a killed run (`GenerationChunkStore`)."""
        folder = self.path / PARTIAL_DIR
        return folder.is_dir() and any(folder.glob(f"{GEN_CHUNK_PREFIX}*.pt"))

    def resume_hint(self) -> str | None:
        """For a run that failed on a user error: how to finish it without sampling again, when it saved
        samples (generation chunks, or both batches); None when it saved none."""
        if not (self.has_partial_chunks() or all(self._batch_path(name).is_file() for name in BATCH_FILES)):
            return None
        return (f"run marked failed; the samples generated so far are kept in {self.path}: after fixing the "
                f"cause, finish it with: entropy-probe run --resume {self.path}")


def _load_pt(path: Path) -> Any | None:
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise OutputError(f"cannot read {path}: {_os_reason(err)}") from err
    except Exception as err:  # unpickling errors: corrupt file or objects outside the weights_only set
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OutputError(f"cannot load {path}: {reason}") from err


# ----------------------------------------------------------------------------------------------
# Console summary
# ----------------------------------------------------------------------------------------------

_UNITS = {"per_token": "nats/token", "per_sequence": "nats/seq"}
_UNITS_LONG = {"per_token": "nats per token", "per_sequence": "nats per sequence"}


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _fmt(x: Any, spec: str = ".4g") -> str:
    """Format a number; None / NaN (written as null in results.json) show as 'n/a'."""
    return format(x, spec) if _finite(x) else "n/a"


def _ratio(num: Any, den: Any) -> float | None:
    return num / den if _finite(num) and _finite(den) and den != 0 else None


def _run_label(results: dict[str, Any]) -> str | None:
    """The model / checkpoint name, when the probe recorded one."""
    for key in ("checkpoint", "model"):
        value = results.get(key)
        if isinstance(value, dict):
            value = value.get("name") or value.get("path")
        if value:
            return str(value)
    return None


IMPORTANCE_OFF_NOTE = "ΔH(η) not measured (importance.enabled: false)"


def render_summary(results: dict[str, Any]) -> str:
    """The console summary as plain text (rich tables, 110 columns, no colour codes).

    A run without ΔH(η) rows (`true` = [], i.e. importance.enabled: false) gets one line saying so
    instead of the ΔH and linearity tables.
    """
    from rich.console import Console

    unit = _UNITS.get(results.get("normalize", "per_token"), "nats")
    bars_dot = results.get("bars_dot")
    buffer = io.StringIO()
    console = Console(file=buffer, width=110, color_system=None, force_terminal=False, soft_wrap=False)
    console.print(_head_table(results, unit))
    console.print()
    entries = results.get("true") or []
    if entries:
        console.print(_eta_table(entries, unit, bars_dot))
        if note := _khat_note(entries):
            console.print(note, markup=False, highlight=False)
        console.print()
        console.print(_fit_table(results.get("linearity") or {}, bars_dot))
    else:
        console.print(IMPORTANCE_OFF_NOTE, markup=False, highlight=False)
    console.print()
    warnings = results.get("warnings") or []
    if warnings:
        console.print(f"Warnings ({len(warnings)}):")
        for w in warnings:
            console.print(f"  ⚠ {w}", markup=False, highlight=False)
    # rich pads every line to the console width; drop that so the text copies cleanly.
    return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines()) + "\n"


def _head_table(results: dict[str, Any], unit: str) -> Any:
    """Ĥ, δH₁ ± SE, X̂·v, lr, batch counts, update and time."""
    from rich.table import Table

    se, bars_dot, label = results.get("se", {}), results.get("bars_dot"), _run_label(results)
    head = Table(title="Entropy probe" + (f": {label}" if label else ""), show_header=False, box=None,
                 title_justify="left", padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    H = results.get("H_orig", {})
    head.add_row("Ĥ per token", f"{_fmt(H.get('per_token'), '.4f')} nats/token")
    head.add_row("Ĥ per sequence", f"{_fmt(H.get('per_sequence'), '.4f')} nats/seq")
    head.add_row("normalize", str(results.get("normalize", "per_token")))
    head.add_row("δH₁ ± SE", f"{_fmt(results.get('deltaH1'), '+.4g')} ± {_fmt(se.get('total'), '.2g')} {unit}"
                             f"  (SE_E {_fmt(se.get('E'), '.2g')}, SE_U {_fmt(se.get('U'), '.2g')})")
    head.add_row("X̂·v (bars_dot)", f"{_fmt(bars_dot, '+.4g')} {unit} per unit lr")
    head.add_row("learning rate", _fmt(results.get("learning_rate"), ".3g"))
    counts = results.get("counts", {})
    if counts:
        head.add_row("batches", f"E {counts.get('B_E')} seqs ({counts.get('unique_E_prompts')} unique prompts, "
                                f"{counts.get('E_tokens')} tokens); U {counts.get('B_U')} prompts × G "
                                f"{counts.get('G')} ({counts.get('U_tokens')} tokens, "
                                f"{counts.get('zero_advantage_prompts')} zero-advantage)")
    update = results.get("update", {})
    if update:
        head.add_row("update", f"{update.get('direction')}: ‖v‖ {_fmt(update.get('norm'), '.4g')}, "
                               f"‖g‖ {_fmt(update.get('grad_norm'), '.4g')}, clipped {update.get('clipped')}")
    total_time = results.get("timing", {}).get("total")
    if _finite(total_time):
        head.add_row("time", f"{total_time:.1f} s")
    return head


def _eta_table(entries: list[dict[str, Any]], unit: str, bars_dot: Any) -> Any:
    """One row per measured η: ΔH ± SE, ESS/N, k̂ (✗ above its threshold), ΔH/δH₁(η), zero weights."""
    from rich.table import Table

    etas = Table(title="Measured ΔH(η) by SNIS on E", title_justify="left")
    for col in ("η", f"ΔH ± SE ({unit})", "ESS/N", "k̂", "ΔH/δH₁(η)", "zero-w"):
        etas.add_column(col, justify="right")
    for entry in entries:
        eta = entry.get("eta")
        khat, thr = entry.get("psis_khat"), entry.get("khat_threshold")
        flag = " ✗" if _finite(khat) and _finite(thr) and khat > thr else ""
        predicted = eta * bars_dot if _finite(eta) and _finite(bars_dot) else None
        etas.add_row(_fmt(eta, ".3g"),
                     f"{_fmt(entry.get('deltaH_true'), '+.4g')} ± {_fmt(entry.get('se'), '.2g')}",
                     _fmt(entry.get("ess_frac"), ".3f"),
                     _fmt(khat, ".2f") + flag,
                     _fmt(_ratio(entry.get("deltaH_true"), predicted), ".3f"),
                     str(entry.get("zero_weight_count", "n/a")))
    return etas


def _fit_table(lin: dict[str, Any], bars_dot: Any) -> Any:
    """The linearity fits of ΔH in η against X̂·v."""
    from rich.table import Table

    fit = Table(title="Linearity of ΔH in η", show_header=False, box=None, title_justify="left", padding=(0, 2))
    fit.add_column(style="bold")
    fit.add_column()
    slope = lin.get("slope_through_origin")
    fit.add_row("slope through origin", f"{_fmt(slope, '+.4g')}  vs X̂·v {_fmt(bars_dot, '+.4g')}  "
                                        f"(ratio {_fmt(_ratio(slope, bars_dot), '.3f')})")
    fit.add_row("log-log slope", f"{_fmt(lin.get('loglog_slope'), '.3f')}  (1 in the linear regime)")
    for item in lin.get("symmetric_slopes") or []:
        s = item.get("slope")
        fit.add_row(f"symmetric slope η={_fmt(item.get('eta'), '.3g')}",
                    f"{_fmt(s, '+.4g')}  (ratio {_fmt(_ratio(s, bars_dot), '.3f')})")
    return fit


def _khat_note(entries: list[dict[str, Any]]) -> str | None:
    """A footnote when k̂ rests on so few tail draws that arviz-stats' prior (towards 0.5) dominates it."""
    from .stats import PSIS_PRIOR_DRAWS, psis_tail_size

    entry = next((e for e in entries if _finite(e.get("ess")) and _finite(e.get("ess_frac")) and e["ess_frac"] > 0),
                 None)
    if entry is None:
        return None
    n = round(entry["ess"] / entry["ess_frac"])  # every η scores the same N sequences
    tail = psis_tail_size(n)
    if not 5 <= tail < 2 * PSIS_PRIOR_DRAWS:
        return None
    return (f"k̂ is fit to the M = {tail} largest of N = {n} weights and shrunk towards 0.5 by a prior "
            f"worth {PSIS_PRIOR_DRAWS} draws, so at this N a k̂ above its threshold "
            f"({_fmt(entry.get('khat_threshold'), '.2f')}) is weak evidence; ESS/N is the steadier guide.")


def print_summary(results: dict[str, Any]) -> None:
    """Print `render_summary(results)` to stdout."""
    import sys

    sys.stdout.write(render_summary(results))
    sys.stdout.flush()


# ----------------------------------------------------------------------------------------------
# Plot
# ----------------------------------------------------------------------------------------------

def _eta_grid(etas: list[float]) -> np.ndarray:
    """A dense η grid over [min η, max η] for drawing η·X̂·v; geometric on each side of 0 so that it
    looks smooth on a symlog axis."""
    lo, hi = min(etas + [0.0]), max(etas + [0.0])
    tiny = min(abs(e) for e in etas if e != 0) / 10
    parts = [np.array([0.0])]
    if hi > 0:
        parts.append(np.geomspace(min(tiny, hi), hi, 100))
    if lo < 0:
        parts.append(-np.geomspace(min(tiny, -lo), -lo, 100))
    return np.sort(np.concatenate(parts))


def plot_delta_h(results: dict[str, Any], path: str | os.PathLike) -> Path:
    """Plot measured ΔH(η) (± SE) against the first-order prediction δH₁(η) = η·X̂·v (± its SE band).

    Left panel: ΔH vs η. Right panel: ΔH/η vs η against the constant X̂·v, which shows where the
    linear regime ends. The SE of δH₁ at the config lr is se.total, so the band at η is |η|/lr·se.total.
    x is symlog when the η values span more than a decade. Without ΔH(η) rows (`true` = [],
    importance.enabled: false) only the prediction is drawn, over η ∈ [0, lr], and the title says
    ΔH(η) was not measured. Written atomically as PNG.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    bars_dot, lr = results.get("bars_dot"), results.get("learning_rate")
    entries = results.get("true") or []
    points = [(e["eta"], e["deltaH_true"], e.get("se")) for e in entries
              if _finite(e.get("eta")) and _finite(e.get("deltaH_true"))]
    measured = bool(entries)
    etas = [e for e, _, _ in points] if measured else ([lr] if _finite(lr) and lr > 0 else [])
    nonzero = [abs(e) for e in etas if e != 0]

    fig = Figure(figsize=(11, 4.5), constrained_layout=True)
    FigureCanvasAgg(fig)
    ax, ax_ratio = fig.subplots(1, 2)
    if nonzero and _finite(bars_dot):
        _draw_prediction(ax, ax_ratio, _eta_grid(etas), bars_dot, results.get("se", {}).get("total"), lr)
    if points:
        _draw_measured(ax, ax_ratio, points)
    elif measured:
        ax.text(0.5, 0.5, "no finite ΔH(η)", transform=ax.transAxes, ha="center")
    else:
        ax_ratio.set_xlim(ax.get_xlim())  # nothing on the right fixes its η range: the prediction's
    symlog = min(nonzero) if nonzero and max(nonzero) / min(nonzero) > 10 else None
    _style_axes((ax, ax_ratio), etas, symlog, _UNITS_LONG.get(results.get("normalize", "per_token"), "nats"))
    label = _run_label(results)
    fig.suptitle("Entropy change of one update step" + (f": {label}" if label else "")
                 + ("" if measured else f" — {IMPORTANCE_OFF_NOTE}"))

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    path = Path(path)
    atomic_write_bytes(path, buffer.getvalue())
    return path


def _draw_prediction(ax: Any, ax_ratio: Any, grid: np.ndarray, bars_dot: float, se_total: Any,
                     lr: Any) -> None:
    """δH₁(η) = η·X̂·v with its ± SE band (left) and the flat X̂·v with its band (right)."""
    line = grid * bars_dot
    ax.plot(grid, line, color="C0", label="δH₁(η) = η·X̂·v")
    if _finite(se_total) and _finite(lr) and lr > 0:
        band = np.abs(grid) / lr * se_total
        ax.fill_between(grid, line - band, line + band, color="C0", alpha=0.2, label="δH₁ ± SE")
        # ΔH/η vs η: the prediction is flat at X̂·v with half-width se_total/lr.
        ax_ratio.axhspan(bars_dot - se_total / lr, bars_dot + se_total / lr, color="C0", alpha=0.2)
    ax_ratio.axhline(bars_dot, color="C0", label="X̂·v")


def _draw_measured(ax: Any, ax_ratio: Any, points: list[tuple[float, float, Any]]) -> None:
    """The finite ΔH(η) ± SE points (left) and ΔH/η ± SE/|η| for η ≠ 0 (right)."""
    eta, dh, err = (np.array(c, dtype=float) for c in zip(*[(e, d, s if _finite(s) else np.nan)
                                                             for e, d, s in points]))
    ax.errorbar(eta, dh, yerr=np.nan_to_num(err), fmt="o", color="C3", capsize=3, label="ΔH (SNIS) ± SE")
    keep = eta != 0
    ax_ratio.errorbar(eta[keep], dh[keep] / eta[keep], yerr=np.nan_to_num(err[keep]) / np.abs(eta[keep]),
                      fmt="o", color="C3", capsize=3, label="ΔH/η (SNIS) ± SE")


def _style_axes(axes: tuple[Any, Any], etas: list[float], symlog: float | None, unit: str) -> None:
    """Ticks at the given η values (labelled compactly: matplotlib's default labels for η ~ 1e-5 print
    every decimal and overlap), symlog x with that linear threshold when given, zero lines, labels."""
    ticks = sorted({0.0, *etas})
    labels = ["0" if t == 0 else f"{t:.0e}".replace("e-0", "e-") for t in ticks]
    for a in axes:
        if symlog is not None:
            a.set_xscale("symlog", linthresh=symlog)
        if etas:
            a.set_xticks(ticks, labels, rotation=45, ha="right", fontsize=8)
        a.axhline(0, color="0.6", lw=0.8)
        a.axvline(0, color="0.6", lw=0.8)
        a.set_xlabel("η (learning rate of the step)")
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    axes[0].set_ylabel(f"ΔH ({unit})")
    axes[1].set_ylabel(f"ΔH/η ({unit} per unit lr)")


# ----------------------------------------------------------------------------------------------
# Generation chunks saved as they complete (resume after a kill during sampling)
# ----------------------------------------------------------------------------------------------

GEN_CHUNK_PREFIX = "gen_"


class GenerationChunkStore:
    """Saves each completed generation chunk as partial/gen_<key>_<i>.pt and hands saved ones back.

    Plugged into a SequenceProcessor (`sp.chunk_store`): a `generate_batched(..., seed_per_chunk=True)`
    call asks `open(key)` for the chunks an earlier (killed) run of the same call saved — `key`
    describes the call (seed, G, chunk size, prompt tokens), so chunks of a different call are never
    reused — and a callback that saves each new chunk atomically. A kill loses at most the chunk in flight.
    """

    def __init__(self, run_dir: RunDirectory):
        self.run_dir = run_dir

    @staticmethod
    def _digest(key: dict[str, Any]) -> str:
        import hashlib

        return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:16]

    def open(self, key: dict[str, Any]) -> tuple[dict[int, list[list[int]]], Callable[[int, list[list[int]]], None]]:
        """(saved chunks {index: responses}, save(index, responses)) for the call described by `key`."""
        from .lifecycle import hold_point

        digest = self._digest(key)
        done: dict[int, list[list[int]]] = {}
        folder = self.run_dir.path / PARTIAL_DIR
        if folder.is_dir():
            for path in sorted(folder.glob(f"{GEN_CHUNK_PREFIX}{digest}_*.pt")):
                obj = self.run_dir.load_partial(path.stem)
                if isinstance(obj, dict) and obj.get("key") == digest and isinstance(obj.get("index"), int):
                    done[obj["index"]] = [list(map(int, r)) for r in obj["responses"]]

        def save(index: int, responses: list[list[int]]) -> None:
            self.run_dir.save_partial(f"{GEN_CHUNK_PREFIX}{digest}_{index:05d}",
                                      {"key": digest, "index": int(index), "responses": responses})
            hold_point("chunk_saved")

        return done, save

    def clear(self) -> None:
        """Delete the saved chunks (once the batches they make up are saved whole)."""
        folder = self.run_dir.path / PARTIAL_DIR
        if folder.is_dir():
            for path in folder.glob(f"{GEN_CHUNK_PREFIX}*.pt"):
                with contextlib.suppress(OSError):
                    path.unlink()

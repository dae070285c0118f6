"""The run directory: its files, saved batches, update vector, per-sequence rows and partial state.

A run directory holds everything a result needs to be checked or resumed (docs/outputs.md, "A run directory"):

    config.yaml                 the fully resolved config
    run_meta.json               {"schema_version", "config_hash", "created", "status"[, "sampling_warnings"]}: marks
                                the directory as ours; a resumed run keeps the reward warnings its sampling raised
    results.json                strict JSON (non-finite floats written as null), schema in REQUIRED_SCHEMA
    E_batch.pt, U_batch.pt      packed batch dicts, loadable with torch.load(weights_only=True)
    update_vector.safetensors   v per unit learning rate, keyed by parameter name
    per_sequence.jsonl          one JSON object per E sequence
    delta_h_vs_eta.png          the plot
    E_tokens.parquet            one row per E token: H and its predicted change (E_tokens.jsonl without pyarrow)
    report.html                 the self-contained report (report/html_report.py)
    probe.log                   the log of the run
    partial/<name>.pt           generation chunks kept for --resume; removed when the run completes

Every file except probe.log is written to a temp file in the same directory, fsynced and moved into
place with os.replace (`io_utils`), so a killed run never leaves a half-written file where a good one was;
OS errors become one-line OutputErrors naming the path.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from .. import io_utils
from ..errors import OutputError, os_error_reason, output_error_on_os_error
from . import results_schema as schema
from .results_schema import RESULTS_FILE, dumps_strict, validate_results_schema

CONFIG_FILE = "config.yaml"
META_FILE = "run_meta.json"
UPDATE_VECTOR_FILE = "update_vector.safetensors"
PER_SEQUENCE_FILE = "per_sequence.jsonl"
PLOT_FILE = "delta_h_vs_eta.png"
E_TOKENS_FILES = ("E_tokens.parquet", "E_tokens.jsonl")  # per E token H, dH (token_table.py; jsonl without pyarrow)
HTML_REPORT_FILE = "report.html"
LOG_FILE = "probe.log"
PARTIAL_DIR = "partial"
BATCH_FILES = {"E": "E_batch.pt", "U": "U_batch.pt"}
GEN_CHUNK_PREFIX = "gen_"

# Every file name a run writes at the top level; overwrite deletes these and nothing else.
RUN_FILES: tuple[str, ...] = (CONFIG_FILE, META_FILE, RESULTS_FILE, *BATCH_FILES.values(),
                              UPDATE_VECTOR_FILE, PER_SEQUENCE_FILE, PLOT_FILE, LOG_FILE, *E_TOKENS_FILES,
                              HTML_REPORT_FILE)
# What a run has sampled or computed: a failed run without any of these (nor partial/) holds nothing to keep.
COMPUTED_FILES: tuple[str, ...] = (RESULTS_FILE, *BATCH_FILES.values(), UPDATE_VECTOR_FILE, PER_SEQUENCE_FILE, PLOT_FILE,
                                   *E_TOKENS_FILES, HTML_REPORT_FILE)
RUN_STATUSES = ("running", "complete", "failed")
_PARTIAL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


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


def _save_torch(obj: Any, path: Path) -> None:
    """torch.save `obj` atomically. Keep `obj` to tensors, containers and primitives so that
    torch.load(weights_only=True) can read it back."""
    with output_error_on_os_error(f"cannot write {path}"):
        io_utils.atomic_write(path, lambda f: torch.save(obj, f))


def _load_torch(path: Path) -> Any | None:
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except OSError as err:
        raise OutputError(f"cannot read {path}: {os_error_reason(err)}") from err
    except Exception as err:  # unpickling errors: corrupt file or objects outside the weights_only set
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise OutputError(f"cannot load {path}: {reason}") from err


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
        - directory of a run with a different config hash: OutputError unless `overwrite` (`resume` needs the
          same config, so it gets the same error; and the same SCHEMA_VERSION, else a ConfigError);
        - directory of a run with the same config: `resume` keeps its batches and partial state;
          otherwise the stale files are cleared so that a later --resume never mixes two runs;
        - directory of a run that failed before it sampled or computed anything (`failed_before_computing`):
          a new run (any config) takes it over without --overwrite;
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
        if not resume and run.failed_before_computing(meta):  # a config / data / preflight error: nothing to keep
            has_old_run = False
        if resume and not ours:
            raise OutputError(f"nothing to resume in {run.path}: it holds no {META_FILE}")
        if resume:
            schema.refuse_other_schema(meta, run.path)
        if has_old_run and old_hash != config_hash and not overwrite:
            hint = "; --resume needs the config the run was started with" if resume else ""
            raise OutputError(f"run directory {run.path} holds a different config (hash {old_hash} ≠ "
                              f"{config_hash}); pass --overwrite to replace it or choose another --out{hint}")
        if not ours and not overwrite:
            run._refuse_leftover_run_files()
        if overwrite:
            unknown = run._unknown_entries()
            if unknown and not ours:
                raise OutputError(f"refusing to overwrite {run.path}: it is not a run directory and holds "
                                  f"other files ({', '.join(unknown[:3])}{', …' if len(unknown) > 3 else ''})")
        if overwrite or (ours and not resume):
            run._clear_run_files()
            meta = None
        created = (meta or {}).get("created") or datetime.now(UTC).isoformat(timespec="seconds")
        run.write_config(config_yaml)
        run._write_meta({**(meta or {}), "config_hash": config_hash, "created": created, "status": "running"})
        return run

    def _create(self) -> None:
        if self.path.exists() and not self.path.is_dir():
            raise OutputError(f"run directory {self.path} exists and is not a directory")
        with output_error_on_os_error(f"cannot create run directory {self.path}"):
            self.path.mkdir(parents=True, exist_ok=True)
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise OutputError(f"cannot write to run directory {self.path}: permission denied")

    def failed_before_computing(self, meta: dict[str, Any] | None) -> bool:
        """Whether this is the directory of a run marked failed that left no samples and no results (only its
        config, run_meta.json and log): e.g. a data set, reward or checkpoint error found before sampling."""
        if (meta or {}).get("status") != "failed":
            return False
        partial = self.path / PARTIAL_DIR
        return not any((self.path / n).exists() for n in COMPUTED_FILES) and not (
            partial.is_dir() and any(partial.iterdir()))

    def _refuse_leftover_run_files(self) -> None:
        """OutputError when a directory without run_meta.json holds files a run writes."""
        leftovers = [n for n in RUN_FILES if (self.path / n).exists()] + (
            [PARTIAL_DIR] if (self.path / PARTIAL_DIR).exists() else [])
        if leftovers:
            raise OutputError(f"run directory {self.path} holds run files ({', '.join(leftovers)}) but no "
                              f"{META_FILE}; pass --overwrite to replace them or choose another --out")

    def _unknown_entries(self) -> list[str]:
        known = set(RUN_FILES) | {PARTIAL_DIR}
        return sorted(n for n in os.listdir(self.path)
                      if n not in known and not io_utils.is_temp_name(n, RUN_FILES))

    def _clear_run_files(self) -> None:
        """Delete the files a run writes and our stale temp files; leave anything else alone."""
        with output_error_on_os_error(f"cannot clear run directory {self.path}"):
            for name in os.listdir(self.path):
                if name in RUN_FILES or io_utils.is_temp_name(name, RUN_FILES):
                    entry = self.path / name
                    if entry.is_file() or entry.is_symlink():
                        entry.unlink()
        self.clear_partial()

    def clear_partial(self) -> None:
        """Delete partial/'s state files and our temp files there, and partial/ itself once empty (a completed
        run keeps none: its batches are saved whole)."""
        partial = self.path / PARTIAL_DIR
        with output_error_on_os_error(f"cannot clear {partial}"):
            if partial.is_dir():
                for entry in partial.iterdir():
                    if entry.is_file() and (entry.suffix == ".pt" or io_utils.is_temp_name(entry.name)):
                        entry.unlink()
                if not any(partial.iterdir()):
                    partial.rmdir()

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
        """run_meta.json, stamped with the SCHEMA_VERSION of this code (`prepare` refused a directory of another)."""
        self._write_text(META_FILE, dumps_strict({**meta, "schema_version": schema.SCHEMA_VERSION}, indent=2) + "\n")

    def record_meta(self, key: str, value: Any) -> None:
        """Store `key` in run_meta.json (kept by a resume of the same config, dropped by a fresh start)."""
        meta = self.read_meta() or {}
        meta[key] = value
        self._write_meta(meta)

    def mark_status(self, status: str) -> None:
        """Record the run's status in run_meta.json: "running" | "complete" | "failed"."""
        if status not in RUN_STATUSES:
            raise ValueError(f"run status must be one of {RUN_STATUSES}, got {status!r}")
        self.record_meta("status", status)

    # ---- files ------------------------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        return self.path / LOG_FILE

    def _write_text(self, name: str, text: str) -> Path:
        """Write `text` as UTF-8 to the file `name` in the run directory, atomically."""
        path = self.path / name
        with output_error_on_os_error(f"cannot write {path}"):
            io_utils.atomic_write_text(path, text)
        return path

    def write_config(self, yaml_text: str) -> None:
        """Write the fully resolved config as config.yaml."""
        self._write_text(CONFIG_FILE, yaml_text)

    def write_results(self, results: dict[str, Any], *, validate: bool = True) -> Path:
        """Write results.json: strict JSON (NaN / ±inf → null), indent 2. Checks the schema first."""
        if validate:
            validate_results_schema(results)
        return self._write_text(RESULTS_FILE, dumps_strict(results, indent=2) + "\n")

    def _batch_path(self, name: str) -> Path:
        if name not in BATCH_FILES:
            raise ValueError(f"batch name must be one of {sorted(BATCH_FILES)}, got {name!r}")
        return self.path / BATCH_FILES[name]

    def save_batch(self, name: str, batch: dict[str, Any]) -> Path:
        """Save the packed "E" or "U" batch dict (tensors, lists, ints, strs, floats) as E_batch.pt / U_batch.pt."""
        path = self._batch_path(name)
        _save_torch(_to_cpu(batch), path)
        return path

    def load_batch(self, name: str) -> dict[str, Any] | None:
        """Load a saved batch with weights_only=True; None when it was never saved."""
        return _load_torch(self._batch_path(name))

    def save_update_vector(self, v_named: dict[str, torch.Tensor], metadata: dict[str, Any] | None = None) -> Path:
        """Save v (per unit learning rate, keyed by parameter name) as update_vector.safetensors
        (tensors moved to CPU, made contiguous).

        safetensors metadata must be str → str: non-string values are stored as JSON text.
        """
        meta = {str(k): v if isinstance(v, str) else dumps_strict(v) for k, v in (metadata or {}).items()}
        cpu = {name: t.detach().cpu().contiguous() for name, t in v_named.items()}
        path = self.path / UPDATE_VECTOR_FILE
        with output_error_on_os_error(f"cannot write {path}"):
            io_utils.atomic_write_bytes(path, safetensors_bytes(cpu, metadata=meta))
        return path

    def load_update_vector(self) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
        """(v_named, metadata) from update_vector.safetensors; None when absent."""
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
        return self._write_text(PER_SEQUENCE_FILE, "".join(dumps_strict(row) + "\n" for row in rows))

    def attach_log_handler(self, logger: logging.Logger, level: int = logging.INFO) -> logging.FileHandler:
        """Append `logger`'s records to probe.log; the caller removes and closes the returned handler."""
        with output_error_on_os_error(f"cannot open log file {self.log_path}"):
            handler = logging.FileHandler(self.log_path, mode="a", encoding="utf-8")
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
        with output_error_on_os_error(f"cannot create {path.parent}"):
            path.parent.mkdir(exist_ok=True)
        _save_torch(_to_cpu(obj), path)
        return path

    def load_partial(self, name: str) -> Any | None:
        """Load partial/<name>.pt with weights_only=True; None when absent."""
        return _load_torch(self._partial_path(name))

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


# ----------------------------------------------------------------------------------------------
# Generation chunks saved as they complete (resume after a kill during sampling)
# ----------------------------------------------------------------------------------------------

class GenerationChunkStore:
    """Saves each completed generation chunk as partial/gen_<key>_<i>.pt and hands saved ones back.

    Plugged into a policy engine (`engine.chunk_store`): a `generate_batched(..., seed_per_chunk=True)`
    call asks `open(key)` for the chunks an earlier (killed) run of the same call saved — `key` describes the call
    (seed, G, chunk size, prompt tokens), so chunks of a different call are never reused — and a callback that saves
    each new chunk atomically. A kill loses at most the chunk in flight."""

    def __init__(self, run_dir: RunDirectory):
        self.run_dir = run_dir

    @staticmethod
    def _digest(key: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()[:16]

    def open(self, key: dict[str, Any]) -> tuple[dict[int, list[list[int]]], Callable[[int, list[list[int]]], None]]:
        """(saved chunks {index: responses}, save(index, responses)) for the call described by `key`."""
        digest = self._digest(key)
        done: dict[int, list[list[int]]] = {}
        folder = self.run_dir.path / PARTIAL_DIR
        if folder.is_dir():
            for path in sorted(folder.glob(f"{GEN_CHUNK_PREFIX}{digest}_*.pt")):
                obj = self.run_dir.load_partial(path.stem)
                if isinstance(obj, dict) and obj.get("key") == digest and isinstance(obj.get("index"), int):
                    responses = [list(map(int, r)) for r in obj["responses"]]  # row-keyed spans: with their log q
                    done[obj["index"]] = {"responses": responses, "logqs": obj["logqs"]} if "logqs" in obj else responses

        def save(index: int, responses: list[list[int]], *logqs: list[list[float]] | None) -> None:
            self.run_dir.save_partial(f"{GEN_CHUNK_PREFIX}{digest}_{index:05d}", {
                "key": digest, "index": int(index), "responses": responses, **({"logqs": logqs[0]} if logqs else {})})

        return done, save

    def clear(self) -> None:
        """Delete the saved chunks (once the batches they make up are saved whole)."""
        folder = self.run_dir.path / PARTIAL_DIR
        if folder.is_dir():
            for path in folder.glob(f"{GEN_CHUNK_PREFIX}*.pt"):
                with contextlib.suppress(OSError):
                    path.unlink()
            with contextlib.suppress(OSError):  # nothing else is kept there: drop the folder once empty
                if not any(folder.iterdir()):
                    folder.rmdir()

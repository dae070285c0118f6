"""The sweep directory: what it holds and when it may be (re)used.

    sweep_meta.json     {"kind": "entropy-probe sweep", "schema_version", "config_hash", "checkpoints_dir", "every",
                         "created", "status"}: marks the directory as a sweep's
    config.yaml         the sweep's config (checkpoint.checkpoint_path is set per checkpoint)
    runs/<checkpoint>/  one probe run directory per checkpoint (`entropy-probe run`'s layout), or an
                        entropy-only one (entropy_only.json) where no step follows
    sweep.json          rows, realised, calibration
    trajectory.png, calibration.png, sweep.log

`--out D` needs a new or empty directory; `--resume D` needs D's sweep_meta.json to hold the same schema version
(report/results_schema.SCHEMA_VERSION), config hash, checkpoint directory and --every, and keeps every finished run. Every file is written atomically.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .. import io_utils
from ..config import ProbeConfig
from ..errors import OutputError, output_error_on_os_error
from ..report.results_schema import SCHEMA_VERSION, dumps_strict, refuse_other_schema
from ..report.run_dir import META_FILE as RUN_META_FILE

__all__ = ["META_FILE", "SWEEP_FILE", "SWEEP_KIND", "SweepDirectory", "sweep_config_hash"]

META_FILE = "sweep_meta.json"
SWEEP_FILE = "sweep.json"
CONFIG_FILE = "config.yaml"
RUNS_DIR = "runs"
LOG_FILE = "sweep.log"
SWEEP_KIND = "entropy-probe sweep"


def sweep_config_hash(config: ProbeConfig) -> str:
    """The config hash of the sweep: its config with the per-checkpoint paths unset (`without_checkpoint_path`)."""
    return without_checkpoint_path(config).config_hash()


def without_checkpoint_path(config: ProbeConfig) -> ProbeConfig:
    """`config` with checkpoint.checkpoint_path and predictors.next_checkpoint = None (set per checkpoint)."""
    ck = config.checkpoint.model_copy(update={"checkpoint_path": None})
    predictors = config.predictors.model_copy(update={"next_checkpoint": None})
    return config.model_copy(update={"checkpoint": ck, "predictors": predictors})


class SweepDirectory:
    """One sweep's output directory; `prepare` creates it (--out) or reopens it (--resume)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @property
    def runs(self) -> Path:
        return self.path / RUNS_DIR

    @property
    def log_path(self) -> Path:
        return self.path / LOG_FILE

    def read_meta(self) -> dict[str, Any] | None:
        path = self.path / META_FILE
        if not path.is_file():
            return None
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise OutputError(f"cannot read {path}: {type(exc).__name__}: {exc}") from exc
        if not isinstance(meta, dict) or meta.get("kind") != SWEEP_KIND:
            raise OutputError(f"{path} is not the meta file of an entropy-probe sweep")
        return meta

    @classmethod
    def prepare(cls, path: Path, config: ProbeConfig, checkpoints_dir: Path, every: int, *,
                resume: bool) -> SweepDirectory:
        """Create the sweep directory, or reopen it to resume (OutputError naming what does not match)."""
        sweep = cls(path)
        if path.exists() and not path.is_dir():
            raise OutputError(f"sweep directory {path} exists and is not a directory")
        meta = sweep.read_meta() if path.is_dir() else None
        wanted = {"config_hash": sweep_config_hash(config), "checkpoints_dir": str(checkpoints_dir.resolve()),
                  "every": every}
        if resume:
            if meta is None:
                raise OutputError(f"nothing to resume in {path}: it holds no {META_FILE}")
            refuse_other_schema(meta, path)
            for key, value in wanted.items():
                if meta.get(key) != value:
                    raise OutputError(f"--resume {path}: that sweep has {key} {meta.get(key)!r}, this one "
                                      f"{value!r} (another config, checkpoint directory or --every)")
        elif path.is_dir() and any(path.iterdir()):
            hint = f"; finish it with --resume {path}" if meta is not None else ""
            raise OutputError(f"sweep directory {path} is not empty{hint} (or choose another --out)")
        with output_error_on_os_error(f"cannot create sweep directory {path}"):
            sweep.runs.mkdir(parents=True, exist_ok=True)
        sweep.write_text(CONFIG_FILE, without_checkpoint_path(config).to_yaml())
        created = (meta or {}).get("created") or datetime.now(UTC).isoformat(timespec="seconds")
        sweep.write_meta({"kind": SWEEP_KIND, "schema_version": SCHEMA_VERSION, **wanted, "created": created,
                          "status": "running"})
        return sweep

    def write_text(self, name: str, text: str) -> Path:
        target = self.path / name
        with output_error_on_os_error(f"cannot write {target}"):
            io_utils.atomic_write_text(target, text)
        return target

    def write_meta(self, meta: dict[str, Any]) -> None:
        self.write_text(META_FILE, dumps_strict(meta, indent=2) + "\n")

    def mark_status(self, status: str) -> None:
        meta = self.read_meta() or {}
        self.write_meta({**meta, "status": status})

    def write_sweep(self, doc: dict[str, Any]) -> Path:
        return self.write_text(SWEEP_FILE, dumps_strict(doc, indent=2) + "\n")

    def run_dir(self, checkpoint_name: str) -> Path:
        return self.runs / checkpoint_name

    @staticmethod
    def run_state(run_dir: Path, config_hash: str) -> str:
        """"new" (no run_meta.json: start it), "complete" (finished with this config: skip it) or "partial"
        (started: resume it). A finished run of another config is an OutputError naming the directory."""
        meta_path = run_dir / RUN_META_FILE
        if not meta_path.is_file():
            return "new"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise OutputError(f"cannot read {meta_path}: {type(exc).__name__}: {exc}") from exc
        if meta.get("status") != "complete":
            return "partial"
        if meta.get("config_hash") != config_hash:
            raise OutputError(f"run directory {run_dir} holds a finished run of another config (hash "
                              f"{meta.get('config_hash')} ≠ {config_hash})")
        return "complete"

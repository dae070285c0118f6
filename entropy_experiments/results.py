"""Moved to `entropy_experiments.report`; kept so that existing imports work.

    report.run_dir          RunDirectory, GenerationChunkStore, the run's file names
    report.results_schema   REQUIRED_SCHEMA, validate_results_schema, load_results, strict JSON
    report.summary          render_summary, print_summary
    report.plot             plot_delta_h

The atomic-write helpers that wrapped `io_utils` are gone: call `io_utils` (or the RunDirectory methods).
"""

from __future__ import annotations

from .report.plot import plot_delta_h
from .report.results_schema import (
    NORMALIZE_MODES,
    REQUIRED_SCHEMA,
    RESULTS_FILE,
    TRUE_ENTRY_SCHEMA,
    dumps_strict,
    load_results,
    to_strict_json,
    validate_results_schema,
)
from .report.run_dir import (
    BATCH_FILES,
    CONFIG_FILE,
    GEN_CHUNK_PREFIX,
    LOG_FILE,
    META_FILE,
    PARTIAL_DIR,
    PER_SEQUENCE_FILE,
    PLOT_FILE,
    RUN_FILES,
    RUN_STATUSES,
    UPDATE_VECTOR_FILE,
    GenerationChunkStore,
    RunDirectory,
)
from .report.summary import IMPORTANCE_OFF_NOTE, print_summary, render_summary

__all__ = [
    "BATCH_FILES",
    "CONFIG_FILE",
    "GEN_CHUNK_PREFIX",
    "IMPORTANCE_OFF_NOTE",
    "LOG_FILE",
    "META_FILE",
    "NORMALIZE_MODES",
    "PARTIAL_DIR",
    "PER_SEQUENCE_FILE",
    "PLOT_FILE",
    "REQUIRED_SCHEMA",
    "RESULTS_FILE",
    "RUN_FILES",
    "RUN_STATUSES",
    "TRUE_ENTRY_SCHEMA",
    "UPDATE_VECTOR_FILE",
    "GenerationChunkStore",
    "RunDirectory",
    "dumps_strict",
    "load_results",
    "plot_delta_h",
    "print_summary",
    "render_summary",
    "to_strict_json",
    "validate_results_schema",
]

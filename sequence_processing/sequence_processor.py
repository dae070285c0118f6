"""Re-export of `entropy_experiments.compat.sequence_processor` (seed 004) under the seed-era module path."""

from entropy_experiments.compat.sequence_processor import (
    BatchedSequences,
    DiagnosticsPack,
    DiagnosticsResults,
    GenerationConfig,
    LogprobResults,
    SequenceDiagnostics,
    SequenceProcessor,
    TokenStepDiagnostics,
)

__all__ = [
    "BatchedSequences", "DiagnosticsPack", "DiagnosticsResults", "GenerationConfig", "LogprobResults",
    "SequenceDiagnostics", "SequenceProcessor", "TokenStepDiagnostics",
]

"""Legacy import path of the original (seed) API: SequenceProcessor and its result types, a thin re-export of
`entropy_experiments.compat.sequence_processor` (where the façade lives)."""

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

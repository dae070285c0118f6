"""Re-export of `entropy_experiments.utils.sequence_processor` under the seed-era module path."""

from entropy_experiments.utils.sequence_processor import (
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

"""Re-export of the seed-004 API (`entropy_experiments.compat.sequence_processor`) under its earlier path.

The implementation lives in `entropy_experiments.policy` (generation, scoring, the sampling policy);
SequenceProcessor is a thin façade over it.
"""

from entropy_experiments.compat.sequence_processor import (
    BatchedSequences,
    DiagnosticsPack,
    DiagnosticsResults,
    GenerationConfig,
    LogprobResults,
    SequenceDiagnostics,
    SequenceProcessor,
    TokenStepDiagnostics,
    chunk_seed,
)

__all__ = [
    "BatchedSequences", "DiagnosticsPack", "DiagnosticsResults", "GenerationConfig", "LogprobResults",
    "SequenceDiagnostics", "SequenceProcessor", "TokenStepDiagnostics", "chunk_seed",
]

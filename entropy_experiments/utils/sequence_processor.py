"""Legacy import path of the original (seed) API: SequenceProcessor and its result types.

A thin re-export of `entropy_experiments.compat.sequence_processor`, where the façade lives (over
`entropy_experiments.policy`: generation, scoring, the sampling policy). New code uses
`entropy_experiments.policy.engine.PolicyEngine`.
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

"""Legacy import path of the original (seed) API: `from sequence_processing.sequence_processor import SequenceProcessor`.

A thin re-export of `entropy_experiments.compat.sequence_processor` (one implementation behind both paths).
"""

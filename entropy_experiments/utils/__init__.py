"""Legacy import path of the original (seed) API: `entropy_experiments.utils.sequence_processor` (SequenceProcessor),
a thin re-export of `entropy_experiments.compat.sequence_processor`."""

"""Legacy import path of the original (seed) API: SequenceProcessor and its result types, a thin re-export of
`entropy_experiments.compat.sequence_processor`. New code uses `entropy_experiments.policy.engine.PolicyEngine`."""

from entropy_experiments.compat.sequence_processor import *  # every legacy name: compat's __all__
from entropy_experiments.compat.sequence_processor import __all__  # noqa: F401

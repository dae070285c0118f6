"""The seed-era API as thin façades over the new modules (`compat/sequence_processor.py`: seed 004's
SequenceProcessor over `entropy_experiments.policy`)."""

"""Earlier import path of the seed-era SequenceProcessor API (`utils/sequence_processor.py`, a re-export of
`entropy_experiments.compat.sequence_processor`)."""

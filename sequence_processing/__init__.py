"""Seed-era import path: `from sequence_processing.sequence_processor import SequenceProcessor, ...`.

A thin re-export of `entropy_experiments.compat.sequence_processor` (one implementation behind both paths).
"""

"""Data: data sets (`datasets/`), rewards (`rewards/`), the index plan (`plan.py`) and the one batch
type, the packed batch dict (`batch.py`: pack, validate, subset, concat).

Importing this package imports none of them.
"""

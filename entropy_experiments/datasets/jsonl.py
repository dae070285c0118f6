"""moved to entropy_experiments.data.datasets.jsonl; kept so existing imports work."""

from entropy_experiments.data.datasets.jsonl import (
    NAME,
    jsonl,
)

__all__ = [
    "NAME",
    "jsonl",
]

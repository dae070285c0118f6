"""moved to entropy_experiments.data.datasets.files; kept so existing imports work."""

from entropy_experiments.data.datasets.files import (
    PATH_KEY,
    first_records,
    read_jsonl,
    resolve_split_path,
    text_field,
)

__all__ = [
    "PATH_KEY",
    "first_records",
    "read_jsonl",
    "resolve_split_path",
    "text_field",
]

"""moved to entropy_experiments.data.datasets; kept so existing imports work."""

from entropy_experiments.data.datasets import (
    DATASET_REGISTRY,
    Example,
    clear_example_cache,
    load_examples,
    r1_prompt,
    register_dataset,
)

__all__ = [
    "DATASET_REGISTRY",
    "Example",
    "clear_example_cache",
    "load_examples",
    "r1_prompt",
    "register_dataset",
]

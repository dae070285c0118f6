"""moved to entropy_experiments.data.datasets.base; kept so existing imports work."""

from entropy_experiments.data.datasets.base import (
    DATASET_REGISTRY,
    Builder,
    Example,
    clear_example_cache,
    load_examples,
    make_meta,
    register_dataset,
)

__all__ = [
    "DATASET_REGISTRY",
    "Builder",
    "Example",
    "clear_example_cache",
    "load_examples",
    "make_meta",
    "register_dataset",
]

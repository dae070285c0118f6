"""Data sets: the `Example` record, DATASET_REGISTRY and `load_examples` (the one entry point).

Registered names: `gsm_symbolic_r1_template` (default, generated offline), `gsm8k_r1_template`
(local JSONL or the hub), `jsonl` (any local JSONL, prompts verbatim), `hf` (anything `datasets` reads, in TRL's column conventions:
`hf.py`). Importing this package reads
nothing from disk or the network; builders import their heavy dependencies when first called.
"""

from entropy_experiments.data.datasets.base import (
    DATASET_REGISTRY,
    Example,
    clear_example_cache,
    load_examples,
    register_dataset,
)
from entropy_experiments.data.datasets.templates import r1_prompt

# Imported for their registration side effect.
from entropy_experiments.data.datasets import gsm8k, gsm_symbolic, hf, jsonl  # noqa: F401  isort: skip

__all__ = [
    "DATASET_REGISTRY",
    "Example",
    "clear_example_cache",
    "load_examples",
    "r1_prompt",
    "register_dataset",
]

"""The `Example` record, the data set registry and `load_examples`, the one entry point.

A data set is a function `builder(split, *, dataset_path=None, pool_size=None) -> list[Example]`
registered under a name. Builders ignore the keyword arguments they do not use, so every caller can
pass both. `load_examples` validates the arguments, checks the result and caches it in-process:
the probe asks for the same split several times (E and U sampling, the reference sampler) and some
builders are slow to import (reasoning-gym takes ~2 s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from entropy_experiments.errors import DataError, closest_match
from entropy_experiments.registry import registrar


@dataclass(frozen=True)
class Example:
    """One problem of a data set split.

    question: the full prompt sent to the model (template applied); "" for a conversational row of `hf`,
              whose prompt is rendered from `prompt` by the tokenizer's chat template.
    answer:   the gold answer as a string; "" when unknown (rewards then warn and score 0).
    text:     the raw problem text, without the template.
    meta:     at least `global_prompt_id` (int, index in the split's pool, stable across runs and
              pool sizes), `dataset` (registry name) and `split`; builders add provenance.
    prompt:   TRL's `prompt` value for data sets in TRL's conventions (`hf`): a string (standard) or a
              list of {role, content} messages (conversational); None for the built-in pools, whose
              `question` is the prompt. `data/prompt_rendering.py` turns it into the trainer's token ids.
    columns:  the row's other columns (TRL passes each to the reward functions as a keyword); None for
              the built-in pools (their reward keywords are question / answer / text / meta).
    """

    question: str
    answer: str
    text: str
    meta: dict[str, Any] = field(default_factory=dict)
    prompt: Any = None
    columns: dict[str, Any] | None = None

    @property
    def conversational(self) -> bool:
        """True when the prompt is a list of messages (TRL's `is_conversational`)."""
        return isinstance(self.prompt, list)


Builder = Callable[..., list[Example]]

DATASET_REGISTRY: dict[str, Builder] = {}

# (name, split, dataset_path, pool_size, columns) -> examples. Tuples so that callers cannot edit the cache.
_CACHE: dict[tuple, tuple[Example, ...]] = {}


# Decorator: `@register_dataset("name")` on the builder, where it is defined (registry.py's style).
register_dataset: Callable[[str], Callable[[Builder], Builder]] = registrar(DATASET_REGISTRY, "data set")


def make_meta(dataset: str, split: str, global_prompt_id: int, **extra: Any) -> dict[str, Any]:
    """The meta dict every builder attaches: the three required keys first, then provenance."""
    return {"global_prompt_id": global_prompt_id, "dataset": dataset, "split": split, **extra}


def load_examples(
    name: str,
    split: str,
    *,
    dataset_path: str | None = None,
    pool_size: int | None = None,
    columns: tuple[str, str | None] | None = None,
) -> list[Example]:
    """Return the examples of data set `name`, split `split` (a fresh list; Examples are frozen).

    dataset_path: local file for file-based data sets ('{split}' in it becomes the split name).
    pool_size:    cap on the pool (the first `pool_size` examples; generated data sets make exactly
                  that many). A smaller pool is always a prefix of a larger one.
    columns:      (prompt column, answer column or None) for data sets in TRL's conventions (`hf`);
                  passed to the builder only when given.
    Raises DataError for an unknown name, bad arguments, unreadable data or an empty split.
    """
    if name not in DATASET_REGISTRY:
        known = sorted(DATASET_REGISTRY)
        hint = closest_match(str(name), known)
        suffix = f" (did you mean '{hint}'?)" if hint else ""
        raise DataError(f"unknown data set '{name}': choose one of {known}{suffix}")
    if not isinstance(split, str) or not split:
        raise DataError(f"data set '{name}': split must be a non-empty string, got {split!r}")
    if pool_size is not None and (
        isinstance(pool_size, bool) or not isinstance(pool_size, int) or pool_size < 1
    ):
        raise DataError(f"data set '{name}': pool_size must be a positive integer or null, got {pool_size!r}")
    path = None if dataset_path is None else str(dataset_path)

    key = (name, split, path, pool_size, columns)
    if key not in _CACHE:
        extra = {} if columns is None else {"columns": columns}
        examples = DATASET_REGISTRY[name](split, dataset_path=path, pool_size=pool_size, **extra)
        if not examples:
            where = f" ({path})" if path else ""
            raise DataError(f"data set '{name}' split '{split}' is empty{where}")
        _CACHE[key] = tuple(examples)
    return list(_CACHE[key])


def clear_example_cache() -> None:
    """Forget every cached split (tests; or after editing a data file within one process)."""
    _CACHE.clear()

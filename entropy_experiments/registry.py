"""One registry style for interchangeable algorithms (the verl way): `@register_...(name)` where the algorithm is
defined. Data sets (`data/datasets/base.register_dataset`), rewards (`data/rewards/registry.register_reward`),
loss types (`estimators/objectives.register_loss_type`) and direction predictors
(`estimators/predictors.register_direction_predictor`) are each a table filled by such a decorator."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

__all__ = ["registrar"]


def registrar(table: dict[str, T], what: str) -> Callable[[str], Callable[[T], T]]:
    """`register(name)`: a decorator that puts the decorated object into `table` under `name` and returns it
    unchanged. A different object under a name already taken is a ValueError naming `what` and the name."""

    def register(name: str) -> Callable[[T], T]:
        def decorator(obj: T) -> T:
            if name in table and table[name] is not obj:
                raise ValueError(f"{what} name {name!r} is already registered")
            table[name] = obj
            return obj

        return decorator

    return register

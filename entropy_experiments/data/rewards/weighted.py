"""Several reward functions with weights, combined as TRL's GRPOTrainer combines them.

`reward.functions: [spec, …]` (registered names or "package.module:function") with `reward.weights`
(default 1 each; `reward.name` alone is one function of weight 1). Each function is called in its own
convention (`calling.py`) once per prompt; a None value is NaN and the weighted sum skips it, as TRL's
`(rewards_per_func * reward_weights).nansum(dim=1)` does; a completion that no function scores is a
RewardError (TRL drops it from the group baseline and zeroes its advantage, which the probe does not
represent). Every function is resolved and its signature checked by `RewardSet.resolve` — before the
model loads — against the keywords the data set will provide.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from entropy_experiments.data.rewards.calling import EXAMPLE_COLUMNS, TRL_FIXED_ARGUMENTS, reward_style
from entropy_experiments.data.rewards.registry import RewardFn, compute_rewards, get_reward
from entropy_experiments.errors import RewardError


@dataclass(frozen=True)
class PromptRewards:
    """One prompt's rewards: the weighted sum [G] and each function's values {name: [G]} (NaN for None)."""

    summed: list[float]
    per_function: dict[str, list[float]]


def check_signature(fn: RewardFn, name: str, keywords: set[str] | None) -> None:
    """RewardError unless `fn` can be called the way the probe will call it. `keywords`: the data-set
    columns a TRL-style call passes (None: not known yet, only the probe's fixed arguments are checked)."""
    style = reward_style(fn)
    if style.trl:
        offered = set(TRL_FIXED_ARGUMENTS) | (keywords or set())
        missing = sorted(style.required - offered) if keywords is not None else []
        if missing:
            raise RewardError(f"reward '{name}' needs argument(s) {missing} that the data set does not provide "
                              f"(its columns: {sorted(keywords)})")
        return
    try:
        inspect.signature(fn).bind("prompt", ["response"], None)
    except (TypeError, ValueError) as exc:
        raise RewardError(f"reward '{name}' cannot be called as fn(prompt, responses, example) ({exc}) nor is it "
                          "TRL style (a parameter named 'completions' or 'completion_ids')") from None


def example_keywords(example: Any) -> set[str]:
    """The keywords a TRL-style call gets for `example` beyond the fixed ones (calling.trl_arguments)."""
    columns = getattr(example, "columns", None)
    if columns is not None:
        return {str(k) for k in columns}
    return set(EXAMPLE_COLUMNS) | {str(k) for k in (getattr(example, "meta", None) or {})}


@dataclass(frozen=True)
class RewardSet:
    """The resolved reward functions, their names (as configured) and weights."""

    names: tuple[str, ...]
    functions: tuple[RewardFn, ...]
    weights: tuple[float, ...]

    @classmethod
    def resolve(cls, specs: Sequence[str], weights: Sequence[float] | None = None,
                example: Any = None) -> RewardSet:
        """Import every function and check its signature (against `example`'s columns when given)."""
        specs = list(specs)
        if not specs:
            raise RewardError("reward.functions: give at least one reward function")
        if len(set(specs)) != len(specs):
            raise RewardError(f"reward.functions: a function is listed twice: {specs}")
        weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
        if len(weights) != len(specs):
            raise RewardError(f"reward.weights: {len(weights)} weights for {len(specs)} reward functions")
        functions = [get_reward(spec) for spec in specs]
        keywords = example_keywords(example) if example is not None else None
        for spec, fn in zip(specs, functions, strict=True):
            check_signature(fn, spec, keywords)
        return cls(tuple(specs), tuple(functions), tuple(weights))

    def describe(self) -> dict[str, Any]:
        return {"functions": list(self.names), "weights": list(self.weights)}

    def score(self, prompt: str, responses: list[str], example: Any, *,
              completion_ids: list[list[int]] | None = None, where: str = "") -> PromptRewards:
        """Every function on one prompt's responses, and their weighted sum (TRL's nansum)."""
        several = len(self.functions) > 1
        per_function = {}
        for name, fn in zip(self.names, self.functions, strict=True):
            per_function[name] = compute_rewards(fn, prompt, responses, example, completion_ids=completion_ids,
                                                 where=where, allow_none=several)
        summed = []
        for g in range(len(responses)):
            values = [(w, per_function[n][g]) for n, w in zip(self.names, self.weights, strict=True)]
            if all(math.isnan(v) for _, v in values):
                raise RewardError(f"every reward function returned None for response {g}{where}: TRL would leave "
                                  "this completion out of the group baseline, which the probe does not represent")
            summed.append(sum(w * v for w, v in values if not math.isnan(v)))
        return PromptRewards(summed=summed, per_function=per_function)

"""How a reward function is called: the probe's own convention or TRL's, told apart by its signature.

Every reward call goes through `call_reward`, once per prompt, with that prompt's G responses:

- **probe style** `fn(prompt, responses, example) -> list[float]`: positional; `example` is the data-set
  `Example` (gold answer in `example.answer`, provenance in `example.meta`).
- **TRL style** — any function with a parameter named `completions` or `completion_ids` (e.g.
  `def f(completions, **kwargs)`, `def f(prompts, completions, answer, **kwargs)`, TRL's own
  `get_repetition_penalty_reward()`, which takes `completion_ids, **kwargs`) — is called by keyword the
  way TRL's `GRPOTrainer._calculate_rewards` calls reward functions on a plain-text (non-conversational)
  data set (completions are strings, not chat messages):

      fn(prompts=[prompt] * G, completions=[G response strings], completion_ids=[G token-id lists],
         question=[...] * G, answer=[...] * G, text=[...] * G, <every example.meta key>=[...] * G,
         trainer_state=None, log_extra=<no-op>, log_metric=<no-op>)

  Every data-set column is a list of length G (one value per completion, as TRL repeats its columns).
  `completion_ids` is None when the caller has no token ids (`compute_rewards` called directly).
  There is no trainer: `trainer_state` is None, and `log_extra` / `log_metric` accept and drop their
  values. A function without `**kwargs` gets only the arguments it names (TRL would pass them all and
  fail); one that requires an argument the probe does not provide (e.g. TRL's `accuracy_reward` needs a
  `solution` column) is a RewardError naming it.
  An `async def` reward is awaited.
- **Data sets in TRL's conventions** (`hf`: examples with `prompt` and `columns`): `prompts` holds the
  data set's own prompt (a string, or the list of messages), `completions` are
  `[{"role": "assistant", "content": text}]` for conversational prompts, and the keywords are exactly the
  data set's other columns (no question / answer / text / meta), as GRPOTrainer passes them.
- **None values** (TRL's "this function cannot score this completion"): with several functions
  (`weighted.py`) a None counts as NaN and the weighted sum skips it (TRL's `nansum`); a completion that
  no function scores is a RewardError (TRL leaves it out of the group baseline and zeroes its advantage,
  which the probe does not represent).

The signature is read once per function (`reward_style`). An exception raised by the function becomes
a one-line RewardError naming the reward, the exception and (from the caller) the prompt.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from entropy_experiments.errors import RewardError

# Arguments the probe itself passes to a TRL-style function; a data-set column must not shadow one.
TRL_FIXED_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")
# A parameter with one of these names makes a function TRL style.
TRL_MARKERS = ("completions", "completion_ids")
# Example fields passed as columns (besides every key of example.meta).
EXAMPLE_COLUMNS = ("question", "answer", "text")


@dataclass(frozen=True)
class RewardStyle:
    """How to call one reward function: `trl` or not, and for TRL style which keywords it takes."""

    trl: bool
    takes_var_keyword: bool = True
    parameters: frozenset[str] = frozenset()
    required: frozenset[str] = frozenset()


_STYLES: dict[int, tuple[Callable, RewardStyle]] = {}  # id(fn) -> (fn kept alive, its style)


def _read_style(fn: Callable) -> RewardStyle:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some builtins: no readable signature, hence no 'completions'
        return RewardStyle(trl=False)
    params = signature.parameters.values()
    named = {p.name: p for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    if not any(marker in named for marker in TRL_MARKERS):
        return RewardStyle(trl=False)
    required = {name for name, p in named.items() if p.default is p.empty}
    return RewardStyle(trl=True, takes_var_keyword=any(p.kind is p.VAR_KEYWORD for p in params),
                       parameters=frozenset(named), required=frozenset(required))


def reward_style(fn: Callable) -> RewardStyle:
    """The calling convention of `fn`, read from its signature on first use and remembered."""
    entry = _STYLES.get(id(fn))
    if entry is None or entry[0] is not fn:
        entry = (fn, _read_style(fn))
        _STYLES[id(fn)] = entry
    return entry[1]


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Stands in for TRL's `log_extra` / `log_metric`: the probe has no completions table to log to."""


def trl_prompt_and_completions(prompt: str, responses: Sequence[str], example: Any) -> tuple[Any, list[Any]]:
    """TRL's `prompts` entry and `completions` for one prompt: a data set in TRL's conventions (`hf`) gives
    its own `prompt` (string, or messages); conversational prompts get completions as
    [{"role": "assistant", "content": text}] (what GRPOTrainer decodes them to without a response parser)."""
    trl_prompt = getattr(example, "prompt", None)
    if trl_prompt is None:
        return prompt, list(responses)
    if isinstance(trl_prompt, list):
        return trl_prompt, [[{"role": "assistant", "content": text}] for text in responses]
    return trl_prompt, list(responses)


def trl_arguments(prompt: str, responses: Sequence[str], example: Any,
                  completion_ids: Sequence[Sequence[int]] | None, name: str) -> dict[str, Any]:
    """Every keyword argument a TRL-style call gets (see the module docstring)."""
    G = len(responses)
    ids = None if completion_ids is None else [list(c) for c in completion_ids]
    trl_prompt, completions = trl_prompt_and_completions(prompt, responses, example)
    kwargs: dict[str, Any] = {"prompts": [trl_prompt] * G, "completions": completions, "completion_ids": ids}
    columns = getattr(example, "columns", None)
    if columns is not None:  # TRL's conventions: exactly the data set's other columns
        for key, value in columns.items():
            if key in TRL_FIXED_ARGUMENTS:
                raise RewardError(f"reward '{name}': data-set column '{key}' clashes with the TRL reward argument "
                                  "of that name")
            kwargs[str(key)] = [value] * G
        kwargs.update({"trainer_state": None, "log_extra": _ignore, "log_metric": _ignore})
        return kwargs
    for field in EXAMPLE_COLUMNS:
        kwargs[field] = [getattr(example, field, None)] * G
    for key, value in (getattr(example, "meta", None) or {}).items():
        if key in kwargs or key in TRL_FIXED_ARGUMENTS:
            raise RewardError(f"reward '{name}': data-set meta key '{key}' clashes with the TRL reward "
                              f"argument of that name")
        kwargs[str(key)] = [value] * G
    kwargs.update({"trainer_state": None, "log_extra": _ignore, "log_metric": _ignore})
    return kwargs


def _select(style: RewardStyle, kwargs: dict[str, Any], name: str) -> dict[str, Any]:
    """The arguments `fn` accepts; a required one the probe does not provide is a RewardError."""
    missing = sorted(style.required - set(kwargs))
    if missing:
        raise RewardError(f"reward '{name}' (TRL style) needs argument(s) {missing} that the probe does not "
                          f"provide; it passes {sorted(kwargs)}")
    if style.takes_var_keyword:
        return kwargs
    return {key: value for key, value in kwargs.items() if key in style.parameters}


def exception_line(exc: BaseException) -> str:
    """'TypeName: first line of the message' (just the type name when the message is empty)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


async def _await(awaitable: Any) -> Any:
    return await awaitable


def call_reward(fn: Callable, prompt: str, responses: Sequence[str], example: Any, *, name: str,
                where: str = "", completion_ids: Sequence[Sequence[int]] | None = None) -> Any:
    """Call `fn` on one prompt's responses in its own convention; returns its raw output (unchecked).

    Anything the function raises becomes RewardError "reward '<name>' raised <Type>: <message><where>"
    (the original exception chained as its cause).
    """
    style = reward_style(fn)
    if style.trl:
        args = ()
        kwargs = _select(style, trl_arguments(prompt, responses, example, completion_ids, name), name)
    else:
        args, kwargs = (prompt, list(responses), example), {}
    try:
        values = fn(*args, **kwargs)
        if inspect.isawaitable(values):
            values = asyncio.run(_await(values))
    except Exception as exc:  # a user's reward function may raise anything
        raise RewardError(f"reward '{name}' raised {exception_line(exc)}{where}") from exc
    return values

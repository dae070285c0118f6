"""The reward registry, `get_reward` (names or "package.module:function") and `compute_rewards`.

A reward function returns one float per response to one prompt. It is either probe style,
`fn(prompt, responses, example)` with `example` the data set record (gold answer in `example.answer`),
or TRL style, `fn(prompts, completions, **kwargs)` (any function with a parameter named `completions`
or `completion_ids`); `calling.py` holds the two conventions. Callers always go through `compute_rewards`, which calls the
function in its convention and checks the length and that every value is a finite number.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable
from typing import Any

from entropy_experiments.data.datasets.base import Example
from entropy_experiments.data.rewards.calling import call_reward, exception_line
from entropy_experiments.errors import RewardError, closest_match
from entropy_experiments.registry import registrar

# fn(prompt, responses, example) -> list[float], or TRL style fn(prompts, completions, **kwargs) (calling.py).
RewardFn = Callable[..., Any]

REWARD_REGISTRY: dict[str, RewardFn] = {}


# Decorator: `@register_reward("name")` on the reward function, where it is defined (registry.py's style).
register_reward: Callable[[str], Callable[[RewardFn], RewardFn]] = registrar(REWARD_REGISTRY, "reward")


def _import_reward(spec: str) -> RewardFn:
    """Resolve "package.module:function" (the function part may be dotted, e.g. "Class.method")."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise RewardError(f"reward '{spec}': expected 'package.module:function'")
    try:
        obj: Any = _import_module(module_name)
    except Exception as exc:  # noqa: BLE001  ImportError, or any error raised while the module runs
        raise RewardError(
            f"reward '{spec}': cannot import module '{module_name}' ({exception_line(exc)})"
            f"{import_path_hint(module_name, exc)}"
        ) from None
    owner = module_name
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            public = [name for name in dir(obj) if not name.startswith("_")]
            hint = closest_match(attr, public)
            suffix = f" (did you mean '{hint}'?)" if hint else ""
            raise RewardError(f"reward '{spec}': '{owner}' has no attribute '{attr}'{suffix}")
        obj = getattr(obj, attr)
        owner = f"{owner}.{attr}"
    if not callable(obj):
        raise RewardError(f"reward '{spec}': '{owner}' is a {type(obj).__name__}, not a function")
    return obj


def _missing_top_level(module_name: str, exc: Exception) -> str | None:
    """The top-level name of `module_name` when `exc` says the module itself (or its package) is not found; None
    when the module was found and something it imports is missing."""
    missing = getattr(exc, "name", None) if isinstance(exc, ModuleNotFoundError) else None
    if not missing or not (module_name == missing or module_name.startswith(missing + ".")):
        return None
    return missing.split(".")[0]


def _in_working_directory(top: str) -> bool:
    cwd = os.getcwd()
    return os.path.exists(os.path.join(cwd, top + ".py")) or os.path.isdir(os.path.join(cwd, top))


def _import_module(module_name: str) -> Any:
    """`importlib.import_module`, and then from the working directory: `entropy-probe run` started next to
    `my_rewards.py` finds it, as `python -m` would. The directory goes to the END of sys.path and only when the
    name is found nowhere else, so a file in the working directory never shadows an installed package."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        top = _missing_top_level(module_name, exc)
        if top is None or not _in_working_directory(top):
            raise
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())
    importlib.invalidate_caches()
    return importlib.import_module(module_name)


def import_path_hint(module_name: str, exc: Exception) -> str:
    """What to do when the reward's own module (or its package) is not on the import path nor in the working
    directory; "" for other errors."""
    top = _missing_top_level(module_name, exc)
    if top is None:
        return ""
    return (f": '{top}' is neither on the import path nor in the working directory {os.getcwd()}; run from the "
            f"directory that holds {top}.py (or the {top}/ package), add that directory to PYTHONPATH, or install "
            "the module")


def get_reward(spec: str) -> RewardFn:
    """The reward function for a registered name (e.g. 'tag_pref', 'zero') or 'package.module:function'."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward spec must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    if ":" in spec:
        return _import_reward(spec)
    if spec not in REWARD_REGISTRY:
        known = sorted(REWARD_REGISTRY)
        hint = closest_match(spec, known)
        suffix = f" (did you mean '{hint}'?)" if hint else ""
        raise RewardError(
            f"unknown reward '{spec}': choose one of {known} or 'package.module:function'{suffix}"
        )
    return REWARD_REGISTRY[spec]


def describe_reward(fn: RewardFn) -> str:
    """A name for error messages: the registry name, else 'module:qualname'."""
    for name, registered in REWARD_REGISTRY.items():
        if registered is fn:
            return name
    module = getattr(fn, "__module__", None) or "?"
    qualname = getattr(fn, "__qualname__", None) or type(fn).__name__
    return f"{module}:{qualname}"


def compute_rewards(reward_fn: RewardFn, prompt: str, responses: list[str], example: Example, *,
                    completion_ids: list[list[int]] | None = None, where: str = "",
                    allow_none: bool = False) -> list[float]:
    """Call `reward_fn` (either convention, `calling.py`) and check its output: exactly len(responses)
    finite numbers, returned as floats (`allow_none`: a None becomes NaN, TRL's convention for "cannot score").

    `completion_ids`: the responses' token ids, for TRL-style functions (None when unknown). `where`
    ends every RewardError message, e.g. " (prompt 3 of 4, prompt id 17)". A function that raises or
    returns None for a response is a RewardError too.
    """
    name = describe_reward(reward_fn)
    values = call_reward(reward_fn, prompt, responses, example, name=name, where=where,
                         completion_ids=completion_ids)
    try:
        count = len(values)
    except TypeError:
        raise RewardError(
            f"reward '{name}' returned a {type(values).__name__}, expected a list of {len(responses)} "
            f"floats{where}"
        ) from None
    if count != len(responses):
        raise RewardError(f"reward '{name}' returned {count} values for {len(responses)} responses{where}")
    rewards = []
    for index, value in enumerate(values):
        if value is None and allow_none:
            rewards.append(math.nan)
            continue
        if value is None:  # TRL's "cannot score this one"; the probe has no way to leave a response out of U
            raise RewardError(f"reward '{name}' returned None at index {index}{where}: the probe needs a "
                              "number for every response (TRL's None, 'not scorable', is not supported)")
        try:
            if isinstance(value, (str, bytes)):  # float("1") would succeed: a string is a bug here
                raise TypeError
            number = float(value)  # accepts ints, bools, numpy scalars and 0-d tensors
        except (TypeError, ValueError):
            raise RewardError(
                f"reward '{name}' value at index {index} is not a number: {value!r}{where}") from None
        if not math.isfinite(number):
            raise RewardError(f"reward '{name}' value at index {index} is not finite: {number!r}{where}")
        rewards.append(number)
    return rewards

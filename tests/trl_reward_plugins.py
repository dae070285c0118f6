"""TRL-style reward functions loaded by spec ("tests.trl_reward_plugins:NAME") in tests/test_rewards.py."""

from __future__ import annotations

import os

RAISE_ENV = "ENTROPY_TEST_REWARD_RAISE"  # "1": flaky_count_a raises (the user's bug); unset: it works


def flaky_count_a(prompts, completions, answer, **kwargs):
    """TRL signature. The number of letters 'a' in each completion, unless RAISE_ENV is "1": then it
    divides by zero, like a reward with a bug that the user fixes before `--resume`."""
    if os.environ.get(RAISE_ENV) == "1":
        return [1 / 0 for _ in completions]
    return [float(c.count("a")) for c in completions]


def all_zero(completions, **kwargs):
    """TRL signature: 0.0 for every completion (all U advantages vanish)."""
    return [0.0 for _ in completions]


def strict(prompts, completions, answer):
    """TRL names without **kwargs: must get exactly these three (TRL itself would pass more and fail)."""
    return [float(len(c) + len(p) + len(a)) for p, c, a in zip(prompts, completions, answer, strict=True)]


def needs_solution(completions, solution, **kwargs):
    """Requires a `solution` column, which the probe's data sets do not have."""
    return [0.0 for _ in completions]


def none_for_empty(completions, **kwargs):
    """TRL's 'cannot score': None for an empty completion."""
    return [None if not c else 1.0 for c in completions]


async def async_length(completions, **kwargs):
    """An async TRL reward (an LLM judge would be one)."""
    return [float(len(c)) for c in completions]

"""Reward functions loaded by spec ("tests.reward_plugins:NAME") in tests/test_rewards.py."""

from __future__ import annotations

import math


def answer_length(prompt, responses, example):
    """A valid custom reward: the length of each response, in characters."""
    return [float(len(response)) for response in responses]


def one_short(prompt, responses, example):
    """Broken: one value fewer than there are responses."""
    return [0.0] * (len(responses) - 1)


def nan_at_one(prompt, responses, example):
    """Broken: a NaN at index 1."""
    return [0.0, math.nan] + [0.0] * (len(responses) - 2)


NOT_A_FUNCTION = 3

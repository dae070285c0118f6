"""Trivial rewards."""

from __future__ import annotations

from entropy_experiments.data.datasets.base import Example
from entropy_experiments.data.rewards.registry import register_reward


@register_reward("zero")
def zero(prompt: str, responses: list[str], example: Example) -> list[float]:
    """0.0 for every response (all advantages vanish: a control for the U side)."""
    return [0.0] * len(responses)


_MATH_CHARS = frozenset("0123456789+-*/=×÷.")


@register_reward("math_density")
def math_density(prompt: str, responses: list[str], example: Example) -> list[float]:
    """Share of a response's non-space characters that are digits or arithmetic symbols, in [0, 1].

    A dense stand-in for `tag_pref` when the policy is too weak to ever answer correctly (the
    embedded 135M demo model): every response gets a graded score, so U has non-zero advantages and
    the probe has a real update direction to study. Not a measure of correctness.
    """
    scores = []
    for response in responses:
        chars = [c for c in response if not c.isspace()]
        scores.append(sum(c in _MATH_CHARS for c in chars) / len(chars) if chars else 0.0)
    return scores

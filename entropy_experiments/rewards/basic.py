"""Trivial rewards."""

from __future__ import annotations

from entropy_experiments.datasets.base import Example
from entropy_experiments.rewards.registry import register_reward


@register_reward("zero")
def zero(prompt: str, responses: list[str], example: Example) -> list[float]:
    """0.0 for every response (all advantages vanish: a control for the U side)."""
    return [0.0] * len(responses)

"""Rewards used by the probe tests (loaded through the "module:function" reward spec)."""


def count_a(prompt, responses, example):
    """Reward = number of letters 'a' in the response: varies between responses, so advantages are non-zero."""
    return [float(r.count("a")) for r in responses]


def constant(prompt, responses, example):
    """The same reward for every response: every advantage is zero (the step is weight decay only)."""
    return [1.0 for _ in responses]

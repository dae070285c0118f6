"""Rewards used by the probe tests (loaded through the "module:function" reward spec)."""


def count_a(prompt, responses, example):
    """Reward = number of letters 'a' in the response: varies between responses, so advantages are non-zero."""
    return [float(r.count("a")) for r in responses]

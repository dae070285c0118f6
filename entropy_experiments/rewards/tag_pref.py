"""moved to entropy_experiments.data.rewards.tag_pref; kept so existing imports work."""

from entropy_experiments.data.rewards.tag_pref import (
    extract_answer,
    score_response,
    tag_pref,
)

__all__ = [
    "extract_answer",
    "score_response",
    "tag_pref",
]

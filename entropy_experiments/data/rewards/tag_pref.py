"""`tag_pref`: 1.0 for a response with exactly one <answer>…</answer> block whose content
math-verify judges equal to the gold answer, else 0.0.

The prompt ends with an opened "<think>", so a response looks like "... </think> <answer>18</answer>".
Numbers are compared as math: "18", "18.0", "$18", "18 dollars" and "1,800" vs "1800" all match.
"""

from __future__ import annotations

import functools
import re
import threading
from typing import Any

from entropy_experiments.data.datasets.base import Example
from entropy_experiments.data.rewards.notices import warn_once
from entropy_experiments.data.rewards.registry import register_reward

ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
_ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TIMEOUT_S = 5


def _timeout() -> int | None:
    # math-verify's timeout uses signal.alarm, which only works in the main thread; elsewhere it
    # would raise ValueError, so run without a timeout there.
    return _TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse(text: str) -> list[Any]:
    """math_verify.parse, [] on any failure (an empty list means "nothing parsable")."""
    import math_verify  # ~0.4 s (sympy) to import, so only on first use

    try:
        return math_verify.parse(text, parsing_timeout=_timeout())
    except Exception:  # noqa: BLE001  model output must never crash the reward: unparsable = wrong
        return []


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold: str) -> tuple[Any, ...]:
    # The same gold answer is compared with G responses and across batches: parse it once.
    return tuple(_parse(gold))


def extract_answer(response: str) -> str | None:
    """Content of the one <answer>…</answer> block, stripped; None when there is not exactly one."""
    if response.count(ANSWER_OPEN) != 1 or response.count(ANSWER_CLOSE) != 1:
        return None
    match = _ANSWER_BLOCK.search(response)
    return match.group(1).strip() if match else None


def score_response(response: str, gold: str, *, where: str = "") -> float:
    """1.0 when `response` holds exactly one answer block equal to `gold` (math-verify), else 0.0.

    A missing or unparsable gold answer scores 0.0 and warns once per process; `where` names the
    example in that warning.
    """
    if not gold.strip():
        warn_once(
            "tag_pref:missing_gold",
            f"tag_pref: no gold answer{where}; responses to such examples get reward 0.0 (warned once per process)",
        )
        return 0.0
    gold_parsed = _parse_gold(gold.strip())
    if not gold_parsed:
        warn_once(
            "tag_pref:unparsable_gold",
            f"tag_pref: math-verify cannot parse the gold answer {gold.strip()[:80]!r}{where}; such responses get "
            "reward 0.0 (warned once per process)",
        )
        return 0.0
    content = extract_answer(response)
    if not content:
        return 0.0
    prediction = _parse(content)
    if not prediction:
        return 0.0
    import math_verify

    try:
        # Argument order matters: math-verify's comparison is not symmetric (gold first).
        return 1.0 if math_verify.verify(list(gold_parsed), prediction, timeout_seconds=_timeout()) else 0.0
    except Exception:  # noqa: BLE001  same: a comparison that fails counts as wrong
        return 0.0


@register_reward("tag_pref")
def tag_pref(prompt: str, responses: list[str], example: Example) -> list[float]:
    """One reward per response to `prompt`, against the gold `example.answer`."""
    gold = example.answer or ""
    meta = example.meta or {}
    where = f" (data set {meta.get('dataset', '?')!r}, prompt id {meta.get('global_prompt_id', '?')})"
    return [score_response(response, gold, where=where) for response in responses]

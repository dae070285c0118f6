"""A small conversational data set in TRL's conventions and two conversational reward functions.

Shared by the real-TRL test (`tests/test_trl_conversational.py`) and `examples/trl_conversational.py`:
GRPOTrainer trains on `conversational_dataset()` with `REWARD_FUNCTIONS` weighted by `REWARD_WEIGHTS`, and the
probe reads the same rows (`dataset_name: hf`) and calls the same functions by their specs (`REWARD_SPECS`).
Both functions take completions as TRL passes them for conversational prompts —
`[{"role": "assistant", "content": text}]` — and raise TypeError on plain strings.
"""

from __future__ import annotations

SYSTEM = "You are a careful assistant. Put the final answer in <answer> </answer> tags."
QUESTIONS = [
    ("What is 2 + 2?", "4"),
    ("Tom has 3 apples and buys 5 more. How many apples does he have?", "8"),
    ("What is 7 times 6?", "42"),
    ("A box holds 12 eggs. How many eggs are in 3 boxes?", "36"),
    ("What is 100 minus 1?", "99"),
    ("Sara reads 10 pages a day. How many pages does she read in a week?", "70"),
    ("What is half of 48?", "24"),
    ("There are 5 birds and 2 fly away. How many are left?", "3"),
]
VOWELS = "aeiou"
REWARD_SPECS = ["entropy_experiments.testing.conversational:vowel_share_reward",
                "entropy_experiments.testing.conversational:answer_mention_reward"]
REWARD_WEIGHTS = [1.0, 0.5]


def conversational_rows(n: int = 8) -> dict[str, list]:
    """Columns `prompt` (system + user messages), `answer` and `level` (an int the first reward reads)."""
    rows = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return {"prompt": [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q, _ in rows],
            "answer": [a for _, a in rows], "level": [1 + i % 3 for i in range(n)]}


def conversational_dataset(n: int = 8):
    """`conversational_rows(n)` as a `datasets.Dataset` (save it with `save_to_disk` for the probe)."""
    from datasets import Dataset

    return Dataset.from_dict(conversational_rows(n))


def _contents(completions: list) -> list[str]:
    if not all(isinstance(c, list) and c and isinstance(c[0], dict) for c in completions):
        raise TypeError(f"expected conversational completions ([{{'role': 'assistant', 'content': ...}}]), got "
                        f"{type(completions[0]).__name__}")
    return [c[0]["content"] for c in completions]


def vowel_share_reward(prompts, completions, level, **kwargs) -> list[float]:
    """Share of the completion's letters that are vowels, times the row's `level`."""
    out = []
    for text, lvl in zip(_contents(completions), level, strict=True):
        letters = [ch for ch in text.lower() if ch.isalpha()]
        out.append(lvl * sum(ch in VOWELS for ch in letters) / len(letters) if letters else 0.0)
    return out


def answer_mention_reward(completions, answer, **kwargs) -> list[float | None]:
    """1.0 when the gold answer appears in the completion, else the share of its characters that are digits;
    None (TRL's "cannot score") for an empty completion."""
    out: list[float | None] = []
    for text, gold in zip(_contents(completions), answer, strict=True):
        if not text:
            out.append(None)
        else:
            out.append(1.0 if str(gold) in text else sum(ch.isdigit() for ch in text) / len(text))
    return out


REWARD_FUNCTIONS = [vowel_share_reward, answer_mention_reward]

"""Rewards [B][G] of a generated batch: the reward called once per prompt with its G responses."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from entropy_experiments.data.batch import Batch, completion_ids
from entropy_experiments.data.rewards.registry import compute_rewards, get_reward

__all__ = ["NO_EXAMPLES_WARNING", "rewards_for_sequences"]

NO_EXAMPLES_WARNING = ("rewards: no data-set example (gold answer) for some prompts; "
                       "their rewards are 0.0 — pass examples= with explicit prompts")


def rewards_for_sequences(reward_spec: str, prompts: Sequence[str], sequences: Batch,
                          examples: Sequence | None, warn_once: Callable[[str, str], None]) -> list[list[float]]:
    """Rewards [B][G] through the reward registry (`reward_spec`, e.g. the config's `reward.name`).

    Prompts without an example (no gold answer) get 0.0 with ONE loud warning (`warn_once(key, text)`);
    reward-function failures propagate (RewardError naming the prompt) rather than silently becoming
    zeros. The reward is called in its own convention (probe or TRL style, `calling.py`); TRL-style
    functions also get each response's token ids as `completion_ids`.
    """
    examples = examples if examples is not None else sequences.examples
    fn = get_reward(reward_spec)
    G = sequences.num_responses_per_prompt
    out: list[list[float]] = []
    for b, prompt in enumerate(prompts):
        example = examples[b] if examples is not None else None
        if example is None:
            warn_once("no_examples", NO_EXAMPLES_WARNING)
            out.append([0.0] * G)
            continue
        meta = getattr(example, "meta", None) or {}
        pid = f", prompt id {meta['global_prompt_id']}" if "global_prompt_id" in meta else ""
        rewards = compute_rewards(fn, prompt, list(sequences.responses_text[b]), example,
                                  completion_ids=completion_ids(sequences, b),
                                  where=f" (prompt {b + 1} of {len(prompts)}{pid})")
        out.append([float(r) for r in rewards])
    return out

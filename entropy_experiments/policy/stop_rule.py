"""The stop rule (docs/maths.md §1): where a generated response ends.

The first EOS (kept and scored), or the token completing a stop string ("</answer>", kept and scored,
nothing forced after it), or max_new_tokens. T is found from the FIRST EOS after the prompt, which
matters where pad == EOS (Qwen, SmolLM2). `StopStringCriterion` stops HF generate early on a stop
string; `response_length` is the authoritative cut.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from entropy_experiments.policy.policy_model import PolicyModel

__all__ = ["StopStringCriterion", "response_length"]


def _stopping_criteria_base():
    from transformers import StoppingCriteria

    return StoppingCriteria


class StopStringCriterion(_stopping_criteria_base()):
    """HF StoppingCriteria: True for rows whose response (after `prompt_len`) newly contains a stop string.

    Each step decodes only a short window of the newest tokens (long enough to hold any stop
    string); a window hit is confirmed on the whole response so far. The post-hoc rule in
    `response_length` stays authoritative: this criterion only saves compute and
    never stops a row earlier than that rule would cut it.
    """

    def __init__(self, tokenizer, stop_strings: list[str], prompt_len: int):
        self.tokenizer = tokenizer
        self.stop_strings = list(stop_strings)
        self.prompt_len = prompt_len
        self.window = max(len(s.encode("utf-8")) for s in self.stop_strings) + 2

    def contains_stop(self, ids: Sequence[int]) -> bool:
        text = self.tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return any(s in text for s in self.stop_strings)

    def __call__(self, input_ids: Tensor, scores: Tensor | None = None, **kwargs) -> Tensor:
        gen = input_ids[:, self.prompt_len:]
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        if gen.shape[1] == 0:
            return done
        windows = self.tokenizer.batch_decode(gen[:, -self.window:].tolist(), skip_special_tokens=False,
                                              clean_up_tokenization_spaces=False)
        for r, text in enumerate(windows):
            if any(s in text for s in self.stop_strings) and self.contains_stop(gen[r].tolist()):
                done[r] = True
        return done


def response_length(policy: PolicyModel, gen_tokens: Sequence[int]) -> int:
    """T by the stop rule (docs/maths.md §1) for the tokens generated after the prompt.

    First EOS (included); else — or earlier — the token completing a stop string, found by
    binary search on the prefix length ("contains" is monotone in the prefix); else all tokens.
    """
    tokens = [int(t) for t in gen_tokens]
    eos = set(policy.eos_token_ids)
    t_eos = next((i + 1 for i, t in enumerate(tokens) if t in eos), None)
    before_eos = (t_eos - 1) if t_eos is not None else len(tokens)
    if policy.config.stop_strings and before_eos > 0:
        probe = StopStringCriterion(policy.tokenizer, policy.config.stop_strings, 0)
        if probe.contains_stop(tokens[:before_eos]):
            lo, hi = 1, before_eos  # smallest k with a stop string in tokens[:k]
            while lo < hi:
                mid = (lo + hi) // 2
                if probe.contains_stop(tokens[:mid]):
                    hi = mid
                else:
                    lo = mid + 1
            return lo
    return t_eos if t_eos is not None else len(tokens)

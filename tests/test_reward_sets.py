"""Several reward functions with weights, called as TRL 1.16's GRPOTrainer calls them.

The per-function values and the weighted sum are compared with TRL's own `GRPOTrainer._calculate_rewards`
(run on a stand-in trainer holding only what it reads) followed by TRL's `(rewards_per_func * weights).nansum`.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from entropy_experiments.config import config_from_dict
from entropy_experiments.data.datasets import Example
from entropy_experiments.data.rewards.weighted import RewardSet
from entropy_experiments.errors import RewardError
from entropy_experiments.testing.conversational import (
    REWARD_FUNCTIONS,
    REWARD_SPECS,
    REWARD_WEIGHTS,
    conversational_rows,
)

COMPLETIONS = [["hello 4", "aeiou", "", "The answer is <answer>4</answer>"],
               ["xyz 8", "", "eight", "8 8 8"]]


def hf_example(rows: dict, i: int) -> Example:
    columns = {k: rows[k][i] for k in rows if k != "prompt"}
    return Example(question="", answer=str(columns["answer"]), text="", meta={"global_prompt_id": i},
                   prompt=rows["prompt"][i], columns=columns)


def trl_rewards(rows: dict, completions: list[list[str]], weights: list[float]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards_per_func [B·G, F], the weighted nansum [B·G]) from TRL's own code."""
    from trl import GRPOTrainer

    G = len(completions[0])
    inputs = [{k: rows[k][b] for k in rows} for b in range(len(completions)) for _ in range(G)]
    messages = [[{"role": "assistant", "content": t}] for row in completions for t in row]
    trainer = SimpleNamespace(
        accelerator=SimpleNamespace(device=torch.device("cpu"), is_main_process=True),
        reward_funcs=REWARD_FUNCTIONS, reward_processing_classes=[None] * len(REWARD_FUNCTIONS),
        reward_func_names=[f.__name__ for f in REWARD_FUNCTIONS], state=SimpleNamespace(global_step=0),
        args=SimpleNamespace(report_to=[]), _log_completion_extra=None, _log_metric=None, environments=None)
    per_func = GRPOTrainer._calculate_rewards(trainer, inputs, [x["prompt"] for x in inputs], messages,
                                              [[0]] * len(messages))
    summed = (per_func * torch.tensor(weights).unsqueeze(0)).nansum(dim=1)
    return per_func, summed


def test_weighted_conversational_rewards_equal_trls_own_computation():
    pytest.importorskip("trl")
    rows = conversational_rows(2)
    rewards = RewardSet.resolve(REWARD_SPECS, REWARD_WEIGHTS, hf_example(rows, 0))
    per_func, summed = trl_rewards(rows, COMPLETIONS, REWARD_WEIGHTS)
    G = len(COMPLETIONS[0])
    for b, texts in enumerate(COMPLETIONS):
        scored = rewards.score("rendered text (unused by TRL-style functions)", texts, hf_example(rows, b))
        assert scored.summed == pytest.approx(summed[b * G:(b + 1) * G].tolist(), rel=1e-6)
        for f, name in enumerate(REWARD_SPECS):
            trl_values = per_func[b * G:(b + 1) * G, f].tolist()
            ours = scored.per_function[name]
            assert [math.isnan(x) for x in ours] == [math.isnan(x) for x in trl_values]  # None → NaN, as TRL
            assert [x for x in ours if not math.isnan(x)] == pytest.approx([x for x in trl_values if not math.isnan(x)])
    assert any(math.isnan(x) for x in per_func[:, 1].tolist())  # the nansum case was exercised


def test_the_functions_get_messages_and_every_column_as_keywords():
    seen = {}

    def spy(prompts, completions, completion_ids, answer, level, trainer_state, **kwargs):
        seen.update(prompts=prompts, completions=completions, answer=answer, level=level, ids=completion_ids,
                    extra=sorted(kwargs))
        return [0.0] * len(completions)

    rows = conversational_rows(1)
    example = hf_example(rows, 0)
    RewardSet(("spy",), (spy,), (1.0,)).score("text", ["a", "b"], example, completion_ids=[[1], [2, 3]])
    assert seen["prompts"] == [rows["prompt"][0]] * 2
    assert seen["completions"] == [[{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "b"}]]
    assert seen["answer"] == [rows["answer"][0]] * 2 and seen["level"] == [rows["level"][0]] * 2
    assert seen["ids"] == [[1], [2, 3]] and seen["extra"] == ["log_extra", "log_metric"]


def test_every_function_returning_none_is_one_clear_error():
    def never(completions, **kwargs):
        return [None] * len(completions)

    rewards = RewardSet(("a", "b"), (never, never), (1.0, 2.0))
    with pytest.raises(RewardError, match="every reward function returned None for response 0"):
        rewards.score("p", ["x"], hf_example(conversational_rows(1), 0))


def test_signatures_are_checked_before_anything_runs(tmp_path):
    example = hf_example(conversational_rows(1), 0)
    with pytest.raises(RewardError, match=r"needs argument\(s\) \['solution'\]"):
        RewardSet.resolve(["tests.trl_reward_plugins:needs_solution"], None, example)
    with pytest.raises(RewardError, match="cannot import module"):
        RewardSet.resolve(["no_such_module_xyz:f"], None, example)
    with pytest.raises(RewardError, match="cannot be called as fn"):
        RewardSet.resolve(["math:sqrt"], None, example)
    with pytest.raises(RewardError, match="2 weights for 1"):
        RewardSet.resolve(["zero"], [1.0, 2.0], example)


def test_reward_config_keys():
    cfg = config_from_dict({"reward": {"functions": REWARD_SPECS, "weights": REWARD_WEIGHTS}})
    assert cfg.reward.specs() == REWARD_SPECS
    assert config_from_dict({}).reward.specs() == ["tag_pref"]
    for bad in ({"functions": REWARD_SPECS, "weights": [1.0]}, {"functions": REWARD_SPECS, "name": "zero"}):
        with pytest.raises(Exception, match="reward"):
            config_from_dict({"reward": bad})

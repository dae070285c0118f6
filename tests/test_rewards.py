"""Rewards: tag_pref against math-verify, the registry, custom specs and output validation."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from pathlib import Path

import pytest

from entropy_experiments.datasets import Example
from entropy_experiments.errors import RewardError
from entropy_experiments.rewards import (
    REWARD_REGISTRY,
    clear_reward_warnings,
    compute_rewards,
    get_reward,
    register_reward,
    reward_warnings,
)
from entropy_experiments.rewards.tag_pref import extract_answer, score_response

REPO_ROOT = Path(__file__).resolve().parents[1]
LOGGER = "entropy_experiments.rewards"


def example(gold: str) -> Example:
    return Example(
        question="prompt", answer=gold, text="problem", meta={"global_prompt_id": 7, "dataset": "d"}
    )


@pytest.fixture
def plugins_importable(monkeypatch):
    # `tests.reward_plugins` must import however pytest was started (cwd is not always on sys.path).
    monkeypatch.syspath_prepend(str(REPO_ROOT))


# ---------------------------------------------------------------- tag_pref


@pytest.mark.parametrize(
    "response, expected",
    [
        (" 9 + 9 = 18 </think> <answer>18</answer>", 1.0),
        (" 9 + 8 </think> <answer>17</answer>", 0.0),
        ("</think> <answer>18.0</answer>", 1.0),
        ("</think> <answer>$18</answer>", 1.0),
        ("</think> <answer>\\boxed{18}</answer>", 1.0),
        ("</think> <answer> 18 dollars </answer>", 1.0),
        ("</think> <answer>18</answer> <answer>18</answer>", 0.0),  # two blocks
        ("</think> <answer>18</answer><answer>", 0.0),  # a second, unclosed block
        (" 18 </think> the answer is 18", 0.0),  # no block
        ("</think> <answer>18", 0.0),  # unclosed (truncated at max_new_tokens)
        ("</think> <answer></answer>", 0.0),
        ("</think> <answer>eighteen</answer>", 0.0),
    ],
)
def test_tag_pref_scores_against_gold_18(response, expected):
    assert get_reward("tag_pref")("prompt", [response], example("18")) == [expected]


@pytest.mark.parametrize(
    "gold, predicted", [("18.0", "18"), ("1800", "1,800"), ("0.5", "\\frac{1}{2}"), ("-5", "-5.00")]
)
def test_tag_pref_compares_numbers_as_math(gold, predicted):
    assert score_response(f"</think> <answer>{predicted}</answer>", gold) == 1.0


def test_extract_answer():
    assert extract_answer("x </think> <answer>\n 42 \n</answer>") == "42"
    assert extract_answer("<answer>1</answer><answer>2</answer>") is None
    assert extract_answer("no tags") is None


def test_tag_pref_scores_each_response_of_a_group():
    responses = ["</think> <answer>240</answer>", "</think> <answer>24</answer>", "<answer>240.0</answer>"]
    assert compute_rewards(get_reward("tag_pref"), "p", responses, example("240")) == [1.0, 0.0, 1.0]


@pytest.mark.parametrize(
    "gold, key",
    [
        ("", "no gold answer (data set 'd', prompt id 7)"),
        ("eighteen", "cannot parse the gold answer 'eighteen' (data set 'd', prompt id 7)"),
    ],
)
def test_bad_gold_scores_zero_with_exactly_one_warning(caplog, gold, key):
    clear_reward_warnings()
    reward = get_reward("tag_pref")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(30):
            assert compute_rewards(reward, "p", ["<answer>18</answer>"] * 4, example(gold)) == [0.0] * 4
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and key in records[0].getMessage()
    assert reward_warnings() == [records[0].getMessage()]
    clear_reward_warnings()
    assert reward_warnings() == []


def test_tag_pref_call_is_fast():
    response = "</think> <answer>1234.5</answer>"
    score_response(response, "1234.5")  # first call imports sympy and warms caches
    durations = []
    for _ in range(15):
        start = time.perf_counter()
        score_response(response, "1234.5")
        durations.append(time.perf_counter() - start)
    assert statistics.median(durations) < 0.05


def test_tag_pref_works_off_the_main_thread():
    # math-verify's signal-based timeout would raise in a worker thread; tag_pref disables it there.
    result = []
    worker = threading.Thread(target=lambda: result.append(score_response("<answer>18.0</answer>", "18")))
    worker.start()
    worker.join()
    assert result == [1.0]


def test_zero_reward():
    assert compute_rewards(get_reward("zero"), "p", ["a", "b", "c"], example("1")) == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------- registry and custom specs


def test_custom_spec_resolves_and_is_validated(plugins_importable):
    from tests.reward_plugins import answer_length

    reward = get_reward("tests.reward_plugins:answer_length")
    assert reward is answer_length
    assert compute_rewards(reward, "p", ["ab", "", "abcd"], example("1")) == [2.0, 0.0, 4.0]


def test_unknown_name_suggests_the_closest():
    with pytest.raises(
        RewardError,
        match=r"unknown reward 'tag_prefs': choose one of \[.*'tag_pref'.*\(did you mean 'tag_pref'\?\)",
    ):
        get_reward("tag_prefs")


def test_missing_module_is_named(plugins_importable):
    with pytest.raises(
        RewardError,
        match=r"cannot import module 'tests.no_such_plugins' \(ModuleNotFoundError: No module named",
    ):
        get_reward("tests.no_such_plugins:fn")


def test_module_that_fails_on_import_is_named(tmp_path, monkeypatch):
    (tmp_path / "broken_reward_plugin.py").write_text("raise RuntimeError('boom at import\\nsecond line')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RewardError) as info:
        get_reward("broken_reward_plugin:fn")
    assert str(info.value) == (
        "reward 'broken_reward_plugin:fn': cannot import module 'broken_reward_plugin' (RuntimeError: boom at import)"
    )


def test_missing_or_uncallable_attribute(plugins_importable):
    with pytest.raises(
        RewardError,
        match=r"'tests.reward_plugins' has no attribute 'answer_lenght' \(did you mean 'answer_length'\?\)",
    ):
        get_reward("tests.reward_plugins:answer_lenght")
    with pytest.raises(RewardError, match=r"'tests.reward_plugins.NOT_A_FUNCTION' is a int, not a function"):
        get_reward("tests.reward_plugins:NOT_A_FUNCTION")
    with pytest.raises(RewardError, match="expected 'package.module:function'"):
        get_reward("tests.reward_plugins:")


def test_wrong_length_names_function_and_both_lengths(plugins_importable):
    reward = get_reward("tests.reward_plugins:one_short")
    with pytest.raises(
        RewardError, match=r"^reward 'tests.reward_plugins:one_short' returned 2 values for 3 responses$"
    ):
        compute_rewards(reward, "p", ["a", "b", "c"], example("1"))


def test_non_finite_value_names_index_and_value(plugins_importable):
    reward = get_reward("tests.reward_plugins:nan_at_one")
    with pytest.raises(
        RewardError, match=r"^reward 'tests.reward_plugins:nan_at_one' value at index 1 is not finite: nan$"
    ):
        compute_rewards(reward, "p", ["a", "b", "c"], example("1"))


@pytest.mark.parametrize(
    "values, message",
    [
        ([1.0, "1.0"], "index 1 is not a number: '1.0'"),
        ([float("-inf"), 0.0], "index 0 is not finite: -inf"),
        (None, "returned a NoneType"),
    ],
)
def test_other_bad_outputs(values, message):
    with pytest.raises(RewardError, match=message):
        compute_rewards(lambda prompt, responses, ex: values, "p", ["a", "b"], example("1"))


def test_numpy_and_int_values_become_floats():
    import numpy as np

    rewards = compute_rewards(lambda p, r, e: np.array([1, 0], dtype=np.int64), "p", ["a", "b"], example("1"))
    assert rewards == [1.0, 0.0] and all(type(value) is float for value in rewards)


def test_register_reward_adds_a_name_used_in_errors():
    @register_reward("test_only_short")
    def short(prompt, responses, ex):
        return [0.5]

    try:
        assert get_reward("test_only_short") is short
        with pytest.raises(
            RewardError, match=r"^reward 'test_only_short' returned 1 values for 2 responses$"
        ):
            compute_rewards(short, "p", ["a", "b"], example("1"))
        with pytest.raises(ValueError, match="already registered"):
            register_reward("test_only_short")(lambda p, r, e: [])
    finally:
        REWARD_REGISTRY.pop("test_only_short")


def test_math_density_is_graded_and_bounded():
    from entropy_experiments.rewards import compute_rewards, get_reward

    fn = get_reward("math_density")
    ex = Example(question="q", answer="1", text="q", meta={"global_prompt_id": 0, "dataset": "t", "split": "train"})
    scores = compute_rewards(fn, "q", ["12 + 3 = 15", "no digits here", "", "a1"], ex)
    assert scores == [1.0, 0.0, 0.0, 0.5]

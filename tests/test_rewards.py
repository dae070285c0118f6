"""Rewards: tag_pref against math-verify, the registry, custom specs and output validation."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from entropy_experiments.data.datasets import Example
from entropy_experiments.data.rewards import (
    REWARD_REGISTRY,
    clear_reward_warnings,
    compute_rewards,
    get_reward,
    register_reward,
    reward_warnings,
)
from entropy_experiments.data.rewards.tag_pref import extract_answer, score_response
from entropy_experiments.errors import RewardError

# Costly module fixtures: one worker runs this whole file (scripts/test.sh distributes by xdist_group).
pytestmark = pytest.mark.xdist_group("test_rewards")

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


def test_tag_pref_gives_the_same_score_on_repeated_calls():
    """Warm caches change nothing (the call's speed is measured by bench/bench_rewards.py, not asserted here)."""
    response = "</think> <answer>1234.5</answer>"
    first = score_response(response, "1234.5")  # first call imports sympy and warms caches
    assert first == 1.0
    assert [score_response(response, "1234.5") for _ in range(5)] == [first] * 5
    assert score_response(response, "1234.6") == 0.0


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
    from entropy_experiments.data.rewards import compute_rewards, get_reward

    fn = get_reward("math_density")
    ex = Example(question="q", answer="1", text="q", meta={"global_prompt_id": 0, "dataset": "t", "split": "train"})
    scores = compute_rewards(fn, "q", ["12 + 3 = 15", "no digits here", "", "a1"], ex)
    assert scores == [1.0, 0.0, 0.0, 0.5]


# ---------------------------------------------------------------- TRL-style reward functions


def trl_example() -> Example:
    meta = {"global_prompt_id": 7, "dataset": "jsonl", "split": "train", "source": "/data/p.jsonl", "line": 8}
    return Example(question="What is 9 + 9?", answer="18", text="9 + 9", meta=meta)


def test_style_is_read_from_the_signature_once_per_function(monkeypatch):
    import inspect

    from entropy_experiments.data.rewards.calling import reward_style

    class Judge:
        def __call__(self, prompts, completions, **kwargs):
            return [0.0] * len(completions)

    def probe_style(prompt, responses, example):
        return [0.0] * len(responses)

    def ids_only(completion_ids, **kwargs):
        return [0.0] * len(completion_ids)

    assert reward_style(probe_style).trl is False
    assert reward_style(lambda p, r, e: []).trl is False
    assert reward_style(Judge()).trl is True
    assert reward_style(ids_only).trl is True  # TRL's repetition / overlong rewards take only completion_ids
    calls = []
    real_signature = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda fn, **kw: calls.append(fn) or real_signature(fn, **kw))

    def fresh(completions, **kwargs):
        return [1.0] * len(completions)

    for _ in range(3):
        assert compute_rewards(fresh, "p", ["a", "b"], trl_example()) == [1.0, 1.0]
    assert calls == [fresh]


def test_trl_call_gets_prompts_completions_ids_and_every_column_as_lists_of_g():
    seen = {}

    def recorder(prompts, completions, **kwargs):
        seen.update(prompts=prompts, completions=completions, **kwargs)
        return [0.5] * len(completions)

    ids = [[5, 6], [7], [8, 9, 10]]
    rewards = compute_rewards(recorder, "What is 9 + 9?", ["x", "yy", "zzz"], trl_example(),
                              completion_ids=ids)
    assert rewards == [0.5, 0.5, 0.5]
    log_extra, log_metric = seen.pop("log_extra"), seen.pop("log_metric")
    assert seen == {
        "prompts": ["What is 9 + 9?"] * 3, "completions": ["x", "yy", "zzz"],
        "completion_ids": [[5, 6], [7], [8, 9, 10]],
        "question": ["What is 9 + 9?"] * 3, "answer": ["18"] * 3, "text": ["9 + 9"] * 3,
        "global_prompt_id": [7] * 3, "dataset": ["jsonl"] * 3, "split": ["train"] * 3,
        "source": ["/data/p.jsonl"] * 3, "line": [8] * 3, "trainer_state": None,
    }
    assert log_extra("column", [1, 2, 3]) is None and log_metric("metric", 1.0) is None  # accepted, dropped


def test_trl_function_without_kwargs_gets_only_what_it_names(plugins_importable):
    reward = get_reward("tests.trl_reward_plugins:strict")
    # len(completion) + len(prompt) + len(answer "18"), computed by hand
    assert compute_rewards(reward, "abc", ["", "zz"], trl_example()) == [5.0, 7.0]


def test_real_trl_reward_functions(plugins_importable):
    from trl.rewards import accuracy_reward, get_repetition_penalty_reward, get_soft_overlong_punishment

    ids = [[1, 2, 3, 4], [5, 5, 5, 5, 5], [1, 2]]
    # Bigrams: 3 of 3 unique -> 0; 1 of 4 unique -> (1 - 1/4) * -1; 1 of 1 unique -> 0.
    penalty = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    responses = ["a", "b", "c"]
    assert compute_rewards(penalty, "p", responses, trl_example(), completion_ids=ids) == [0.0, -0.75, 0.0]
    # Lengths 4, 5, 2 against L_max 5, cache 2: 4 is in (3, 5] -> (3 - 4) / 2; 5 -> (3 - 5) / 2; 2 -> 0.
    overlong = get_soft_overlong_punishment(max_completion_len=5, soft_punish_cache=2)
    assert compute_rewards(overlong, "p", responses, trl_example(), completion_ids=ids) == [-0.5, -1.0, 0.0]
    with pytest.raises(RewardError) as info:  # needs a `solution` column the probe's data sets lack
        compute_rewards(accuracy_reward, "p", ["a"], trl_example())
    message = str(info.value)
    assert message.startswith("reward 'trl.rewards.accuracy_rewards:accuracy_reward' (TRL style) needs "
                              "argument(s) ['solution'] that the probe does not provide; it passes [")
    assert "'answer'" in message and "'completions'" in message


def test_none_and_missing_arguments_are_one_line_errors(plugins_importable):
    with pytest.raises(RewardError) as info:
        compute_rewards(get_reward("tests.trl_reward_plugins:none_for_empty"), "p", ["a", ""], trl_example(),
                        where=" (prompt 2 of 3, prompt id 7)")
    assert str(info.value) == (
        "reward 'tests.trl_reward_plugins:none_for_empty' returned None at index 1 "
        "(prompt 2 of 3, prompt id 7): "
        "the probe needs a number for every response (TRL's None, 'not scorable', is not supported)")
    with pytest.raises(RewardError, match=r"needs argument\(s\) \['solution'\]"):
        compute_rewards(get_reward("tests.trl_reward_plugins:needs_solution"), "p", ["a"], trl_example())


def test_async_trl_reward_is_awaited(plugins_importable):
    reward = get_reward("tests.trl_reward_plugins:async_length")
    assert compute_rewards(reward, "p", ["abc", ""], trl_example()) == [3.0, 0.0]


@pytest.mark.parametrize("style", ["probe", "trl"])
def test_a_raising_reward_is_one_line_naming_reward_exception_and_prompt(style):
    def probe_style(prompt, responses, example):
        return [1 / 0 for _ in responses]

    def trl_style(completions, **kwargs):
        raise ValueError("no answer tag\nsecond line of the message")

    fn = probe_style if style == "probe" else trl_style
    with pytest.raises(RewardError) as info:
        compute_rewards(fn, "p", ["a"], trl_example(), where=" (prompt 3 of 4, prompt id 7)")
    detail = "ZeroDivisionError: division by zero" if style == "probe" else "ValueError: no answer tag"
    assert str(info.value) == (f"reward '{fn.__module__}:{fn.__qualname__}' raised {detail} "
                               "(prompt 3 of 4, prompt id 7)")
    assert fn.__qualname__.endswith(f"<locals>.{style}_style")
    assert isinstance(info.value.__cause__, (ZeroDivisionError, ValueError))  # kept for a Python caller


# ---------------------------------------------------------------- through `entropy-probe run` (tiny model)


@pytest.fixture(scope="module")
def run_setup(tiny_model_dir, tmp_path_factory) -> Path:
    """A probe config file (tiny model, 1-step checkpoint, reward count_a); tests set another reward."""
    from tests.run_helpers import make_run_setup

    config, _ = make_run_setup(tmp_path_factory.mktemp("reward_cli"), tiny_model_dir)
    return config


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """`entropy-probe ARGV` in process: (exit code, stdout, stderr); logging restored afterwards."""
    import contextlib
    import io

    from entropy_experiments import cli
    from tests.run_helpers import logging_restored

    out, err = io.StringIO(), io.StringIO()
    with logging_restored(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture
def generate_calls(monkeypatch) -> list[int]:
    """Rows of every real generation call (saved chunks that are reused are not generated)."""
    from entropy_experiments.policy.engine import PolicyEngine

    calls: list[int] = []
    real = PolicyEngine._generate_span

    def counting(self, *args, **kwargs):
        rows = real(self, *args, **kwargs)
        calls.append(len(rows))
        return rows

    monkeypatch.setattr(PolicyEngine, "_generate_span", counting)
    return calls


@pytest.mark.e2e
def test_raising_reward_is_exit_2_one_line_and_resume_reuses_the_samples(
        run_setup, tmp_path, monkeypatch, plugins_importable, generate_calls):
    import json

    import torch

    from entropy_experiments.report.results_schema import validate_results_schema
    from tests.trl_reward_plugins import RAISE_ENV

    out = tmp_path / "run"
    monkeypatch.setenv(RAISE_ENV, "1")
    code, _, err = _cli(["run", "--config", str(run_setup), "--out", str(out),
                         "--set", "reward.name=tests.trl_reward_plugins:flaky_count_a"])
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert [line for line in lines if line.startswith("error: ")] == [lines[-1]] and "Traceback" not in err
    first_error = lines[-1]
    assert "finish it with: entropy-probe run --resume" in err
    # U first (2 prompts × G 2, one chunk); the reward raised on the first U prompt's responses, so E (4 × 1)
    # was never sampled
    assert generate_calls == [4]
    assert json.loads((out / "run_meta.json").read_text())["status"] == "failed"
    assert not {"results.json", "E_batch.pt", "U_batch.pt"} & {p.name for p in out.iterdir()}
    assert len(list((out / "partial").glob("gen_*.pt"))) == 1  # U's generation chunk kept

    generate_calls.clear()
    monkeypatch.delenv(RAISE_ENV)  # the user fixes the reward
    code, _, err = _cli(["run", "--resume", str(out)])
    assert code == 0, err[-3000:]
    assert generate_calls == [4]  # U not generated again; E generated once
    assert err.count("generation: reusing 1 saved chunk(s) of 1") == 1
    U = torch.load(out / "U_batch.pt", weights_only=True)
    assert first_error == ("error: reward 'tests.trl_reward_plugins:flaky_count_a' raised ZeroDivisionError: "
                           f"division by zero (prompt 1 of 2, prompt id {U['prompt_ids'][0]})")
    assert U["rewards"] == [[float(text.count("a")) for text in row] for row in U["responses_text"]]
    validate_results_schema(json.loads((out / "results.json").read_text()))
    assert json.loads((out / "run_meta.json").read_text())["status"] == "complete"
    assert not list((out / "partial").glob("gen_*.pt"))


@pytest.mark.e2e
def test_all_zero_trl_reward_keeps_the_loud_warning(run_setup, tmp_path, plugins_importable):
    import json

    import torch

    out = tmp_path / "run"
    code, stdout, err = _cli(["run", "--config", str(run_setup), "--out", str(out),
                              "--set", "reward.name=tests.trl_reward_plugins:all_zero",
                              "--set", "importance.enabled=false"])
    assert code == 0, err[-3000:]
    warning = "every U prompt has all-zero advantages"
    assert f"WARNING {warning}" in err and warning in stdout
    res = json.loads((out / "results.json").read_text())
    assert [w for w in res["warnings"] if warning in w] and res["counts"]["zero_advantage_prompts"] == 2
    assert torch.load(out / "U_batch.pt", weights_only=True)["rewards"] == [[0.0, 0.0], [0.0, 0.0]]


def test_meta_key_that_shadows_a_trl_argument():
    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    bad = Example(question="q", answer="1", text="q", meta={"global_prompt_id": 0, "completions": "x"})
    with pytest.raises(RewardError) as info:
        compute_rewards(reward, "q", ["a"], bad)
    assert str(info.value).endswith(
        "<locals>.reward': data-set meta key 'completions' clashes with the TRL reward argument of that name")
    assert compute_rewards(lambda p, r, e: [2.0], "q", ["a"], bad) == [2.0]  # probe style: meta not unpacked


@pytest.mark.e2e
def test_a_raising_reward_stops_at_the_first_u_prompts_responses(run_setup, tmp_path, monkeypatch, plugins_importable,
                                                                 generate_calls):
    """One generation chunk per U prompt (gen_batch_size = G = 2): the reward raises on the first prompt's
    responses, so the second U prompt and E are never generated."""
    from tests.trl_reward_plugins import RAISE_ENV

    monkeypatch.setenv(RAISE_ENV, "1")
    code, _, err = _cli(["run", "--config", str(run_setup), "--out", str(tmp_path / "run"),
                         "--set", "reward.name=tests.trl_reward_plugins:flaky_count_a",
                         "--set", "generation.gen_batch_size=2"])
    assert code == 2 and "raised ZeroDivisionError" in err.strip().splitlines()[-1]
    assert generate_calls == [2]  # U prompt 1 of 2 only

"""Data sets: the offline default, GSM8K from JSONL, generic JSONL, errors and caching."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from entropy_experiments.data.datasets import (
    DATASET_REGISTRY,
    Example,
    clear_example_cache,
    load_examples,
    r1_prompt,
)
from entropy_experiments.data.datasets.gsm_symbolic import (
    POOL_ROWS,
    SPLIT_SEEDS,
    generate_rows,
    pool_path,
    split_of,
)
from entropy_experiments.errors import DataError

DEFAULT = "gsm_symbolic_r1_template"
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_cache():
    clear_example_cache()
    yield
    clear_example_cache()


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


# ---------------------------------------------------------------- offline default (shipped reasoning-gym pool)


def test_default_builds_deterministically_with_500_examples():
    first = DATASET_REGISTRY[DEFAULT]("train")  # bypass the cache: two real builds
    second = DATASET_REGISTRY[DEFAULT]("train")
    assert len(first) == 500
    assert first == second
    assert all(isinstance(ex, Example) for ex in first)


def test_default_pool_is_pinned():
    # Pins the pool under the pinned reasoning-gym version: if this changes, prompt ids of old runs
    # no longer name the same problems.
    assert [ex.answer for ex in load_examples(DEFAULT, "train", pool_size=5)] == [
        "392",
        "224",
        "319",
        "19",
        "1430",
    ]
    assert [ex.answer for ex in load_examples(DEFAULT, "test", pool_size=5)] == [
        "283",
        "50",
        "1111",
        "221",
        "17",
    ]


def test_default_train_and_test_questions_are_disjoint_and_distinct():
    train = load_examples(DEFAULT, "train")
    test = load_examples(DEFAULT, "test")
    train_texts, test_texts = {ex.text for ex in train}, {ex.text for ex in test}
    assert len(train_texts) == len(train) and len(test_texts) == len(test)
    assert not train_texts & test_texts
    assert all(split_of(text) == "train" for text in train_texts)


def test_default_examples_match_reasoning_gym_entries():
    reasoning_gym = pytest.importorskip("reasoning_gym")  # not a dependency: installed by hand

    examples = load_examples(DEFAULT, "test", pool_size=20)
    stream = reasoning_gym.create_dataset("gsm_symbolic", seed=SPLIT_SEEDS["test"], size=200)
    for i, ex in enumerate(examples):
        entry = stream[ex.meta["reasoning_gym"]["source_index"]]
        assert ex.text == entry["question"] and ex.answer == entry["answer"]
        assert ex.question == r1_prompt(entry["question"])
        assert ex.question.endswith("Response: <think>")
        assert ex.meta["global_prompt_id"] == i
        assert ex.meta["dataset"] == DEFAULT and ex.meta["split"] == "test"
        json.dumps(ex.meta)  # meta goes into per_sequence.jsonl


@pytest.mark.parametrize("split", sorted(SPLIT_SEEDS))
def test_shipped_pool_is_what_reasoning_gym_generates(split):
    # The pool files were written once by scripts/make_prompt_pool.py; with reasoning-gym at hand,
    # regenerating them must give the same rows, byte for byte.
    pytest.importorskip("reasoning_gym")
    text = "".join(json.dumps(row) + "\n" for row in generate_rows(split, POOL_ROWS))
    assert pool_path(split).read_text(encoding="utf-8") == text


@pytest.mark.parametrize("split", sorted(SPLIT_SEEDS))
def test_shipped_pool_file_shape(split):
    lines = pool_path(split).read_text(encoding="utf-8").splitlines()
    assert len(lines) == POOL_ROWS
    rows = [json.loads(line) for line in lines]
    assert all(list(row) == ["source_index", "question", "answer", "answer_cot"] for row in rows)
    indices = [row["source_index"] for row in rows]
    assert indices == sorted(set(indices)) and indices[-1] < 4 * POOL_ROWS + 64
    assert len({row["question"] for row in rows}) == POOL_ROWS
    assert all(split_of(row["question"]) == split and row["answer"] == row["answer"].strip() != "" for row in rows)
    examples = load_examples(DEFAULT, split, pool_size=POOL_ROWS)
    assert [ex.text for ex in examples] == [row["question"] for row in rows]
    assert examples[3].meta == {
        "global_prompt_id": 3, "dataset": DEFAULT, "split": split, "source": "reasoning_gym:gsm_symbolic",
        "reasoning_gym": {"seed": SPLIT_SEEDS[split], "source_index": rows[3]["source_index"],
                          "answer_cot": rows[3]["answer_cot"]},
    }


def test_pool_beyond_the_shipped_rows_needs_reasoning_gym(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import reasoning_gym` raise ImportError
    with pytest.raises(DataError, match=f"holds {POOL_ROWS} problems.*pip install reasoning-gym=="):
        load_examples(DEFAULT, "train", pool_size=POOL_ROWS + 1)


def test_global_prompt_id_is_stable_across_pool_sizes():
    small = load_examples(DEFAULT, "train", pool_size=50)
    large = load_examples(DEFAULT, "train", pool_size=200)
    assert small == large[:50]
    assert [ex.meta["global_prompt_id"] for ex in large] == list(range(200))


def test_default_rejects_unknown_split():
    with pytest.raises(DataError, match="has no split 'validation'.*'test', 'train'"):
        load_examples(DEFAULT, "validation")


def test_default_build_is_offline_and_import_is_light():
    # A fresh interpreter with sockets disabled: importing the package pulls in no heavy module,
    # and building the default data set opens no connection.
    code = (
        "import socket, sys\n"
        "def refuse(*a, **k): raise RuntimeError('network used')\n"
        "socket.socket.connect = refuse; socket.create_connection = refuse\n"
        "import entropy_experiments.data.datasets as d\n"
        "assert 'reasoning_gym' not in sys.modules and 'datasets' not in sys.modules\n"
        "print(len(d.load_examples('gsm_symbolic_r1_template', 'test', pool_size=10)))\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "10"


# ---------------------------------------------------------------- GSM8K


def test_gsm8k_from_jsonl_with_split_substitution(tmp_path):
    write_jsonl(
        tmp_path / "gsm8k_train.jsonl",
        [
            {"question": "Tom has 1,200 apples and buys 34. How many?", "answer": "1200+34=1234\n#### 1,234"},
            {"question": "No marker here?", "answer": "just text"},
            {"question": "Third?", "answer": "#### 7"},
        ],
    )
    write_jsonl(tmp_path / "gsm8k_test.jsonl", [{"question": "Test q?", "answer": "so #### -5"}])
    pattern = str(tmp_path / "gsm8k_{split}.jsonl")

    train = load_examples("gsm8k_r1_template", "train", dataset_path=pattern)
    assert [ex.answer for ex in train] == ["1234", "", "7"]
    assert train[0].text == "Tom has 1,200 apples and buys 34. How many?"
    assert train[0].question == r1_prompt(train[0].text) and train[0].question.endswith("Response: <think>")
    assert "User: Tom has 1,200 apples" in train[0].question
    assert [ex.meta["global_prompt_id"] for ex in train] == [0, 1, 2]
    assert train[2].meta["line"] == 3 and train[0].meta["split"] == "train"

    test = load_examples("gsm8k_r1_template", "test", dataset_path=pattern)
    assert [(ex.text, ex.answer) for ex in test] == [("Test q?", "-5")]
    assert load_examples("gsm8k_r1_template", "train", dataset_path=pattern, pool_size=2) == train[:2]


def test_gsm8k_offline_without_path_says_what_to_do(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DataError, match="batch_config.dataset_path.*gsm_symbolic_r1_template"):
        load_examples("gsm8k_r1_template", "train")


def test_hf_without_datasets_package_names_the_extra(monkeypatch, tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "1+1?", "solution": "2"}])
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DataError, match=r"needs the optional package 'datasets'.*entropy_experiments\[hf\]"):
        load_examples("hf", "train", dataset_path=str(path))


def test_gsm8k_without_datasets_package_says_what_to_do(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(DataError, match="'datasets' is not installed.*batch_config.dataset_path"):
        load_examples("gsm8k_r1_template", "test")


def test_gsm8k_missing_answer_field_names_path_and_line(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "a", "answer": "#### 1"}, {"question": "b"}])
    with pytest.raises(DataError, match=rf"^{path}:2: missing 'answer'"):
        load_examples("gsm8k_r1_template", "train", dataset_path=str(path))


# ---------------------------------------------------------------- generic JSONL


def test_jsonl_prompts_verbatim_and_one_file_for_every_split(tmp_path):
    path = write_jsonl(
        tmp_path / "mine.jsonl",
        [{"question": "Q1 verbatim", "answer": 18}, "", {"question": "Q2", "text": "raw two"}],
    )
    for split in ("train", "test"):
        examples = load_examples("jsonl", split, dataset_path=str(path))
        assert [(ex.question, ex.answer, ex.text) for ex in examples] == [
            ("Q1 verbatim", "18", "Q1 verbatim"),
            ("Q2", "", "raw two"),
        ]
        assert [ex.meta["line"] for ex in examples] == [1, 3]  # blank lines are skipped, not renumbered
        assert examples[0].meta["split"] == split


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"question": "x", ', "invalid JSON"),
        ('["question"]', "expected a JSON object, got list"),
        ('{"answer": "1"}', "missing 'question'"),
        ('{"question": {"nested": 1}}', "'question' must be a string"),
    ],
)
def test_jsonl_malformed_line_names_path_and_line(tmp_path, bad_line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"question": "fine", "answer": "1"}, "", bad_line])
    with pytest.raises(DataError, match=rf"^{path}:3: {message}"):
        load_examples("jsonl", "train", dataset_path=str(path))


def test_jsonl_needs_an_existing_path(tmp_path):
    with pytest.raises(DataError, match="needs batch_config.dataset_path"):
        load_examples("jsonl", "train")
    with pytest.raises(
        DataError, match=r"batch_config.dataset_path: file not found: .*nope_test.jsonl \(split 'test'\)"
    ):
        load_examples("jsonl", "test", dataset_path=str(tmp_path / "nope_{split}.jsonl"))


def test_empty_split_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match="data set 'jsonl' split 'dev' is empty"):
        load_examples("jsonl", "dev", dataset_path=str(path))


# ---------------------------------------------------------------- entry point


def test_unknown_data_set_suggests_the_closest_name():
    with pytest.raises(DataError) as info:
        load_examples("gsm8k_r1", "train")
    message = str(info.value)
    assert message.startswith("unknown data set 'gsm8k_r1': choose one of [")
    assert "(did you mean 'gsm8k_r1_template'?)" in message and "\n" not in message


@pytest.mark.parametrize("pool_size", [0, -3, 2.5, True])
def test_bad_pool_size_is_an_error(pool_size):
    with pytest.raises(DataError, match="pool_size must be a positive integer"):
        load_examples(DEFAULT, "train", pool_size=pool_size)


def test_results_are_cached_per_arguments_and_returned_as_fresh_lists(monkeypatch):
    calls = []

    def builder(split, *, dataset_path=None, pool_size=None):
        calls.append((split, dataset_path, pool_size))
        return [Example(question=f"{split}?", answer="1", text="t", meta={"global_prompt_id": 0})]

    monkeypatch.setitem(DATASET_REGISTRY, "counting", builder)
    first = load_examples("counting", "train")
    first.clear()  # a caller editing its list must not edit the cache
    assert load_examples("counting", "train")[0].question == "train?"
    load_examples("counting", "train", pool_size=3)
    load_examples("counting", "test")
    assert calls == [("train", None, None), ("train", None, 3), ("test", None, None)]

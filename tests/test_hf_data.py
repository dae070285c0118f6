"""Data sets in TRL's conventions (`dataset_name: hf`) and prompts rendered exactly as TRL 1.16's GRPOTrainer.

The rendering is compared with TRL's own code: `GRPOTrainer._tokenize_prompts` (called on a stand-in for the
trainer holding only the attributes it reads) for the token ids, `trl.data_utils.maybe_apply_chat_template`
for the text, on a standard and a conversational data set (system message included), with a tokenizer that
adds a BOS (and whose chat template writes one) and one that does not.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from entropy_experiments.data.datasets import clear_example_cache, load_examples
from entropy_experiments.data.prompt_rendering import check_chat_template, render_prompt
from entropy_experiments.errors import DataError
from entropy_experiments.testing.tiny_model import build_tiny_tokenizer

datasets = pytest.importorskip("datasets")
datasets.disable_progress_bars()

SYSTEM = {"role": "system", "content": "Answer in <answer> </answer> tags."}
QUESTIONS = ["What is 2 + 2?", "Tom has 3 apples and buys 5 more. How many apples does he have?",
             "Show your work in <think> </think> tags."]
ANSWERS = ["4", "8", "0"]
# A template that reads a chat_template_kwargs key (as Qwen3's reads enable_thinking).
KWARG_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% if think %}<think>{% endif %}{% endif %}")


def conversational_rows() -> dict:
    prompts = [[SYSTEM, {"role": "user", "content": q}] if i != 1 else [{"role": "user", "content": q}]
               for i, q in enumerate(QUESTIONS)]
    return {"prompt": prompts, "answer": ANSWERS, "level": [1, 2, 3]}


def standard_rows() -> dict:
    return {"prompt": QUESTIONS, "answer": ANSWERS, "level": [1, 2, 3]}


@pytest.fixture(scope="module")
def tokenizers() -> dict:
    return {"no_bos": build_tiny_tokenizer(), "bos": build_tiny_tokenizer(add_bos=True)}


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_example_cache()
    yield
    clear_example_cache()


def trl_prompt_ids(tokenizer, prompts: list, chat_template_kwargs: dict | None = None) -> list[list[int]]:
    """TRL's own prompt tokenisation (GRPOTrainer._tokenize_prompts) on a stand-in trainer."""
    GRPOTrainer = pytest.importorskip("trl").GRPOTrainer

    trainer = SimpleNamespace(processing_class=tokenizer, _is_vlm=False, environment_factories=None, tools=None,
                              chat_template=None, chat_template_kwargs=chat_template_kwargs or {})
    ids, _, _ = GRPOTrainer._tokenize_prompts(trainer, prompts)
    return [list(map(int, row)) for row in ids]


def load_hf(path, split: str = "train", columns=("prompt", None)):
    return load_examples("hf", split, dataset_path=str(path), columns=columns)


@pytest.mark.parametrize("kind", ["standard", "conversational"])
@pytest.mark.parametrize("tok", ["no_bos", "bos"])
def test_rendered_ids_and_text_equal_trls(tmp_path, tokenizers, kind, tok):
    maybe_apply_chat_template = pytest.importorskip("trl.data_utils").maybe_apply_chat_template

    tokenizer = tokenizers[tok]
    rows = standard_rows() if kind == "standard" else conversational_rows()
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    examples = load_hf(tmp_path / "ds")
    expected_ids = trl_prompt_ids(tokenizer, rows["prompt"])
    for example, prompt, ids in zip(examples, rows["prompt"], expected_ids, strict=True):
        rendered = render_prompt(tokenizer, example)
        assert list(rendered.token_ids) == ids
        assert rendered.text == maybe_apply_chat_template({"prompt": prompt}, tokenizer)["prompt"]
        bos = tokenizer.bos_token_id
        assert ids.count(bos) == (1 if tok == "bos" else 0) if bos is not None else True  # one BOS, never two
    if kind == "conversational":
        assert examples[0].conversational and examples[0].prompt[0] == SYSTEM


def test_chat_template_kwargs_reach_the_template_as_in_trl(tmp_path, tokenizers):
    maybe_apply_chat_template = pytest.importorskip("trl.data_utils").maybe_apply_chat_template

    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = KWARG_TEMPLATE
    rows = conversational_rows()
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    example = load_hf(tmp_path / "ds")[0]
    for kwargs in ({"think": True}, {}):
        rendered = render_prompt(tokenizer, example, kwargs)
        assert list(rendered.token_ids) == trl_prompt_ids(tokenizer, rows["prompt"][:1], kwargs)[0]
        assert rendered.text == maybe_apply_chat_template({"prompt": rows["prompt"][0]}, tokenizer, **kwargs)["prompt"]
        assert rendered.text.endswith("<think>") == bool(kwargs)


def test_every_format_loads_the_same_examples(tmp_path):
    ds = datasets.Dataset.from_dict(conversational_rows())
    ds.save_to_disk(str(tmp_path / "disk"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp_path / "dict"))
    ds.to_parquet(str(tmp_path / "train.parquet"))
    ds.to_json(str(tmp_path / "train.jsonl"))  # JSON lines
    paths = [tmp_path / "disk", tmp_path / "dict", tmp_path / "train.parquet", tmp_path / "train.jsonl",
             tmp_path / "{split}.parquet"]
    loaded = [[(ex.prompt, ex.columns, ex.answer) for ex in load_hf(p)] for p in paths]
    assert all(one == loaded[0] for one in loaded)
    assert loaded[0][0][1] == {"answer": "4", "level": 1} and loaded[0][0][2] == "4"
    std = datasets.Dataset.from_dict(standard_rows())
    std.to_csv(str(tmp_path / "train.csv"), index=False)
    std.save_to_disk(str(tmp_path / "std"))
    csv, disk = load_hf(tmp_path / "train.csv"), load_hf(tmp_path / "std")
    # CSV infers column types (the answers become ints); prompts and gold answers are the same
    assert [(e.prompt, e.question, e.answer) for e in csv] == [(e.prompt, e.question, e.answer) for e in disk]
    assert csv[1].question == QUESTIONS[1] and not csv[1].conversational


def test_prompt_and_answer_columns(tmp_path):
    rows = {"question": QUESTIONS, "solution": ANSWERS}
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "ds"))
    examples = load_hf(tmp_path / "ds", columns=("question", "solution"))
    assert [e.prompt for e in examples] == QUESTIONS and [e.answer for e in examples] == ANSWERS
    assert examples[0].columns == {"solution": "4"}


def _error(fn) -> str:
    with pytest.raises(DataError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message
    return message


def test_bad_inputs_are_one_line_naming_path_row_and_column(tmp_path, tokenizers):
    datasets.Dataset.from_dict({"question": QUESTIONS}).save_to_disk(str(tmp_path / "nocol"))
    assert "no column 'prompt'" in _error(lambda: load_hf(tmp_path / "nocol")) and "nocol" in _error(
        lambda: load_hf(tmp_path / "nocol"))
    bad = {"prompt": [[{"role": "user", "content": "hi"}], [{"text": "no role"}], [{"role": "user", "content": "x"}]]}
    datasets.Dataset.from_dict(bad).to_json(str(tmp_path / "bad.jsonl"))
    message = _error(lambda: load_hf(tmp_path / "bad.jsonl"))
    assert "bad.jsonl row 1" in message and "column 'prompt' message 0" in message
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"prompt": [{"role": "user", "content": "hi"}]}\n{"prompt": "plain"}\n')
    assert "row 1" in _error(lambda: load_hf(mixed)) and "first row is" in _error(lambda: load_hf(mixed))
    (tmp_path / "broken.parquet").write_bytes(b"not a parquet file")
    assert "cannot read" in _error(lambda: load_hf(tmp_path / "broken.parquet"))
    assert "file not found" in _error(lambda: load_hf(tmp_path / "missing_{split}.parquet"))
    (tmp_path / "empty.csv").write_text("prompt,answer\n")
    assert "is empty" in _error(lambda: load_hf(tmp_path / "empty.csv"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(standard_rows())}).save_to_disk(str(tmp_path / "dd"))
    assert "no split 'test'" in _error(lambda: load_hf(tmp_path / "dd", split="test"))
    datasets.Dataset.from_dict(conversational_rows()).save_to_disk(str(tmp_path / "conv"))
    plain = build_tiny_tokenizer()
    plain.chat_template = None
    message = _error(lambda: check_chat_template(plain, load_hf(tmp_path / "conv"), "base model"))
    assert "no chat template" in message


@pytest.mark.e2e
@pytest.mark.parametrize("case", ["no_prompt_column", "reward_signature"])
def test_data_and_reward_errors_come_before_the_model_loads(tmp_path, monkeypatch, case):
    import contextlib
    import io

    import yaml

    from entropy_experiments import cli
    from entropy_experiments.probe import recipe
    from tests.run_helpers import logging_restored

    def no_model(*args, **kwargs):
        raise AssertionError("the model must not load before the data set and rewards are checked")

    monkeypatch.setattr(recipe, "load_phase", no_model)
    columns = {"question": QUESTIONS} if case == "no_prompt_column" else standard_rows()
    datasets.Dataset.from_dict(columns).to_parquet(str(tmp_path / "train.parquet"))
    reward = {"functions": ["zero", "math:sqrt"]} if case == "reward_signature" else {"name": "zero"}
    config = {"checkpoint": {"checkpoint_path": str(tmp_path / "no_checkpoint_here")}, "reward": reward,
              "batch_config": {"dataset_name": "hf", "dataset_path": str(tmp_path / "{split}.parquet")}}
    (tmp_path / "probe.yaml").write_text(yaml.safe_dump(config))
    err = io.StringIO()
    with logging_restored(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = cli.main(["run", "--config", str(tmp_path / "probe.yaml"), "--out", str(tmp_path / "run")])
    line = err.getvalue().strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err.getvalue()
    expected = "no column 'prompt'" if case == "no_prompt_column" else "reward 'math:sqrt' cannot be called"
    assert line.startswith("error: ") and expected in line, line
    if case == "no_prompt_column":
        assert "train.parquet" in line


def test_a_pool_smaller_than_the_split_is_a_warning(tmp_path):
    from entropy_experiments.probe.preflight import pool_warning

    datasets.Dataset.from_dict(standard_rows()).save_to_disk(str(tmp_path / "ds"))
    two = load_examples("hf", "train", dataset_path=str(tmp_path / "ds"), pool_size=2, columns=("prompt", None))
    assert [e.prompt for e in two] == QUESTIONS[:2]
    assert "first 2 of the split's 3 rows" in pool_warning(two, 2)
    assert pool_warning(load_hf(tmp_path / "ds"), 500) is None


def test_a_large_split_is_sampled_whole_unless_the_user_caps_it(tmp_path):
    """The default config (pool_size null) draws from every row of a 7,000-row split, not its first 500; a
    pool_size the user writes keeps that many first rows; the default data set still makes its 500 problems."""
    from entropy_experiments.config import config_from_dict
    from entropy_experiments.probe.parallel import SINGLE
    from entropy_experiments.probe.sampling import draw_plan, prompt_examples

    rows = 7000
    datasets.Dataset.from_dict({"prompt": [f"question {i}" for i in range(rows)],
                                "answer": [str(i) for i in range(rows)]}).save_to_disk(str(tmp_path / "ds"))
    section = {"dataset_name": "hf", "dataset_path": str(tmp_path / "ds"), "B_E": 64, "B_U": 8}
    config = config_from_dict({"batch_config": section})
    examples = prompt_examples(config.batch_config)
    assert len(examples) == rows and examples[-1].prompt == f"question {rows - 1}"
    plan = draw_plan(config, len(examples), SINGLE)  # the probe's own draw: E with replacement, U distinct
    drawn = plan.E_prompt_indices + plan.U_prompt_indices
    assert max(drawn) >= 500 and sum(i >= 500 for i in drawn) > len(drawn) / 2  # ~93 % of the split lies there
    capped = config_from_dict({"batch_config": {**section, "pool_size": 300}})
    assert [e.prompt for e in prompt_examples(capped.batch_config)] == [f"question {i}" for i in range(300)]
    assert len(prompt_examples(config_from_dict({}).batch_config)) == 500


def test_the_pool_size_is_hashed_as_written(tmp_path):
    """The config hash is over the config as written: pool_size null (the data set's own size) and each number
    hash apart, for the generated default data set and for a read split alike."""
    from entropy_experiments.config import config_from_dict

    def config_hash(batch_config: dict) -> str:
        return config_from_dict({"batch_config": batch_config}).config_hash()

    assert len({config_hash({}), config_hash({"pool_size": 500}), config_hash({"pool_size": 400})}) == 3
    hf = {"dataset_name": "hf", "dataset_path": str(tmp_path)}
    assert config_hash(hf) != config_hash({**hf, "pool_size": 500})

"""Any local JSONL of {"question", "answer", optional "text"} records; prompts used verbatim."""

from __future__ import annotations

from entropy_experiments.data.datasets.base import Example, make_meta, register_dataset
from entropy_experiments.data.datasets.files import (
    PATH_KEY,
    first_records,
    read_jsonl,
    resolve_split_path,
    text_field,
)
from entropy_experiments.errors import DataError

NAME = "jsonl"


@register_dataset(NAME)
def jsonl(split: str, *, dataset_path: str | None = None, pool_size: int | None = None) -> list[Example]:
    """Examples from `dataset_path`; '{split}' in the path selects a per-split file, else one file serves all.

    `question` is sent to the model as is (no template); a missing `answer` gives "" (unknown gold);
    `text` defaults to the question.
    """
    if dataset_path is None:
        raise DataError(f"data set '{NAME}' needs {PATH_KEY} (a local JSONL with 'question' and 'answer')")
    path = resolve_split_path(dataset_path, split)
    examples = []
    for index, lineno, record in first_records(read_jsonl(path), pool_size):
        question = text_field(record, "question", path, lineno, required=True)
        answer = text_field(record, "answer", path, lineno, required=False).strip()
        text = text_field(record, "text", path, lineno, required=False) or question
        meta = make_meta(NAME, split, index, source=str(path), line=lineno)
        examples.append(Example(question=question, answer=answer, text=text, meta=meta))
    return examples

"""`hf`: any data set the `datasets` library reads, in TRL's column conventions.

`batch_config.dataset_path` names a `save_to_disk` directory, a parquet / JSON / JSON-lines / CSV file
(one path, or a pattern with '{split}'), or a hub name (offline: the local cache). The prompt column
(`batch_config.prompt_column`, default `prompt`) holds a string (standard) or a list of {role, content}
messages (conversational, TRL's `is_conversational`); every other column travels with the example to
the reward functions (TRL passes each as a keyword). The gold answer that the built-in rewards read is
`batch_config.answer_column` (default: the column `answer` when there is one, else unknown).
Every row is checked here, before any model loads; a bad row is one DataError naming path, row and column.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from entropy_experiments.data.datasets.base import Example, make_meta, register_dataset
from entropy_experiments.data.datasets.files import PATH_KEY
from entropy_experiments.errors import DataError

NAME = "hf"
FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}
DEFAULT_ANSWER_COLUMN = "answer"


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _datasets() -> Any:
    """The `datasets` module (~1 s to import, so only when this data set is used); DataError without it."""
    try:
        import datasets
    except ImportError:
        raise DataError(f"data set '{NAME}' needs the optional package 'datasets': "
                        "pip install 'entropy_experiments[hf]'") from None
    return datasets


def _from_disk(path: Path, split: str) -> Any:
    datasets = _datasets()

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # noqa: BLE001  a corrupt or foreign directory: one line naming it
        raise DataError(f"{PATH_KEY}: cannot read the save_to_disk directory {path} ({_first_line(exc)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{PATH_KEY}: {path} has no split '{split}': choose one of {sorted(loaded)} "
                            "(batch_config.split)")
        return loaded[split]
    return loaded


def _from_file(path: Path, split: str) -> Any:
    datasets = _datasets()

    builder = FILE_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise DataError(f"{PATH_KEY}: {path}: unknown file type '{path.suffix}' (expected one of "
                        f"{sorted(FILE_BUILDERS)}, or a save_to_disk directory)")
    try:
        return datasets.load_dataset(builder, data_files={split: str(path)}, split=split)
    except Exception as exc:  # noqa: BLE001  unparsable file: one line naming it
        if "corresponds to no data" in str(exc):
            raise DataError(f"data set '{NAME}' split '{split}' is empty ({path})") from None
        raise DataError(f"{PATH_KEY}: cannot read {path} as {builder} ({_first_line(exc)})") from None


def _from_hub(name: str, split: str) -> Any:
    datasets = _datasets()

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as exc:  # noqa: BLE001  network, cache, unknown name: all mean "not available here"
        raise DataError(f"{PATH_KEY}: '{name}' is neither a local file or directory nor a data set the hub "
                        f"(or its local cache) serves ({_first_line(exc)})") from None


def open_split(dataset_path: str, split: str) -> tuple[Any, str]:
    """(the `datasets.Dataset` of `split`, its source for provenance) from any supported location."""
    resolved = dataset_path.replace("{split}", split)
    path = Path(resolved).expanduser()
    if path.is_dir():
        return _from_disk(path, split), str(path)
    if path.is_file():
        return _from_file(path, split), str(path)
    if "{split}" in dataset_path or path.suffix.lower() in FILE_BUILDERS or resolved.startswith((".", "/", "~")):
        raise DataError(f"{PATH_KEY}: file not found: {path} (split '{split}')")
    return _from_hub(resolved, split), f"hub:{resolved}"


def _check_messages(value: list, where: str, column: str) -> None:
    if not value:
        raise DataError(f"{where}: column '{column}' is an empty list of messages")
    for i, message in enumerate(value):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise DataError(f"{where}: column '{column}' message {i} is not a {{role, content}} dict: {message!r:.80}")
        if not isinstance(message["role"], str) or not isinstance(message["content"], str):
            raise DataError(f"{where}: column '{column}' message {i}: role and content must be strings "
                            f"(text-only chat), got {type(message['role']).__name__} / "
                            f"{type(message['content']).__name__}")


def check_prompt(value: Any, where: str, column: str, conversational: bool | None) -> bool:
    """Check one row's prompt; returns whether it is conversational. `conversational`: the first row's kind
    (TRL decides by the first prompt of a batch, so every row must be of the same kind)."""
    is_messages = isinstance(value, list)
    if is_messages:
        _check_messages(value, where, column)
    elif not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: column '{column}' must be a non-empty string or a list of {{role, content}} "
                        f"messages, got {value!r:.80}")
    if conversational is not None and is_messages != conversational:
        kinds = ("standard (string)", "conversational (messages)")
        raise DataError(f"{where}: column '{column}' is {kinds[is_messages]} but the first row is "
                        f"{kinds[conversational]}; TRL needs one kind per data set")
    return is_messages


def _plain_messages(value: Any) -> Any:
    """Messages as plain {role, content} dicts (datasets may add keys that other rows have, as None)."""
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in m.items() if v is not None} for m in value]


def _row_example(row: dict[str, Any], index: int, split: str, source: str, prompt_column: str,
                 answer_column: str | None, conversational: bool | None, rows_in_split: int) -> tuple[Example, bool]:
    where = f"{source} row {index}"
    prompt = _plain_messages(row[prompt_column])
    kind = check_prompt(prompt, where, prompt_column, conversational)
    columns = {key: value for key, value in row.items() if key != prompt_column}
    answer = columns.get(answer_column or DEFAULT_ANSWER_COLUMN)
    text = prompt if isinstance(prompt, str) else str(prompt[-1]["content"])
    meta = make_meta(NAME, split, index, source=source, row=index, rows_in_split=rows_in_split)
    example = Example(question=prompt if isinstance(prompt, str) else "", answer="" if answer is None else str(answer),
                      text=text, meta=meta, prompt=prompt, columns=columns)
    return example, kind


@register_dataset(NAME)
def hf_dataset(split: str, *, dataset_path: str | None = None, pool_size: int | None = None,
               columns: tuple[str, str | None] = ("prompt", None)) -> list[Example]:
    """The first `pool_size` rows of `split` as Examples carrying TRL's `prompt` and the other columns."""
    if dataset_path is None:
        raise DataError(f"data set '{NAME}' needs {PATH_KEY} (a save_to_disk directory, a parquet / JSON / "
                        "JSON-lines / CSV file or '{split}' pattern, or a hub name)")
    dataset, source = open_split(dataset_path, split)
    return dataset_examples(dataset, split, source=source, columns=columns, pool_size=pool_size)


def dataset_examples(dataset: Any, split: str, *, source: str, columns: tuple[str, str | None] = ("prompt", None),
                     pool_size: int | None = None) -> list[Example]:
    """The first `pool_size` rows of an opened `datasets.Dataset` as Examples (every row checked)."""
    prompt_column, answer_column = columns
    names = list(getattr(dataset, "column_names", None) or [])
    if prompt_column not in names:
        raise DataError(f"{source}: no column '{prompt_column}' (columns: {names}); TRL reads the prompt from "
                        "'prompt' — set batch_config.prompt_column to use another")
    if answer_column is not None and answer_column not in names:
        raise DataError(f"{source}: no column '{answer_column}' (batch_config.answer_column; columns: {names})")
    rows = len(dataset) if pool_size is None else min(pool_size, len(dataset))
    examples, kind = [], None
    for index in range(rows):
        example, row_kind = _row_example(dict(dataset[index]), index, split, source, prompt_column, answer_column,
                                         kind, len(dataset))
        kind = row_kind if kind is None else kind
        examples.append(example)
    return examples

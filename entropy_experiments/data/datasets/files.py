"""Reading local JSONL data files with one-line, PATH:LINE error messages."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from entropy_experiments.errors import DataError

PATH_KEY = "batch_config.dataset_path"


def resolve_split_path(dataset_path: str, split: str) -> Path:
    """Replace '{split}' in `dataset_path` by the split name and check that the file exists."""
    path = Path(dataset_path.replace("{split}", split)).expanduser()
    if not path.exists():
        raise DataError(f"{PATH_KEY}: file not found: {path} (split '{split}')")
    if not path.is_file():
        raise DataError(f"{PATH_KEY}: not a file: {path}")
    return path


def read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number starting at 1, record) for every non-blank line of a JSONL file."""
    try:
        with path.open("r", encoding="utf-8") as handle:
            for lineno, line in enumerate(handle, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(
                        f"{path}:{lineno}: invalid JSON ({exc.msg} at column {exc.colno})"
                    ) from None
                if not isinstance(record, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(record).__name__}")
                yield lineno, record
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read ({exc.strerror or exc})") from None


def text_field(record: dict[str, Any], key: str, path: Path | str, lineno: int, *, required: bool) -> str:
    """record[key] as a string: numbers are converted, null / absent give "" unless `required`."""
    value = record.get(key)
    if value is None:
        if required:
            raise DataError(f"{path}:{lineno}: missing '{key}' (keys present: {sorted(record)})")
        return ""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{path}:{lineno}: '{key}' must be a string, got {type(value).__name__}")
    text = str(value)
    if required and not text.strip():
        raise DataError(f"{path}:{lineno}: '{key}' is empty")
    return text


def first_records(
    records: Iterable[tuple[int, dict[str, Any]]], pool_size: int | None
) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """Yield (pool index, line number, record) for the first `pool_size` records (all when None).

    Stops reading as soon as the pool is full, so a huge file costs only the prefix it serves.
    """
    for index, (lineno, record) in enumerate(records):
        if pool_size is not None and index >= pool_size:
            return
        yield index, lineno, record

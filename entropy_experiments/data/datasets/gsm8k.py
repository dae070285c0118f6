"""GSM8K in the R1 template: from a local JSONL in GSM8K's own layout, or from the hub.

GSM8K records are {"question": ..., "answer": "<worked solution> #### 1,234"}; the gold answer is
the text after '####' with thousands separators removed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

from entropy_experiments.data.datasets.base import Example, make_meta, register_dataset
from entropy_experiments.data.datasets.files import first_records, read_jsonl, resolve_split_path, text_field
from entropy_experiments.data.datasets.templates import r1_prompt
from entropy_experiments.errors import DataError

NAME = "gsm8k_r1_template"
HUB_ID = "openai/gsm8k"

_OFFLINE_HINT = (
    "set batch_config.dataset_path to a local GSM8K JSONL (fields 'question' and 'answer'; "
    "'{split}' in the path becomes the split name) or use batch_config.dataset_name: gsm_symbolic_r1_template"
)


def gsm8k_gold(solution: str) -> str:
    """The final answer of a GSM8K solution: text after the last '####', commas removed; "" if none."""
    if "####" not in solution:
        return ""
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _hub_records(split: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """GSM8K rows from the hub as (row number starting at 1, record); DataError when unreachable."""
    if _env_flag("HF_HUB_OFFLINE") or _env_flag("HF_DATASETS_OFFLINE"):
        raise DataError(f"{NAME}: GSM8K cannot be downloaded (HF_HUB_OFFLINE is set): {_OFFLINE_HINT}")
    try:
        import datasets  # an optional dependency (extra `hf`), imported only here (~1 s)
    except ImportError:
        raise DataError(
            f"{NAME}: the optional package 'datasets' is not installed (pip install "
            f"'entropy_experiments[hf]'): {_OFFLINE_HINT}"
        ) from None
    try:
        splits = datasets.load_dataset(HUB_ID, "main")
    except Exception as exc:  # noqa: BLE001  network, auth, cache: all mean "not available here"
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{NAME}: loading {HUB_ID} failed ({first_line}): {_OFFLINE_HINT}") from None
    if split not in splits:
        raise DataError(f"{NAME}: {HUB_ID} has no split '{split}': choose one of {sorted(splits)}")
    for row_number, row in enumerate(splits[split], start=1):
        yield row_number, dict(row)


@register_dataset(NAME)
def gsm8k_r1_template(
    split: str, *, dataset_path: str | None = None, pool_size: int | None = None
) -> list[Example]:
    """GSM8K split `split` as R1-template Examples (see module docstring for the sources)."""
    if dataset_path is not None:
        path = resolve_split_path(dataset_path, split)
        source: str = str(path)
        records = read_jsonl(path)
    else:
        source = f"hub:{HUB_ID}"
        records = _hub_records(split)

    examples = []
    for index, lineno, record in first_records(records, pool_size):
        problem = text_field(record, "question", source, lineno, required=True)
        solution = text_field(record, "answer", source, lineno, required=True)
        meta = make_meta(NAME, split, index, source=source, line=lineno)
        examples.append(
            Example(question=r1_prompt(problem), answer=gsm8k_gold(solution), text=problem, meta=meta)
        )
    return examples

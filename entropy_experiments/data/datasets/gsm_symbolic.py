"""GSM8K-style problems generated offline by reasoning-gym (`gsm_symbolic`): the default data set.

Each split reads its own fixed-seed reasoning-gym stream. reasoning-gym's templates have small
variable ranges, so two independent streams repeat some questions (3 of 500 between the train and
test seeds below). To make the splits disjoint for any pool sizes, every question text is assigned
to one split by a hash, and a split keeps only the questions of its own stream that hash to it,
skipping repeats. The pool is therefore a deterministic function of (split, pool_size), and a
smaller pool is a prefix of a larger one, so `global_prompt_id` means the same problem everywhere.

The first POOL_ROWS problems of each split ship with the package (data/pools/gsm_symbolic_<split>.jsonl,
written once by scripts/make_prompt_pool.py from reasoning-gym 0.1.25), so the default data set needs
no reasoning-gym at run time. Only a pool_size beyond POOL_ROWS generates the stream again, and that
needs reasoning-gym installed by hand.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Any

from entropy_experiments.data.datasets.base import Example, make_meta, register_dataset
from entropy_experiments.data.datasets.templates import r1_prompt
from entropy_experiments.errors import DataError
from entropy_experiments.library_noise import quiet_source_compilation

NAME = "gsm_symbolic_r1_template"
DEFAULT_POOL_SIZE = 500
SPLIT_SEEDS: dict[str, int] = {"train": 1234, "test": 98765}
# Candidates drawn per pool slot before giving up: half are rejected by the hash, a few as repeats.
_CANDIDATES_PER_SLOT = 4
# Problems per split in the shipped pool files.
POOL_ROWS = 2000
REASONING_GYM = "reasoning-gym==0.1.25"


def split_of(question: str) -> str:
    """The one split that owns `question` (first bit of its SHA-256)."""
    return "train" if hashlib.sha256(question.encode("utf-8")).digest()[0] % 2 == 0 else "test"


def pool_path(split: str) -> Path:
    """The shipped pool file of `split`."""
    return Path(__file__).resolve().parents[1] / "pools" / f"gsm_symbolic_{split}.jsonl"


def _stream_length(size: int) -> int:
    return _CANDIDATES_PER_SLOT * size + 64


def _too_few(split: str, found: int, size: int) -> DataError:
    return DataError(
        f"data set '{NAME}' split '{split}': only {found} distinct problems among "
        f"{_stream_length(size)} generated, fewer than pool_size {size}; use a smaller batch_config pool size"
    )


def generate_rows(split: str, size: int) -> list[dict[str, Any]]:
    """The first `size` problems of `split`, generated with reasoning-gym (the pool files' source).

    One dict per problem: source_index (position in the stream), question (raw text), answer, answer_cot.
    """
    with quiet_source_compilation():
        import reasoning_gym  # ~2 s to import; only for pools beyond the shipped files

    # Item i of a reasoning-gym stream depends only on (seed, i), not on the stream's size, so
    # asking for a longer stream never changes the items already taken.
    stream = reasoning_gym.create_dataset("gsm_symbolic", seed=SPLIT_SEEDS[split], size=_stream_length(size))
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for source_index in range(len(stream)):
        if len(rows) == size:
            break
        entry = stream[source_index]
        problem = entry["question"]
        if problem in seen or split_of(problem) != split:
            continue
        seen.add(problem)
        rows.append({
            "source_index": source_index,
            "question": problem,
            "answer": str(entry["answer"]).strip(),
            # Only cheap, JSON-safe provenance (the entry's `variables` hold Fractions).
            "answer_cot": entry["metadata"].get("answer_cot", ""),
        })
    if len(rows) < size:
        raise _too_few(split, len(rows), size)
    return rows


@functools.cache
def _shipped_rows(split: str) -> tuple[dict[str, Any], ...]:
    path = pool_path(split)
    try:
        with path.open(encoding="utf-8") as handle:
            return tuple(json.loads(line) for line in handle)
    except OSError as exc:
        raise DataError(f"data set '{NAME}': cannot read the packaged pool {path} ({exc.strerror})") from None


def _rows(split: str, size: int) -> list[dict[str, Any]]:
    shipped = _shipped_rows(split)
    if size > len(shipped):
        try:
            return generate_rows(split, size)
        except ImportError:
            raise DataError(
                f"data set '{NAME}': the packaged pool holds {len(shipped)} problems per split; pool_size "
                f"{size} needs reasoning-gym to generate more (pip install {REASONING_GYM}) or a smaller "
                "batch_config.pool_size"
            ) from None
    # The run-time builder examined only the first 4·size+64 stream items: same rows, same error.
    limit = _stream_length(size)
    rows = [row for row in shipped[:size] if row["source_index"] < limit]
    if len(rows) < size:
        raise _too_few(split, sum(row["source_index"] < limit for row in shipped), size)
    return rows


@register_dataset(NAME)
def gsm_symbolic_r1_template(
    split: str, *, dataset_path: str | None = None, pool_size: int | None = None
) -> list[Example]:
    """`pool_size` (default 500) distinct reasoning-gym gsm_symbolic problems of split 'train' or 'test'.

    dataset_path is ignored (nothing is read from the network; the pool ships with the package).
    """
    if split not in SPLIT_SEEDS:
        raise DataError(f"data set '{NAME}' has no split '{split}': choose one of {sorted(SPLIT_SEEDS)}")
    size = DEFAULT_POOL_SIZE if pool_size is None else pool_size
    seed = SPLIT_SEEDS[split]
    examples: list[Example] = []
    for row in _rows(split, size):
        provenance = {"seed": seed, "source_index": row["source_index"], "answer_cot": row["answer_cot"]}
        meta = make_meta(
            NAME, split, len(examples), source="reasoning_gym:gsm_symbolic", reasoning_gym=provenance
        )
        examples.append(Example(question=r1_prompt(row["question"]), answer=row["answer"],
                                text=row["question"], meta=meta))
    return examples

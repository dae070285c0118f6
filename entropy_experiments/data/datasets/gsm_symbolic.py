"""GSM8K-style problems generated offline by reasoning-gym (`gsm_symbolic`): the default data set.

Each split reads its own fixed-seed reasoning-gym stream. reasoning-gym's templates have small
variable ranges, so two independent streams repeat some questions (3 of 500 between the train and
test seeds below). To make the splits disjoint for any pool sizes, every question text is assigned
to one split by a hash, and a split keeps only the questions of its own stream that hash to it,
skipping repeats. The pool is therefore a deterministic function of (split, pool_size), and a
smaller pool is a prefix of a larger one, so `global_prompt_id` means the same problem everywhere.
"""

from __future__ import annotations

import hashlib

from entropy_experiments.data.datasets.base import Example, make_meta, register_dataset
from entropy_experiments.data.datasets.templates import r1_prompt
from entropy_experiments.errors import DataError
from entropy_experiments.library_noise import quiet_source_compilation

NAME = "gsm_symbolic_r1_template"
DEFAULT_POOL_SIZE = 500
SPLIT_SEEDS: dict[str, int] = {"train": 1234, "test": 98765}
# Candidates drawn per pool slot before giving up: half are rejected by the hash, a few as repeats.
_CANDIDATES_PER_SLOT = 4


def split_of(question: str) -> str:
    """The one split that owns `question` (first bit of its SHA-256)."""
    return "train" if hashlib.sha256(question.encode("utf-8")).digest()[0] % 2 == 0 else "test"


@register_dataset(NAME)
def gsm_symbolic_r1_template(
    split: str, *, dataset_path: str | None = None, pool_size: int | None = None
) -> list[Example]:
    """`pool_size` (default 500) distinct reasoning-gym gsm_symbolic problems of split 'train' or 'test'.

    dataset_path is ignored (nothing is read from disk or the network).
    """
    if split not in SPLIT_SEEDS:
        raise DataError(f"data set '{NAME}' has no split '{split}': choose one of {sorted(SPLIT_SEEDS)}")
    size = DEFAULT_POOL_SIZE if pool_size is None else pool_size
    seed = SPLIT_SEEDS[split]

    with quiet_source_compilation():
        import reasoning_gym  # ~2 s to import, so only when this data set is used

    # Item i of a reasoning-gym stream depends only on (seed, i), not on the stream's size, so
    # asking for a longer stream never changes the items already taken.
    stream = reasoning_gym.create_dataset("gsm_symbolic", seed=seed, size=_CANDIDATES_PER_SLOT * size + 64)
    examples: list[Example] = []
    seen: set[str] = set()
    for source_index in range(len(stream)):
        if len(examples) == size:
            break
        entry = stream[source_index]
        problem = entry["question"]
        if problem in seen or split_of(problem) != split:
            continue
        seen.add(problem)
        # Keep only cheap, JSON-safe provenance (the entry's `variables` hold Fractions).
        provenance = {
            "seed": seed,
            "source_index": source_index,
            "answer_cot": entry["metadata"].get("answer_cot", ""),
        }
        meta = make_meta(
            NAME, split, len(examples), source="reasoning_gym:gsm_symbolic", reasoning_gym=provenance
        )
        examples.append(
            Example(question=r1_prompt(problem), answer=str(entry["answer"]).strip(), text=problem, meta=meta)
        )
    if len(examples) < size:
        raise DataError(
            f"data set '{NAME}' split '{split}': only {len(examples)} distinct problems among "
            f"{len(stream)} generated, fewer than pool_size {size}; use a smaller batch_config pool size"
        )
    return examples

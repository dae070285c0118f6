#!/usr/bin/env python3
"""Write the default data set's prompt pools, entropy_experiments/data/pools/gsm_symbolic_<split>.jsonl.

Run once, by hand, with reasoning-gym installed (`pip install reasoning-gym==0.1.25`):

    python scripts/make_prompt_pool.py            # both splits, ROWS problems each
    python scripts/make_prompt_pool.py --check    # compare the shipped files with a fresh generation

The rows are what `gsm_symbolic_r1_template` generated at run time before the files were shipped
(generate_rows in entropy_experiments/data/datasets/gsm_symbolic.py keeps that code): each
split reads its own fixed-seed reasoning-gym `gsm_symbolic` stream and keeps, in stream order, the
questions whose SHA-256 first bit names that split, skipping repeats. Item i of a stream depends only
on (seed, i), so one long stream gives every smaller pool as a prefix; each row keeps its
`source_index` so that the loader can reproduce the old "only n distinct problems among
4·pool_size+64 generated" error exactly. One JSON object per line: source_index, question (the raw
problem text), answer (str(entry["answer"]).strip()), answer_cot.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from entropy_experiments.data.datasets.gsm_symbolic import (
    POOL_ROWS,
    SPLIT_SEEDS,
    generate_rows,
    pool_path,
)


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=POOL_ROWS, help=f"problems per split (default {POOL_ROWS})")
    parser.add_argument("--check", action="store_true", help="compare the shipped files, write nothing")
    args = parser.parse_args()
    status = 0
    for split in SPLIT_SEEDS:
        text = render(generate_rows(split, args.rows))
        path = pool_path(split)
        if args.check:
            same = path.exists() and path.read_text(encoding="utf-8") == text
            print(f"{path.relative_to(ROOT)}: {'identical' if same else 'DIFFERS'}")
            status |= not same
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path.relative_to(ROOT)} ({args.rows} rows, {len(text.encode()) / 1e6:.2f} MB)")
    return status


if __name__ == "__main__":
    sys.exit(main())

"""Progress bars for long loops (tqdm; shown only on a terminal)."""

from __future__ import annotations

from collections.abc import Iterable


def progress(iterable: Iterable, desc: str, total: int | None = None):
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, disable=None, leave=False)

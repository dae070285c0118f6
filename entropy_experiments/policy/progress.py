"""Progress of long loops: a tqdm bar on a terminal, otherwise a log line every few seconds.

CI logs and `tee` get no bar (tqdm draws nothing when stderr is not a terminal), so there the loop
logs "desc: done/total (rate/s)" at most every `every_s` seconds, and a last line with the final
count when it logged anything. Short loops stay silent.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

from tqdm.auto import tqdm

PROGRESS_EVERY_S = 10.0
log = logging.getLogger("entropy_experiments.progress")


def progress(iterable: Iterable, desc: str, total: int | None = None, *, stream: TextIO | None = None,
             every_s: float = PROGRESS_EVERY_S) -> Iterable:
    """`iterable` with progress: a tqdm bar when `stream` (default stderr) is a terminal, else log lines."""
    stream = stream or sys.stderr
    if stream.isatty():
        return tqdm(iterable, desc=desc, total=total, leave=False, file=stream)
    if total is None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    return _logged(iterable, desc, total, every_s)


def _logged(iterable: Iterable, desc: str, total: int | None, every_s: float) -> Iterator[Any]:
    start = last = time.monotonic()
    done, logged = 0, False
    for item in iterable:
        yield item
        done += 1
        now = time.monotonic()
        if now - last >= every_s:
            _line(desc, done, total, now - start)
            last, logged = now, True
    if logged and now != last:
        _line(desc, done, total, time.monotonic() - start)


def _line(desc: str, done: int, total: int | None, seconds: float) -> None:
    rate = done / seconds if seconds > 0 else float("inf")
    log.info("%s: %d/%s (%.2f/s)", desc, done, "?" if total is None else total, rate)

"""Out-of-memory handling: recognise an OOM, drop it, and halve the rows per forward (down to 1)."""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from entropy_experiments.errors import DeviceError, NumericsError

__all__ = ["oom_reason", "release_memory", "shrink_after_oom", "unless_out_of_memory"]


def oom_reason(exc: BaseException) -> str | None:
    """A one-line description when `exc` is an out-of-memory error (torch.OutOfMemoryError, or a
    RuntimeError saying "out of memory" from older builds / other backends), else None."""
    oom_type = getattr(torch, "OutOfMemoryError", None)
    text = str(exc).strip()
    if (oom_type is not None and isinstance(exc, oom_type)) or (
            isinstance(exc, RuntimeError) and "out of memory" in text.lower()):
        return text.splitlines()[0][:200] if text else type(exc).__name__
    return None


def unless_out_of_memory(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    """(fn(), None), or (None, reason) when fn ran out of memory; every other error propagates.

    Returning instead of re-raising drops the exception (and the frames holding its tensors) before
    the caller retries with fewer rows."""
    try:
        return fn(), None
    except NumericsError:
        raise
    except Exception as exc:
        reason = oom_reason(exc)
        if reason is None:
            raise
        return None, reason


def release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def shrink_after_oom(rows: int, reason: str, where: str, logger: logging.Logger, *, can_split: bool = True) -> int:
    """Halve the rows per forward after running out of memory (logged); DeviceError at 1 row."""
    if rows <= 1 or not can_split:
        hint = ("a single row does not fit: lower generation.max_new_tokens or use a device with more memory"
                if rows <= 1 else "this pass needs its rows in one forward: lower estimator.microbatch_size")
        raise DeviceError(f"out of memory during {where} at {rows} row(s) per forward ({reason}); {hint}")
    new = max(1, rows // 2)
    logger.warning("out of memory during %s at %d rows per forward; retrying with %d (%s)", where, rows, new, reason)
    release_memory()
    return new

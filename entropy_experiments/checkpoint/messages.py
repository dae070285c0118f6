"""One-line error text from library exceptions (transformers, peft and torch messages are often multi-line)."""

from __future__ import annotations


def first_line(exc: BaseException, limit: int = 300) -> str:
    """First non-empty line of an exception message, cut at `limit` characters."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit] + "…"

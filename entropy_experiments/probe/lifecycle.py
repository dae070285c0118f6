"""Process lifecycle of a run: SIGTERM/SIGINT as a clean interruption.

`interruptible()` turns SIGTERM (and SIGINT) into `RunInterrupted`, a KeyboardInterrupt, so that the
run directory's `except BaseException` path marks the run "failed" (resumable with --resume) and the
atomic writes in flight are rolled back, instead of the process dying between two writes. The CLI
reports it as one line and exit code 128 + signal number.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class RunInterrupted(KeyboardInterrupt):
    """SIGTERM / SIGINT received during a run; `exit_code` is 128 + the signal number."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        self.exit_code = 128 + self.signum
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}")


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Within the block SIGTERM and SIGINT raise RunInterrupted (main thread only; no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise RunInterrupted(signum)

    saved = {}
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            saved[sig] = signal.signal(sig, handler)
        except (ValueError, OSError):  # pragma: no cover - exotic embedding
            pass
    try:
        yield
    finally:
        for sig, previous in saved.items():
            signal.signal(sig, previous)

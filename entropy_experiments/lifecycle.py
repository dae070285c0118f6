"""Process lifecycle of a run: SIGTERM/SIGINT as a clean interruption, and test-only hold points.

`interruptible()` turns SIGTERM (and SIGINT) into `RunInterrupted`, a KeyboardInterrupt, so that the
run directory's `except BaseException` path marks the run "failed" (resumable with --resume) and the
atomic writes in flight are rolled back, instead of the process dying between two writes. The CLI
reports it as one line and exit code 128 + signal number.

`hold_point(name)` lets the kill/resume tests stop a real run at a named point: with
ENTROPY_PROBE_TEST_HOLD="name[:n]" and ENTROPY_PROBE_TEST_HOLD_FILE=PATH set, the n-th time (default
1st) the run passes `name` it creates PATH and sleeps, waiting to be killed. Unset, it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator

HOLD_ENV = "ENTROPY_PROBE_TEST_HOLD"
HOLD_FILE_ENV = "ENTROPY_PROBE_TEST_HOLD_FILE"
_hits: Counter = Counter()


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


def hold_point(name: str) -> None:
    """Test hook (see the module docstring); does nothing unless ENTROPY_PROBE_TEST_HOLD names `name`."""
    spec = os.environ.get(HOLD_ENV)
    if not spec:
        return
    point, _, count = spec.partition(":")
    if point != name:
        return
    _hits[name] += 1
    if _hits[name] != int(count or 1):
        return
    marker = os.environ.get(HOLD_FILE_ENV)
    if marker:
        with open(marker, "w", encoding="utf-8") as f:
            f.write(f"{name} {os.getpid()}\n")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # sleep in short steps so that signal handlers run promptly
        time.sleep(0.05)

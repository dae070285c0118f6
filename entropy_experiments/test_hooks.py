"""Hooks that only the kill / resume / fault tests switch on; each is a no-op unless its variable is set.

- `hold_for_kill_test(name)`: with ENTROPY_PROBE_TEST_HOLD="name[:n]" and
  ENTROPY_PROBE_TEST_HOLD_FILE=PATH, the n-th time (default 1st) the run passes `name` it creates PATH
  and sleeps, waiting for the test to send it a signal (tests/test_kill_resume.py).
- `inject_fault_for_tests(phase, rank)`: with ENTROPY_PROBE_TEST_FAULT="PHASE[:RANK[:MODE]]", rank RANK
  (default 1) dies (MODE kill, the default: SIGKILL itself), exits (os._exit(3)) or hangs when it
  reaches PHASE (tests/test_distributed.py: what the other ranks report when a peer is lost).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import Counter

HOLD_ENV = "ENTROPY_PROBE_TEST_HOLD"
HOLD_FILE_ENV = "ENTROPY_PROBE_TEST_HOLD_FILE"
FAULT_ENV = "ENTROPY_PROBE_TEST_FAULT"

log = logging.getLogger("entropy_experiments.test_hooks")
_hits: Counter = Counter()


def hold_for_kill_test(name: str) -> None:
    """Sleep at the named point when ENTROPY_PROBE_TEST_HOLD names it (see the module docstring)."""
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


def inject_fault_for_tests(phase: str, rank: int) -> None:
    """Die, exit or hang at `phase` when ENTROPY_PROBE_TEST_FAULT names it and this rank."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    target_rank = int(parts[1]) if len(parts) > 1 and parts[1] else 1
    mode = parts[2] if len(parts) > 2 else "kill"
    if parts[0] != phase or rank != target_rank:
        return
    log.warning("test fault injection: rank %d %s at phase %s", rank, mode, phase)
    if mode == "hang":
        while True:
            time.sleep(1)
    elif mode == "exit":
        os._exit(3)
    else:
        os.kill(os.getpid(), signal.SIGKILL)

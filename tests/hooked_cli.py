"""`entropy-probe` with the kill / fault tests' hooks wrapped around the product functions (test support only).

    python tests/hooked_cli.py <cli args>                                   instead of python -m entropy_experiments.cli
    python -m torch.distributed.run --nproc_per_node=2 tests/hooked_cli.py <cli args>      (under torchrun too)

It patches module attributes of the product before calling `entropy_experiments.cli.main`; each hook is a
no-op unless its environment variable is set:

- ENTROPY_PROBE_TEST_HOLD="point[:n]" with ENTROPY_PROBE_TEST_HOLD_FILE=PATH: the n-th time (default 1st) the
  run passes `point` it creates PATH and sleeps, waiting for the test to send it a signal
  (tests/test_kill_resume.py, tests/test_sweep.py). Points:
    chunk_saved      a generation chunk saved into partial/ (RunDirectory.save_partial of a gen_* chunk)
    batches_saved    E and U saved into the run directory (after the runner's on_batches callback)
    results_written  results.json written (after RunDirectory.write_results)
- ENTROPY_PROBE_TEST_FAULT="PHASE[:RANK[:MODE]]": rank RANK (default 1) dies (MODE kill, the default: SIGKILL
  itself), exits (os._exit(3)) or hangs when it reaches PHASE (tests/test_distributed.py). Phases:
    sampled    E and U sampled (just before the runner's on_batches callback)
    delta_h1   δH₁ computed (after recipe.delta_h1_phase)
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path

HOLD_ENV = "ENTROPY_PROBE_TEST_HOLD"
HOLD_FILE_ENV = "ENTROPY_PROBE_TEST_HOLD_FILE"
FAULT_ENV = "ENTROPY_PROBE_TEST_FAULT"
SHIM = Path(__file__).resolve()

log = logging.getLogger("entropy_experiments.tests.hooked_cli")
_hits: Counter = Counter()


def hooked_command(*args: str) -> list[str]:
    """The command line that runs `entropy-probe <args>` through this shim."""
    return [sys.executable, str(SHIM), *args]


def hold(point: str) -> None:
    """Sleep at `point` when ENTROPY_PROBE_TEST_HOLD names it (see the module docstring)."""
    spec = os.environ.get(HOLD_ENV)
    if not spec:
        return
    name, _, count = spec.partition(":")
    if name != point:
        return
    _hits[point] += 1
    if _hits[point] != int(count or 1):
        return
    marker = os.environ.get(HOLD_FILE_ENV)
    if marker:
        with open(marker, "w", encoding="utf-8") as f:
            f.write(f"{point} {os.getpid()}\n")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:  # sleep in short steps so that signal handlers run promptly
        time.sleep(0.05)


def fault(phase: str, rank: int) -> None:
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


def install() -> None:
    """Wrap the product functions at the hook points (module attributes, looked up at call time)."""
    from entropy_experiments.probe import recipe
    from entropy_experiments.probe.parallel import SINGLE
    from entropy_experiments.report import run_dir

    original_run, original_delta_h1 = recipe.run, recipe.delta_h1_phase
    original_save_partial, original_write_results = run_dir.RunDirectory.save_partial, run_dir.RunDirectory.write_results

    @functools.wraps(original_run)
    def run(config, *args, **kwargs):
        rank = kwargs.get("dist", SINGLE).rank
        saves = config.output.save_batches and kwargs.get("batches") is None  # as the runner's on_batches
        on_batches = kwargs.get("on_batches")

        def hooked_on_batches(E, U):
            fault("sampled", rank)
            if on_batches is not None:
                on_batches(E, U)
                if saves:
                    hold("batches_saved")

        return original_run(config, *args, **{**kwargs, "on_batches": hooked_on_batches})

    @functools.wraps(original_delta_h1)
    def delta_h1_phase(*args, **kwargs):
        result = original_delta_h1(*args, **kwargs)
        fault("delta_h1", kwargs.get("dist", SINGLE).rank)
        return result

    @functools.wraps(original_save_partial)
    def save_partial(self, name, obj):
        path = original_save_partial(self, name, obj)
        if name.startswith(run_dir.GEN_CHUNK_PREFIX):
            hold("chunk_saved")
        return path

    @functools.wraps(original_write_results)
    def write_results(self, *args, **kwargs):
        path = original_write_results(self, *args, **kwargs)
        hold("results_written")
        return path

    recipe.run, recipe.delta_h1_phase = run, delta_h1_phase
    run_dir.RunDirectory.save_partial, run_dir.RunDirectory.write_results = save_partial, write_results


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == SHIM.parent:
        sys.path.pop(0)  # tests/ itself is no import root (the repository is, on PYTHONPATH)
    install()
    from entropy_experiments import cli

    sys.exit(cli.main())

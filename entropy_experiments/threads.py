"""How many CPU threads torch uses (docs/user-guide.md, "Threads").

torch's default is one thread per core the process may run on, whoever else is using them: on a shared machine
with another process busy on the cores, its threads wait on each other and one generate call can take minutes
instead of seconds. The probe picks instead, in this order: `--threads N` on the command line; OMP_NUM_THREADS
when set (a positive integer); else the free cores, the cores this process may use (os.sched_getaffinity) less
the 1-minute load average, at least 1.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from dataclasses import dataclass

log = logging.getLogger(__name__)

OMP_ENV = "OMP_NUM_THREADS"


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def load_average() -> float:
    """The 1-minute load average (0.0 where the system has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return 0.0


def choose_threads(requested: int | None, omp_env: str | None, cores: int, load: float) -> ThreadChoice:
    """The thread count and why: `requested` (--threads), else OMP_NUM_THREADS (`omp_env`) when a positive
    integer, else the `cores` not busy by the `load` average (at least 1)."""
    if requested is not None:
        return ThreadChoice(requested, "--threads")
    if omp_env is not None and omp_env.strip().isdigit() and int(omp_env) > 0:
        return ThreadChoice(int(omp_env), f"{OMP_ENV}={omp_env.strip()}")
    free = max(1, min(cores, cores - math.ceil(load - 0.5)))
    return ThreadChoice(free, f"{cores} cores, load average {load:.1f}: {free} free")


def apply_threads(requested: int | None) -> ThreadChoice:
    """Set torch's intra-op threads by `choose_threads` (the environment and this machine) and log the choice."""
    import torch

    choice = choose_threads(requested, os.environ.get(OMP_ENV), usable_cores(), load_average())
    torch.set_num_threads(choice.threads)
    # a choice the user made (--threads, OMP_NUM_THREADS) is no news: logged with -v only
    explicit = requested is not None or os.environ.get(OMP_ENV) is not None
    log.log(logging.DEBUG if explicit else logging.INFO, "CPU threads: %d (%s)", choice.threads, choice.reason)
    return choice


def positive_threads(text: str) -> int:
    """argparse type of --threads: a positive integer (argparse's one-line error and exit 2 otherwise)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--threads must be a positive integer, got {text!r}")
    return int(text)


def add_threads_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--threads", type=positive_threads, default=None, metavar="N",
                        help=f"CPU threads for torch (default: {OMP_ENV} when set, else the free cores)")

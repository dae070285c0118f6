"""The seeds' module: `OfflineEntropyProbe` and `python -m entropy_experiments.offline_entropy_probe`.

    python -m entropy_experiments.offline_entropy_probe --config FILE [--dryrun]

The probe itself lives in probe.py (its phases), run.py (with a run directory) and
compat/offline_entropy_probe.py (the seeds' class); this module keeps their import path and the
module entry point. The command line is `entropy-probe` (cli.py).
"""

from __future__ import annotations

import argparse
import sys

from .cli import interrupt_hint, run_with_clean_errors
from .compat.offline_entropy_probe import OfflineEntropyProbe
from .config import load_config
from .probe.runner import DRYRUN_OVERRIDES, dryrun_config, run_probe
from .report.results_dict import environment_info

__all__ = ["DRYRUN_OVERRIDES", "OfflineEntropyProbe", "dryrun_config", "environment_info", "main", "run_probe"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m entropy_experiments.offline_entropy_probe",
                                     description="Run the offline entropy probe on a config file.")
    parser.add_argument("--config", required=True)
    parser.add_argument("--dryrun", action="store_true", help="minimal sizes, print the summary, write nothing")
    args = parser.parse_args(argv)
    return run_with_clean_errors(lambda: run_probe(load_config(args.config), dryrun=args.dryrun),
                                 on_interrupt=interrupt_hint("run", args.dryrun))


if __name__ == "__main__":
    sys.exit(main())

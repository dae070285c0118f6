"""Legacy import path of the original (seed) API: `OfflineEntropyProbe` and the seeds' command line

    python -m entropy_experiments.offline_entropy_probe --config FILE [--dryrun]

A thin re-export of `entropy_experiments.compat.offline_entropy_probe`, where the code lives. New code calls
`entropy_experiments.probe.run(config)` / `entropy_experiments.probe.run_probe(config, out=...)`; the command
line is `entropy-probe` (cli.py).
"""

import sys

from .compat.offline_entropy_probe import (
    DRYRUN_OVERRIDES,
    OfflineEntropyProbe,
    dryrun_config,
    environment_info,
    main,
    run_probe,
)

__all__ = ["DRYRUN_OVERRIDES", "OfflineEntropyProbe", "dryrun_config", "environment_info", "main", "run_probe"]

if __name__ == "__main__":
    sys.exit(main())

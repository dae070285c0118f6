"""Legacy import path of the original (seed) API: `OfflineEntropyProbe` and the seeds' command line

    python -m entropy_experiments.offline_entropy_probe --config FILE [--dryrun]

A thin re-export of `entropy_experiments.compat.offline_entropy_probe`. New code calls
`entropy_experiments.probe.run(config)`; the command line is `entropy-probe` (cli.py).
"""

import sys

from .compat.offline_entropy_probe import OfflineEntropyProbe, main

__all__ = ["OfflineEntropyProbe", "main"]

if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env bash
# Run the whole test suite from a fresh machine with only python3: `scripts/test.sh [pytest args]`.
set -euo pipefail
# The environment is requirements.lock (every extra: dev, trl, qlora, plots, hf): see setup_env.sh.
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
start=$(date +%s)
# Lint first (seconds): a style regression fails CI just like a test.
ruff check --quiet . || { echo "[test] ruff check failed" >&2; exit 1; }
# Two workers on two cores, each torch on one thread; tests are dealt out one at a time (the files with
# costly module fixtures as one unit each: their xdist_group mark), so neither worker idles at the end.
set +e
OMP_NUM_THREADS=1 python -m pytest -n 2 --dist loadgroup -q "$@"
status=$?
set -e
echo "[test] pytest finished in $(( $(date +%s) - start )) s with exit code $status" >&2
exit $status

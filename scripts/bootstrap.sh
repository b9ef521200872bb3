#!/usr/bin/env bash
# Create .venv with everything ds_odc needs, on a fresh machine (idempotent, quick when done).
# torch is pinned to 2.13.0 (this machine's CPU wheel); deepspeed==0.19.8 builds from source against it,
# so it is installed without build isolation (an isolated build would pull an unpinned torch).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
stamp=.venv/.ds_odc_installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q --no-build-isolation -e ".[test]"
  touch "$stamp"
fi
# JIT-built operators, built here rather than by the first rank that needs one (see the script)
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.venv/torch_extensions}
.venv/bin/python scripts/prebuild_ops.py

#!/usr/bin/env bash
# One-time set-up, idempotent: a virtual environment in .venv with torch and this package.
# The venv sees the system's site-packages, so an existing torch (a user's CUDA build) is reused;
# only where none is importable is torch==2.13.0 installed (the CPU build on the dev/CI machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv --system-site-packages .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[test]"

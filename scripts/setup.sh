#!/usr/bin/env bash
# Set-up shared by the README's two commands: creates .venv on first use, installs torch 2.13.0 (the CPU build
# pip finds on local disk; an unpinned torch would pull a multi-GB CUDA build) and then this package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.megatron_bmw-installed
if [ ! -f "$stamp" ] || [ setup.py -nt "$stamp" ] || ! .venv/bin/python -c "import torch, megatron_bmw" 2>/dev/null; then
  echo "[setup] installing torch 2.13.0 and megatron_bmw into .venv (first run only)"
  .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/pip install -q --disable-pip-version-check -e ".[test,plot]" 2>&1 | grep -v "^WARNING: Location" || true
  .venv/bin/python -c "import torch, megatron_bmw" || { echo "[setup] installation failed" >&2; exit 1; }
  touch "$stamp"
fi

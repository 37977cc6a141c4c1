#!/usr/bin/env bash
# Set-up shared by the README's two commands: creates .venv on first use, installs torch 2.13.0 (the CPU build
# pip finds on local disk; an unpinned torch would pull a multi-GB CUDA build) and then this package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.megatron_bmw-installed
if [ -f "$stamp" ] && [ ! setup.py -nt "$stamp" ] && .venv/bin/python -c "import torch, megatron_bmw" 2>/dev/null; then
  exit 0
fi
step() { echo "[setup $(date +%H:%M:%S)] $*"; }
# pip's own lines show progress; its progress bars only where a person watches
bar=$([ -t 1 ] && echo on || echo off)
pip_install() { .venv/bin/pip install --disable-pip-version-check --progress-bar "$bar" "$@" 2>&1 \
                  | grep -v -e "^WARNING: Location" -e "^Requirement already satisfied" || true; }
t0=$SECONDS
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $($PY --version 2>&1)"
  "$PY" -m venv .venv
fi
step "1/2 installing torch 2.13.0 (CPU build, about 200 MB from the local wheel store; usually under a minute," \
     "several minutes on a busy machine)"
pip_install torch==2.13.0
step "2/2 installing megatron_bmw and its dependencies (numpy, sentencepiece, tensorboard, regex, pyyaml;" \
     "for the tests pytest, transformers, tokenizers; matplotlib for plots): about 1-3 minutes"
pip_install -e ".[test,plot]"
.venv/bin/python -c "import torch, megatron_bmw" || { echo "[setup] installation failed (see pip's lines above)" >&2; exit 1; }
touch "$stamp"
step "done in $((SECONDS - t0)) s; later runs skip this"

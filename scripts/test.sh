#!/usr/bin/env bash
# Runs the whole test suite (sets up .venv first if needed). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "$@"

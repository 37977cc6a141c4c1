#!/usr/bin/env bash
# Runs the test suite (sets up .venv first if needed). Extra arguments go to pytest.
#   bash scripts/test.sh          the whole suite (CI's command)
#   bash scripts/test.sh --fast   unit tests and single-process equivalence only (no test marked slow)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then
    export MBMW_TEST_TIER=fast
    args+=(-m "not slow")
  else
    args+=("$a")
  fi
done
exec .venv/bin/python -m pytest -q -p no:cacheprovider tests "${args[@]}"

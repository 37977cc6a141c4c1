#!/usr/bin/env bash
# Runs the test suite (sets up .venv first if needed). Extra arguments go to pytest.
#   bash scripts/test.sh                 the whole suite (CI's command)
#   bash scripts/test.sh --fast          unit tests and single-process equivalence only (no test marked slow)
#   bash scripts/test.sh tests/pipeline  only the paths given (with or without --fast)
# Two pytest-xdist workers share the tests (MBMW_TEST_WORKERS=1 runs them in one process): many tests leave a core
# idle (single-process tests, entry points on one rank, waits for a timeout), so two run in about 3/4 of the time.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
args=()
paths=0
for a in "$@"; do
  if [ "$a" = "--fast" ]; then
    export MBMW_TEST_TIER=fast
    args+=(-m "not slow")
  else
    case "$a" in tests|tests/*) paths=1 ;; esac
    args+=("$a")
  fi
done
[ "$paths" = 1 ] || args=(tests "${args[@]}")
workers=${MBMW_TEST_WORKERS:-2}
[ "$workers" -gt 1 ] && args=(-n "$workers" "${args[@]}")
exec .venv/bin/python -m pytest -q -p no:cacheprovider "${args[@]}"

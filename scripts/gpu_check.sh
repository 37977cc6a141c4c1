#!/usr/bin/env bash
# The GPU check (issue #27): run the CUDA paths of every feature on one GPU in under 9 minutes and write
# OUTDIR/report.md, OUTDIR/report.json, OUTDIR/logs.tar.gz and OUTDIR/nvidia-smi.txt. Needs no install and no
# network: the package runs from this tree (PYTHONPATH). Every step has its own time limit; a failing step is
# recorded and the rest still run. Extra arguments go to tools/gpu_check.py (--steps big,planner, --dry-run).
# Wheels in GPU_CHECK_WHEELS (default: .whl, when it holds any) are installed into a temporary folder first, without
# an index or dependencies: megatron-core's wheel there makes the peer step compare against it.
#   bash scripts/gpu_check.sh OUTDIR            # PYTHON=python3 by default
#   bash scripts/gpu_check.sh OUTDIR --steps env,moe,cp,covered,planner_archs   # issue #52's steps, ~5 minutes
set -uo pipefail
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
  echo "usage: scripts/gpu_check.sh OUTDIR [tools/gpu_check.py flags]" >&2
  exit 2
fi
OUT=$1
shift
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p "$OUT" || exit 2
WHEELS=${GPU_CHECK_WHEELS:-.whl}
if compgen -G "$WHEELS/*.whl" > /dev/null; then
  SITE=$(mktemp -d)
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl; then
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
  else
    echo "[gpu_check] the wheels in $WHEELS did not install; going on without them" >&2
  fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
timeout -k 10 "${GPU_CHECK_TIMEOUT_S:-530}" "$PY" tools/gpu_check.py "$OUT" --python "$PY" "$@"
rc=$?
if [ $rc -ne 0 ]; then
  echo "[gpu_check] tools/gpu_check.py exited $rc; $OUT/report.md holds the steps that finished" >&2
fi
{ nvidia-smi || echo "nvidia-smi: not available"; } > "$OUT/nvidia-smi.txt" 2>&1
exit $rc

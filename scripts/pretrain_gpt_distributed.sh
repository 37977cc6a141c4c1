#!/usr/bin/env bash
# torchrun launcher, one or many nodes. Run it on every node with the same MASTER_ADDR and its own NODE_RANK:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 bash scripts/pretrain_gpt_distributed.sh <pretrain_gpt.py flags>
# ENTRY picks the entry script (default pretrain_gpt.py; pretrain_bert_distributed.sh sets pretrain_bert.py).
# GPUS_PER_NODE defaults to the visible GPU count (1 process on a machine without GPUs).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  [ "${GPUS_PER_NODE:-0}" -gt 0 ] || GPUS_PER_NODE=1
fi
need_int() {  # name, value, least: one line and exit 2 for a variable that is not an integer >= least
  case "$2" in ''|*[!0-9]*) echo "error: $1=$2: must be an integer >= $3" >&2; exit 2 ;; esac
  [ "$2" -ge "$3" ] || { echo "error: $1=$2: must be an integer >= $3" >&2; exit 2; }
}
need_int GPUS_PER_NODE "$GPUS_PER_NODE" 1
need_int NNODES "${NNODES:-1}" 1
need_int NODE_RANK "${NODE_RANK:-0}" 0
[ "${NODE_RANK:-0}" -lt "${NNODES:-1}" ] || { echo "error: NODE_RANK=${NODE_RANK:-0}: must be below NNODES=${NNODES:-1}" >&2; exit 2; }
need_int MASTER_PORT "${MASTER_PORT:-29500}" 1
[ "${MASTER_PORT:-29500}" -le 65535 ] || { echo "error: MASTER_PORT=${MASTER_PORT}: must be a port in [1, 65535]" >&2; exit 2; }
PYTHON_BIN=${PYTHON_BIN:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python )}
exec "$PYTHON_BIN" -m torch.distributed.run \
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
    "${ENTRY:-pretrain_gpt.py}" "$@"

#!/usr/bin/env bash
# torchrun launcher for BERT, one or many nodes. Run it on every node with the same MASTER_ADDR and its own NODE_RANK:
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 bash scripts/pretrain_bert_distributed.sh <pretrain_bert.py flags>
# Same environment variables as pretrain_gpt_distributed.sh.
set -euo pipefail
ENTRY=pretrain_bert.py exec bash "$(dirname "$0")/pretrain_gpt_distributed.sh" "$@"

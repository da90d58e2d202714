#!/usr/bin/env bash
# RLHF end to end on the embedded corpus, as DeepSpeed-Chat's e2e script: SFT -> reward model -> RL
# (GRPO, or PPO with --algo ppo, scored by that reward model), one layout for every stage
# (docs/post-training.md):
#   bash scripts/rlhf_e2e.sh [--run-root DIR] [--pretrain-iters 500] [--sft-iters 200] [--rm-iters 300]
#                            [--grpo-iters 100] [--algo grpo|ppo]
#                            [launcher flags, e.g. --tp 2 --pp 2; default one process]
#
#   0. data:     python -m data.prepare (the embedded corpus and tokenizer, as pretrain_gpt.sh does);
#                python -m data.post_train_demo --prompts 256: SFT records (6 lines of stdlib code ->
#                the next 4), preference pairs (the next 4 lines against them reversed; the held-out
#                files' pairs the validation split) and RL prompts (SFT windows of at most 240 tokens,
#                the real next lines as the answer), then python -m data.prompts on the prompts
#   1. pretrain: bash scripts/pretrain_gpt.sh (a small GPT: 2 layers, hidden 128, seq 256)
#   2. sft:      bash scripts/post_train.sh sft --load ROOT/pretrain --finetune
#   3. rm:       bash scripts/post_train.sh rm --load ROOT/sft --finetune (validated on the held-out pairs)
#   4. grpo:     bash scripts/post_train.sh grpo --load ROOT/sft --finetune --reward rm:ROOT/rm
#                (4 prompts x 4 responses of at most 16 tokens per iteration, no KL term); with
#                --algo ppo: bash scripts/post_train.sh ppo ... --critic-load ROOT/rm (the critic
#                starts from the reward model, KL coefficient 0.05), iterations --grpo-iters
# Then one line per stage from its metrics.jsonl: SFT's final loss, the RM's held-out accuracy,
# GRPO's reward (the RM's mean score of a rollout) at the first and the last iteration. A stage
# whose checkpoint exists under ROOT (default <repo>/runs/rlhf_e2e) is skipped. About 7 minutes
# on 2 quiet CPU cores (26 beside another run). Every stage's logs are in ROOT/<stage>/run.
set -euo pipefail
ROOT=""; PRETRAIN=500; SFT=200; RM=300; GRPO=100; ALGO=grpo
LAUNCH=()
count() { [[ "${2:-}" =~ ^[1-9][0-9]{0,6}$ ]] || { echo "rlhf_e2e.sh: $1 needs a whole number >= 1, got '${2:-}'; fix: e.g. $1 20" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --run-root) [ $# -ge 2 ] || { echo "rlhf_e2e.sh: --run-root needs a directory" >&2; exit 2; }; ROOT="$2"; shift 2 ;;
    --pretrain-iters) count "$1" "${2:-}"; PRETRAIN="$2"; shift 2 ;;
    --sft-iters) count "$1" "${2:-}"; SFT="$2"; shift 2 ;;
    --rm-iters) count "$1" "${2:-}"; RM="$2"; shift 2 ;;
    --grpo-iters) count "$1" "${2:-}"; GRPO="$2"; shift 2 ;;
    --algo) case "${2:-}" in grpo|ppo) ALGO="$2"; shift 2 ;; *) echo "rlhf_e2e.sh: --algo takes grpo or ppo, got '${2:-}'; fix: --algo ppo" >&2; exit 2 ;; esac ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) LAUNCH+=("$1"); shift ;;
  esac
done
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEGAZERO_ROOT"
ROOT="${ROOT:-$MEGAZERO_ROOT/runs/rlhf_e2e}"
DATA_DIR="${MEGAZERO_DATA_DIR:-$MEGAZERO_ROOT/.cache/data}"
START=$SECONDS
MODEL=(--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 256)
MAX_NEW=16
"$PY" -m data.prepare --data-dir "$DATA_DIR" > /dev/null
OUT="$("$PY" -m data.post_train_demo --data-dir "$DATA_DIR" --sft-records 2000 --pairs 2000 --prompts 256 \
  --max-prompt-tokens $((256 - MAX_NEW)))"
printf '%s\n' "$OUT" | head -n 1
value() { printf '%s\n' "$OUT" | sed -n "s/^$1=//p"; }
SFT_PATH="$(value SFT_PATH)"; PREF_PATH="$(value PREF_PATH)"; SPLIT="$(value SPLIT)"; PROMPTS="$(value PROMPTS_JSONL)"
TOK="$DATA_DIR/tokenizer.model"
PROMPTS_PATH="${PROMPTS%.jsonl}"
"$PY" -m data.prompts --input "$PROMPTS" --tokenizer-model "$TOK" --output-prefix "$PROMPTS_PATH" \
  --max-prompt-length $((256 - MAX_NEW))
stage() {  # stage NAME SCRIPT ARGS...: run unless ROOT/NAME holds a checkpoint
  local name="$1"; shift
  if [ -f "$ROOT/$name/latest" ]; then echo "[rlhf] $name: $ROOT/$name exists, skipped"; return; fi
  echo "[rlhf] $name ($((SECONDS - START)) s): bash $*"
  bash "$@" "${MODEL[@]}" ${LAUNCH[@]+"${LAUNCH[@]}"} --save "$ROOT/$name" --run-dir "$ROOT/$name/run"
}
stage pretrain scripts/pretrain_gpt.sh --data-dir "$DATA_DIR" --train-iters "$PRETRAIN" --micro-batch-size 4 \
  --global-batch-size 8 --eval-iters 0
stage sft scripts/post_train.sh sft --load "$ROOT/pretrain" --finetune --data-path "$SFT_PATH" \
  --tokenizer-model "$TOK" --sft-packing pack --reset-attention-mask --reset-position-ids \
  --train-iters "$SFT" --micro-batch-size 4 --global-batch-size 8 --lr 5e-4 --lr-warmup-iters $((SFT / 10)) --eval-iters 0
stage rm scripts/post_train.sh rm --load "$ROOT/sft" --finetune --data-path "$PREF_PATH" --tokenizer-model "$TOK" \
  --split "$SPLIT" --micro-batch-size 4 --global-batch-size 16 --train-iters "$RM" --lr 5e-4 --min-lr 5e-5 \
  --lr-warmup-iters $((RM / 10)) --eval-interval "$RM" --eval-iters 4
RL=(--grpo-kl-beta 0)
[ "$ALGO" = ppo ] && RL=(--critic-load "$ROOT/rm" --init-kl-coef 0.05)
stage "$ALGO" scripts/post_train.sh "$ALGO" --load "$ROOT/sft" --finetune --data-path "$PROMPTS_PATH" \
  --tokenizer-model "$TOK" --split 1 --reward "rm:$ROOT/rm" --grpo-prompts-per-step 4 --grpo-group-size 4 \
  --max-new-tokens "$MAX_NEW" --micro-batch-size 4 --global-batch-size 16 --train-iters "$GRPO" --lr 2e-4 \
  --lr-warmup-iters 0 --lr-decay-style constant "${RL[@]}" --eval-iters 0 --log-interval 1
echo "[rlhf] done in $((SECONDS - START)) s: checkpoints under $ROOT (pretrain, sft, rm, $ALGO)"
"$PY" - "$ROOT" "$ALGO" <<'PY'
import json, os, sys
def records(stage, kind):
    path = os.path.join(sys.argv[1], stage, "run", "metrics.jsonl")
    return [r for r in map(json.loads, open(path)) if r["kind"] == kind] if os.path.exists(path) else []
algo = sys.argv[2]
sft, rm, grpo = records("sft", "train"), records("rm", "valid"), records(algo, "train")
print(f"[rlhf] SFT: final training loss {sft[-1]['loss']:.4f} nats/token (iteration {sft[-1]['iteration']})" if sft else "[rlhf] SFT: no metrics")
print(f"[rlhf] RM: held-out pair accuracy {rm[-1]['rm_accuracy']:.3f}, pair loss {rm[-1]['loss']:.4f} (iteration {rm[-1]['iteration']})" if rm else "[rlhf] RM: no validation")
if grpo:
    r = [g["rl_reward"] for g in grpo]
    k = max(1, len(r) // 4)
    print(f"[rlhf] {algo.upper()}: reward (the RM's mean score) {r[0]:.4f} at iteration {grpo[0]['iteration']} -> {r[-1]:.4f} at "
          f"{grpo[-1]['iteration']}; mean of the first {k} {sum(r[:k]) / k:.4f}, of the last {k} {sum(r[-k:]) / k:.4f}")
else:
    print(f"[rlhf] {algo.upper()}: no metrics")
PY

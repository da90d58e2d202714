#!/usr/bin/env bash
# Post-training front door: bash scripts/post_train.sh MODE [launcher and train.py flags ...]
#   MODE: sft (supervised fine-tuning on python -m data.sft records; the same as --sft)
#         rm  (a reward model on python -m data.preference pairs; --rm-use-margin, --rm-center-coef)
#         dpo (preference optimisation on python -m data.preference pairs; --dpo-loss sigmoid|ipo|simpo|hinge)
#         grpo (reinforcement learning on python -m data.prompts prompts; --reward exact|python:MODULE:FN|rm:DIR;
#               bash scripts/rl_demo.sh)
#         ppo  (the same with a critic: --critic-load RM_DIR, --gamma, --lam, --init-kl-coef, --kl-target)
#
# Runs scripts/pretrain_gpt.sh with --post-train MODE: the same launcher flags (--tp --cp --pp --dp
# --nnodes ...), the same train.py flags, logs, TensorBoard and checkpoints. A post-training stage
# usually starts from the previous stage's checkpoint with --load DIR --finetune (weights only:
# iteration 0, a fresh optimizer), or from a Hugging Face folder with --from-hf DIR. For dpo the
# frozen reference model is that starting point unless --ref-load DIR names another checkpoint.
# docs/post-training.md walks through SFT -> RM -> DPO (bash scripts/post_train_demo.sh) and SFT ->
# RM -> GRPO (bash scripts/rlhf_e2e.sh). There is no embedded default data here: --data-path is
# required (exit 2 without it).
set -euo pipefail
usage() { sed -n '2,17p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; }
case "${1:-}" in
  sft|rm|dpo|grpo|ppo) mode="$1"; shift ;;
  -h|--help) usage; exit 0 ;;
  *) echo "post_train.sh: the first argument must be the mode, sft, rm, dpo, grpo or ppo (got '${1:-}'); fix: bash scripts/post_train.sh dpo --data-path PREFIX ..." >&2; exit 2 ;;
esac
for a in "$@"; do
  case "$a" in -h|--help) exec bash "$(dirname "${BASH_SOURCE[0]}")/pretrain_gpt.sh" --help ;; esac
done
have_data=0
for a in "$@"; do case "$a" in --data-path|--data-path=*) have_data=1 ;; esac; done
if [ "$have_data" = 0 ]; then
  case "$mode" in sft) tool=data.sft ;; grpo|ppo) tool=data.prompts ;; *) tool=data.preference ;; esac
  what="python -m $tool --input FILE.jsonl --tokenizer-model TOK --output-prefix PREFIX"
  echo "post_train.sh $mode: --data-path is missing; fix: make the data with '$what' and give --data-path PREFIX --tokenizer-model TOK" >&2
  exit 2
fi
exec bash "$(dirname "${BASH_SOURCE[0]}")/pretrain_gpt.sh" --post-train "$mode" "$@"

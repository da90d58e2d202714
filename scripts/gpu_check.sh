#!/usr/bin/env bash
# GPU check, the one command to run on a machine with NVIDIA GPUs (about 9 minutes on one GPU):
#   bash scripts/gpu_check.sh [--dry-run] [--out DIR] [--only STEP,...] [--budget-s 540]
#
# Runs every step below under its own time budget, each one's output in its own log under
# --out (default runs/gpu_check-<UTC date-time>), copied to $OUT/<folder> when OUT is set, and
# summary.txt / summary.json (status pass/fail/timeout/skip, wall time, key numbers) rewritten
# after each step. A failing or overrunning step does not stop the others; the exit status is
# non-zero when any step failed. The runner is scripts/gpu_check.py; docs/performance.md, "GPU
# check", lists the files and the numbers. The steps, in order:
#   versions      torch / CUDA / cuDNN / NCCL / apex versions, the GPUs (scripts/gpu_probe.py)
#   peak          sustained bf16 matmul peak: the median of 20 timed 8192^3 products after warm-up
#   mfu-gpt2      a 1.3B GPT (24 x 2048, seq 2048) in bf16, 12 iterations, one profiled (trace
#   mfu-llama     kept): MFU against the measured and the data-sheet peak; GPT-2 and LLaMA-GQA blocks
#   cuda-tests    pytest -m cuda tests/
#   nccl-smoke    (2+ GPUs) the collectives over NCCL against their closed forms
#   layout-*      (2+ GPUs; tp2 pp2 dp2 with 8) tp/pp/dp/cp runs, losses against the same run on CPU
#   probes        which SDPA kernel CUDA picks per attention case, torch._grouped_mm against the
#                 per-expert loop in bf16, host syncs per training step (dense, MoE)
#   sweep         ZeRO 0-3, optimizer offload cpu / nvme, async save and resume across devices, MoE,
#                 recompute, fp16, bf16, torch.compile, DPO and reward-model post-training: GPU losses
#                 against CPU losses
#   fp8           bf16 against --fp8-format hybrid --fp8-recipe tensorwise, 30 steps of a small GPT on the
#                 stdlib's email package: tokens/s of each, pass when the FP8 loss is within 2 % of bf16's
#                 (scripts/bench/bench_fp8.py)
#   kernels       fused kernels (norms, Adam, attention) against their references
#   offload       ZeRO-2 bf16 with and without --offload-optimizer cpu (scripts/bench/bench_offload.py)
#
# --dry-run (or GPU_CHECK_DRY_RUN=1) prints the plan, each step's budget and command, and touches
# no GPU; --ngpu N (or GPU_CHECK_NGPU=N) stands for the machine's GPU count there. Tested on CPU
# in tests/launcher/test_gpu_check.py. A missing dependency on a machine without a network ends it
# with one line (scripts/env.sh), nothing installed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEGAZERO_ROOT"
export PYTHONPATH="$MEGAZERO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "${GPU_CHECK_DRY_RUN:-0}" = 1 ]; then set -- --dry-run "$@"; fi
if [ -n "${GPU_CHECK_NGPU:-}" ]; then set -- --ngpu "$GPU_CHECK_NGPU" "$@"; fi
exec "$PY" -m scripts.gpu_check "$@"

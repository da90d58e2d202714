#!/usr/bin/env bash
# GPU check, run on a machine with NVIDIA GPUs: bash scripts/gpu_check.sh
#
# 1. prints the torch / CUDA / cuDNN / NCCL / apex versions and the GPUs;
# 2. runs the CUDA-marked tests (pytest -m cuda tests/): kernel backends on the GPU, ...;
# 3. an NCCL smoke on 2 ranks through torchrun (all-reduce, reduce-scatter and all-gather through
#    megazero.collectives, checked against their closed-form results); on one GPU it is skipped
#    and said so ("NCCL: skipped, 1 GPU"): at world size 1 every collective returns at once;
# 4. a short training run on the GPU(s): scripts/pretrain_gpt.sh --dp N $GPU_CHECK_TRAIN_ARGS
#    (N = min(2, GPUs); default "--device cuda --mock-data --train-iters 5"; GPU_CHECK_TRAIN=0
#    skips it), saving a checkpoint, then the same run resumed from it to 7 iterations;
# 5. on two or more GPUs, the layouts a single GPU cannot show, 4 iterations each
#    (GPU_CHECK_LAYOUTS=0 skips them): pp 2 (the p2p handshake and 1F1B over NCCL), dp 2
#    with an evaluation every 2 iterations (the token counts all-reduced over dp), ZeRO-1 at
#    dp 2 with --overlap-param-gather on in bf16 with bf16 gradients, and tp 2 with sequence
#    parallelism (CUDA_DEVICE_MAX_CONNECTIONS=1 from the launcher);
# 6. optimizer offload on the GPU (ZeRO-Offload): python -m scripts.bench.bench_offload --device cuda at
#    ZeRO-1 and ZeRO-2, fp32 and bf16: device/host model-state bytes against the formulas, peak
#    device memory and step time with and without --offload-optimizer cpu; fails when the
#    losses differ by more than 1e-5 or offload does not lower the device bytes
#    (GPU_CHECK_OFFLOAD=0 skips it).
# 7. kernels (python -m scripts.bench.bench_kernels --dtype bf16): the bf16 matmul peak of GPU 0, measured
#    by a timed 8192^3 product, and each fused kernel (LayerNorm, RMSNorm, Adam, attention)
#    against its reference: times and speed-up (GPU_CHECK_KERNELS=0 skips it and step 8's
#    measured-peak MFU).
# 8. a 1.3B-parameter GPT (24 layers, hidden 2048, 16 heads, seq 2048, vocabulary 50257) in
#    bf16 with the fused kernels on one GPU, 6 iterations of 8 sequences, full recomputation
#    when the GPU has under 60 GiB; prints python -m scripts.bench.run_throughput's line: tokens/s and MFU
#    against step 7's measured peak and against the GPU's data-sheet peak
#    (megazero.planning.flops; GPU_CHECK_1B3=0 skips it; GPU_CHECK_1B3_ARGS adds flags).
# The last line names every part that did not run, and why. Output format of steps 7-8:
# docs/performance.md, "GPU check". Under 8 minutes on one GPU with GPU_CHECK_OFFLOAD=0.
# Exits non-zero at the first failing step; a missing dependency on a machine without a
# network ends it with one line (scripts/env.sh), nothing installed.
#
# GPU_CHECK_DRY_RUN=1 prints each step's command instead of running it and touches no GPU
# (GPU_CHECK_NGPU, GPU_CHECK_GIB and GPU_CHECK_GPU_NAME stand for the machine; tested on CPU in
# tests/launcher/test_gpu_check.py).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEGAZERO_ROOT"
export PYTHONPATH="$MEGAZERO_ROOT${PYTHONPATH:+:$PYTHONPATH}"

DRY="${GPU_CHECK_DRY_RUN:-0}"
run() {  # a step's command, or in a dry run its words
  if [ "$DRY" = 1 ]; then echo "+ $*"; else "$@"; fi
}
tmpd() {  # a new temporary folder (a dry run makes none)
  if [ "$DRY" = 1 ]; then echo "<tmp>"; else mktemp -d; fi
}
gpu() {  # one line about the GPUs from torch (a dry run: the stand-in value $2)
  if [ "$DRY" = 1 ]; then echo "$2"; else "$PY" -c "import torch; print($1)"; fi
}
SKIPPED=()

echo "== versions"
run "$PY" - <<'PY'
import torch
from megazero.ops.backend import apex_available, describe_backends
print("torch", torch.__version__, "| cuda", torch.version.cuda, "| cudnn", torch.backends.cudnn.version())
assert torch.cuda.is_available(), "no CUDA device visible: this script needs a GPU machine"
print("nccl", ".".join(map(str, torch.cuda.nccl.version())))
for i in range(torch.cuda.device_count()):
    print(f"gpu {i}:", torch.cuda.get_device_name(i))
try:
    import apex
    print("apex", getattr(apex, "__version__", "installed"), "| CUDA extensions:", apex_available())
except ImportError:
    print("apex not installed")
print(describe_backends(torch.device("cuda", 0)))
PY

echo "== pytest -m cuda"
run "$PY" -m pytest -q -m cuda tests/

GPUS=$(gpu "torch.cuda.device_count()" "${GPU_CHECK_NGPU:-1}")
NGPU=$(( GPUS < 2 ? GPUS : 2 ))
if [ "$NGPU" -ge 2 ]; then
  echo "== NCCL smoke on 2 ranks"
  SMOKE="$(tmpd)/nccl_smoke.py"
  [ "$DRY" = 1 ] || cat > "$SMOKE" <<'PY'
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megazero import collectives

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", local))
group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
assert world >= 2, f"an NCCL smoke needs 2 ranks, got {world}: every collective returns at once on one"
dev = torch.device("cuda", local)
t = torch.full((8,), float(rank + 1), device=dev)
collectives.all_reduce_sum(t, group)
assert torch.all(t == world * (world + 1) / 2), t
full = torch.arange(4 * world, dtype=torch.float32, device=dev) * (rank + 1)
shard = torch.empty(4, device=dev)
collectives.reduce_scatter_sum(shard, full, group)
expected = torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32, device=dev) * world * (world + 1) / 2
assert torch.equal(shard, expected), (shard, expected)
out = torch.empty(4 * world, device=dev)
collectives.all_gather_into(out, torch.full((4,), float(rank), device=dev), group)
assert torch.equal(out, torch.arange(world, device=dev).float().repeat_interleave(4)), out
torch.cuda.synchronize()
if rank == 0:
    print(f"NCCL smoke ok on {world} ranks")
dist.destroy_process_group()
PY
  run "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 "$SMOKE"
else
  echo "== NCCL: skipped, $GPUS GPU (at world size 1 every collective returns at once: nothing to test)"
  SKIPPED+=("NCCL smoke ($GPUS GPU)")
fi

if [ "${GPU_CHECK_TRAIN:-1}" != 0 ]; then
  TRAIN_ARGS="${GPU_CHECK_TRAIN_ARGS:---device cuda --mock-data --train-iters 5}"
  CKPT="$(tmpd)/ckpt"
  echo "== training smoke: --dp $NGPU $TRAIN_ARGS --save $CKPT"
  # shellcheck disable=SC2086  # the extra arguments are meant to split into words
  run bash scripts/pretrain_gpt.sh --dp "$NGPU" $TRAIN_ARGS --save "$CKPT" --load "$CKPT"
  # a resume on the GPU(s) through torch.distributed.checkpoint: two more iterations
  echo "== resume smoke: the same run continued to 7 iterations from $CKPT"
  if [ "$DRY" = 1 ]; then
    # shellcheck disable=SC2086
    run bash scripts/pretrain_gpt.sh --dp "$NGPU" $TRAIN_ARGS --save "$CKPT" --load "$CKPT" --train-iters 7
  else
    # shellcheck disable=SC2086
    bash scripts/pretrain_gpt.sh --dp "$NGPU" $TRAIN_ARGS --save "$CKPT" --load "$CKPT" --train-iters 7 \
      > "$CKPT.log" 2>&1 || { cat "$CKPT.log"; exit 1; }
    cat "$CKPT.log"
    grep -q "resumed from $CKPT at iteration 5" "$CKPT.log" || { echo "the resume did not start at iteration 5"; exit 1; }
  fi
else
  SKIPPED+=("training smoke (GPU_CHECK_TRAIN=0)")
fi

if [ "${GPU_CHECK_LAYOUTS:-1}" = 0 ]; then
  SKIPPED+=("multi-GPU layouts (GPU_CHECK_LAYOUTS=0)")
elif [ "$NGPU" -ge 2 ]; then
  # every layout also evaluates (forward-only schedule, token counts all-reduced over dp)
  LAYOUT_BASE=(--device cuda --mock-data --train-iters 4 --log-interval 1 --eval-interval 2 --eval-iters 1)
  layout() {  # NAME FLAGS...: 4 iterations on 2 GPUs and 2 evaluations; its log beside its run dir
    local name="$1" dir; shift
    dir="$(tmpd)/$name"
    echo "== layout $name: $*"
    if [ "$DRY" = 1 ]; then run bash scripts/pretrain_gpt.sh "${LAYOUT_BASE[@]}" "$@" --run-dir "$dir"; return; fi
    bash scripts/pretrain_gpt.sh "${LAYOUT_BASE[@]}" "$@" --run-dir "$dir" > "$dir.log" 2>&1 \
      || { tail -n 40 "$dir.log"; echo "layout $name failed (log: $dir.log)"; exit 1; }
    grep "^iteration 4/" "$dir.log" || { echo "layout $name logged no iteration 4 (log: $dir.log)"; exit 1; }
    grep "^validation at iteration 4 " "$dir.log" || { echo "layout $name did not evaluate (log: $dir.log)"; exit 1; }
  }
  layout pp2 --pp 2
  layout dp2-eval --dp 2 --eval-iters 2
  layout zero1-overlap-bf16 --dp 2 --zero-stage 1 --overlap-param-gather on --bf16 --grads-in-model-dtype
  layout tp2-sp --tp 2 --sequence-parallel
else
  echo "== multi-GPU layouts: skipped, $GPUS GPU (pp 2, dp 2 with evaluation, ZeRO-1 --overlap-param-gather, tp 2 need 2)"
  SKIPPED+=("multi-GPU layouts: pp 2, dp 2 with evaluation, ZeRO-1 --overlap-param-gather, tp 2 ($GPUS GPU)")
fi

if [ "${GPU_CHECK_OFFLOAD:-1}" != 0 ]; then
  for STAGE in 1 2; do
    for DTYPE in "" "--bf16"; do
      echo "== offload: ZeRO-$STAGE ${DTYPE:-fp32}, with and without --offload-optimizer cpu"
      # shellcheck disable=SC2086  # an empty DTYPE adds no word
      run "$PY" -m scripts.bench.bench_offload --device cuda --stage "$STAGE" --steps 6 $DTYPE
    done
  done
else
  SKIPPED+=("optimizer offload (GPU_CHECK_OFFLOAD=0)")
fi
PEAK=""
if [ "${GPU_CHECK_KERNELS:-1}" != 0 ]; then
  echo "== kernels: bf16 matmul peak and each fused kernel against its reference"
  if [ "$DRY" = 1 ]; then
    run "$PY" -m scripts.bench.bench_kernels --device cuda --dtype bf16
    PEAK="<measured>"
  else
    KERNELS="$(mktemp)"
    "$PY" -m scripts.bench.bench_kernels --device cuda --dtype bf16 | tee "$KERNELS"
    PEAK=$(sed -n 's/^matmul peak bf16: .*, \([0-9.]*\) TFLOP\/s$/\1/p' "$KERNELS")
  fi
else
  SKIPPED+=("kernels and the measured matmul peak (GPU_CHECK_KERNELS=0)")
fi
if [ "${GPU_CHECK_1B3:-1}" != 0 ]; then
  RECOMPUTE=()
  GIB=$(gpu "torch.cuda.get_device_properties(0).total_memory >> 30" "${GPU_CHECK_GIB:-80}")
  NAME=$(gpu "torch.cuda.get_device_name(0)" "${GPU_CHECK_GPU_NAME:-NVIDIA H100 80GB HBM3}")
  [ "$GIB" -ge 60 ] || RECOMPUTE=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
  RUN="$(tmpd)/gpt1b3"
  echo "== GPT 1.3B bf16 on one GPU ($NAME, $GIB GiB${RECOMPUTE[*]:+, ${RECOMPUTE[*]}}), peak ${PEAK:-unknown} TFLOP/s: $RUN"
  GPT1B3=(bash scripts/pretrain_gpt.sh --run-dir "$RUN" --device cuda --mock-data --bf16 --kernels auto
          --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048
          --vocab-size 50257 --micro-batch-size 4 --global-batch-size 8 --train-iters 6
          --log-interval 1 --lr 1e-4 --min-lr 1e-5 ${PEAK:+--peak-tflops "$PEAK"} "${RECOMPUTE[@]}")
  # shellcheck disable=SC2206  # the extra arguments are meant to split into words
  GPT1B3+=(${GPU_CHECK_1B3_ARGS:-})
  THROUGHPUT=("$PY" -m scripts.bench.run_throughput "$RUN" --skip 2 --gpu-name "$NAME" --dtype bf16
              ${PEAK:+--measured-peak-tflops "$PEAK"})
  if [ "$DRY" = 1 ]; then
    run "${GPT1B3[@]}"
    run "${THROUGHPUT[@]}"
  else
    "${GPT1B3[@]}" > "$RUN.log" 2>&1 || { tail -n 40 "$RUN.log"; exit 1; }
    grep -E -A1 "rank +Psi" "$RUN.log" || true   # Psi: the parameters of the rank
    grep "^iteration" "$RUN.log" || true
    "${THROUGHPUT[@]}"
  fi
else
  SKIPPED+=("GPT 1.3B throughput (GPU_CHECK_1B3=0)")
fi
if [ "${#SKIPPED[@]}" -gt 0 ]; then
  NOT_TESTED=$(printf '%s; ' "${SKIPPED[@]}")
  echo "== not tested: ${NOT_TESTED%; }"
fi
if [ "$DRY" = 1 ]; then echo "== gpu_check dry run: nothing ran"; else echo "== gpu_check passed"; fi

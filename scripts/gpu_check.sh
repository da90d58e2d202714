#!/usr/bin/env bash
# GPU check, run on a machine with NVIDIA GPUs: bash scripts/gpu_check.sh
#
# 1. prints the torch / CUDA / cuDNN / NCCL / apex versions and the GPUs;
# 2. runs the CUDA-marked tests (pytest -m cuda tests/): kernel backends on the GPU, ...;
# 3. an NCCL smoke on min(2, #GPUs) ranks through torchrun: all-reduce, reduce-scatter and
#    all-gather through megazero.collectives, checked against their closed-form results;
# 4. a short training run on the GPU(s): scripts/pretrain_gpt.sh --dp N $GPU_CHECK_TRAIN_ARGS
#    (default "--device cuda --mock-data --train-iters 5"; GPU_CHECK_TRAIN=0 skips it), saving a
#    checkpoint, then the same run resumed from it to 7 iterations.
# 5. optimizer offload on the GPU (ZeRO-Offload): scripts/bench_offload.py --device cuda at
#    ZeRO-1 and ZeRO-2, fp32 and bf16: device/host model-state bytes against the formulas, peak
#    device memory and step time with and without --offload-optimizer cpu; fails when the
#    losses differ by more than 1e-5 or offload does not lower the device bytes
#    (GPU_CHECK_OFFLOAD=0 skips it).
# 6. kernels (scripts/bench_kernels.py --dtype bf16): the bf16 matmul peak of GPU 0, measured
#    by a timed 8192^3 product, and each fused kernel (LayerNorm, RMSNorm, Adam, attention)
#    against its reference: times and speed-up (GPU_CHECK_KERNELS=0 skips it and step 7's MFU).
# 7. a 1.3B-parameter GPT (24 layers, hidden 2048, 16 heads, seq 2048, vocabulary 50257) in
#    bf16 with the fused kernels on one GPU, 6 iterations of 8 sequences, full recomputation
#    when the GPU has under 60 GiB; prints scripts/run_throughput.py's line: tokens/s and MFU
#    against step 6's measured peak (GPU_CHECK_1B3=0 skips it; GPU_CHECK_1B3_ARGS adds flags).
# Output format of steps 6-7: docs/performance.md, "GPU check". Under 8 minutes on one GPU
# with GPU_CHECK_OFFLOAD=0. Exits non-zero at the first failing step.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
cd "$MEGAZERO_ROOT"

echo "== versions"
"$PY" - <<'PY'
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
"$PY" -m pytest -q -m cuda tests/

NGPU=$("$PY" -c "import torch; print(min(2, torch.cuda.device_count()))")
echo "== NCCL smoke on $NGPU rank(s)"
SMOKE="$(mktemp -d)/nccl_smoke.py"
cat > "$SMOKE" <<'PY'
import os
from datetime import timedelta

import torch
import torch.distributed as dist

from megazero import collectives

local = int(os.environ["LOCAL_RANK"])
torch.cuda.set_device(local)
dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=torch.device("cuda", local))
group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
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
    print(f"NCCL smoke ok on {world} rank(s)")
dist.destroy_process_group()
PY
PYTHONPATH="$MEGAZERO_ROOT${PYTHONPATH:+:$PYTHONPATH}" \
  "$PY" -m torch.distributed.run --standalone --nproc_per_node="$NGPU" "$SMOKE"

if [ "${GPU_CHECK_TRAIN:-1}" != 0 ]; then
  TRAIN_ARGS="${GPU_CHECK_TRAIN_ARGS:---device cuda --mock-data --train-iters 5}"
  CKPT="$(mktemp -d)/ckpt"
  echo "== training smoke: --dp $NGPU $TRAIN_ARGS --save $CKPT"
  # shellcheck disable=SC2086  # the extra arguments are meant to split into words
  bash scripts/pretrain_gpt.sh --dp "$NGPU" $TRAIN_ARGS --save "$CKPT" --load "$CKPT"
  # a resume on the GPU(s) through torch.distributed.checkpoint over NCCL: two more iterations
  echo "== resume smoke: the same run continued to 7 iterations from $CKPT"
  # shellcheck disable=SC2086
  bash scripts/pretrain_gpt.sh --dp "$NGPU" $TRAIN_ARGS --save "$CKPT" --load "$CKPT" --train-iters 7 \
    > "$CKPT.log" 2>&1 || { cat "$CKPT.log"; exit 1; }
  cat "$CKPT.log"
  grep -q "resumed from $CKPT at iteration 5" "$CKPT.log" || { echo "the resume did not start at iteration 5"; exit 1; }
fi
if [ "${GPU_CHECK_OFFLOAD:-1}" != 0 ]; then
  for STAGE in 1 2; do
    for DTYPE in "" "--bf16"; do
      echo "== offload: ZeRO-$STAGE ${DTYPE:-fp32}, with and without --offload-optimizer cpu"
      # shellcheck disable=SC2086  # an empty DTYPE adds no word
      PYTHONPATH="$MEGAZERO_ROOT${PYTHONPATH:+:$PYTHONPATH}" \
        "$PY" scripts/bench_offload.py --device cuda --stage "$STAGE" --steps 6 $DTYPE
    done
  done
fi
PEAK=""
if [ "${GPU_CHECK_KERNELS:-1}" != 0 ]; then
  echo "== kernels: bf16 matmul peak and each fused kernel against its reference"
  KERNELS="$(mktemp)"
  PYTHONPATH="$MEGAZERO_ROOT${PYTHONPATH:+:$PYTHONPATH}" \
    "$PY" scripts/bench_kernels.py --device cuda --dtype bf16 | tee "$KERNELS"
  PEAK=$(sed -n 's/^matmul peak bf16: .*, \([0-9.]*\) TFLOP\/s$/\1/p' "$KERNELS")
fi
if [ "${GPU_CHECK_1B3:-1}" != 0 ]; then
  RECOMPUTE=()
  GIB=$("$PY" -c "import torch; print(torch.cuda.get_device_properties(0).total_memory >> 30)")
  [ "$GIB" -ge 60 ] || RECOMPUTE=(--recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
  RUN="$(mktemp -d)/gpt1b3"
  echo "== GPT 1.3B bf16 on one GPU ($GIB GiB${RECOMPUTE[*]:+, ${RECOMPUTE[*]}}), peak ${PEAK:-unknown} TFLOP/s: $RUN"
  # shellcheck disable=SC2086  # the extra arguments are meant to split into words
  bash scripts/pretrain_gpt.sh --run-dir "$RUN" --device cuda --mock-data --bf16 --kernels auto \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
    --vocab-size 50257 --micro-batch-size 4 --global-batch-size 8 --train-iters 6 \
    --log-interval 1 --lr 1e-4 --min-lr 1e-5 ${PEAK:+--peak-tflops "$PEAK"} "${RECOMPUTE[@]}" \
    ${GPU_CHECK_1B3_ARGS:-} > "$RUN.log" 2>&1 || { tail -n 40 "$RUN.log"; exit 1; }
  grep -E -A1 "rank +Psi" "$RUN.log" || true   # Psi: the parameters of the rank
  grep "^iteration" "$RUN.log" || true
  PYTHONPATH="$MEGAZERO_ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" scripts/run_throughput.py "$RUN" --skip 2
fi
echo "== gpu_check passed"

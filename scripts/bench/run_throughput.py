"""Median throughput of a finished training run, from its ``RUN_DIR/metrics.jsonl``.

Reads the ``kind: "train"`` records the monitor writes (``megazero/runtime/monitor.py``: one per
logged iteration), drops the first ``--skip`` logged iterations (warm-up: allocator, kernel
selection) and prints the medians of the rest in one line::

    throughput: iterations 3-6 of 6 (median): 412.3 ms/iteration, 39741.0 tokens/s, 312.4 TFLOP/s/device, MFU 41.21%

MFU is ``n/a`` when the run knew no peak (``--peak-tflops``). ``--measured-peak-tflops`` (a
timed matmul, scripts/bench/bench_kernels.py) and ``--gpu-name`` with ``--dtype`` (the data-sheet
peak of ``megazero.planning.flops.peak_flops_for_name``) add the median TFLOP/s/device as a
fraction of each, so one line shows how far the run is from what the GPU does and from what
its maker says it does::

    ..., 406.4 TFLOP/s/device, MFU 52.10%; MFU 52.10% of the measured matmul peak (780.0 TFLOP/s),
    41.09% of the data-sheet peak (989.0 TFLOP/s, NVIDIA H100 80GB HBM3 bf16)

Exits 2 with one line when the file is missing or holds no iteration after the skipped ones.

    python -m scripts.bench.run_throughput RUN_DIR --skip 2 [--measured-peak-tflops T] [--gpu-name NAME --dtype bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Optional


def summarize(records: list[dict], skip: int) -> str:
    """The report line of the module docstring from the monitor's records (any kinds).

    Raises ValueError when no ``train`` record is left after skipping ``skip`` of them."""
    train = [r for r in records if r.get("kind") == "train"]
    kept = train[skip:]
    if not kept:
        raise ValueError(
            f"{len(train)} logged training iterations, none left after --skip {skip}: train longer or lower --skip"
        )
    med = {k: statistics.median(r[k] for r in kept) for k in ("iteration_time_s", "tokens_per_s", "tflops_per_device")}
    mfus = [r["mfu"] for r in kept if r.get("mfu") is not None]
    mfu = f"{100 * statistics.median(mfus):.2f}%" if mfus else "n/a"
    return (
        f"throughput: iterations {kept[0]['iteration']}-{kept[-1]['iteration']} of "
        f"{train[-1]['iteration']} (median): {1e3 * med['iteration_time_s']:.1f} ms/iteration, "
        f"{med['tokens_per_s']:.1f} tokens/s, {med['tflops_per_device']:.1f} TFLOP/s/device, MFU {mfu}"
    )


def mfu_both_ways(
    line: str, tflops_per_device: float, measured_tflops: Optional[float], gpu_name: Optional[str], dtype: str
) -> str:
    """``line`` with the MFU against the measured matmul peak and the data-sheet peak of
    ``gpu_name`` at ``dtype`` (``bf16``, ``fp16``, ``fp32``) appended; a peak not given or
    not in the table is said to be unknown. TFLOP/s arguments are per device."""
    parts = []
    if measured_tflops:
        parts.append(
            f"MFU {100 * tflops_per_device / measured_tflops:.2f}% of the measured matmul peak "
            f"({measured_tflops:.1f} TFLOP/s)"
        )
    if gpu_name:
        import torch

        from megazero.planning.flops import peak_flops_for_name

        peak = peak_flops_for_name(
            gpu_name, {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        )
        parts.append(
            f"{100 * tflops_per_device / (peak / 1e12):.2f}% of the data-sheet peak ({peak / 1e12:.1f} "
            f"TFLOP/s, {gpu_name} {dtype})"
            if peak
            else f"no data-sheet peak for {gpu_name} {dtype}"
        )
    return f"{line}; {', '.join(parts)}" if parts else line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--skip", type=int, default=2, help="first logged iterations left out (warm-up)")
    ap.add_argument("--measured-peak-tflops", type=float, help="measured matmul peak of one GPU, TFLOP/s")
    ap.add_argument("--gpu-name", help="torch.cuda.get_device_name(), for the data-sheet peak")
    ap.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="the run's matmul dtype")
    args = ap.parse_args(argv)
    path = os.path.join(args.run_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            records = [json.loads(line) for line in f if line.strip()]
        line = summarize(records, args.skip)
        kept = [r for r in records if r.get("kind") == "train"][args.skip :]
        tflops = statistics.median(r["tflops_per_device"] for r in kept)
        print(mfu_both_ways(line, tflops, args.measured_peak_tflops, args.gpu_name, args.dtype))
    except (OSError, ValueError) as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Median throughput of a finished training run, from its ``RUN_DIR/metrics.jsonl``.

Reads the ``kind: "train"`` records the monitor writes (``megazero/runtime/monitor.py``: one per
logged iteration), drops the first ``--skip`` logged iterations (warm-up: allocator, kernel
selection) and prints the medians of the rest in one line::

    throughput: iterations 3-6 of 6 (median): 412.3 ms/iteration, 39741.0 tokens/s, 312.4 TFLOP/s/device, MFU 41.21%

MFU is ``n/a`` when the run knew no peak (``--peak-tflops``). Exits 2 with one line when the
file is missing or holds no iteration after the skipped ones.

    python scripts/run_throughput.py RUN_DIR --skip 2
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def summarize(records: list[dict], skip: int) -> str:
    """The report line of the module docstring from the monitor's records (any kinds).

    Raises ValueError when no ``train`` record is left after skipping ``skip`` of them."""
    train = [r for r in records if r.get("kind") == "train"]
    kept = train[skip:]
    if not kept:
        raise ValueError(f"{len(train)} logged training iterations, none left after --skip {skip}: "
                         "train longer or lower --skip")
    med = {k: statistics.median(r[k] for r in kept)
           for k in ("iteration_time_s", "tokens_per_s", "tflops_per_device")}
    mfus = [r["mfu"] for r in kept if r.get("mfu") is not None]
    mfu = f"{100 * statistics.median(mfus):.2f}%" if mfus else "n/a"
    return (f"throughput: iterations {kept[0]['iteration']}-{kept[-1]['iteration']} of "
            f"{train[-1]['iteration']} (median): {1e3 * med['iteration_time_s']:.1f} ms/iteration, "
            f"{med['tokens_per_s']:.1f} tokens/s, {med['tflops_per_device']:.1f} TFLOP/s/device, MFU {mfu}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--skip", type=int, default=2, help="first logged iterations left out (warm-up)")
    args = ap.parse_args(argv)
    path = os.path.join(args.run_dir, "metrics.jsonl")
    try:
        with open(path, encoding="utf-8") as f:
            print(summarize([json.loads(line) for line in f if line.strip()], args.skip))
    except (OSError, ValueError) as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

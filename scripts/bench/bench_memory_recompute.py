"""Activation memory with and without recomputation, and the planner against measurement.

Two Markdown tables (docs/performance.md, "Activation memory and the planner"):

1. a GPT at sequence length 1024 with hidden and attention dropout 0.1, trained on one CPU
   rank with no / selective / full recomputation: measured peak memory beside the planner's
   prediction (megazero/planning/activations.py);
2. predicted and measured peak memory of every rank for CPU layouts (tp, pp, dp, ZeRO stage,
   schedule, sequence parallelism, recomputation), with the error of the worst rank
   (target: within 10 %).

Peak memory per rank is measured as in ``python -m scripts.plan --measure`` (resident memory the
run adds over its baseline, glibc's mmap threshold fixed).

    python -m scripts.bench.bench_memory_recompute [--steps 3] [--only recompute|layouts] [--match "pp2 1F1B" "pp2 ZB"]
"""

from __future__ import annotations

import argparse

from scripts import plan

MiB = 2**20
MODEL = [
    "--mock-data",
    "--vocab-size",
    "1001",
    "--make-vocab-size-divisible-by",
    "8",
    "--num-layers",
    "4",
    "--hidden-size",
    "256",
    "--num-attention-heads",
    "4",
    "--seq-length",
    "1024",
    "--micro-batch-size",
    "2",
    "--eval-iters",
    "0",
    "--train-iters",
    "3",
    "--lr",
    "1e-3",
]
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
RECOMPUTE = {
    "none": [],
    "selective": ["--recompute-granularity", "selective"],
    "full (uniform, 1 layer)": ["--recompute-granularity", "full", "--recompute-method", "uniform"],
}
LAYOUTS = {  # name: (world, flags)
    "tp1 pp1 dp1, ZeRO-0": (1, ["--global-batch-size", "2"]),
    "tp2": (2, ["--tp", "2", "--global-batch-size", "2"]),
    "tp2 + sequence parallel, dropout": (2, ["--tp", "2", "--sequence-parallel", "--global-batch-size", "2"] + DROPOUT),
    "pp2 1F1B, 4 micro-batches": (2, ["--pp", "2", "--global-batch-size", "8"]),
    "pp2 GPipe, 4 micro-batches": (2, ["--pp", "2", "--pipeline-schedule", "gpipe", "--global-batch-size", "8"]),
    "pp2 interleaved (vp 2), 4 micro-batches": (
        2,
        ["--pp", "2", "--virtual-pipeline-size", "2", "--global-batch-size", "8"],
    ),
    "pp2 ZB-H1, 4 micro-batches": (2, ["--pp", "2", "--pipeline-schedule", "zb-h1", "--global-batch-size", "8"]),
    "pp2 1F1B untied, 4 micro-batches": (
        2,
        ["--pp", "2", "--global-batch-size", "8", "--untie-embeddings-and-output-weights"],
    ),
    "pp2 ZB-V untied, 4 micro-batches": (
        2,
        [
            "--pp",
            "2",
            "--pipeline-schedule",
            "zb-v",
            "--global-batch-size",
            "8",
            "--untie-embeddings-and-output-weights",
        ],
    ),
    "pp4 1F1B, 8 micro-batches": (4, ["--pp", "4", "--global-batch-size", "16"]),
    "pp4 ZB-H1, 8 micro-batches": (4, ["--pp", "4", "--pipeline-schedule", "zb-h1", "--global-batch-size", "16"]),
    # GPT-2's dropout and four (two) layers per stage: the same comparison where the head is a
    # smaller share of the last stage and B keeps the dropout masks W does not need
    "pp2 1F1B, 8 layers, dropout": (2, ["--pp", "2", "--global-batch-size", "8", "--num-layers", "8"] + DROPOUT),
    "pp2 ZB-H1, 8 layers, dropout": (
        2,
        ["--pp", "2", "--pipeline-schedule", "zb-h1", "--global-batch-size", "8", "--num-layers", "8"] + DROPOUT,
    ),
    "pp4 1F1B, 8 layers, dropout": (4, ["--pp", "4", "--global-batch-size", "16", "--num-layers", "8"] + DROPOUT),
    "pp4 ZB-H1, 8 layers, dropout": (
        4,
        ["--pp", "4", "--pipeline-schedule", "zb-h1", "--global-batch-size", "16", "--num-layers", "8"] + DROPOUT,
    ),
    "dp2 ZeRO-1": (2, ["--dp", "2", "--zero-stage", "1", "--global-batch-size", "4"]),
    "dp2 ZeRO-2": (2, ["--dp", "2", "--zero-stage", "2", "--global-batch-size", "4"]),
    "tp2 pp2 dp2 SP ZeRO-1, full recompute, dropout": (
        8,
        [
            "--tp",
            "2",
            "--pp",
            "2",
            "--dp",
            "2",
            "--sequence-parallel",
            "--zero-stage",
            "1",
            "--global-batch-size",
            "8",
            "--recompute-granularity",
            "full",
            "--recompute-method",
            "uniform",
        ]
        + DROPOUT,
    ),
    "tp2 pp2 1F1B, selective, dropout": (
        4,
        ["--tp", "2", "--pp", "2", "--global-batch-size", "8", "--recompute-granularity", "selective"] + DROPOUT,
    ),
}


def recompute_table(steps: int) -> str:
    rows = ["| recomputation | predicted peak MiB | measured peak MiB | error |", "|---|---|---|---|"]
    for name, flags in RECOMPUTE.items():
        ((_, want, got),) = plan.measure(MODEL + DROPOUT + ["--global-batch-size", "2"] + flags, 1, steps)
        rows.append(f"| {name} | {want / MiB:.1f} | {got / MiB:.1f} | {(want - got) / got:+.1%} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def layouts_table(steps: int, match: tuple = ("",)) -> str:
    rows = [
        "| layout | ranks | predicted peak MiB per rank | measured peak MiB per rank | worst error |",
        "|---|---|---|---|---|",
    ]
    for name, (world, flags) in LAYOUTS.items():
        if not any(m in name for m in match):
            continue
        res = plan.measure(MODEL + flags, world, steps)
        worst = max((abs(want - got) / got, (want - got) / got) for _, want, got in res)[1]
        wants = " / ".join(f"{w / MiB:.0f}" for _, w, _ in res)
        gots = " / ".join(f"{g / MiB:.0f}" for _, _, g in res)
        rows.append(f"| {name} | {world} | {wants} | {gots} | {worst:+.1%} |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--only", choices=("recompute", "layouts"), default=None)
    ap.add_argument("--match", nargs="+", default=[""], help="only the layouts whose name contains one of these")
    args = ap.parse_args()
    if args.only != "layouts":
        print(recompute_table(args.steps) + "\n")
    if args.only != "recompute":
        print(layouts_table(args.steps, args.match))


if __name__ == "__main__":
    plan.ensure_mmap_threshold()
    main()

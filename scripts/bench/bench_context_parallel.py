"""Context parallelism on CPU gloo ranks: peak memory per rank beside the planner, and the step
time of ring (p2p) against all-to-all (a2a) attention.

A small GPT-2-style model (2 layers, hidden 64, 4 heads, micro-batch 1, vocabulary 1001, fp32,
no dropout) trains through ``training.Trainer`` on ``cp`` gloo ranks (world = cp, one torch thread
each) at sequence lengths 2048, 4096 and 8192 and cp 1, 2, 4. Two Markdown tables:

1. memory: each rank's peak as ``python -m scripts.plan --measure`` measures it (resident memory the run
   adds over its baseline, ``VmHWM`` reset through ``/proc/self/clear_refs``, glibc's
   ``MALLOC_MMAP_THRESHOLD_=65536`` so freed tensors leave the resident set; 2 steps), beside
   the planner's activations, its cp attention line (K/V buffers, ring block scores) and its
   peak (``megazero.planning.plan.plan_stages``), the difference in MiB and relative to the
   measured peak, for the rank farthest from the plan;
2. step time: one set of ranks per (T, cp) builds a p2p and an a2a Trainer on the same process
   groups and alternates their steps in rounds (p2p first in even rounds, a2a first in odd
   ones) after one warm-up step each; a step is timed on rank 0 from a barrier to a barrier
   (so it waits for the slowest rank). Medians and (min-max) over the rounds.

This is a CPU with gloo, shared: at cp 4 four ranks share the cores, the ring's blocks are
einsum matmuls in fp32 and the all-to-all's attention is torch's fused CPU kernel, so step
times say nothing about a GPU. The memory counts are what the planner is checked against.

    python -m scripts.bench.bench_context_parallel [--seq 2048 4096 8192] [--cp 1 2 4] [--rounds 5]
        [--only memory|time]

About 8 minutes on the 2-core development machine (12 under another process's load), most of
it the ring's steps at T 8192; the memory table alone takes under 2.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from scripts import plan

MiB = 2**20
COMMS = ("p2p", "a2a")


def model_argv(seq: int) -> list[str]:
    """train.py flags of the benchmark's GPT at sequence length ``seq`` (one sequence a step)."""
    return [
        "--mock-data",
        "--vocab-size",
        "1001",
        "--make-vocab-size-divisible-by",
        "8",
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
        "--num-attention-heads",
        "4",
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--micro-batch-size",
        "1",
        "--global-batch-size",
        "1",
        "--eval-iters",
        "0",
        "--train-iters",
        "100",
        "--lr",
        "1e-3",
        "--device",
        "cpu",
    ]


def layout_argv(seq: int, cp: int, comm: str) -> list[str]:
    return model_argv(seq) + (["--cp", str(cp), "--cp-comm-type", comm] if cp > 1 else [])


def memory_row(seq: int, cp: int, comm: str, steps: int) -> str:
    """One Markdown row: the planner's numbers and the measured peak (min-max over ranks)."""
    from megazero.config import config_from_argv
    from megazero.planning.plan import plan_stages
    from model.build import build_gpt_config

    argv = layout_argv(seq, cp, comm)
    cfg = config_from_argv(argv, cp, print_warnings=False)
    (e,) = plan_stages(cfg, build_gpt_config(cfg, plan.vocab_of(cfg)))
    measured = [got for _, _, got in plan.measure(argv, cp, steps)]
    worst = max(measured, key=lambda got: abs(e.total_bytes - got))
    spread = f"{min(measured) / MiB:.1f}" + (f"-{max(measured) / MiB:.1f}" if cp > 1 else "")
    kv, blocks = e.cp_attention
    return (
        f"| {seq} | {cp} | {comm if cp > 1 else '-'} | {e.activation_bytes / MiB:.1f} | "
        f"{kv / MiB:.1f} / {blocks / MiB:.1f} | {e.total_bytes / MiB:.1f} | {spread} | "
        f"{(worst - e.total_bytes) / MiB:+.1f} | {(e.total_bytes - worst) / worst:+.1%} |"
    )


def memory_table(seqs, cps, steps: int) -> str:
    rows = [
        "| T | cp | comm | planned activations MiB | planned cp K/V buffers / ring blocks MiB | "
        "planned peak MiB | measured peak MiB (ranks) | measured - planned MiB | error (worst rank) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for seq in seqs:
        for cp in cps:
            for comm in COMMS if cp > 1 else COMMS[:1]:
                rows.append(memory_row(seq, cp, comm, steps))
                print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def step_times(rank: int, world: int, seq: int, rounds: int) -> dict:
    """On every rank of a cp = ``world`` layout: a p2p and an a2a Trainer on the same groups,
    one warm-up step each, then ``rounds`` rounds of one step each in alternating order.
    Returns rank 0's step seconds per comm type (barrier to barrier), other ranks ``{}``."""
    import torch.distributed as dist

    from megazero import training
    from megazero.config import config_from_argv
    from megazero.process_groups import ProcessGroups
    from megazero.topology import Topology
    from megazero.training import build_trainer

    cfgs = {c: config_from_argv(layout_argv(seq, world, c), world, print_warnings=False) for c in COMMS}
    groups = ProcessGroups.build(Topology(tp=1, pp=1, dp=1, cp=world))
    data = training.build_data(cfgs["p2p"])
    trainers = {c: build_trainer(cfg, data=data, groups=groups) for c, cfg in cfgs.items()}
    times = {c: [] for c in COMMS}
    for r in range(rounds + 1):
        for c in COMMS if r % 2 == 0 else COMMS[::-1]:
            t = trainers[c]
            batches = training.dp_micro_batches(data.train, t.state.consumed_samples, cfgs[c], groups, "cpu")
            dist.barrier()
            t0 = time.perf_counter()
            t.train_step(batches)
            dist.barrier()
            if r > 0:
                times[c].append(time.perf_counter() - t0)
    for t in trainers.values():
        t.close()
    return times if rank == 0 else {}


def _fmt(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def time_table(seqs, cps, rounds: int) -> str:
    from tests.support.distributed import run_distributed

    rows = [
        "| T | cp | p2p step s, median (min-max) | a2a step s, median (min-max) | a2a / p2p |",
        "|---|---|---|---|---|",
    ]
    for seq in seqs:
        for cp in (c for c in cps if c > 1):
            times = run_distributed(step_times, cp, seq, rounds, timeout_s=3600, collective_timeout_s=1800)[0]
            ratio = statistics.median(times["a2a"]) / statistics.median(times["p2p"])
            rows.append(f"| {seq} | {cp} | {_fmt(times['p2p'])} | {_fmt(times['a2a'])} | {ratio:.2f} |")
            print(rows[-1], file=sys.stderr, flush=True)
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, nargs="+", default=[2048, 4096, 8192], help="sequence lengths (tokens)")
    ap.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4], help="context-parallel sizes (= ranks)")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds (one p2p and one a2a step each)")
    ap.add_argument("--steps", type=int, default=2, help="training steps of each memory run")
    ap.add_argument("--only", choices=("memory", "time"), default=None)
    a = ap.parse_args()
    if a.only != "time":
        print(memory_table(a.seq, a.cp, a.steps) + "\n", flush=True)
    if a.only != "memory":
        print(time_table(a.seq, a.cp, a.rounds), flush=True)


if __name__ == "__main__":
    plan.ensure_mmap_threshold()
    main()

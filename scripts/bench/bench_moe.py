"""A Mixture-of-Experts training step against the dense step with the same active parameters.

Two ``training.Trainer`` runs at tp = pp = dp = 1 (one process): a dense GPT with MLP width
``k x F_e`` and an MoE GPT whose every MLP has ``E`` experts of width ``F_e`` routed top-k (no
shared expert, aux loss 1e-2), so both have the same active matmul parameters per token. The
steps alternate (machine noise hits both alike) and the script prints the median step time of
each, their ratio, and the same for the MLP layer alone (``MLP`` against ``MoEMLP``, forward
plus backward on one micro-batch), and the process's peak memory (``ru_maxrss``) after each of
the first steps. ``--profile`` prints torch.profiler's table of the MoE step's top operators.

    python -m scripts.bench.bench_moe [--steps 10] [--hidden-size 256] [--num-experts 8] ...
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch

from data.samplers import get_micro_batches
from megazero.training import build_trainer
from model.gpt import MLP, MoEMLP


def _trainer(base: list[str], extra: list[str]):
    trainer = build_trainer(base + extra, 1)
    return trainer, trainer.data.train, trainer.cfg


def _layer_time(layer, x: torch.Tensor, reps: int, clock) -> float:
    """Median seconds of ``layer(x)`` forward + backward (training mode)."""
    times = []
    for _ in range(reps):
        t0 = clock()
        layer(x).square().mean().backward()
        times.append(clock() - t0)
    return statistics.median(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--global-batch-size", type=int, default=8)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--num-experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (steadier on a shared machine)",
    )
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of one MoE step")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    steps = a.steps + a.warmup
    base = [
        "--mock-data",
        "--vocab-size",
        str(a.vocab_size),
        "--hidden-size",
        str(a.hidden_size),
        "--num-layers",
        str(a.num_layers),
        "--num-attention-heads",
        "4",
        "--seq-length",
        str(a.seq_length),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--global-batch-size",
        str(a.global_batch_size),
        "--train-iters",
        str(steps),
        "--lr",
        "1e-4",
        "--min-lr",
        "1e-5",
        "--eval-iters",
        "0",
        "--device",
        "cpu",
        "--hidden-dropout",
        "0",
        "--attention-dropout",
        "0",
    ]
    runs = {
        "dense": _trainer(base, ["--ffn-hidden-size", str(a.topk * a.expert_ffn)]),
        "moe": _trainer(
            base,
            [
                "--num-experts",
                str(a.num_experts),
                "--moe-router-topk",
                str(a.topk),
                "--moe-ffn-hidden-size",
                str(a.expert_ffn),
                "--moe-aux-loss-coeff",
                "1e-2",
            ],
        ),
    }
    times, peaks = {k: [] for k in runs}, []
    clock = time.perf_counter if a.clock == "wall" else time.process_time
    for step in range(steps):
        for name, (trainer, ds, cfg) in runs.items():
            gbs = cfg.train.global_batch_size
            batches = get_micro_batches(ds, step * gbs, gbs, cfg.train.micro_batch_size, 0, 1)
            t0 = clock()
            trainer.train_step(batches)
            if step >= a.warmup:
                times[name].append(clock() - t0)
        peaks.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)  # KiB -> GiB
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"hidden {a.hidden_size}, {a.num_layers} layers, seq {a.seq_length}, micro-batch {a.micro_batch_size}, "
        f"global batch {a.global_batch_size}; {a.num_experts} experts of {a.expert_ffn} top-{a.topk} against a "
        f"dense MLP of {a.topk * a.expert_ffn}; torch threads {torch.get_num_threads()}; {a.clock} clock"
    )
    print(
        f"median step  dense: {med['dense'] * 1e3:.1f} ms  moe: {med['moe'] * 1e3:.1f} ms  "
        f"ratio {med['moe'] / med['dense']:.2f}"
    )
    print("peak RSS after each step (GiB, both runs): " + " ".join(f"{p:.3f}" for p in peaks))
    dense_mlp = next(m for m in runs["dense"][0].chunks[0].modules() if isinstance(m, MLP))
    moe_mlp = next(m for m in runs["moe"][0].chunks[0].modules() if isinstance(m, MoEMLP))
    x = torch.randn(a.micro_batch_size, a.seq_length, a.hidden_size, requires_grad=True)
    td, tm = _layer_time(dense_mlp, x, 20, clock), _layer_time(moe_mlp, x, 20, clock)
    print(f"MLP layer alone (fwd + bwd)  dense: {td * 1e3:.2f} ms  moe: {tm * 1e3:.2f} ms  ratio {tm / td:.2f}")
    if a.profile:
        trainer, ds, cfg = runs["moe"]
        gbs = cfg.train.global_batch_size
        batches = get_micro_batches(ds, 0, gbs, cfg.train.micro_batch_size, 0, 1)
        with torch.profiler.profile() as prof:
            trainer.train_step(batches)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()

"""Step time of ``--compile`` (``torch.compile`` of each transformer layer) against eager.

Two ``training.Trainer`` s at tp = pp = dp = 1, the same GPT (same seed, hence the same weights)
and the same batches, one eager and one with ``--compile``. Their first ``--warmup`` steps
are not timed (the compiled one traces and compiles there; its time is printed apart). Then
``--rounds`` interleaved rounds: in each, both run ``--steps`` steps, the one that goes first
alternating from round to round, so that machine noise hits both alike. Printed: the median
ms/step of each over all timed steps, the spread (lowest and highest per-round median), the
per-round ratio compiled / eager, and the largest relative loss difference over every step
(both runs see the same batches in the same order; ``--compile`` promises fp32 losses
equal to eager within 1e-5, tests/layouts/test_compile.py).

    python -m scripts.bench.bench_compile [--rounds 5] [--steps 3] [--hidden-size 256] ...
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

# inductor compiles in this process: no pool of compile workers left running beside the timed steps
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")

import torch

from data.samplers import get_micro_batches
from megazero.training import build_trainer


class Run:
    """One trainer and its own position in the shared batch sequence."""

    def __init__(self, argv: list[str]):
        self.trainer = build_trainer(argv, 1)
        self.cfg, self.data = self.trainer.cfg, self.trainer.data.train
        self.losses: list[float] = []

    def step(self) -> float:
        """One training step on the next global batch; returns its wall time in seconds."""
        gbs, t = self.cfg.train.global_batch_size, self.trainer.state.iteration
        batches = get_micro_batches(self.data, t * gbs, gbs, self.cfg.train.micro_batch_size, 0, 1)
        t0 = time.perf_counter()
        out = self.trainer.train_step(batches).values
        elapsed = time.perf_counter() - t0
        self.losses.append(out["loss"])
        return elapsed


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each run per round")
    ap.add_argument("--warmup", type=int, default=3, help="steps of each not timed (compilation)")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: no OpenMP barrier to spin on when other jobs share the cores)",
    )
    return ap.parse_args()


def main() -> None:
    a = parse()
    torch.set_num_threads(a.threads)
    total = a.warmup + a.rounds * a.steps
    argv = [
        "--mock-data",
        "--vocab-size",
        str(a.vocab_size),
        "--hidden-size",
        str(a.hidden_size),
        "--num-layers",
        str(a.num_layers),
        "--num-attention-heads",
        str(a.num_attention_heads),
        "--seq-length",
        str(a.seq_length),
        "--micro-batch-size",
        str(a.micro_batch_size),
        "--train-iters",
        str(total),
        "--lr-decay-style",
        "constant",
        "--lr-warmup-iters",
        "0",
        "--lr",
        str(a.lr),
        "--min-lr",
        str(a.lr),
        "--clip-grad",
        "1.0",
        "--eval-iters",
        "0",
        "--device",
        "cpu",
    ]
    runs = {"eager": Run(argv), "compiled": Run(argv + ["--compile"])}
    warm = {name: sum(r.step() for _ in range(a.warmup)) for name, r in runs.items()}
    graphs = _compiled_graphs()
    times = {name: [] for name in runs}
    per_round = {name: [] for name in runs}
    for rnd in range(a.rounds):
        order = list(runs) if rnd % 2 == 0 else list(runs)[::-1]
        for name in order:
            got = [runs[name].step() for _ in range(a.steps)]
            times[name] += got
            per_round[name].append(statistics.median(got))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(
        f"model: {a.num_layers} layers, hidden {a.hidden_size}, seq {a.seq_length}, micro-batch "
        f"{a.micro_batch_size}, vocab {a.vocab_size}; {a.rounds} interleaved rounds x {a.steps} steps "
        f"each; torch {torch.__version__}, {torch.get_num_threads()} threads; load average "
        f"{os.getloadavg()[0]:.1f}"
    )
    print(
        f"untimed first {a.warmup} steps: eager {warm['eager']:.1f} s, compiled {warm['compiled']:.1f} s "
        f"(tracing and compilation: {graphs} graphs; compiled during the timed steps: "
        f"{_compiled_graphs() - graphs})"
    )
    for name in runs:
        r = [x * 1e3 for x in per_round[name]]
        print(f"{name:9s} median {med[name]:8.1f} ms/step   per-round medians {min(r):.1f} - {max(r):.1f}")
    ratios = [c / e for c, e in zip(per_round["compiled"], per_round["eager"])]
    print(
        f"ratio compiled / eager: {med['compiled'] / med['eager']:.3f}  (per round "
        f"{min(ratios):.3f} - {max(ratios):.3f})"
    )
    e, c = runs["eager"].losses, runs["compiled"].losses
    diff = max(abs(x - y) / abs(x) for x, y in zip(e, c))
    first = abs(e[0] - c[0]) / abs(e[0])
    print(f"largest relative loss difference over {len(e)} steps: {diff:.2e} (first step {first:.2e})")


def _compiled_graphs() -> int:
    """Graphs dynamo has compiled so far in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


if __name__ == "__main__":
    main()

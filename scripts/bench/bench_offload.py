"""Optimizer offload (ZeRO-Offload) against no offload: device/host bytes, peak memory, step time.

One process (dp 1) builds ``training.Trainer`` twice on ``--device`` with the same model and
ZeRO stage, once with ``--offload-optimizer cpu``, trains ``--steps`` steps on mock data and
prints per run: the model-state bytes on the device and on the host
(``DistributedOptimizer.bytes_by_place``) beside ``offload_formula_bytes`` /
``zero_formula_bytes``, the peak device memory allocated (``torch.cuda.max_memory_allocated``
on CUDA, n/a on CPU, where host and device are the same memory), the median step time, and
the largest loss difference between the two runs (the offloaded Adam does the same fp32
arithmetic on the host, so it is at rounding level). Exits 1 when the losses differ by more
than 1e-5 relative (2e-2 with --bf16: the host and device Adam kernels may round a bf16
parameter one ulp apart) or the offloaded run's device bytes are not below the plain run's.

    python -m scripts.bench.bench_offload [--device cuda] [--stage 2] [--steps 6] [--bf16] ...
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from data.samplers import get_micro_batches
from megazero.optim.offload import offload_formula_bytes
from megazero.optim.zero import zero_formula_bytes
from megazero.training import build_trainer

MIB = 2**20


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(argv: list, steps: int, device: torch.device) -> dict:
    """Train ``steps`` steps with ``argv``; losses, step times (s), bytes by place, formula."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = build_trainer(argv, 1, device=device)
    cfg, train_ds = trainer.cfg, trainer.data.train
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    losses, times = [], []
    for step in range(steps):
        batches = [(t.to(device), l.to(device)) for t, l in get_micro_batches(train_ds, step * gbs, gbs, mbs, 0, 1)]
        _sync(device)
        t0 = time.perf_counter()
        losses.append(trainer.train_step(batches).values["loss"])
        _sync(device)
        times.append(time.perf_counter() - t0)
    opt = trainer.optimizer
    padded = sum(b.layout.padded_numel for b in trainer.ddp.buffers)
    p, g = trainer.dtype.itemsize, trainer.ddp.grad_dtype.itemsize
    if cfg.zero.offload_optimizer == "cpu":
        formula = offload_formula_bytes(padded, 1, cfg.zero.stage, p, g)
    else:
        formula = {"device": zero_formula_bytes(padded, 1, cfg.zero.stage, p, g), "host": 0}
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    buckets = opt.model_state_bytes()["buckets"]
    return dict(
        losses=losses, times=times, place=opt.bytes_by_place(), formula=formula, buckets=buckets, peak=peak, psi=padded
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden-size", type=int, default=512)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=128)
    ap.add_argument("--bf16", action="store_true")
    a = ap.parse_args()
    device = torch.device(a.device)
    base = [
        "--mock-data",
        "--vocab-size",
        "6400",
        "--hidden-size",
        str(a.hidden_size),
        "--num-layers",
        str(a.num_layers),
        "--num-attention-heads",
        "8",
        "--seq-length",
        str(a.seq_length),
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        str(a.steps),
        "--eval-iters",
        "0",
        "--zero-stage",
        str(a.stage),
        "--device",
        device.type,
        "--lr",
        "1e-3",
    ]
    base += ["--bf16"] if a.bf16 else []
    plain = run(base, a.steps, device)
    off = run(base + ["--offload-optimizer", "cpu"], a.steps, device)
    print(f"ZeRO-{a.stage} on {device}, Psi={plain['psi']:,} (padded), {a.steps} steps, {'bf16' if a.bf16 else 'fp32'}")
    print(
        f"{'run':>10} {'device MiB':>11} {'(formula)':>10} {'host MiB':>9} {'(formula)':>10} "
        f"{'peak dev MiB':>13} {'step ms':>8}"
    )
    for name, r in (("plain", plain), ("offload", off)):
        dev = (r["place"]["device"] - r["buckets"]) / MIB
        peak = "n/a" if r["peak"] is None else f"{r['peak'] / MIB:.1f}"
        print(
            f"{name:>10} {dev:>11.2f} {r['formula']['device'] / MIB:>10.2f} {r['place']['host'] / MIB:>9.2f} "
            f"{r['formula']['host'] / MIB:>10.2f} {peak:>13} {1e3 * statistics.median(r['times'][1:]):>8.1f}"
        )
    diff = max(abs(x - y) / abs(y) for x, y in zip(off["losses"], plain["losses"]))
    print(f"largest relative loss difference offload vs plain: {diff:.2e}")
    tol = 2e-2 if a.bf16 else 1e-5  # bf16: a one-ulp difference of a cast parameter shows
    ok = diff <= tol and off["place"]["device"] < plain["place"]["device"]
    print(f"{'ok' if ok else 'FAILED'}: tolerance {tol:g}, device bytes lower with offload")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

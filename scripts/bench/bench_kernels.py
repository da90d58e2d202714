"""The device's matmul peak and the speed-up of each fused kernel over its reference.

1. Matmul peak: a timed ``[n, n] @ [n, n]`` in ``--dtype`` (``2 n^3`` FLOP per product), the
   MEDIAN of ``--peak-iters`` products timed one by one after ``--peak-warmup`` untimed ones: the
   sustained rate, the MFU denominator ``scripts/gpu_check.sh`` passes to ``train.py
   --peak-tflops``. Not the fastest product: a GPU's clock boosts for a short burst and then
   settles at its power limit, so the best single product overstates what a training run can
   get (and understates its MFU); the best is printed beside it.
2. Each fused kernel megazero uses against the plain-tensor reference it is tested against,
   forward + backward where the kernel has one, on the shapes of the model being checked
   (``[tokens, hidden]`` activations, ``--adam-numel`` fp32 elements of a flat Adam shard):

   - ``layer_norm``, ``rms_norm`` (``megazero.ops.norm``): the selected ``--kernels auto``
     backend (apex on CUDA when importable, else torch) vs ``*_norm_reference``;
   - ``adam`` (``megazero.ops.adam.adam_step``): the same backend vs the reference formulas;
   - ``attention``: ``F.scaled_dot_product_attention`` (causal; flash/memory-efficient kernels
     on CUDA) vs ``softmax(q k^T / sqrt(d) + mask) v`` written out.

   Before timing, each fused output is compared with the reference (ValueError naming the kernel
   when they differ by more than the dtype's tolerance), so a speed-up is never of a wrong kernel.

Output (one line each; ``scripts/gpu_check.sh`` reads the first line's sustained TFLOP/s)::

    matmul peak bf16: n 8192, 1.412 ms, 778.7 TFLOP/s (median of 20 after 5 warm-up; best 1.305 ms, 842.5 TFLOP/s)
    kernel layer_norm [8192, 2048] bf16 fwd+bwd: reference 0.512 ms, apex 0.081 ms, speed-up 6.32x

    python -m scripts.bench.bench_kernels --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn.functional as F

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 3e-3}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn, device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median wall-clock milliseconds of ``fn()`` over ``iters`` calls after ``warmup`` calls,
    the device synchronised around each call."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return 1e3 * sorted(times)[len(times) // 2]


def sustained_peak(times_ms: list[float], flop: float) -> tuple[float, float]:
    """(median ms, TFLOP/s) of timed runs of one ``flop``-FLOP product: the median of
    ``times_ms`` (milliseconds per product), so a few boosted or throttled products move it
    no more than their rank does. Raises ValueError for no timing or a non-positive one."""
    if not times_ms or min(times_ms) <= 0:
        raise ValueError(f"sustained_peak: needs positive timings in ms, got {times_ms!r}")
    ms = statistics.median(times_ms)
    return ms, flop / (ms * 1e-3) / 1e12


def matmul_peak(
    n: int, dtype: torch.dtype, device: torch.device, iters: int, warmup: int = 5
) -> tuple[float, float, float]:
    """(median ms, sustained TFLOP/s, best ms) of an ``[n, n] @ [n, n]`` product (``2 n^3`` FLOP):
    ``warmup`` untimed products, then ``iters`` products timed one by one, the device
    synchronised around each; the rate is :func:`sustained_peak` of those timings (the
    median, not the fastest: module docstring)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(warmup):
        a @ b
    times = [time_ms(lambda: a @ b, device, 1, warmup=0) for _ in range(iters)]
    ms, tflops = sustained_peak(times, 2.0 * n**3)
    return ms, tflops, min(times)


def _fwd_bwd(fn, *inputs):
    """``fn(*inputs)`` forward, then backward of the output's sum; returns the output."""
    out = fn(*inputs)
    out.float().sum().backward()
    return out


def check_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got.float() - want.float()).abs().max().item()
    tol = TOLERANCE[want.dtype] * max(1.0, want.float().abs().max().item())
    if not err <= tol:
        raise ValueError(f"kernel {name}: fused output differs from the reference by {err:.3g} (tolerance {tol:.3g})")


def _norm_cases(tokens: int, hidden: int, dtype, device, backend: str) -> dict:
    from megazero.ops import norm

    x = torch.randn(tokens, hidden, dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(hidden, device=device, requires_grad=True)
    b = torch.randn(hidden, device=device, requires_grad=True)
    eps = 1e-5
    return {
        "layer_norm": (
            lambda: _fwd_bwd(norm.layer_norm_reference, x, w, b, eps),
            lambda: _fwd_bwd(lambda *a: norm.layer_norm_backend(*a, backend), x, w, b, eps),
            f"[{tokens}, {hidden}]",
            "fwd+bwd",
        ),
        "rms_norm": (
            lambda: _fwd_bwd(norm.rms_norm_reference, x, w, eps),
            lambda: _fwd_bwd(lambda *a: norm.rms_norm_backend(*a, backend), x, w, eps),
            f"[{tokens}, {hidden}]",
            "fwd+bwd",
        ),
    }


def _adam_case(numel: int, device, backend: str) -> dict:
    from megazero.ops.adam import adam_step

    g = torch.randn(numel, device=device)
    states = {
        k: [torch.randn(numel, device=device), torch.zeros(numel, device=device), torch.zeros(numel, device=device)]
        for k in ("reference", backend)
    }

    def run(kind):
        p, m, v = states[kind]
        adam_step(p, g, m, v, step=1, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, backend=kind)
        return p

    states[backend][0].copy_(states["reference"][0])
    return {"adam": (lambda: run("reference"), lambda: run(backend), f"[{numel}] fp32", "step")}


def _attention_case(batch: int, heads: int, seq: int, head_dim: int, dtype, device) -> dict:
    q, k, v = (
        torch.randn(batch, heads, seq, head_dim, dtype=dtype, device=device, requires_grad=True) for _ in range(3)
    )
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), 1)

    def explicit(q, k, v):
        s = (q @ k.transpose(-2, -1)).float() / math.sqrt(head_dim)  # (B, heads, T, T)
        return (s.masked_fill(mask, float("-inf")).softmax(-1).to(v.dtype)) @ v

    sdpa = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return {
        "attention": (
            lambda: _fwd_bwd(explicit, q, k, v),
            lambda: _fwd_bwd(sdpa, q, k, v),
            f"[{batch}, {heads}, {seq}, {head_dim}]",
            "fwd+bwd",
        )
    }


def run(args) -> list[str]:
    """The report's lines (module docstring); ValueError when a fused kernel is wrong."""
    from megazero.ops.backend import select_backend

    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    backend = select_backend("auto", device)
    ms, tflops, best = matmul_peak(args.matmul, dtype, device, args.peak_iters, args.peak_warmup)
    flop = 2.0 * args.matmul**3
    lines = [
        f"matmul peak {args.dtype}: n {args.matmul}, {ms:.3f} ms, {tflops:.1f} TFLOP/s (median of "
        f"{args.peak_iters} after {args.peak_warmup} warm-up; best {best:.3f} ms, {flop / best / 1e9:.1f} TFLOP/s)"
    ]
    if args.peak_only:
        return lines
    cases = _norm_cases(args.tokens, args.hidden, dtype, device, backend)
    cases.update(_adam_case(args.adam_numel, device, backend))
    cases.update(
        _attention_case(args.tokens // args.seq, args.heads, args.seq, args.hidden // args.heads, dtype, device)
    )
    for name, (reference, fused, shape, what) in cases.items():
        check_close(name, fused(), reference())
        t_ref, t_fused = time_ms(reference, device, args.iters), time_ms(fused, device, args.iters)
        label = "sdpa" if name == "attention" else backend
        dt = "" if name == "adam" else f" {args.dtype}"
        lines.append(
            f"kernel {name} {shape}{dt} {what}: reference {t_ref:.3f} ms, {label} "
            f"{t_fused:.3f} ms, speed-up {t_ref / t_fused:.2f}x"
        )
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--matmul", type=int, default=8192, help="matmul size n (n x n x n)")
    ap.add_argument("--tokens", type=int, default=8192, help="rows of the norm inputs (batch x seq)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048, help="attention sequence length")
    ap.add_argument("--adam-numel", type=int, default=2**26, help="elements of the Adam shard")
    ap.add_argument("--iters", type=int, default=10, help="timed calls of each kernel (median)")
    ap.add_argument("--peak-iters", type=int, default=20, help="timed matmuls of the peak (median)")
    ap.add_argument("--peak-warmup", type=int, default=5, help="untimed matmuls before the peak's timing")
    ap.add_argument("--peak-only", action="store_true", help="print the matmul peak line only")
    args = ap.parse_args(argv)
    if args.tokens % args.seq or args.hidden % args.heads:
        print(
            f"error: --tokens ({args.tokens}) must be a multiple of --seq ({args.seq}) and "
            f"--hidden ({args.hidden}) of --heads ({args.heads})",
            file=sys.stderr,
        )
        return 2
    print("\n".join(run(args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

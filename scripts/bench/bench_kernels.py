"""The device's matmul peak and the speed-up of each fused kernel over its reference.

1. Matmul peak: a timed ``[n, n] @ [n, n]`` in ``--dtype`` (``2 n^3`` FLOP per product), the
   best of ``--iters`` timed products after warm-up: the MFU denominator ``scripts/gpu_check.sh``
   passes to ``train.py --peak-tflops``.
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

Output (one line each; ``scripts/gpu_check.sh`` parses the first)::

    matmul peak bf16: n 8192, 0.912 ms, 1205.6 TFLOP/s
    kernel layer_norm [8192, 2048] bf16 fwd+bwd: reference 0.512 ms, apex 0.081 ms, speed-up 6.32x

    python -m scripts.bench.bench_kernels --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import math
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


def matmul_peak(n: int, dtype: torch.dtype, device: torch.device, iters: int) -> tuple[float, float]:
    """(best ms, TFLOP/s) of an ``[n, n] @ [n, n]`` product: ``2 n^3`` FLOP over the fastest
    of ``iters`` timed products (a peak, not a median)."""
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    best = min(time_ms(lambda: a @ b, device, 1, warmup=2 if i == 0 else 0) for i in range(iters))
    return best, 2 * n**3 / (best * 1e-3) / 1e12


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
    ms, tflops = matmul_peak(args.matmul, dtype, device, args.iters)
    lines = [f"matmul peak {args.dtype}: n {args.matmul}, {ms:.3f} ms, {tflops:.1f} TFLOP/s"]
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
    ap.add_argument("--iters", type=int, default=10)
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

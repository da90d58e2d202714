"""Time of one attention core, forward and backward, with the open checkpoints' attention features
against plain causal attention, on this machine (CPU fp32 by default).

Variants (megazero/context_parallel/attention.py ``local_attention``, the one-rank path every
layer without context parallelism takes for them):

- ``causal``: SDPA with ``is_causal`` (no feature; the baseline of the ratios);
- ``window``: a sliding window of ``--window`` keys, SDPA with the additive ``[1, 1, T, T]`` mask;
- ``sinks``: learned sinks, the ring's blockwise attention on one rank (two zigzag chunks, the
  fused block kernels, the sink merged as one more partial; what megazero runs);
- ``sinks-explicit``: the same sinks through ``sink_attention`` (the ``[B, h, T, T]`` scores made
  explicitly, as transformers' gpt-oss eager attention; megazero uses it only for decoding);
- ``sinks+window``: both.

Rounds are interleaved (each round times every variant once, in a rotated order), after one
warm-up round; printed: the median ms of a forward + backward over the rounds, the spread
(min-max), and the ratio of medians to ``causal``.

    python -m scripts.bench.bench_attention_features [--seq 1024] [--heads 8] [--groups 2] \\
        [--head-dim 64] [--batch 2] [--window 256] [--rounds 7] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megazero.context_parallel.attention import local_attention, sink_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def variants(window: int) -> dict:
    """name -> ``f(q, k, v, sinks)`` returning the attention output."""
    return {
        "causal": lambda q, k, v, s: local_attention(q, k, v),
        "window": lambda q, k, v, s: local_attention(q, k, v, window=window),
        "sinks": lambda q, k, v, s: local_attention(q, k, v, sinks=s),
        "sinks-explicit": lambda q, k, v, s: sink_attention(q, k, v, s),
        "sinks+window": lambda q, k, v, s: local_attention(q, k, v, sinks=s, window=window),
    }


def time_once(fn, q, k, v, s, dy) -> float:
    """ms of one forward + backward of ``fn`` (gradients of q, k, v and the sinks)."""
    for t in (q, k, v, s):
        t.grad = None
    start = time.perf_counter()
    fn(q, k, v, s).backward(dy)
    return (time.perf_counter() - start) * 1e3


def run(B: int, h: int, G: int, T: int, d: int, window: int, rounds: int, dtype) -> dict:
    """name -> list of ``rounds`` times (ms), interleaved rounds after one warm-up round."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, h, T, d, generator=g, device="cpu").to(dtype).requires_grad_()
    k, v = (torch.randn(B, G, T, d, generator=g, device="cpu").to(dtype).requires_grad_() for _ in range(2))
    s = torch.randn(h, generator=g, device="cpu").requires_grad_()
    dy = torch.randn(B, h, T, d, generator=g, device="cpu").to(dtype)
    fns = variants(window)
    names = list(fns)
    times: dict = {n: [] for n in names}
    for r in range(rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]  # rotated: no variant always first
        for n in order:
            ms = time_once(fns[n], q, k, v, s, dy)
            if r > 0:  # round 0 warms up
                times[n].append(ms)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--groups", type=int, default=2, help="key/value heads")
    ap.add_argument("--seq", type=int, default=1024, help="tokens (even)")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=256, help="sliding window W (keys)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    a = ap.parse_args(argv)
    times = run(a.batch, a.heads, a.groups, a.seq, a.head_dim, a.window, a.rounds, DTYPES[a.dtype])
    base = statistics.median(times["causal"])
    print(
        f"attention core fwd+bwd, B {a.batch}, heads {a.heads} (kv {a.groups}), T {a.seq}, d {a.head_dim}, "
        f"window {a.window}, {a.dtype}, median of {a.rounds} interleaved rounds"
    )
    print(f"{'variant':<16} {'median ms':>10} {'min-max ms':>16} {'x causal':>9}")
    for name, ts in times.items():
        m = statistics.median(ts)
        print(f"{name:<16} {m:>10.2f} {min(ts):>7.2f}-{max(ts):<8.2f} {m / base:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

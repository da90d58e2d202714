"""What megazero's machinery costs at tp = pp = dp = 1, against a plain PyTorch loop.

Trains the same GPT (same weights, same batches) with ``training.Trainer`` (pipeline executor,
gradient buffer, sharded-Adam optimizer, loss scaling hooks, all at size 1) and with
``tests/support/reference.py``'s model under ``torch.optim.AdamW`` (the plain loop a researcher would
write). The two alternate step by step, so machine noise hits both alike, and the script
prints the median step time of each and their ratio (target: megazero / plain <= 1.02).

Like with like: the plain model's attention is switched to ``scaled_dot_product_attention``,
the kernel megazero's model calls (the reference writes softmax(QK^T)V by hand, a kernel
difference that is no framework overhead). The loss comparison means something only where
the runs are not chaotic. Measured over 33 steps (hidden 256, seq 128, micro-batch 2): at
the default ``--lr 1e-4`` the largest relative difference is 2.5e-7, with or without a 1e-6
relative nudge of the plain loop's gradients (``--nudge 1e-6``), so a real megazero error
would show; at ``--lr 2e-3`` that nudge alone gives 3.8e-2. The first step's losses (same
weights, same batch) are printed apart: they differ by summation order only (8e-9).

The allocator: by default (``--allocator keep``) glibc is told to keep freed heap memory
(``keep_freed_memory``), as CUDA's caching allocator does, because with glibc's defaults both
loops spend about a sixth of their step in page faults and megazero's gradient hooks, which free
each gradient as soon as it is in the flat buffer, take more of them (measured: 149 against 112
MiB of faults per step). ``--allocator system`` measures with the defaults.

    python -m scripts.bench.bench_overhead [--steps 30] [--allocator keep|system] [--hidden-size 256] ...
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch
import torch.nn.functional as F

from data.samplers import get_micro_batches
from megazero.training import build_trainer
from model.gpt import init_full_weights
from tests.support.reference import ReferenceGPT


def sdpa_attention(block, x: torch.Tensor, positions=None, hidden=None) -> torch.Tensor:
    """The reference block's attention with ``F.scaled_dot_product_attention`` (causal), as
    megazero's model computes it; ``x`` is ``(B, T, H)``. The benchmark's model has learned
    positions and no packed documents, so ``positions`` and ``hidden`` must be None."""
    if positions is not None and block.rope is not None or hidden is not None:
        raise ValueError("bench_overhead's SDPA attention covers the GPT-2 block only (no RoPE, no document mask)")
    B, T, H = x.shape
    q, k, v = block._heads(x)  # each (B, heads, T, head_dim)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return block.proj(y.transpose(1, 2).reshape(B, T, H))  # (B, heads, T, hd) -> (B, T, H)


TOP_PAD = 1 << 30  # bytes: glibc's M_TOP_PAD for --allocator keep


def keep_freed_memory() -> bool:
    """Make glibc keep freed heap memory for reuse: ``mallopt(M_TOP_PAD, 1 GiB)`` (malloc(3)), so
    the heap grows and is trimmed in 1 GiB steps. With glibc's defaults the top of the heap is
    handed back to the kernel whenever enough of it is free, and the next allocation there takes a
    page fault per 4 KiB: on this benchmark's model 112 MiB of faults per step in the plain loop
    and 149 MiB in megazero's (which frees each parameter's gradient as soon as it sits in the
    flat buffer), about a sixth of both step times. A caching allocator (CUDA's, jemalloc,
    tcmalloc) keeps freed blocks, so framework overhead is measured with both loops on that
    footing. Returns False where there is no glibc ``mallopt`` (the defaults then stay)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    M_TOP_PAD = -2  # glibc <malloc.h>
    return mallopt(M_TOP_PAD, TOP_PAD) == 1


def main(argv=None) -> dict:
    """Run the comparison (``argv``: the command-line flags, default ``sys.argv[1:]``); prints the
    report and returns ``{"ratio": megazero / plain median step time, "loss_diffs": relative loss
    difference per step}``."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps of each not timed")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-4, help="constant learning rate of both runs")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time (steadier on a shared machine)",
    )
    ap.add_argument(
        "--nudge",
        type=float,
        default=0.0,
        help="multiply the plain loop's gradients by (1 + nudge): the chaos floor of the comparison",
    )
    ap.add_argument(
        "--allocator",
        choices=("keep", "system"),
        default="keep",
        help="keep: glibc keeps freed heap memory for reuse (M_TOP_PAD 1 GiB, as a caching "
        "allocator does; see keep_freed_memory); system: glibc's defaults, where page "
        "faults of memory returned to the kernel and touched again weigh on both loops",
    )
    a = ap.parse_args(argv)
    allocator = "glibc defaults"
    if a.allocator == "keep":
        allocator = (
            "freed heap memory kept (M_TOP_PAD 1 GiB)" if keep_freed_memory() else "glibc defaults (no mallopt here)"
        )
    steps = a.steps + a.warmup
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
        str(steps),
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
    trainer = build_trainer(argv, 1)
    cfg, train_ds, vocab = trainer.cfg, trainer.data.train, trainer.data.vocab_size

    full = init_full_weights(trainer.gpt_config, cfg.train.seed)
    ref = ReferenceGPT.from_full_weights(full, vocab, a.num_attention_heads, cfg.model.layernorm_epsilon)
    for block in ref.blocks:
        block.attention = types.MethodType(sdpa_attention, block)
    params = list(ref.parameters())
    o = cfg.optim
    opt = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
    )

    clock = time.perf_counter if a.clock == "wall" else time.process_time
    gbs = cfg.train.global_batch_size
    times = {"megazero": [], "plain": []}
    losses = {"megazero": [], "plain": []}
    for step in range(steps):
        batches = get_micro_batches(train_ds, step * gbs, gbs, cfg.train.micro_batch_size, 0, 1)
        t0 = clock()
        out = trainer.train_step(batches).values
        t1 = clock()
        tokens, labels = batches[0]
        opt.zero_grad(set_to_none=True)
        loss = ref.loss(tokens, labels)
        loss.backward()
        if a.nudge:
            for p in params:
                p.grad.mul_(1.0 + a.nudge)
        torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        opt.step()
        t2 = clock()
        losses["megazero"].append(out["loss"])
        losses["plain"].append(loss.item())
        if step >= a.warmup:
            times["megazero"].append(t1 - t0)
            times["plain"].append(t2 - t1)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f"model: {a.num_layers} layers, hidden {a.hidden_size}, seq {a.seq_length}, micro-batch "
        f"{a.micro_batch_size}, vocab {vocab}; {a.steps} timed steps each, alternating; "
        f"torch threads {torch.get_num_threads()}; {a.clock} clock; allocator: {allocator}"
    )
    print(f"median step time  megazero: {med['megazero'] * 1e3:.1f} ms   plain PyTorch: {med['plain'] * 1e3:.1f} ms")
    print(f"ratio megazero / plain: {med['megazero'] / med['plain']:.3f}  (target <= 1.02)")
    diffs = [abs(x - y) / abs(y) for x, y in zip(losses["megazero"], losses["plain"])]
    print(
        f"relative loss difference at step 1 (same weights and batch): {diffs[0]:.2e}; largest over "
        f"{steps} steps at --lr {a.lr:g}{f' with --nudge {a.nudge:g}' if a.nudge else ''}: {max(diffs):.2e}"
    )
    return {"ratio": med["megazero"] / med["plain"], "loss_diffs": diffs, "allocator": allocator}


if __name__ == "__main__":
    main()

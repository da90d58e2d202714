"""What megazero's machinery costs at tp = pp = dp = 1, against a plain PyTorch loop.

Trains the same GPT (same weights, same batches) with ``train.Trainer`` (pipeline executor,
gradient buffer, sharded-Adam optimizer, loss scaling hooks, all at size 1) and with
``tests/reference.py``'s model under ``torch.optim.AdamW`` (the plain loop a researcher would
write). The two alternate step by step, so machine noise hits both alike, and the script
prints the median step time of each and their ratio (target: megazero / plain <= 1.05).

    python scripts/bench_overhead.py [--steps 30] [--hidden-size 256] [--num-layers 4] ...
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train  # noqa: E402
from data.samplers import get_micro_batches  # noqa: E402
from megazero.config import config_from_argv  # noqa: E402
from megazero.process_groups import ProcessGroups  # noqa: E402
from model.gpt import init_full_weights  # noqa: E402
from tests.reference import ReferenceGPT  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3, help="steps of each not timed")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-attention-heads", type=int, default=4)
    ap.add_argument("--seq-length", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--vocab-size", type=int, default=8192)
    a = ap.parse_args()
    steps = a.steps + a.warmup
    argv = ["--mock-data", "--vocab-size", str(a.vocab_size), "--hidden-size", str(a.hidden_size),
            "--num-layers", str(a.num_layers), "--num-attention-heads", str(a.num_attention_heads),
            "--seq-length", str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
            "--train-iters", str(steps), "--lr-decay-style", "constant", "--lr-warmup-iters", "0",
            "--clip-grad", "1.0", "--eval-iters", "0", "--device", "cpu"]
    cfg = config_from_argv(argv, 1)
    _, (train_ds, _, _), vocab = train.build_data(cfg)
    trainer = train.Trainer(cfg, ProcessGroups.single(), torch.device("cpu"), vocab)

    full = init_full_weights(trainer.gpt_config, cfg.train.seed)
    ref = ReferenceGPT.from_full_weights(full, vocab, a.num_attention_heads, cfg.model.layernorm_epsilon)
    params = list(ref.parameters())
    o = cfg.optim
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps)

    gbs = cfg.train.global_batch_size
    times = {"megazero": [], "plain": []}
    losses = {"megazero": [], "plain": []}
    for step in range(steps):
        batches = get_micro_batches(train_ds, step * gbs, gbs, cfg.train.micro_batch_size, 0, 1)
        t0 = time.perf_counter()
        out = trainer.train_step(batches)
        t1 = time.perf_counter()
        tokens, labels = batches[0]
        opt.zero_grad(set_to_none=True)
        loss = ref.loss(tokens, labels)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, o.clip_grad)
        opt.step()
        t2 = time.perf_counter()
        losses["megazero"].append(out["loss"])
        losses["plain"].append(loss.item())
        if step >= a.warmup:
            times["megazero"].append(t1 - t0)
            times["plain"].append(t2 - t1)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"model: {a.num_layers} layers, hidden {a.hidden_size}, seq {a.seq_length}, micro-batch "
          f"{a.micro_batch_size}, vocab {vocab}; {a.steps} timed steps each, alternating; "
          f"torch threads {torch.get_num_threads()}")
    print(f"median step time  megazero: {med['megazero'] * 1e3:.1f} ms   plain PyTorch: "
          f"{med['plain'] * 1e3:.1f} ms")
    print(f"ratio megazero / plain: {med['megazero'] / med['plain']:.3f}  (target <= 1.05)")
    drift = max(abs(x - y) / abs(y) for x, y in zip(losses["megazero"], losses["plain"]))
    print(f"largest relative loss difference between the two runs: {drift:.2e}")


if __name__ == "__main__":
    main()
